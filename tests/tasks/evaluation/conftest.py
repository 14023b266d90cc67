"""Fixtures for the evaluation tests: a tiny local Hugging Face model, no Hub access."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# NOTE: tests/conftest.py sets HF_HOME to a temp dir and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE.

TEXT = (
    "The quick brown fox jumps over the lazy dog. What is 3 + 4? The answer is 7.\n"
    "Monday comes before Tuesday, and January comes before February. Hot is the opposite of "
    "cold. Question: What is 2 * 3?\nAnswer: 6\nA small model reads a small corpus.\n"
)


def make_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Train a byte-level BPE and save it with a random 2-layer Llama to ``out_dir``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|bos|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 50, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|bos|>",
        pad_token="<|pad|>",
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=len(hf_tok),
        max_position_embeddings=512,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    hf_tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "hf")


def write_heldout(out_dir: Path) -> Path:
    """Two domains, three short documents each, in two parquet shards."""
    rows = [
        {"id": f"p{i}", "text": f"Prose number {i}. " + TEXT[: 60 + 20 * i], "domain": "prose",
         "source": "test"}
        for i in range(3)
    ] + [
        {"id": f"c{i}", "text": f"def f{i}(x):\n    return x + {i}\n", "domain": "code",
         "source": "test"}
        for i in range(3)
    ]  # fmt: skip
    (out_dir / "shard").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows[:3]), out_dir / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[3:]), out_dir / "shard" / "part-1.parquet")
    return out_dir


@pytest.fixture(scope="session")
def heldout_dir(tmp_path_factory) -> Path:
    return write_heldout(tmp_path_factory.mktemp("heldout"))


@pytest.fixture(scope="session")
def shared_eval_dir(shared_data: Path) -> Path:
    """The real eval sets; tests using them skip when ../shared/data is absent."""
    eval_dir = shared_data / "eval"
    if not eval_dir.is_dir():
        pytest.skip("../shared/data/eval is absent")
    return eval_dir.resolve()


@pytest.fixture(scope="session")
def tiny_model_factory():
    """``make_tiny_model`` for tests that need more than one model."""
    return make_tiny_model
