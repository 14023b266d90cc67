"""Tiny random models our importer refuses but transformers, TRL and mergekit load as they are.

``save_foreign_model(mirror, "OWNER/NAME", kind)`` writes ``mirror/OWNER/NAME`` in the Hub
layout (config.json, model.safetensors, the tokenizer with a chat template, and
``.cache/huggingface/download/*.metadata`` recording ``commit``, as ``--local-dir`` does):

- ``qwen3-moe``: ``Qwen3MoeForCausalLM`` (4 experts, 2 per token) with Qwen3's released chat
  template (TRL has a training version of it, for assistant-only loss);
- ``mistral``: ``MistralForCausalLM`` with a sliding window and Mistral's ``[INST]`` template,
  its assistant turn inside ``{% generation %}`` markers (TRL has no training version of it).
"""

from __future__ import annotations

from pathlib import Path

from tests.flows.hub_models import TEXT

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}"
    "{% endgeneration %}{% elif m['role'] == 'system' %}{{ m['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}"
)
KINDS = ("qwen3-moe", "mistral")


def qwen3_chat_template() -> str:
    """Qwen3's released chat template (TRL ships a copy of it)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()


def build_tokenizer(kind: str):
    """A ~400-token byte-level BPE with the family's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "qwen3-moe":  # Qwen3: pad = eos = <|endoftext|>, turns end with <|im_end|>
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
        names = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        template = qwen3_chat_template()
    else:  # Mistral: <s> bos, </s> eos, no pad
        special = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
        names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        template = MISTRAL_TEMPLATE
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT * 20], trainer=trainer)
    extra = [s for s in special if s not in names.values()]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, additional_special_tokens=extra, chat_template=template, **names
    )


def build_model(kind: str, tokenizer, seed: int = 0):
    """A 2-layer random ``Qwen3MoeForCausalLM`` or ``MistralForCausalLM`` sized to the tokenizer."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    if kind == "qwen3-moe":
        config = Qwen3MoeConfig(
            **common, head_dim=8, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, tie_word_embeddings=True,
        )  # fmt: skip
        return Qwen3MoeForCausalLM(config)
    config = MistralConfig(**common, intermediate_size=64, sliding_window=64)
    return MistralForCausalLM(config)


def save_foreign_model(mirror: Path, repo: str, kind: str, commit: str, seed: int = 0) -> Path:
    """``mirror/repo`` laid out as the Hub repo, ``commit`` recorded as a --local-dir download."""
    folder = Path(mirror) / repo
    tokenizer = build_tokenizer(kind)
    build_model(kind, tokenizer, seed).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    meta = folder / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.is_file():
            (meta / f"{path.name}.metadata").write_text(f"{commit}\netag\n0\n")
    return folder
