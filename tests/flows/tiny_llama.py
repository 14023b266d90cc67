"""A tiny random ``LlamaForCausalLM`` with a Llama-3-style tokenizer, as a Hub-layout folder.

The tokenizer is a byte-level BPE trained here, laid out as Llama 3's (a ``Split`` pre-tokenizer
with Llama 3's pattern, then ``ByteLevel`` without its regex; a post-processor adding
``<|begin_of_text|>``), which the fast byte-level encoder does not cover: tokenize falls back to
``tokenizers``. The model's vocabulary is the tokenizer's size.
"""

from __future__ import annotations

from pathlib import Path

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TEXT = (
    "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"
    "What is 12 + 30? 12 + 30 = 42. Paris is the capital of France. Water boils at 100 degrees. "
    "The model learns the structure of the corpus, one token at a time; numbers 1234567.\n"
)


def build_tokenizer(vocab_size: int = 384):
    """A Llama-3-layout byte-level BPE as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT] * 50, trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)


def build_llama(vocab_size: int, seed: int = 0, **changes):
    """A 2-layer random ``LlamaForCausalLM`` (transformers' own class)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(seed)
    config = LlamaConfig(**{**fields, **changes})
    config.architectures = ["LlamaForCausalLM"]
    return LlamaForCausalLM(config).eval()


def save_tiny_llama(folder: Path, seed: int = 0, tokenizer_vocab: int = 384, **changes) -> Path:
    """Write a Hub-layout folder (config.json, model.safetensors, tokenizer files)."""
    tokenizer = build_tokenizer(tokenizer_vocab)
    model = build_llama(len(tokenizer), seed, **changes)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


LLAMA3_CHAT_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def build_llama3_chat_tokenizer(vocab_size: int = 384):
    """`build_tokenizer` plus Llama 3 Instruct's header and end-of-turn tokens and its chat
    template (TRL's copy): a turn ends with ``<|eot_id|>``, not ``<|im_end|>`` nor eos."""
    import trl

    tokenizer = build_tokenizer(vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_CHAT_TOKENS})
    template = Path(trl.__file__).parent / "chat_templates" / "llama3.jinja"
    tokenizer.chat_template = template.read_text()
    return tokenizer


def save_tiny_llama3_chat(folder: Path, seed: int = 0) -> Path:
    """A Hub-layout tiny Llama with a Llama-3-style chat template; config.json's eos is
    ``<|end_of_text|>`` only (as a base Llama 3), so the end of turn must come from the template."""
    tokenizer = build_llama3_chat_tokenizer()
    model = build_llama(len(tokenizer), seed, eos_token_id=tokenizer.convert_tokens_to_ids(EOS))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
