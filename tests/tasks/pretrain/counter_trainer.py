"""The trainer with one more component: step counters whose state a checkpoint carries.

Run as the trainer is (``python counter_trainer.py --config ...`` or under torchrun). The only
change to the trainer is the component itself: it declares a ``state_key`` and the trainer's
state registry saves, resumes and reshards it (test_state_registry.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from llmflow.tasks.pretrain import train
from llmflow.tasks.pretrain.callbacks import Callback


class StepCounter(Callback):
    """Counts the optimizer steps this run has taken, across resumes (rank 0's state)."""

    state_key = "step_counter"

    def __init__(self) -> None:
        self.counted = 0

    def state_dict(self) -> dict[str, int]:
        return {"counted": self.counted}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.counted = state["counted"]

    def on_step_end(self, trainer, out) -> None:
        self.counted += 1

    def on_train_end(self, trainer) -> None:
        rank = trainer.runtime.rank
        report = {"counted": self.counted, "step": trainer.state.step}
        Path(trainer.out_dir, f"{self.state_key}-{rank}.json").write_text(json.dumps(report))


class RankCounter(StepCounter):
    """The same count kept by each rank for itself (each rank's own state)."""

    state_key = "rank_counter"
    state_per_rank = True


def _components(self, val_dir):
    """The trainer's components with the counters before the checkpointer: a checkpoint taken
    at a step end holds the state of the components whose hook ran before its own."""
    found = ORIGINAL(self, val_dir)
    at = found.index(self.checkpointer)
    return [*found[:at], StepCounter(), RankCounter(), *found[at:]]


ORIGINAL = train.Trainer._components
train.Trainer._components = _components

if __name__ == "__main__":
    train.main()
