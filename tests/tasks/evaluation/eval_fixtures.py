"""Helpers for the evaluation and scheduled-evaluation tests: a tiny local Hugging Face model
(no Hub access), held-out documents, and fixture steps that put a trainer checkpoint, a
tokenizer and a tokenize-like output in a store."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from llmflow.tasks.framework.step import Metrics, step

TEXT = (
    "The quick brown fox jumps over the lazy dog. What is 3 + 4? The answer is 7.\n"
    "Monday comes before Tuesday, and January comes before February. Hot is the opposite of "
    "cold. Question: What is 2 * 3?\nAnswer: 6\nA small model reads a small corpus.\n"
)


def make_tokenizer():
    """A byte-level BPE (512 tokens) over ``TEXT`` as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|bos|>",
        pad_token="<|pad|>",
    )


def make_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Save a random 2-layer Llama with ``make_tokenizer()``'s tokenizer to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_tok = make_tokenizer()
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


class CheckpointFixture(BaseModel):
    """A trainer-style checkpoint: its seed and what its summary.json says."""

    seed: int = 0
    tokens_seen: int = 400
    total_tokens_seen: int | None = 1000
    steps: int = 10


LINEAGE_DECOY = 999_999  # in the checkpoint's lineage metrics; nothing may read it from there


@step("fixture-checkpoint")
def fixture_checkpoint(cfg: CheckpointFixture, out: Path) -> Metrics:
    """Write final/ (model_config.json, model.safetensors) and summary.json like the trainer."""
    import torch

    from llmflow.model.config import ModelConfig
    from llmflow.model.hf import save_model
    from llmflow.model.transformer import Transformer

    tok = make_tokenizer()
    model_cfg = ModelConfig(
        vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=128, max_seq_len=256, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(cfg.seed)
    save_model(Transformer(model_cfg), model_cfg, out / "final")
    summary = {"steps": cfg.steps, "tokens_seen": cfg.tokens_seen}
    if cfg.total_tokens_seen is not None:
        summary["total_tokens_seen"] = cfg.total_tokens_seen
    (out / "summary.json").write_text(json.dumps(summary))
    return {"total_tokens_seen": LINEAGE_DECOY, "tokens_seen": LINEAGE_DECOY}


class TokenizerFixture(BaseModel):
    name: str = "tiny"


@step("fixture-tokenizer")
def fixture_tokenizer(cfg: TokenizerFixture, out: Path) -> Metrics:
    """Save ``make_tokenizer()`` like the tokenizer step (AutoTokenizer-loadable files)."""
    make_tokenizer().save_pretrained(out)
    return {}


@step("fixture-tokenize")
def fixture_tokenize(cfg: TokenizerFixture, out: Path) -> Metrics:
    """Held-out documents where the tokenize step keeps them (validation_docs/)."""
    write_heldout(out / "validation_docs")
    return {}
