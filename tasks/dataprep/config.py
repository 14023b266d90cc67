"""Configs for tokenizing the curated corpus, building per-stage mixtures and packing."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmflow.tasks.framework.hashing import OMIT_DEFAULT, UNVERSIONED


class TokenizeConfig(BaseModel):
    """How `tokenize_corpus` turns curated documents into per-domain token arrays."""

    model_config = ConfigDict(extra="forbid")

    validation_fraction: float = Field(
        0.01,
        description="Share of documents per domain held out as validation, chosen by a hash of "
        "the document id (so the split is stable when the corpus grows).",
    )
    encode_batch_size: int = Field(
        2048,
        description="Documents per `encode_batch` call; larger batches keep Rust threads busy.",
        json_schema_extra=UNVERSIONED,
    )
    read_batch_rows: int = Field(
        8192,
        description="Rows per parquet record batch read while streaming the corpus.",
        json_schema_extra=UNVERSIONED,
    )

    @field_validator("validation_fraction")
    @classmethod
    def _fraction_in_range(cls, value: float) -> float:
        if not 0.0 <= value < 1.0:
            raise ValueError(
                f"validation_fraction={value} must be in [0, 1); use e.g. 0.01 to hold out 1%"
            )
        return value

    @field_validator("encode_batch_size", "read_batch_rows")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"batch sizes must be >= 1, got {value}")
        return value


class PackConfig(BaseModel):
    """Layout of a packed dataset: sequence length, shard size and the offline shuffle seed."""

    model_config = ConfigDict(extra="forbid")

    seq_len: int = Field(
        256,
        description="Tokens per training sequence T. Each stored row holds T+1 tokens so that "
        "input = row[:-1] and labels = row[1:].",
    )
    seed: int = Field(0, description="Seed for document selection and the offline row shuffle.")
    rows_per_shard: int = Field(
        65536, description="Rows (sequences) per shard file; the last shard may be shorter."
    )

    @field_validator("seq_len", "rows_per_shard")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"seq_len and rows_per_shard must be >= 1, got {value}")
        return value


class ValidationConfig(PackConfig):
    """How `build_validation` packs the held-out documents (every one exactly once)."""

    by_domain: bool = Field(
        False,
        description="Also record each document's domain (segment_domains.bin), so that every "
        "validation of the stages reads the held-out loss per domain (val_loss_by_domain); it "
        "costs one more forward pass over the validation batches per domain.",
        json_schema_extra=OMIT_DEFAULT,
    )


class StageMixture(PackConfig):
    """One curriculum stage: domain weights, a token budget and a cap on repetition."""

    weights: dict[str, float] = Field(
        description="Relative weight per domain (the `domain` column); normalized to sum to 1. "
        "Domains absent here are not used in this stage. Empty: every domain of the data, in "
        "proportion to its tokens (a recipe for whatever data the user brings)."
    )
    num_tokens: int = Field(
        description="Token budget of the stage, counting each document's trailing eos token."
    )
    max_epochs: float = Field(
        4.0,
        description="Most times any domain may be repeated to meet the budget (Muennighoff et "
        "al. 2023: up to ~4 epochs is nearly as good as fresh data).",
    )
    on_overflow: Literal["fail", "reweight"] = Field(
        "fail",
        description="What to do when a domain would need more than max_epochs: 'fail' stops "
        "with a message naming the domain; 'reweight' caps it at max_epochs and gives the "
        "missing tokens to the other domains in proportion to their weights.",
    )

    @field_validator("weights")
    @classmethod
    def _weights_valid(cls, value: dict[str, float]) -> dict[str, float]:
        negative = {k: v for k, v in value.items() if v < 0}
        if negative:
            raise ValueError(f"weights must be >= 0, got negative weights {negative}")
        if value and sum(value.values()) <= 0:  # empty: the data's domains (plan_mixture)
            raise ValueError(f"weights are all zero ({value}); give some domain a positive weight")
        return value

    @field_validator("num_tokens")
    @classmethod
    def _budget_positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"num_tokens={value} must be >= 1")
        return value

    @field_validator("max_epochs")
    @classmethod
    def _epochs_positive(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"max_epochs={value} must be > 0 (1.0 means no repetition)")
        return value

    @model_validator(mode="after")
    def _budget_fills_a_sequence(self) -> StageMixture:
        if self.num_tokens < self.seq_len + 1:
            raise ValueError(
                f"num_tokens={self.num_tokens} is smaller than one sequence (seq_len+1="
                f"{self.seq_len + 1}); raise num_tokens or lower seq_len"
            )
        return self

    def normalized_weights(self) -> dict[str, float]:
        """Weights scaled to sum to 1, zero-weight domains dropped."""
        total = sum(self.weights.values())
        return {k: v / total for k, v in sorted(self.weights.items()) if v > 0}
