"""Experiment trackers besides TensorBoard: MLflow and Weights & Biases, on rank 0.

Each trainer output folder is one tracker run. Its id is kept in the folder, so a resumed run
(a retried step, a restarted worker group) logs into the same run instead of starting another.
A fresh run records the config as flat parameters (``optimizer.lr``) and as a file, and the
lineage of the training data (the mixture's ``lineage.json``, which leads back to the raw files);
the end of training adds the summary.

MLflow logs to ``tracker.mlflow_tracking_uri`` (else ``MLFLOW_TRACKING_URI``, else a file store
in the run folder); W&B runs in ``tracker.wandb_mode`` (``offline`` writes a run directory under
the run folder that ``wandb sync`` uploads later).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from llmflow.tasks.pretrain.config import TrainConfig

LINEAGE_FILE = "lineage.json"
MAX_PARAM_CHARS = 500  # MLflow's limit on one parameter value


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optimizer": {"lr": 3e-4}}`` -> ``{"optimizer.lr": 3e-4}`` (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


class _RunId:
    """The tracker run id kept in the run folder."""

    def __init__(self, out_dir: Path, name: str):
        self.path = Path(out_dir) / f"{name}_run_id"

    def read(self) -> str | None:
        return self.path.read_text().strip() if self.path.exists() else None

    def write(self, run_id: str) -> None:
        self.path.write_text(run_id + "\n")


class MLflowRun:
    """One MLflow run per run folder."""

    def __init__(self, cfg: TrainConfig, out_dir: Path, data_dir: Path | None):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(
            cfg.tracker.mlflow_tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or (Path(out_dir) / "mlruns").resolve().as_uri()
        )
        mlflow.set_experiment(cfg.tracker.project)
        saved = _RunId(out_dir, "mlflow")
        run_id = saved.read()
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else Path(out_dir).name)
        if run_id is None:
            saved.write(self.run.info.run_id)
            self._describe(cfg, out_dir, data_dir)

    def _describe(self, cfg: TrainConfig, out_dir: Path, data_dir: Path | None) -> None:
        config = cfg.model_dump(mode="json")
        params = {k: v for k, v in flatten(config).items() if len(str(v)) <= MAX_PARAM_CHARS}
        self.mlflow.log_params(params)
        self.mlflow.set_tags({"llmflow.output": Path(out_dir).name})
        self.mlflow.log_dict(config, "train_config.json")
        lineage = Path(data_dir) / LINEAGE_FILE if data_dir is not None else None
        if lineage is not None and lineage.exists():
            self.mlflow.log_dict(json.loads(lineage.read_text()), "data_lineage.json")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def finish(self, summary: dict[str, Any] | None) -> None:
        if summary:
            self.mlflow.log_dict(summary, "summary.json")
        self.mlflow.end_run()


class WandbRun:
    """One W&B run per run folder (``dir`` is the run folder)."""

    def __init__(self, cfg: TrainConfig, out_dir: Path, data_dir: Path | None):
        import wandb

        saved = _RunId(out_dir, "wandb")
        run_id = saved.read() or uuid.uuid4().hex[:8]
        config = cfg.model_dump(mode="json")
        lineage = Path(data_dir) / LINEAGE_FILE if data_dir is not None else None
        if lineage is not None and lineage.exists():
            config["data_lineage"] = json.loads(lineage.read_text())
        self.run = wandb.init(
            project=cfg.tracker.project,
            dir=str(out_dir),
            id=run_id,
            resume="allow",
            name=Path(out_dir).name,
            config=config,
            mode=cfg.tracker.wandb_mode,
        )
        saved.write(run_id)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self, summary: dict[str, Any] | None) -> None:
        if summary:
            self.run.summary.update(summary)
        self.run.finish()


def open_trackers(cfg: TrainConfig, out_dir: Path, data_dir: Path | None) -> list[Any]:
    """The trackers ``cfg.tracker.others`` names, started (rank 0 calls this)."""
    kinds = {"mlflow": MLflowRun, "wandb": WandbRun}
    return [kinds[name](cfg, out_dir, data_dir) for name in cfg.tracker.others]
