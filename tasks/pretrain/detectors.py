"""Detectors: trainer components that watch the health metrics and raise alerts (rank 0).

- :class:`ThroughputDetector`: tokens/s at a metric row below ``(1 - throughput_drop)`` times the
  median of the recent rows, for ``throughput_sustain`` rows in a row; the cause is the part of
  the step split (data wait, compute, checkpoint) whose seconds per token rose most.
- :class:`StallDetector`: one batch waited for longer than ``stall_s``, seen while it happens by a
  watchdog thread.

The guard's spike and NaN events name the layers whose gradient norm jumped (``guard.py``).
A detector's state (``state_dict``) is saved in every checkpoint under its ``state_key``, so a
resumed run alerts as the uninterrupted one would.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmflow.tasks.pretrain.alerts import record_alert
from llmflow.tasks.pretrain.callbacks import Callback, MetricsLogger
from llmflow.tasks.pretrain.config import MonitorConfig
from llmflow.tasks.pretrain.health import median
from llmflow.tasks.pretrain.state import StepOutput

if TYPE_CHECKING:
    from llmflow.tasks.pretrain.train import Trainer

# The parts of a row a throughput drop is blamed on, from the row's time fields.
CAUSES = {
    "data wait": ("time_data_s",),
    "compute": ("time_compute_s", "time_optimizer_s"),
    "checkpoint": ("time_checkpoint_s",),
}


class ThroughputDetector(Callback):
    """A sustained drop of tokens/s against the run's own recent median (rank 0 only).

    The throughput a row is judged by is its tokens over its train-step seconds plus the
    checkpoint time that blocked training; validation is left out. The first ``warmup_rows``
    rows after the start, a resume or a rewind are ignored; one slow row (a checkpoint save) is
    noise, not a drop. Low rows stay out of the reference window until they have alerted.
    """

    state_key = "throughput_detector"

    def __init__(self, cfg: MonitorConfig, out_dir: Path, stage: str) -> None:
        self.cfg, self.out_dir, self.stage = cfg, Path(out_dir), stage
        self.window: deque[dict[str, float]] = deque(maxlen=cfg.throughput_window)
        self.low: list[dict[str, float]] = []
        self.alerting = False
        self.quiet = cfg.warmup_rows
        self.last_step = -1
        self.logger: MetricsLogger | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"window": list(self.window), "low": self.low, "alerting": self.alerting}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window = deque(state["window"], maxlen=self.cfg.throughput_window)
        self.low, self.alerting = list(state["low"]), bool(state["alerting"])

    def on_train_start(self, trainer: Trainer) -> None:
        self.logger = next((c for c in trainer.callbacks if isinstance(c, MetricsLogger)), None)
        self.quiet, self.last_step = self.cfg.warmup_rows, trainer.state.step

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        if out.step <= self.last_step:  # a rewind: the first steps after it reload and warm up
            self.quiet, self.low = self.cfg.warmup_rows, []
        self.last_step = out.step
        row = self.logger.last_row if self.logger is not None else None
        if row is not None and row["step"] == out.step:
            self.observe(row)

    def observe(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """Judge one metric row; return the alert it raised, if any."""
        sample = _sample(row)
        if sample is None:
            return None
        if self.quiet > 0:
            self.quiet -= 1
            return None
        reference = median([s["tokens_per_s"] for s in self.window]) if self.window else 0.0
        enough = len(self.window) >= self.cfg.throughput_min_rows
        if not (enough and sample["tokens_per_s"] < (1 - self.cfg.throughput_drop) * reference):
            self.low, self.alerting = [], False
            self.window.append(sample)
            return None
        self.low.append(sample)
        if self.alerting:  # the new normal: it joins the reference, alerted once
            self.window.append(sample)
            return None
        if len(self.low) < self.cfg.throughput_sustain:
            return None
        self.alerting = True
        return self._alert(reference)

    def _alert(self, reference: float) -> dict[str, Any]:
        now = _mean(self.low)
        before = {key: median([s[key] for s in self.window]) for key in now}
        rise = {cause: now[cause] - before[cause] for cause in CAUSES}
        cause = max(rise, key=rise.get)
        step = int(self.low[-1]["step"])
        drop = 1 - now["tokens_per_s"] / reference
        message = (
            f"throughput fell {drop:.0%} ({now['tokens_per_s']:.0f} tokens/s against a median of "
            f"{reference:.0f}) for {len(self.low)} rows since step {int(self.low[0]['step'])}; "
            f"cause: {cause} (data share {now['data_share']:.0%}, was "
            f"{before['data_share']:.0%})"
        )
        details = {
            "tokens_per_s": now["tokens_per_s"],
            "median_tokens_per_s": reference,
            "since_step": int(self.low[0]["step"]),
            "seconds_per_million_tokens": {c: 1e6 * now[c] for c in CAUSES},
            "before_seconds_per_million_tokens": {c: 1e6 * before[c] for c in CAUSES},
            "data_share": now["data_share"],
            "before_data_share": before["data_share"],
        }
        return record_alert(self.out_dir, "throughput", step, self.stage, message, cause, details)


def _sample(row: dict[str, Any]) -> dict[str, float] | None:
    """What the detector keeps of a metric row: throughput and seconds per token by cause."""
    step_s, tokens_per_s = row.get("time_step_s"), row.get("tokens_per_s")
    if not step_s or not tokens_per_s:
        return None
    tokens = tokens_per_s * step_s
    blocked = step_s + row.get("time_checkpoint_s", 0.0)
    sample = {"step": row["step"], "tokens_per_s": tokens / blocked}
    for cause, keys in CAUSES.items():
        sample[cause] = sum(row.get(k, 0.0) for k in keys) / tokens
    sample["data_share"] = row.get("data_share", 0.0)
    return sample


def _mean(samples: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in samples[0] if k != "step"]
    return {k: sum(s[k] for s in samples) / len(samples) for k in keys}


class StallDetector(Callback):
    """One batch waited for longer than ``stall_s``: alerted while the wait goes on (rank 0).

    A watchdog thread looks at the trainer's clock every ``min(1 s, stall_s / 4)``; each wait
    alerts at most once. NOTE: rank 0 sees its own loader only; another rank's stall shows up
    on rank 0 as a slow collective (compute), not as a stall.
    """

    def __init__(self, cfg: MonitorConfig, out_dir: Path, stage: str) -> None:
        self.cfg, self.out_dir, self.stage = cfg, Path(out_dir), stage
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.num_stalls = 0

    def on_train_start(self, trainer: Trainer) -> None:
        self.stop.clear()
        self.thread = threading.Thread(target=self._watch, args=(trainer,), daemon=True)
        self.thread.start()

    def on_train_end(self, trainer: Trainer) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def _watch(self, trainer: Trainer) -> None:
        limit, alerted_for = self.cfg.stall_s, None
        while not self.stop.wait(min(1.0, limit / 4)):
            since = trainer.clock.waiting_since
            if since is None or since == alerted_for:
                continue
            waited = time.perf_counter() - since
            if waited > limit:
                alerted_for = since
                self.alert(trainer.state.step, waited)

    def alert(self, step: int, waited_s: float) -> dict[str, Any]:
        """Record a stall of the batch for ``step`` that has waited ``waited_s`` so far."""
        self.num_stalls += 1
        message = (
            f"data loader stalled: the batch for step {step} has waited {waited_s:.1f}s "
            f"(limit monitor.stall_s={self.cfg.stall_s:g}s)"
        )
        details = {"waited_s": waited_s, "limit_s": self.cfg.stall_s}
        return record_alert(self.out_dir, "stall", step, self.stage, message, "data wait", details)
