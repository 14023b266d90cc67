"""Store adapters for the sample and ingest steps (plain Python, no Prefect)."""

from __future__ import annotations

import json
from typing import Any

import fsspec

from llmflow.tasks.framework.store import StepContext, file_sha256
from llmflow.tasks.ingest.ingest import ingest, list_files
from llmflow.tasks.ingest.sample import make_sample

SAMPLE_VERSION = "1"
INGEST_VERSION = "1"


def describe_sources(paths: list[str]) -> list[dict[str, Any]]:
    """The raw files behind ``paths`` with their sha256, so lineage reaches the raw bytes."""
    described = []
    for uri in list_files(paths):
        fs, path = fsspec.core.url_to_fs(uri)
        described.append({"uri": uri, "sha256": file_sha256(fs, path), "bytes": fs.size(path)})
    return described


def sample_step(ctx: StepContext) -> dict[str, Any]:
    """Generate the quickstart corpus into ``files/`` and its ground truth into ``manifest.json``."""
    metrics = make_sample(ctx.config, ctx.out_dir / "files")
    (ctx.out_dir / "files" / "manifest.json").rename(ctx.out_dir / "manifest.json")
    return metrics


def ingest_step(ctx: StepContext) -> dict[str, Any]:
    """Ingest the sample (an upstream output) or the user's raw files (sources)."""
    if "sample" in ctx.inputs:
        files = list_files([str(ctx.inputs["sample"] / "files")])
    else:
        files = [s["uri"] for s in ctx.sources]
    metrics = ingest(ctx.config, files, ctx.out_dir)
    report = json.loads((ctx.out_dir / "report.json").read_text())
    rows = [{"source": uri, **counts} for uri, counts in report["sources"].items()]
    ctx.report_table("ingest-sources", rows, "Records read, kept and rejected per source file")
    return metrics
