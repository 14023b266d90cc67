"""Fixtures: a byte-level BPE tokenizer with the project's chat contract and a tiny Llama.

The offline HF environment and ``shared_data`` come from ``tests/conftest.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# The project's tokenizer contract: ChatML, assistant content (and its end-of-turn token) inside
# {% generation %} so assistant-only loss works, and add_generation_prompt support.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|bos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


def _training_text() -> str:
    from llmflow.tasks.posttrain.quickstart import quickstart_sft_examples

    lines = [m["content"] for e in quickstart_sft_examples(200, seed=123) for m in e["messages"]]
    prose = "The quick brown fox jumps over the lazy dog. Who are you? I am a helpful assistant. "
    return "\n".join(lines) + "\n" + prose * 20


def build_tokenizer():
    """A ~512-token byte-level BPE wrapped as a PreTrainedTokenizerFast with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_training_text()], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_llama(tokenizer, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def build_tiny_smollm3(tokenizer, seed: int = 0):
    """The architecture the project's own model exports as (NoPE layers, GQA)."""
    import torch
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    torch.manual_seed(seed)
    config = SmolLM3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return SmolLM3ForCausalLM(config)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_output(tmp_path_factory, tokenizer) -> Path:
    """A model output: a randomly initialized tiny Llama + tokenizer in its ``hf/``."""
    path = tmp_path_factory.mktemp("tiny_llama")
    build_tiny_llama(tokenizer).save_pretrained(path / "hf", safe_serialization=True)
    tokenizer.save_pretrained(path / "hf")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_output) -> Path:
    """The tiny Llama's Hugging Face folder."""
    return tiny_model_output / "hf"


def _assert_chats(model_dir: Path) -> None:
    """The export loads with transformers and generates from its own chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert "generation" in tokenizer.chat_template
    assert model.config.use_cache is True
    assert list(model_dir.glob("*.safetensors"))
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id


@pytest.fixture(scope="session")
def tiny_smollm3_dir(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny_smollm3")
    build_tiny_smollm3(tokenizer).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def assert_chats():
    return _assert_chats
