"""The end-to-end flow: ingest → curate → tokenizer → tokenize/pack → pretrain 1–3 → extend →
evaluate → SFT → DPO → evaluate. It reads like a recipe: each line is a step whose arguments are
earlier steps' outputs (URIs). Steps skip when their content-addressed output exists.
"""

from __future__ import annotations

import flows  # noqa: F401  (sets Prefect env defaults before prefect is imported)
from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.curate import curate_flow
from flows.runners import combined, task_runner
from tasks.config import PipelineConfig
from tasks.evaluation.steps import ExportConfig, LeaderboardConfig
from tasks.evaluation.task import evaluate_task, export_task, leaderboard_task
from tasks.dataprep.task import mixture_task, tokenize_task, validation_task
from tasks.ingest.task import describe_sources_task, ingest_task, sample_task
from tasks.pretrain.curriculum import stage_train_config
from tasks.pretrain.steps import StageRun
from tasks.pretrain.task import pretrain_task
from tasks.store import StepResult
from tasks.tokenizer.task import tokenizer_task


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
    curate_results = curate_flow.with_options(task_runner=task_runner(config.runner))(
        config.curate, raw.uri, config.root, config.name
    )
    curated = run.add(combined("curate", curate_results))
    if run.stop_after("curate"):
        return _finish(run)
    tokenizer = run.add(tokenizer_task(config.tokenizer, inputs={"corpus": curated.uri}, **common))
    if run.stop_after("tokenizer"):
        return _finish(run)
    tokenized = run.add(
        tokenize_task(
            config.tokenize, inputs={"corpus": curated.uri, "tokenizer": tokenizer.uri}, **common
        )
    )
    if run.stop_after("tokenize"):
        return _finish(run)
    validation = run.add(validation_task(config.validation, inputs={"tokenized": tokenized.uri}, **common))
    mixtures = [
        run.add(mixture_task(stage.mixture, inputs={"tokenized": tokenized.uri}, root=config.root,
                             name=f"{config.name}-{stage.name}"))
        for stage in config.pretrain.stages
    ]
    if run.stop_after("mixture"):
        return _finish(run)
    previous = None
    for index, (stage, mixture) in enumerate(zip(config.pretrain.stages, mixtures)):
        stage_run = StageRun(
            train=stage_train_config(config.pretrain, index),
            num_processes=config.pretrain.num_processes,
            accelerate_config=config.pretrain.accelerate_config,
            timeout_s=config.pretrain.timeout_s,
        )
        inputs = {"data": mixture.uri, "validation": validation.uri}
        if previous is not None:
            inputs["init"] = previous.uri
        previous = run.add(
            pretrain_task(stage_run, inputs=inputs, root=config.root, name=f"{config.name}-{stage.name}")
        )
    if run.stop_after("pretrain"):
        return _finish(run)
    evaluated: list[tuple[str, StepResult, StepResult]] = []

    def export_and_evaluate(label: str, checkpoint: StepResult, **export_options) -> StepResult:
        exported = run.add(
            export_task(
                ExportConfig(label=label, **export_options),
                inputs={"checkpoint": checkpoint.uri, "tokenizer": tokenizer.uri},
                root=config.root, name=f"{config.name}-{label}",
            )
        )
        scores = run.add(
            evaluate_task(
                config.evaluate, inputs={"model": exported.uri, "heldout": tokenized.uri},
                root=config.root, name=f"{config.name}-{label}",
            )
        )
        evaluated.append((label, exported, scores))
        return exported

    base = export_and_evaluate("base", previous)
    if run.stop_after("evaluate"):
        return _finish(run, evaluated, config)
    del base
    return _finish(run, evaluated, config)


def _finish(run: _Run, evaluated=(), config: PipelineConfig | None = None) -> list[StepResult]:
    if evaluated:
        run.add(
            leaderboard_task(
                LeaderboardConfig(labels=[label for label, _, _ in evaluated]),
                inputs={
                    "evaluations": [scores.uri for _, _, scores in evaluated],
                    "models": [model.uri for _, model, _ in evaluated],
                },
                root=config.root, name=config.name,
            )
        )
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
