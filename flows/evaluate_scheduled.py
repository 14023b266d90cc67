"""Scheduled evaluation: score every new checkpoint under a root exactly once, keep a leaderboard.

A checkpoint is an HF export holding ``_COMMITTED`` (the store writes it last, so one still being
written is never touched). Results are keyed by checkpoint and suite hash, so each checkpoint is
evaluated once per suite; a failing checkpoint (say, a truncated safetensors) fails alone and
the run ends Failed naming it, after the others were scored and the leaderboard updated.
Deploy it with a cron schedule (``deployments/prefect.yaml``) and a concurrency limit of 1.
"""

from __future__ import annotations  # noqa: I001  (flows must be imported before prefect)

import tempfile
from pathlib import Path

import llmflow.flows  # noqa: F401  (sets Prefect env defaults before prefect is imported)
import fsspec
from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.framework.concurrency import gpu_slot
from llmflow.tasks.evaluation.checkpoints import evaluate_checkpoints, raise_for_failures
from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.leaderboard import update_leaderboard


class ScheduledEvaluationConfig(BaseModel):
    """Where checkpoints are, where results go, and the suite to run."""

    model_config = ConfigDict(extra="forbid")

    root: str = Field("./runs", description="Artifact root: a folder or s3://bucket/prefix.")
    checkpoint_root: str | None = Field(
        None, description="Folder of HF exports to scan (default: {root}/export)."
    )
    results_root: str | None = Field(
        None, description="Where results and the leaderboard go (default: {root}/evaluations)."
    )
    heldout_dir: str | None = Field(
        None, description="Local held-out documents (parquet) for the perplexity tasks."
    )
    evaluate: EvalConfig = Field(
        default_factory=lambda: EvalConfig(
            tasks=["cf_arith", "mcf_arith", "gen_arith", "cf_facts"]
        ),
        description="The suite (tasks needing held-out docs need heldout_dir).",
    )

    def roots(self) -> tuple[str, str]:
        base = self.root.rstrip("/")
        return self.checkpoint_root or f"{base}/export", self.results_root or f"{base}/evaluations"


@task(name="evaluate-new-checkpoints", retries=0)
def evaluate_new(config: ScheduledEvaluationConfig) -> list[dict]:
    """Evaluate each checkpoint not yet scored on this suite (failures isolated)."""
    checkpoints, results = config.roots()
    heldout = Path(config.heldout_dir) if config.heldout_dir else None
    fs, path = fsspec.core.url_to_fs(checkpoints)
    if not fs.exists(path):  # a fresh root: nothing exported yet is zero checkpoints, not an error
        print(f"no checkpoints yet under {checkpoints}")
        return []
    with gpu_slot():
        return evaluate_checkpoints(config.evaluate, checkpoints, results, heldout)


@task(name="update-leaderboard", retries=2, retry_delay_seconds=5)
def leaderboard(config: ScheduledEvaluationConfig) -> dict:
    """Rebuild the leaderboard (table, plots, signal quality) from every result so far."""
    _, results = config.roots()
    with tempfile.TemporaryDirectory(prefix="llmflow-leaderboard-") as tmp:
        summary = update_leaderboard(results, Path(tmp))
        markdown = (Path(tmp) / "leaderboard.md").read_text()
        quality = (Path(tmp) / "signal_quality.md").read_text()
        fs, path = fsspec.core.url_to_fs(f"{results.rstrip('/')}/_leaderboard")
        fs.makedirs(path, exist_ok=True)
        fs.put(f"{tmp}/", f"{path}/", recursive=True)
    create_markdown_artifact(
        f"## Leaderboard\n\n{markdown}\n\n## Signal quality\n\n{quality}",
        key="llmflow-leaderboard",
        description="Every checkpoint x task, and which tasks are worth watching",
    )
    return summary


@flow(name="llmflow-scheduled-evaluation", log_prints=True)
def scheduled_evaluation(
    config: ScheduledEvaluationConfig = ScheduledEvaluationConfig(),  # noqa: B008
) -> list[dict]:
    """Score new checkpoints, update the leaderboard, fail naming any checkpoint that failed."""
    statuses = evaluate_new(config)
    rows = [
        {"checkpoint": s["checkpoint"], "status": s["status"], "error": s.get("error", "")}
        for s in statuses
    ]
    create_table_artifact(
        rows or [{"checkpoint": "(none new)", "status": "", "error": ""}],
        key="llmflow-scheduled-evaluation",
    )
    print(f"evaluated {len(statuses)} new checkpoint(s)")
    leaderboard(config)
    raise_for_failures(statuses)
    return statuses
