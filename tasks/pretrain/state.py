"""The trainer's run state, typed: what a checkpoint restores and what the components read.

``TrainState`` is the state every rank shares (step, tokens, data position, timing, last
losses); the per-rank part (RNG streams, the data loader's cursor) is saved beside it by the
checkpointer. ``StepOutput`` is what one accepted optimizer step hands to the components.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

RECENT_LOSSES = 10


@dataclass
class TrainState:
    """Counters of one stage's run, saved in every checkpoint (``trainer_state.json``)."""

    step: int = 0
    """Optimizer steps taken over the whole curriculum (the schedule's step)."""
    start_step: int = 0
    """The step this stage started at (its init checkpoint's step)."""
    end_step: int = 0
    """The step this stage stops at."""
    tokens_seen: int = 0
    """Tokens trained on in this stage (all ranks)."""
    tokens_before: int = 0
    """Tokens trained on by the stages before this one."""
    batches_drawn: int = 0
    """Micro-batches drawn from the loader in this stage, skipped ones included."""
    train_time_s: float = 0.0
    """Seconds spent in train steps (validation and checkpointing excluded)."""
    recent_losses: list[float] = field(default_factory=list)
    """Losses of the last accepted steps (``final_loss`` is their mean)."""
    val_loss: float | None = None
    """The latest validation loss."""
    val_loss_by_domain: dict[str, float] | None = None
    """The latest validation loss per domain (a held-out set packed with its domains)."""

    @property
    def total_tokens_seen(self) -> int:
        """Tokens over the whole curriculum up to now: what evaluations plot against."""
        return self.tokens_before + self.tokens_seen

    def advance(self, loss: float, num_tokens: int) -> None:
        """Count one accepted optimizer step."""
        self.step += 1
        self.tokens_seen += num_tokens
        self.recent_losses = [*self.recent_losses, loss][-RECENT_LOSSES:]

    def start_stage(self) -> None:
        """After loading the previous stage's final state: a new stage starts at its step."""
        kept = {"step": self.step, "start_step": self.step, "tokens_before": self.total_tokens_seen}
        self.load_state_dict({**TrainState().state_dict(), **kept})

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` output (keys a former version lacks keep their value)."""
        for f in dataclasses.fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])


@dataclass
class StepOutput:
    """One accepted optimizer step, as the components see it."""

    step: int
    """The step count after this update (1 for the first)."""
    loss: float
    grad_norm: float
    lr: float
    num_tokens: int
    seconds: float
    first_batch: dict[str, torch.Tensor]
    """This step's first micro-batch (the rank-info component fingerprints it)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Extra metrics components add for the logger (the validator's ``val_loss``)."""
