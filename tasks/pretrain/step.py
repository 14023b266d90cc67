"""The pretrain step: one trainer run (a curriculum or context-extension stage) in its own process.

The output folder is the run folder: ``final/`` (the stage's checkpoint, also a plain model
folder), ``summary.json`` (headline metrics, ``total_tokens_seen`` over the whole curriculum
included), ``metrics.jsonl``, ``checkpoints/`` while it runs. A retried step finds the previous
attempt's checkpoints there and resumes exactly; each checkpoint the trainer completes is mirrored
to the store (``checkpoint_saved``) so a run killed on one machine resumes on another.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import ConfigDict, Field

from llmflow.tasks.framework.step import Metrics, checkpoint_saved, step
from llmflow.tasks.pretrain.alert_events import forward_alerts
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.launch import LaunchSettings, launch_training
from llmflow.tasks.pretrain.stage_report import LiveReport, publish_stage_report
from llmflow.tasks.pretrain.validate import read_meta

log = logging.getLogger("llmflow.pretrain")

# Read although the hash leaves them out: how to launch, and (through model_dump, which the
# trainer's config file needs) the trainer's execution-only fields.
EXECUTION = (
    "num_processes",
    "accelerate_config",
    "timeout_s",
    "launcher",
    "ray",
    "train.deterministic",
    "train.checkpoint.async_save",
    "train.checkpoint.preempt_grace_s",
    "train.activation_checkpointing",
    "train.activation_checkpointing_every_k",
    "train.log_interval",
    "train.eval_interval",
    "train.progress_bar",
    "train.tracker",
    "train.monitor",
)


class StageRun(LaunchSettings):
    """One trainer run: its config and how to launch it (launch fields are execution-only)."""

    model_config = ConfigDict(extra="forbid")

    train: TrainConfig = Field(description="The trainer's config for this stage.")


def with_data_vocab(train: TrainConfig, data_dir: Path) -> TrainConfig:
    """Take the vocabulary size from the packed data unless the config sets it explicitly."""
    if train.model.overrides.vocab_size is not None:
        return train
    return train.replaced(**{"model.overrides.vocab_size": read_meta(data_dir)["vocab_size"]})


@step("pretrain", version=2, gpu=True, execution=EXECUTION)
def pretrain(
    cfg: StageRun,
    data: Path,
    out: Path,
    validation: Path | None = None,
    init: Path | None = None,
) -> Metrics:
    """Train (or resume) one stage; final/ is its checkpoint, summary.json its metrics."""
    label = out.name.rpartition("-")[0]  # the output's {name}-{hash} folder
    with forward_alerts(out):  # each alert the trainer writes: a Prefect event, a log line
        metrics = launch_training(
            with_data_vocab(cfg.train, data),
            data,
            out,
            val_dir=validation,
            init_from=init / "final" if init is not None else None,
            launcher=cfg.build_launcher(),
            on_line=LiveReport(out, label).follow(log.info),
            on_checkpoint=lambda _notice: checkpoint_saved(),
            timeout_s=cfg.timeout_s,
        )
    publish_stage_report(out, label)  # plots and alerts, a Prefect artifact with the output
    return metrics
