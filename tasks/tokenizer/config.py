"""Config of the tokenizer step, and the special tokens every later step relies on."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmflow.tasks.framework.hashing import UNVERSIONED

# NOTE: the SFT step and the chat template depend on these exact strings.
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, BOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN]
BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)


def _check_vocab_size(value: int, field: str) -> int:
    if value < MIN_VOCAB_SIZE:
        raise ValueError(
            f"{field}={value} is smaller than the byte alphabet (256) plus "
            f"{len(SPECIAL_TOKENS)} special tokens; use at least {MIN_VOCAB_SIZE}"
        )
    return value


class TokenizerConfig(BaseModel):
    """Byte-level BPE trained on a capped, streamed sample of the curated corpus."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(8192, description="Vocabulary size, special tokens included.")
    min_frequency: int = Field(2, description="Least count for a pair to be merged.")
    max_sample_bytes: int = Field(
        200_000_000,
        description="Cap on UTF-8 bytes of text streamed into training (the sample is the "
        "first documents in file order, minus the evaluation hold-out).",
    )
    eval_fraction: float = Field(
        0.05,
        description="Share of documents (by a hash of the id) kept out of training and used "
        "for the fertility report.",
    )
    max_eval_docs_per_domain: int = Field(
        500, description="Cap on evaluation documents per domain."
    )
    sweep_vocab_sizes: list[int] = Field(
        default_factory=list,
        description="Extra vocabulary sizes to train and evaluate for the comparison table and "
        "plot (the saved tokenizer always uses vocab_size). Empty: no sweep.",
    )
    read_batch_rows: int = Field(
        4096,
        description="Rows per parquet record batch while streaming.",
        json_schema_extra=UNVERSIONED,
    )

    @field_validator("vocab_size")
    @classmethod
    def _vocab_fits_bytes(cls, value: int) -> int:
        return _check_vocab_size(value, "vocab_size")

    @field_validator("sweep_vocab_sizes")
    @classmethod
    def _sweep_fits_bytes(cls, value: list[int]) -> list[int]:
        for size in value:
            _check_vocab_size(size, "sweep_vocab_sizes entry")
        return sorted(set(value))

    @field_validator("eval_fraction")
    @classmethod
    def _fraction_in_range(cls, value: float) -> float:
        if not 0.0 <= value < 1.0:
            raise ValueError(f"eval_fraction={value} must be in [0, 1)")
        return value

    @field_validator(
        "min_frequency", "max_sample_bytes", "max_eval_docs_per_domain", "read_batch_rows"
    )
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"value {value} must be >= 1")
        return value
