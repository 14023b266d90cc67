"""Trainer callbacks that only observe: metric logging (jsonl, TensorBoard, trackers, progress)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from llmflow.tasks.pretrain.config import TrainConfig


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_jsonl(path: Path, after_step: int) -> None:
    """Drop rows logged after ``after_step`` (they are replayed after a resume)."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in rows if json.loads(r).get("step", 0) <= after_step]
    path.write_text("".join(r + "\n" for r in kept))


class MetricsLogger:
    """Writes metric rows to metrics.jsonl, TensorBoard, accelerate trackers and the console.

    Only rank 0 constructs one; the trainer passes ``None`` elsewhere.
    """

    def __init__(self, cfg: TrainConfig, out_dir: Path, start_step: int, total_steps: int):
        self.path = Path(out_dir) / "metrics.jsonl"
        truncate_jsonl(self.path, start_step)
        truncate_jsonl(Path(out_dir) / "events.jsonl", start_step)
        self.writer = None
        if cfg.tracker.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(out_dir) / "tb"), purge_step=start_step + 1)
        self.trackers = _accelerate_trackers(cfg, out_dir)
        self.bar = None
        if cfg.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", file=sys.stderr)

    def log(self, row: dict[str, Any]) -> None:
        """Record one row (must hold ``step``)."""
        step = row["step"]
        append_jsonl(self.path, {**row, "time": time.time()})
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(f"train/{key}", value, step)
        for tracker in self.trackers:
            tracker.log(scalars, step=step)
        text = f"step {step} loss {row.get('loss', float('nan')):.4f}"
        if "tokens_per_s" in row:
            text += f" tok/s {row['tokens_per_s']:.0f}"
        if "val_loss" in row:
            text += f" val_loss {row['val_loss']:.4f}"
        if self.bar is not None:
            self.bar.set_postfix_str(text)
        else:
            print(text, flush=True)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers:
            tracker.finish()
        if self.bar is not None:
            self.bar.close()


def _accelerate_trackers(cfg: TrainConfig, out_dir: Path) -> list[Any]:
    """W&B / MLflow through accelerate's tracker classes (rank 0 only)."""
    trackers: list[Any] = []
    if not cfg.tracker.others:
        return trackers
    from accelerate.tracking import MLflowTracker, WandBTracker

    config = cfg.model_dump(mode="json")
    for name in cfg.tracker.others:
        if name == "wandb":
            tracker = WandBTracker(cfg.tracker.project, dir=str(out_dir))
        else:
            tracker = MLflowTracker(cfg.tracker.project, logging_dir=str(out_dir))
        # NOTE: accelerate >= 1.x defers the real init to start() on the main process.
        if hasattr(tracker, "start"):
            tracker.start()
        tracker.store_init_configuration(config)
        trackers.append(tracker)
    return trackers


def log_event(out_dir: Path, event: dict[str, Any]) -> None:
    """Append a guard event to events.jsonl and echo it."""
    append_jsonl(Path(out_dir) / "events.jsonl", {**event, "time": time.time()})
    print(f"guard event: {json.dumps(event)}", flush=True)
