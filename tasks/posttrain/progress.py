"""Post-training's progress in the pipeline's own lines, in place of the metric dicts that
transformers prints (``{'loss': '5.237', 'grad_norm': ...}``).

The console (through the ``llmflow.posttrain`` logger, as every step logs) gets one line per log:

    sft: step 10/60 loss 5.2370 grad_norm 2.46 lr 9.76e-04 mean_token_accuracy 0.197 (4.1 s)

and every dict the Trainer logs goes whole to ``train_log.jsonl`` in the step's output, one row
each with its ``step``: a resumed run's file holds the rows the checkpoint restored, then its own.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import Trainer

TRAIN_LOG = "train_log.jsonl"
logger = logging.getLogger("llmflow.posttrain")


def report_progress(trainer: Trainer, name: str, out: Path, keys: tuple[str, ...] = ()) -> None:
    """Swap transformers' console printer for the pipeline's progress lines and ``train_log.jsonl``.

    Args:
        trainer: The method's Trainer, before ``train()``.
        name: The step's name, which starts each line.
        out: The step's output folder.
        keys: Metrics of the method shown after loss, grad_norm and lr when logged.
    """
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback

    # NOTE: disable_tqdm=True makes the Trainer print each log dict (PrinterCallback); without
    # it, a tqdm bar (ProgressCallback) writes them. Either is raw library output here.
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)

    class Progress(_ProgressLines, TrainerCallback):
        pass

    trainer.add_callback(Progress(name, Path(out) / TRAIN_LOG, keys))


class _ProgressLines:
    """The progress callback's events (a mixin: transformers' TrainerCallback, its base, loads
    only when the step runs): progress lines, and every logged dict into ``path``."""

    def __init__(self, name: str, path: Path, keys: tuple[str, ...]):
        self.name, self.path, self.keys = name, path, keys
        self.started, self.training = time.monotonic(), False
        self.rows: list[dict[str, Any]] = []  # logged before training (the "before" scores)

    def on_train_begin(self, args, state, control, **kwargs):
        self.started, self.training = time.monotonic(), True
        if state.is_world_process_zero:
            # the restored history (a resumed run) covers every step up to its checkpoint
            rows = self.rows + [r for r in state.log_history if r.get("step", 0) > 0]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            first = state.global_step + 1
            logger.info("%s: training steps %d..%d", self.name, first, state.max_steps)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        row = {**logs, "step": state.global_step}
        if self.training:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        else:
            self.rows.append(row)
        if "loss" in logs:
            seconds = time.monotonic() - self.started
            line = progress_line(
                self.name, state.global_step, state.max_steps, logs, self.keys, seconds
            )
            logger.info(line)


def progress_line(
    name: str,
    step: int,
    num_steps: int,
    logs: dict[str, Any],
    keys: tuple[str, ...],
    seconds: float,
) -> str:
    """``<name>: step i/n loss x grad_norm g lr r <key> v ... (t s)`` from one logged dict."""
    parts = [f"{name}: step {step}/{num_steps}", f"loss {logs['loss']:.4f}"]
    if isinstance(logs.get("grad_norm"), (int, float)):
        parts.append(f"grad_norm {logs['grad_norm']:.3g}")
    if isinstance(logs.get("learning_rate"), (int, float)):
        parts.append(f"lr {logs['learning_rate']:.2e}")
    parts += [f"{k} {logs[k]:.4g}" for k in keys if isinstance(logs.get(k), (int, float))]
    return " ".join(parts) + f" ({seconds:.1f} s)"


def summary_line(name: str, metrics: dict[str, Any]) -> str:
    """The step's last line: its steps, mean train loss and held-out metrics before -> after."""
    text = f"{name} done: {metrics.get('num_steps')} steps, train_loss {metrics['train_loss']:.4f}"
    heldout = []
    for key, before in metrics.items():
        if key.startswith("heldout_") and key.endswith("_before"):
            after = metrics.get(key.removesuffix("_before") + "_after")
            if isinstance(before, (int, float)) and isinstance(after, (int, float)):
                metric = key.removeprefix("heldout_").removesuffix("_before")
                heldout.append(f"{metric} {before:.4g} -> {after:.4g}")
    if heldout:
        text += "; held-out " + ", ".join(heldout)
    return text
