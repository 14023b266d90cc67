"""Store adapter for one pretraining stage (no Prefect): launches the trainer subprocess."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.framework.resources import preset_path
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.launch import pretrain

PRETRAIN_VERSION = "1"


class StageRun(BaseModel):
    """One trainer run: its config and how to launch it (launch fields are execution-only)."""

    model_config = ConfigDict(extra="forbid")

    train: TrainConfig
    num_processes: int = Field(1, ge=1, json_schema_extra={"versioned": False})
    accelerate_config: str | None = Field(None, json_schema_extra={"versioned": False})
    timeout_s: float | None = Field(None, json_schema_extra={"versioned": False})


def with_data_vocab(train: TrainConfig, data_dir: Path) -> TrainConfig:
    """Take the vocabulary size from the packed data unless the config sets it explicitly."""
    if "vocab_size" in train.model.overrides:
        return train
    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    model = train.model.model_copy(
        update={"overrides": {**train.model.overrides, "vocab_size": vocab}}
    )
    return TrainConfig.model_validate(train.model_copy(update={"model": model}).model_dump())


def pretrain_step(ctx) -> dict[str, Any]:
    """Train (or resume) one stage into ``ctx.out_dir``; ``final/`` is the stage's checkpoint."""
    cfg: StageRun = ctx.config
    data = ctx.inputs["data"]
    train = with_data_vocab(cfg.train, data)
    init = ctx.inputs.get("init")

    def on_line(line: str) -> None:
        ctx.log.info(line)
        if "saved checkpoint" in line:  # push partial state so a killed run resumes remotely
            ctx.sync()

    accelerate = preset_path(cfg.accelerate_config) if cfg.accelerate_config else None
    metrics = pretrain(
        train,
        data,
        ctx.out_dir,
        val_dir=ctx.inputs.get("validation"),
        init_from=(init / "final") if init else None,
        num_processes=cfg.num_processes,
        accelerate_config=accelerate,
        on_line=on_line,
        timeout_s=cfg.timeout_s,
    )
    previous = 0
    if init is not None and (init / "lineage.json").exists():
        previous = json.loads((init / "lineage.json").read_text())["metrics"].get(
            "total_tokens_seen", 0
        )
    # The trainer counts this stage's tokens; the curriculum total is what evaluations plot against.
    metrics["total_tokens_seen"] = previous + metrics.get("tokens_seen", 0)
    return metrics
