"""One driver for every post-training method (SFT, DPO and APO, GRPO), with exact resume.

A `PosttrainMethod` says what differs between methods: how its data is read and split, which
TRL trainer it builds, what it measures on the held-out records, and what it writes besides the
model. `run_posttrain` is the body the steps share:

    data -> rejects.jsonl -> trainer -> held-out "before" -> train (resuming) -> "after" -> hf/

Progress is the pipeline's own lines (``progress.py``); the Trainer's logged dicts go to
``train_log.jsonl`` in the output, not to the console.

Checkpoints are TRL/transformers' own (``save_steps``, ``resume_from_checkpoint``), written every
``cfg.checkpoint_interval`` optimizer steps into ``trainer/`` of the step's output folder. The
store makes that folder the output's fixed ``.partial`` folder (``tasks/framework/store.py``), so
a retried or preempted step finds the previous attempt's checkpoints there, as pretraining's do.
A checkpoint counts once `CHECKPOINT_MARKER` is in it: the Trainer writes its files one by one, so
a kill mid-save leaves a folder that looks like a checkpoint but lacks the marker, written last.
The Trainer restores weights, optimizer, scheduler, RNG states and the data position, so the
resumed run's weights equal an uninterrupted run's bit for bit
(``tests/tasks/posttrain/test_posttrain_resume.py``); the checkpoints are dropped once the model
is exported.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmflow.tasks.decontam.posttrain import excluded_records
from llmflow.tasks.evaluation.models import hf_dir
from llmflow.tasks.framework.step import Metrics, RawFiles, checkpoint_saved
from llmflow.tasks.posttrain.common import (
    finish_step,
    local_data,
    offline_environment,
    require_examples,
    split_heldout,
    write_rejects,
)
from llmflow.tasks.posttrain.formats import Record
from llmflow.tasks.posttrain.progress import report_progress, summary_line

if TYPE_CHECKING:
    from transformers import Trainer, TrainerCallback

CHECKPOINT_MARKER = "llmflow_checkpoint.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
logger = logging.getLogger("llmflow.posttrain")


@dataclass
class PosttrainData:
    """What a method's data step hands the driver.

    Attributes:
        train: Records to train on.
        heldout: Records for the before/after evaluation.
        rejects: Dropped records, each with its index and reason (``rejects.jsonl``).
        counts: Metrics about the data (``num_examples``, ...).
        what: Names the records in the error when none is usable; None: no such check (the
            method checked already, or generated its data).
        source: The file the records came from, for that error.
        extra: Whatever else the method carries from data to trainer (GRPO's rewards).
    """

    train: list[Record]
    heldout: list[Record]
    rejects: list[Record]
    counts: dict[str, Any] = field(default_factory=dict)
    what: str | None = None
    source: str = ""
    extra: Any = None


def split_data(
    cfg: Any, records: list[Record], rejects: list[Record], noun: str, what: str, source: Path
) -> PosttrainData:
    """``records`` split into train and held out (``cfg.num_heldout``, by ``cfg.seed``), with the
    counts ``num_<noun>``, ``num_train_<noun>``, ``num_heldout_<noun>``; ``what`` and ``source``
    name them in the error when none is usable."""
    train, heldout = split_heldout(records, cfg.num_heldout, cfg.seed)
    counts = {
        f"num_{noun}": len(records),
        f"num_train_{noun}": len(train),
        f"num_heldout_{noun}": len(heldout),
    }
    return PosttrainData(train, heldout, rejects, counts, what, str(source))


class PosttrainMethod(ABC):
    """One post-training method: its data, its TRL trainer, its held-out metrics."""

    name: str
    progress_keys: tuple[str, ...] = ()
    """Logged metrics shown in the progress lines after loss, grad_norm and lr."""

    @abstractmethod
    def data(
        self, cfg: Any, model_dir: Path, out: Path, data_path: Path | None, exclude: dict[int, str]
    ) -> PosttrainData:
        """Read (or generate), normalize, length-check and split the records."""

    @abstractmethod
    def trainer(self, cfg: Any, model_dir: Path, out: Path, data: PosttrainData) -> Trainer:
        """The TRL trainer, its output_dir ``out/trainer`` (``common_training_args``)."""

    @abstractmethod
    def heldout(
        self, trainer: Trainer, cfg: Any, model_dir: Path, data: PosttrainData, when: str
    ) -> dict[str, Any]:
        """Metrics on the held-out records, ``when`` = before / after; {} without any."""

    def finish(
        self, cfg: Any, out: Path, data: PosttrainData, before: dict, after: dict
    ) -> dict[str, Any]:
        """Write the method's own outputs before the model is exported; extra metrics."""
        return {}

    def report(self, metrics: dict[str, Any], before: dict, after: dict) -> None:
        """Report tables once the outputs are written (none by default)."""
        return None


def run_posttrain(
    method: PosttrainMethod,
    cfg: Any,
    model: Path,
    out: Path,
    data: RawFiles | None,
    data_check: Path | None,
) -> Metrics:
    """The body every post-training step shares; see the module docstring.

    Returns:
        Rejects and data counts, ``heldout_<metric>_<before|after>``, ``num_steps``,
        ``train_loss`` (the mean over every step, a resumed run's included), and the method's own.
    """
    offline_environment()
    model_dir = hf_dir(model)
    records, metrics = _read_data(method, cfg, model_dir, out, data, data_check)
    trainer = method.trainer(cfg, model_dir, out, records)
    before, after = _train_measured(method, trainer, cfg, model_dir, out, records, metrics)
    metrics.update(method.finish(cfg, out, records, before, after))
    finish_step(trainer, out, metrics)
    method.report(metrics, before, after)
    logger.info(summary_line(method.name, metrics))
    return metrics


def _read_data(
    method: PosttrainMethod,
    cfg: Any,
    model_dir: Path,
    out: Path,
    data: RawFiles | None,
    data_check: Path | None,
) -> tuple[PosttrainData, dict[str, Any]]:
    """The method's records, and the reject counts once ``rejects.jsonl`` is written.

    Raises:
        BadInputError: no usable record (when the method names its records ``what``).
    """
    records = method.data(cfg, model_dir, out, local_data(data, out), excluded_records(data_check))
    metrics: dict[str, Any] = write_rejects(out, records.rejects)
    if records.what is not None:
        usable = records.train + records.heldout
        require_examples(usable, records.what, records.source, records.rejects)
    return records, metrics


def _train_measured(
    method: PosttrainMethod,
    trainer: Trainer,
    cfg: Any,
    model_dir: Path,
    out: Path,
    records: PosttrainData,
    metrics: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Held-out scores, training (resuming), held-out scores again; returns both scores and adds
    them to ``metrics`` with the data counts, the steps and the mean train loss."""
    report_progress(trainer, method.name, out, method.progress_keys)
    before = method.heldout(trainer, cfg, model_dir, records, "before")
    num_steps, train_loss = train_resuming(trainer)
    after = method.heldout(trainer, cfg, model_dir, records, "after")
    metrics.update({f"heldout_{k}_before": v for k, v in before.items()})
    metrics.update({f"heldout_{k}_after": v for k, v in after.items()})
    metrics.update(records.counts)
    metrics.update(num_steps=num_steps, train_loss=train_loss)
    return before, after


# -- checkpoints -------------------------------------------------------------------------------
def last_checkpoint(folder: Path, clean: bool = True) -> Path | None:
    """The newest complete checkpoint in a Trainer's output_dir, or None.

    Args:
        folder: The Trainer's ``output_dir``.
        clean: Remove the unfinished ones (no marker: a kill mid-save), which transformers'
            own ``get_last_checkpoint`` would pick and fail to load.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    found = {}
    for path in folder.iterdir():
        match = _CHECKPOINT.match(path.name)
        if match is None or not path.is_dir():
            continue
        if (path / CHECKPOINT_MARKER).is_file():
            found[int(match.group(1))] = path
        elif clean:
            logger.warning("removing %s: an unfinished checkpoint (no %s)", path, CHECKPOINT_MARKER)
            shutil.rmtree(path)
    return found[max(found)] if found else None


def train_resuming(trainer: Trainer) -> tuple[int, float]:
    """``trainer.train()`` from the newest complete checkpoint in its output_dir, if any.

    Returns:
        The optimizer steps done and the mean training loss over all of them. (transformers'
        loss total restarts at 0 with every ``train()`` call, so each checkpoint's marker holds
        the sum over every step before it: the sum carried from the checkpoint this run resumed
        from plus this run's share, however many runs came before.)
    """
    start = last_checkpoint(Path(trainer.args.output_dir))
    carried = {"step": 0, "loss_sum": 0.0}
    if start is not None:
        carried = json.loads((start / CHECKPOINT_MARKER).read_text())
        logger.info("resuming from %s (step %d)", start.name, carried["step"])
    trainer.add_callback(_checkpoint_marker(trainer, carried))
    result = trainer.train(resume_from_checkpoint=str(start) if start else None)
    steps_now = result.global_step - carried["step"]
    loss_sum = carried["loss_sum"] + result.training_loss * steps_now
    return result.global_step, loss_sum / max(result.global_step, 1)


def _checkpoint_marker(trainer: Trainer, carried: dict[str, Any]) -> TrainerCallback:
    """A callback that completes each checkpoint with `CHECKPOINT_MARKER`: its step and the loss
    summed over every step up to it (``carried``: the sum the resumed checkpoint held)."""
    from transformers import TrainerCallback

    class MarkCheckpoints(TrainerCallback):
        # NOTE: on_save runs after the Trainer has written and rotated the checkpoint, so the
        # marker lands last; save_total_limit=2 keeps the previous complete one meanwhile.
        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                loss_sum = carried["loss_sum"] + _loss_sum(trainer)
                _write_atomic(
                    path / CHECKPOINT_MARKER, {"step": state.global_step, "loss_sum": loss_sum}
                )
            checkpoint_saved()  # on S3 the partial folder is mirrored for a retry elsewhere

    return MarkCheckpoints()


def _loss_sum(trainer: Trainer) -> float:
    """The training loss summed over the steps so far: what transformers drained into its total
    at each log, plus what accumulates on the device since the last one.

    NOTE: private attributes of transformers' Trainer (5.x); with several processes the part since
    the last log is this process's. A checkpoint interval that is a multiple of logging_steps
    makes that part 0, and the resumed mean equals the uninterrupted one to rounding.
    """
    total = float(getattr(trainer, "_total_loss_scalar", 0.0))
    pending = getattr(trainer, "_tr_loss", None)
    return total + (float(pending.item()) if pending is not None else 0.0)


def _write_atomic(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)
