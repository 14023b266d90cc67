"""Stability guard: detect NaN/Inf losses or gradients and loss spikes.

A spike is a loss more than ``zscore`` standard deviations above the mean of the last ``window``
accepted losses. The guard only classifies; the trainer applies the configured policy and logs
every event to ``events.jsonl``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from llmflow.tasks.pretrain.config import GuardConfig


class StabilityGuard:
    """Classifies each step's loss and grad norm as ok, non-finite or spike."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.num_events = 0
        self.num_skipped = 0
        self.num_rewinds = 0
        self.lr_scale = 1.0

    def check(self, loss: float, grad_norm: float) -> tuple[str, float]:
        """Return ``(kind, zscore)`` with kind in {"ok", "nonfinite", "spike"}."""
        if not self.cfg.enabled:
            return "ok", 0.0
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "nonfinite", math.nan
        z = self.zscore(loss)
        if z > self.cfg.zscore:
            return "spike", z
        return "ok", z

    def zscore(self, loss: float) -> float:
        """Return the loss's z-score against the window (0 until min_history losses)."""
        if len(self.history) < self.cfg.min_history:
            return 0.0
        mean = sum(self.history) / len(self.history)
        var = sum((x - mean) ** 2 for x in self.history) / (len(self.history) - 1)
        # NOTE: a floor on the std keeps a flat plateau (std ~ 0) from flagging tiny wiggles.
        std = max(math.sqrt(var), 1e-3 * abs(mean), 1e-8)
        return (loss - mean) / std

    def accept(self, loss: float) -> None:
        """Record an accepted step's loss in the moving window."""
        self.history.append(loss)

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.history),
            "num_events": self.num_events,
            "num_skipped": self.num_skipped,
            "num_rewinds": self.num_rewinds,
            "lr_scale": self.lr_scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(state["history"], maxlen=self.cfg.window)
        self.num_events = state["num_events"]
        self.num_skipped = state["num_skipped"]
        self.num_rewinds = state["num_rewinds"]
        self.lr_scale = state["lr_scale"]
