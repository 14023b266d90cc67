"""Stability guard: detect NaN/Inf losses or gradients and loss spikes, and act on them.

A spike is a loss more than ``zscore`` standard deviations above the mean of the last ``window``
accepted losses. The guard is a trainer component: the train step asks it to ``admit`` each
step's gradients; on an event it applies the configured policy (skip the batch, rewind to the
last checkpoint with a lower LR, or stop) and logs the event to ``events.jsonl`` as an alert
(``alerts.py``, kind ``spike`` or ``nonfinite``) that names the layers whose gradient norm jumped
most against its recent median (a layer whose weights jumped first; ``health.jumped_layers``).
"""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmflow.tasks.pretrain.alerts import EVENTS, record_alert
from llmflow.tasks.pretrain.callbacks import Callback, truncate_jsonl
from llmflow.tasks.pretrain.config import GuardConfig, MonitorConfig
from llmflow.tasks.pretrain.health import WEIGHT_JUMP, jumped_layers

if TYPE_CHECKING:
    from llmflow.tasks.pretrain.train import Trainer

__all__ = ["EVENTS", "StabilityGuard"]


class StabilityGuard(Callback):
    """Classifies each step's loss and grad norm as ok, non-finite or spike; applies the policy."""

    state_key = "guard"  # checkpointed (state_registry.py)

    def __init__(self, cfg: GuardConfig, monitor: MonitorConfig | None = None) -> None:
        self.cfg, self.monitor = cfg, monitor or MonitorConfig()
        self.history: deque[float] = deque(maxlen=cfg.window)
        # per-layer gradient norms of recent measured steps: what an event's jump is against
        self.layer_history: deque[dict[str, float]] = deque(maxlen=self.monitor.spike_history)
        self.layer_weights: dict[str, float] = {}  # per-layer weight norms when last measured
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

    def remember_layers(self, grad_norms: dict[str, float], weights: dict[str, float]) -> None:
        """Record an accepted step's per-layer gradient norms (before clipping) and weight
        norms (after its update)."""
        if grad_norms:
            self.layer_history.append(dict(grad_norms))
        self.layer_weights = dict(weights)

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.history),
            "num_events": self.num_events,
            "num_skipped": self.num_skipped,
            "num_rewinds": self.num_rewinds,
            "lr_scale": self.lr_scale,
            "layer_history": list(self.layer_history),
            "layer_weights": self.layer_weights,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(state["history"], maxlen=self.cfg.window)
        self.num_events = state["num_events"]
        self.num_skipped = state["num_skipped"]
        self.num_rewinds = state["num_rewinds"]
        self.lr_scale = state["lr_scale"]
        self.layer_history = deque(
            state.get("layer_history", []), maxlen=self.monitor.spike_history
        )
        self.layer_weights = dict(state.get("layer_weights", {}))

    # ------------------------------------------------------------------------- the policy
    def on_train_start(self, trainer: Trainer) -> None:
        if trainer.runtime.is_main:
            truncate_jsonl(trainer.out_dir / EVENTS, trainer.state.step)
        if self.cfg.policy == "rewind" and trainer.checkpointer.latest() is None:
            trainer.checkpointer.save_step(trainer)  # something to rewind to

    def admit(self, trainer: Trainer, loss: float, grad_norm: float, batch_ids: list[int]) -> bool:
        """Whether this step's gradients may be applied; if not, the policy has been applied."""
        kind, zscore = self.check(loss, grad_norm)
        if kind == "ok":
            self.accept(loss)
            return True
        layers = self.jumped_layers(trainer, grad_norm)  # NOTE: while the gradients are there
        trainer.zero_grad()
        self.num_events += 1
        event = {
            "step": trainer.state.step,
            "kind": kind,
            "policy": self.cfg.policy,
            "loss": _finite(loss),
            "grad_norm": _finite(grad_norm),
            "zscore": _finite(zscore),
            "batch_ids": batch_ids,
            "loader_state": trainer.loader.state_dict(),
            "layers": [row["layer"] for row in layers],
        }
        event.update(self._apply_policy(trainer))
        if trainer.runtime.is_main:
            _log_event(trainer, event, layers)
        if self.cfg.policy == "stop" or self.num_events > self.cfg.max_events:
            raise RuntimeError(
                f"stability guard: {kind} at step {event['step']} (loss {loss}); "
                f"{self.num_events} events; policy={self.cfg.policy}"
            )
        return False

    def jumped_layers(self, trainer: Trainer, grad_norm: float) -> list[dict[str, Any]]:
        """The layers whose gradient norm (before clipping) jumped most, a layer whose weights
        jumped first (collective)."""
        max_norm = trainer.cfg.optimizer.grad_clip
        clipped = max_norm > 0 and math.isfinite(grad_norm) and grad_norm > max_norm
        # NOTE: the clip multiplied every gradient by max_norm / (norm + 1e-6); undone here
        scale = (grad_norm + 1e-6) / max_norm if clipped else 1.0
        stats = trainer.layer_stats
        norms, weights = stats.grad_norms(scale), stats.weight_norms()
        history, top = list(self.layer_history), self.monitor.spike_top_layers
        return jumped_layers(norms, history, top, weights, self.layer_weights)

    def _apply_policy(self, trainer: Trainer) -> dict[str, Any]:
        """Skip (also a rewind with nothing to rewind to) or rewind; what the event adds."""
        target = trainer.checkpointer.latest() if self.cfg.policy == "rewind" else None
        if self.cfg.policy == "skip" or (self.cfg.policy == "rewind" and target is None):
            self.num_skipped += 1
        elif self.cfg.policy == "rewind":
            self._rewind(trainer, target)
            return {"rewound_to": trainer.state.step, "lr_scale": self.lr_scale}
        return {}

    def _rewind(self, trainer: Trainer, target: Path) -> None:
        """Reload weights, optimizer and step from ``target``; keep the data moving forward."""
        counters = {"num_events": self.num_events, "num_skipped": self.num_skipped}
        state = trainer.state
        kept = {k: getattr(state, k) for k in ("batches_drawn", "train_time_s", "end_step")}
        lr_scale = self.lr_scale * self.cfg.rewind_lr_factor
        num_rewinds = self.num_rewinds + 1
        trainer_state, _ = trainer.checkpointer.load(trainer, target)
        state.load_state_dict(kept)
        self.load_state_dict({**trainer_state["guard"], **counters})
        self.lr_scale, self.num_rewinds = lr_scale, num_rewinds


def _finite(value: float) -> float | None:
    return value if np.isfinite(value) else None


def _log_event(trainer: Trainer, event: dict[str, Any], layers: list[dict[str, Any]]) -> None:
    """Append a guard event to events.jsonl as an alert (its own fields kept) and echo it."""
    jumps = ", ".join(f"{r['layer']} ({_jump(r)})" for r in layers)
    loss = f"{event['loss']:.4g}" if event["loss"] is not None else "non-finite"
    message = (
        f"{event['kind']}: loss {loss} at step {event['step']}; gradient norm jumped most in "
        f"{jumps}; policy {event['policy']}"
    )
    details = {"layers": layers, "loss": event["loss"], "grad_norm": event["grad_norm"],
               "zscore": event["zscore"], "policy": event["policy"]}  # fmt: skip
    cause = layers[0]["layer"] if layers else None
    stage = trainer.out_dir.name
    record_alert(trainer.out_dir, event["kind"], event["step"], stage, message, cause, details,
                 extra=event)  # fmt: skip
    print(f"guard event: {json.dumps(event)}", flush=True)


def _jump(row: dict[str, Any]) -> str:
    ratio, moved = row["ratio"], row.get("weight_ratio")
    if moved is not None and not (1 / WEIGHT_JUMP <= moved <= WEIGHT_JUMP):
        return f"weights x{moved:.3g} since last measured"
    if ratio is None:
        return f"norm {row['grad_norm']:.3g}, no history"
    return "non-finite" if math.isinf(ratio) else f"x{ratio:.1f} its median"
