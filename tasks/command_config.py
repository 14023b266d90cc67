"""The recipe's sections for its commands besides ``run``: ``llmflow preflight``
(`PreflightOptions`, the recipe's ``preflight``), ``llmflow critical-batch``
(`CriticalBatchConfig`, ``critical_batch``) and ``llmflow ablate`` (`AblationConfig`,
``ablation``). Each is set by ``--set`` as every field is; the commands' flags are shorthands for
these fields. Execution-only: no step of the recipe's own graph reads them."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmflow.tasks.framework.errors import BadInputError


class PreflightOptions(BaseModel):
    """How much of the checklist to run here, and at what size."""

    model_config = ConfigDict(extra="forbid")

    processes: int = Field(2, ge=1, description="Ranks of the test steps (FSDP2 when > 1).")
    seq_len: int | None = Field(
        None, gt=1, description="Sequence length of the test steps (None: the recipe's)."
    )
    micro_batch_size: int | None = Field(
        None, gt=0, description="Sequences per rank per step (None: the recipe's)."
    )
    steps: int = Field(
        4, ge=2, description="Optimizer steps; the resume starts after half of them."
    )
    docs_per_source: int = Field(2, ge=1, description="Documents read from each data source.")
    check_data: bool = Field(True, description="Open every data source and read documents.")
    train: bool = Field(True, description="Run the test steps (False: plan and meta build only).")
    timeout_s: float = Field(1800, gt=0, description="Deadline of each trainer launch.")
    layouts: Literal["plan", "all", "none"] = Field(
        "plan",
        description="Parallel layouts rehearsed at a tiny width against data parallelism alone: "
        "those `llmflow plan` gives the recipe's stages (plan), each of TP, CP and PP (all), or "
        "none. Runs with the test steps.",
    )
    host_memory_gb: float | None = Field(
        None,
        gt=0,
        description="Memory per rank the test steps are scaled to (None: this host's available "
        "memory shared by the ranks, or a GPU's free memory).",
    )


class CriticalBatchConfig(BaseModel):
    """Base batch, the multiples to try, the LR rule, where to branch and for how long."""

    model_config = ConfigDict(extra="forbid")

    base_batch: int = Field(4, gt=0, description="Base batch B, in sequences.")
    factors: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8], description="Multiples k of B (1 is the baseline)."
    )
    lr_scaling: Literal["sqrt", "linear"] = Field(
        "sqrt", description="LR at k·B: lr·sqrt(k) (Adam) or lr·k (SGD)."
    )
    points: list[int] = Field(
        default_factory=lambda: [40_000, 200_000],
        description="Trunk tokens at which to branch (two points of training).",
    )
    branch_tokens: int = Field(65_536, gt=0, description="Tokens of every branch.")
    tolerance: float = Field(0.01, gt=0, description="Relative loss within which k·B matches B.")

    @field_validator("factors")
    @classmethod
    def _has_baseline(cls, value: list[int]) -> list[int]:
        if 1 not in value or any(k < 1 for k in value):
            raise ValueError(f"factors must be >= 1 and include 1 (the baseline), got {value}")
        return sorted(set(value))

    @field_validator("points")
    @classmethod
    def _increasing(cls, value: list[int]) -> list[int]:
        if not value or value != sorted(set(value)) or value[0] <= 0:
            raise ValueError(f"points must be increasing positive token counts, got {value}")
        return value

    def lr_factor(self, k: int) -> float:
        return math.sqrt(k) if self.lr_scaling == "sqrt" else float(k)


class AblationConfig(BaseModel):
    """Which checkpoint to anneal from, the candidate source and the budget."""

    model_config = ConfigDict(extra="forbid")

    candidate: str | None = Field(
        None,
        description="Domain to test as late-stage data (e.g. math); `llmflow ablate` needs it.",
    )
    from_stage: int = Field(
        -2, description="Curriculum stage index to start from (-2: stage 2 of 3)."
    )
    candidate_share: float = Field(0.6, gt=0, lt=1, description="Share of the candidate source.")
    num_tokens: int = Field(50_000, gt=0, description="Annealing budget of each arm.")

    def required_candidate(self) -> str:
        """The candidate domain; a ``BadInputError`` naming the field when it is not set."""
        if self.candidate is None:
            raise BadInputError(
                "ablation.candidate is not set: name the domain to test as late-stage data "
                "(--candidate DOMAIN or --set ablation.candidate=DOMAIN)"
            )
        return self.candidate
