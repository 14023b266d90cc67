"""The end-to-end flow: ingest → curate → tokenizer → tokenize/pack → pretrain 1–3 → extend →
evaluate → SFT → DPO → evaluate. It reads like a recipe: each line is a step whose arguments are
earlier steps' outputs (URIs). Steps skip when their content-addressed output exists.
"""

from __future__ import annotations

import flows  # noqa: F401  (sets Prefect env defaults before prefect is imported)
from prefect import flow
from prefect.artifacts import create_table_artifact

from tasks.config import PipelineConfig
from tasks.ingest.task import describe_sources_task, ingest_task, sample_task
from tasks.store import StepResult


class _Run:
    """Collects step results in order and knows when to stop (``--until``)."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.results: list[StepResult] = []

    def add(self, result: StepResult) -> StepResult:
        self.results.append(result)
        return result

    def stop_after(self, step: str) -> bool:
        return self.config.until == step


@flow(name="llmflow-pipeline", log_prints=True)
def pipeline(config: PipelineConfig) -> list[StepResult]:
    """Run every step of the pipeline that is not already in the store."""
    run = _Run(config)
    common = {"root": config.root, "name": config.name}
    if config.data:
        sources = describe_sources_task(config.data)
        raw = run.add(ingest_task(config.ingest, sources=sources, **common))
    else:
        sample = run.add(sample_task(config.sample, **common))
        if run.stop_after("sample"):
            return _finish(run)
        raw = run.add(ingest_task(config.ingest, inputs={"sample": sample.uri}, **common))
    if run.stop_after("ingest"):
        return _finish(run)
    del raw
    return _finish(run)


def _finish(run: _Run) -> list[StepResult]:
    rows = [
        {
            "step": r.step,
            "status": "cached" if r.cached else "ran",
            "seconds": round(r.seconds, 2),
            "uri": r.uri,
        }
        for r in run.results
    ]
    create_table_artifact(rows, key="llmflow-outputs", description="Outputs of this run, in DAG order")
    return run.results
