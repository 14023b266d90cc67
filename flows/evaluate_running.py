"""Evaluation of running stages: score each new checkpoint while training goes on, against a
reference curve, and alert on a regression.

Each pass scores every complete checkpoint of each running stage (``stages``, or every pretrain
stage still being written under ``root``: ``pretrain/.partial/*``) that has no score yet, on
held-out loss and a cheap lm-eval suite (``tasks/evaluation/running.py``): the checkpoint is held
from the trainer's pruning while its weights are read, then converted and scored on one thread of
a niced process, so training keeps its cores. Scores are files under ``results`` named by the
checkpoint's checksums and the scoring config: a rerun, or the next scheduled pass, scores only
what is new. The reference (another run's stage folders, or model folders and
``hf://models/OWNER/NAME@REVISION`` revisions) is scored once the same way and placed on the same
token axis; a checkpoint worse than the reference at equal tokens by more than ``noise_band`` is an
``eval_regression`` alert in its stage's ``events.jsonl``.

Deployed on a schedule (``deployments/prefect.yaml``: every 10 minutes, one run at a time), or run
with ``follow=True`` beside a stage: it polls until every stage has written ``final/``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmflow.tasks.evaluation.running import (
    DEFAULT_NOISE_BAND,
    Scorer,
    ScoringConfig,
    alert_regressions,
    one_core,
    regressions,
    stage_checkpoints,
)
from llmflow.tasks.framework.errors import BadInputError, ConfigError

RUNNING_STAGES = "pretrain/.partial"  # where the store keeps the stages being trained
STORE_HASH = re.compile(r"-[0-9a-f]{16}$")


class ReferencePoint(BaseModel):
    """One reference model and the tokens it had seen (read from the folder when it says)."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        description="A trainer checkpoint, a model output, a Hugging Face folder, or "
        "hf://models/OWNER/NAME@REVISION."
    )
    tokens_seen: int | None = Field(
        None, description="Its place on the token axis (needed where the folder has no record)."
    )

    @model_validator(mode="after")
    def _hub_needs_tokens(self) -> ReferencePoint:
        if self.source.startswith("hf://") and self.tokens_seen is None:
            raise ValueError(
                f"reference.checkpoints source={self.source!r} has tokens_seen=None: a Hub "
                "revision records no tokens seen; give {source, tokens_seen}"
            )
        return self


class ReferenceConfig(BaseModel):
    """The curve a running stage is compared with, scored once (cached) like the stage."""

    model_config = ConfigDict(extra="forbid")

    stages: list[str] = Field(
        default_factory=list,
        description="Another run's stage folders: every checkpoint they hold, and final/.",
    )
    checkpoints: list[ReferencePoint] = Field(
        default_factory=list,
        description="Reference models: a path or hf:// id, or {source, tokens_seen}.",
    )

    @field_validator("checkpoints", mode="before")
    @classmethod
    def _plain_sources(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"source": v} if isinstance(v, str) else v for v in value]
        return value


class RunningEvaluationConfig(BaseModel):
    """Which stages to follow, how to score them, and what they are compared with."""

    model_config = ConfigDict(extra="forbid")

    root: str = Field("./runs", description="Artifact root (a local folder).")
    stages: list[str] = Field(
        default_factory=list,
        description="Stage folders to evaluate; empty: every running pretrain stage under root.",
    )
    results: str | None = Field(
        None, description="Where scores are kept; None: <root>/running-evaluation."
    )
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    noise_band: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_NOISE_BAND),
        description="Per metric, how much worse than the reference at equal tokens a checkpoint "
        "may be before it alerts (what clean runs with other seeds differ by); metrics without "
        "a band are scored, not compared.",
    )
    follow: bool = Field(False, description="Poll until every stage has written final/.")
    poll_s: float = Field(30.0, description="Seconds between passes when following.")
    max_wait_s: float | None = Field(
        None, description="Stop following after this long (a configured stage never started)."
    )
    threads: int = Field(1, description="Torch threads for scoring (one core beside training).")
    niceness: int = Field(10, description="How much nicer this process becomes (0: as is).")
    hold_ttl_s: float = Field(600.0, description="A hold not refreshed for this long expires.")

    @field_validator("threads")
    @classmethod
    def _one_or_more(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"threads={value} must be >= 1")
        return value

    @field_validator("noise_band")
    @classmethod
    def _bands(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in value.items() if v < 0}
        if bad:
            raise ValueError(f"noise_band={bad} must be >= 0")
        return value

    @model_validator(mode="after")
    def _local_root(self) -> RunningEvaluationConfig:
        if "://" in self.root and not self.stages:
            raise ValueError(f"root={self.root!r}: running stages are found in a local root only")
        return self

    def results_dir(self) -> Path:
        return Path(self.results or Path(self.root) / "running-evaluation")


def running_stages(config: RunningEvaluationConfig) -> list[Path]:
    """The configured stages, or each pretrain stage being written under the root."""
    if config.stages:
        return [Path(s) for s in config.stages]
    partial = Path(config.root) / RUNNING_STAGES
    if not partial.is_dir():
        return []
    return sorted(p for p in partial.iterdir() if (p / "checkpoints").is_dir())


def stage_name(stage: Path) -> str:
    """A stage's name: its folder's, less the store's hash."""
    return STORE_HASH.sub("", Path(stage).name)


def reference_curve(config: RunningEvaluationConfig, scorer: Scorer) -> list[dict[str, Any]]:
    """The reference's scores, each at its tokens (scored once, then read from the cache)."""
    curve = []
    for folder in config.reference.stages:
        label = f"reference-{Path(folder).name}"
        for checkpoint in stage_checkpoints(Path(folder)):
            point = scorer.score(label, checkpoint)
            if point is not None:
                curve.append(point)
    for ref in config.reference.checkpoints:
        point = scorer.score("reference", _local(ref.source), ref.tokens_seen)
        if point is not None:
            if ref.tokens_seen is not None:
                point["tokens_seen"] = ref.tokens_seen
            curve.append(point)
    missing = [p["checkpoint"] for p in curve if p.get("tokens_seen") is None]
    if missing:
        raise BadInputError(
            f"reference.checkpoints: {missing[0]} records no tokens_seen; give it "
            "{source, tokens_seen}"
        )
    return curve


def _local(source: str) -> Path:
    """A reference model's folder (an hf:// revision downloaded through the Hub cache)."""
    from llmflow.tasks.ingest.models import MODEL_PREFIX, local_folder, resolve

    if source.startswith(MODEL_PREFIX):
        return local_folder(resolve(source, "reference.checkpoints"), "reference.checkpoints")
    folder = Path(source)
    if not folder.is_dir():
        raise BadInputError(f"reference.checkpoints: {source!r}: no such folder")
    return folder


def evaluate_pass(
    config: RunningEvaluationConfig, scorer: Scorer, curve: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Score every checkpoint of the running stages; alert on each regression; one row each."""
    rows = []
    for stage in running_stages(config):
        for checkpoint in stage_checkpoints(stage):
            try:
                point = scorer.score(stage.name, checkpoint)
            except Exception as err:
                # NOTE: a stage committed (moved) while it was read: skip its checkpoints.
                if (checkpoint / "COMPLETE").exists():
                    raise
                print(f"{checkpoint}: gone while it was read ({type(err).__name__}); skipped")
                continue
            if point is None:  # pruned before it could be held
                continue
            found = regressions(point, curve, config.noise_band)
            alerts = alert_regressions(stage, stage_name(stage), point, found)
            rows.append(
                {
                    "stage": stage_name(stage),
                    "step": point["step"],
                    "tokens_seen": point["tokens_seen"],
                    **{k: round(v, 4) for k, v in sorted(point["metrics"].items())},
                    "cached": point["cached"],
                    "regressions": ", ".join(f["metric"] for f in found),
                    "new_alerts": len(alerts),
                }
            )
    return rows


def finished(config: RunningEvaluationConfig) -> bool:
    """Every stage has written final/. A stage found under the root may also have left the
    running area (committed); a configured one that is not there yet has not started."""
    stages = running_stages(config)
    gone_is_done = not config.stages
    return all(
        (s / "final" / "COMPLETE").exists() or (gone_is_done and not s.exists()) for s in stages
    )


@flow(name="llmflow-running-evaluation", log_prints=True)
def evaluate_running(
    config: RunningEvaluationConfig = RunningEvaluationConfig(),  # noqa: B008
) -> list[dict[str, Any]]:
    """Score the running stages' new checkpoints against the reference; alert on regressions."""
    if running_stages(config) and not (config.scoring.heldout or config.scoring.tokenizer):
        raise ConfigError(
            "scoring.heldout=None and scoring.tokenizer=None: a checkpoint needs held-out data "
            "(held-out loss) or a tokenizer (the lm-eval suite) to be scored"
        )
    scorer = Scorer(config.scoring, config.results_dir(), config.hold_ttl_s)
    started = time.monotonic()
    seen: dict[tuple[str, int | None], dict[str, Any]] = {}
    try:
        with one_core(config.threads, config.niceness):
            curve = reference_curve(config, scorer)
            while True:
                done = finished(config)  # NOTE: before the pass, so final/ is scored too
                for row in evaluate_pass(config, scorer, curve):
                    first = seen.setdefault((row["stage"], row["step"]), row)
                    if first is not row:  # scored on an earlier pass: count its new alerts
                        first["new_alerts"] += row["new_alerts"]
                out_of_time = (
                    config.max_wait_s is not None and time.monotonic() - started > config.max_wait_s
                )
                if not config.follow or done or out_of_time:
                    break
                time.sleep(config.poll_s)
    finally:
        scorer.close()
    rows = sorted(seen.values(), key=lambda r: (r["stage"], r["step"] or 0))
    create_table_artifact(
        rows or [{"stage": "(no running stage)", "step": None}],
        key="llmflow-running-evaluation",
        description="Each checkpoint of the running stages: scores, regressions vs the reference",
    )
    alerts = sum(r["new_alerts"] for r in rows)
    print(
        f"{len(rows)} checkpoint(s) scored against {len(curve)} reference point(s): {alerts} alert(s)"
    )
    return rows
