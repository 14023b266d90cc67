"""Tiny random models built with transformers' own classes, saved as Hub-layout folders.

``save_hub_model(mirror, "OWNER/NAME", kind)`` writes ``mirror/OWNER/NAME`` as
``huggingface-cli download --local-dir`` would: config.json, model.safetensors, the tokenizer
files and ``.cache/huggingface/download/*.metadata`` recording the commit. Qwen2 gets Qwen2.5's
real chat template (no ``{% generation %}`` markers, as released); Llama, like a base Llama,
none.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = (
    "The quick brown fox jumps over the lazy dog. What is 2 + 3? 2 + 3 = 5. "
    "Paris is the capital of France. Water boils at 100 degrees. Who are you? "
    "I am a helpful assistant. The answer is 42. system user assistant\n"
)


def qwen_chat_template() -> str:
    """Qwen2.5's released chat template (TRL ships a copy of it)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def build_tokenizer(chat_template: str | None):
    """A ~400-token byte-level BPE with Qwen's special tokens (pad = eos, as Qwen2.5 base)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT * 20], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=chat_template,
    )


def build_model(kind: str, tokenizer, seed: int = 0):
    """A 2-layer random ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
    ``LlamaForSequenceClassification`` sized to the tokenizer."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "llama-classifier": ("LlamaConfig", "LlamaForSequenceClassification"),
    }[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=kind == "qwen2",
    )
    return getattr(transformers, model_cls)(config)


def save_hub_model(
    mirror: Path, repo: str, kind: str, seed: int = 0, commit: str | None = None
) -> Path:
    """``mirror/repo`` laid out as the Hub repo (``commit`` recorded as a --local-dir download)."""
    folder = Path(mirror) / repo
    tokenizer = build_tokenizer(qwen_chat_template() if kind == "qwen2" else None)
    build_model(kind, tokenizer, seed).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if commit is not None:
        meta = folder / ".cache" / "huggingface" / "download"
        meta.mkdir(parents=True, exist_ok=True)
        for path in folder.iterdir():
            if path.is_file():
                (meta / f"{path.name}.metadata").write_text(f"{commit}\netag\n0\n")
    return folder
