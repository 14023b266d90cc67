"""Store adapters for the curation stages (plain Python, no Prefect).

Each stage is its own content-addressed output. A stage's hash covers only the config fields
that stage depends on (``stage_config``), so changing a filter threshold re-runs the filter
stage and the cheap global stages, never normalization, exact hashes or MinHash signatures.
Per-shard stages are mapped over shards; one failing shard retries alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.curation.config import CurateConfig
from llmflow.tasks.curation.pipeline import (
    exact_dedup,
    exact_hashes_shard,
    filter_shard,
    finalize,
    minhash_signatures_shard,
    near_dedup,
    normalize_shard,
    quality_model,
    stage_config,
)
from llmflow.tasks.curation.shards import shards_in
from llmflow.tasks.framework.store import StepContext

CURATE_VERSION = "1"


class CurateStage(BaseModel):
    """One curation stage's config: the fields it depends on are hashed, the rest rides along."""

    model_config = ConfigDict(extra="forbid")

    stage: str
    shard: str | None = None
    settings: dict[str, Any] = Field(description="stage_config(curate, stage): what is hashed.")
    curate: CurateConfig = Field(json_schema_extra={"versioned": False})


def stage(cfg: CurateConfig, name: str, shard: str | None = None) -> CurateStage:
    """The config of stage ``name`` (for ``shard`` when it is a per-shard stage)."""
    return CurateStage(stage=name, shard=shard, settings=stage_config(cfg, name), curate=cfg)


def shard_names(ingest_dir: Path) -> list[str]:
    """Names of the ingested shards, the unit of fan-out."""
    return [p.name for p in shards_in(ingest_dir)]


def _one_shard(directory: Path) -> Path:
    (shard,) = shards_in(directory)
    return shard


def normalize_step(ctx: StepContext) -> dict[str, Any]:
    cfg: CurateStage = ctx.config
    return normalize_shard(cfg.curate, ctx.inputs["ingest"] / "shards" / cfg.shard, ctx.out_dir)


def filter_step(ctx: StepContext) -> dict[str, Any]:
    return filter_shard(ctx.config.curate, _one_shard(ctx.inputs["normalized"]), ctx.out_dir)


def exact_hashes_step(ctx: StepContext) -> dict[str, Any]:
    return exact_hashes_shard(ctx.config.curate, _one_shard(ctx.inputs["normalized"]), ctx.out_dir)


def minhash_step(ctx: StepContext) -> dict[str, Any]:
    return minhash_signatures_shard(
        ctx.config.curate, _one_shard(ctx.inputs["normalized"]), ctx.out_dir
    )


def exact_dedup_step(ctx: StepContext) -> dict[str, Any]:
    return exact_dedup(
        ctx.config.curate, ctx.inputs["hashes"], ctx.out_dir, keep_dirs=ctx.inputs["filtered"]
    )


def near_dedup_step(ctx: StepContext) -> dict[str, Any]:
    return near_dedup(
        ctx.config.curate,
        ctx.inputs["signatures"],
        ctx.out_dir,
        keep_dirs=ctx.inputs["filtered"],
        exclude_dirs=[ctx.inputs["exact"]],
    )


def quality_model_step(ctx: StepContext) -> dict[str, Any]:
    return quality_model(
        ctx.config.curate,
        ctx.inputs["filtered"],
        ctx.out_dir,
        exclude_dirs=[ctx.inputs["exact"], ctx.inputs["near"]],
    )


def finalize_step(ctx: StepContext) -> dict[str, Any]:
    """Write the curated corpus; publish the report as markdown and a per-stage table."""
    inputs = ctx.inputs
    metrics = finalize(
        ctx.config.curate,
        inputs["filtered"],
        [inputs["exact"], inputs["near"], inputs["quality"]],
        ctx.out_dir,
        stats_dirs=[*inputs["normalized"], *inputs["filtered"]],
    )
    summary = ctx.out_dir / "summary.md"
    if summary.exists():
        ctx.report_markdown(
            "curation-report", summary.read_text(), "Curation: what was removed and why"
        )
    report = json.loads((ctx.out_dir / "curation_report.json").read_text())
    stages = report.get("stages")
    if isinstance(stages, list) and stages and isinstance(stages[0], dict):
        ctx.report_table("curation-stages", stages, "Documents and tokens in/out per stage")
    return {k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}
