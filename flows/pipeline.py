"""The end-to-end flow: ingest → curate → tokenizer → tokenize/pack → pretrain 1–3 → extend →
evaluate → SFT → DPO → evaluate. It reads like a recipe: each line is a step whose arguments are
earlier steps' outputs (URIs). Steps skip when their content-addressed output exists.
"""

from __future__ import annotations  # noqa: I001  (flows must be imported before prefect)

import llmflow.flows  # noqa: F401  (sets Prefect env defaults before prefect is imported)
from prefect import flow
from prefect.artifacts import create_table_artifact

from llmflow.flows.curate import curate_flow
from llmflow.flows.runners import combined, task_runner
from llmflow.tasks.config import PipelineConfig
from llmflow.tasks.dataprep.task import mixture_task, tokenize_task, validation_task
from llmflow.tasks.evaluation.steps import ExportConfig, LeaderboardConfig
from llmflow.tasks.evaluation.task import evaluate_task, export_task, leaderboard_task
from llmflow.tasks.extend.steps import LongContextEval, extension_mixture, extension_train_config
from llmflow.tasks.extend.task import longctx_task
from llmflow.tasks.ingest.task import describe_sources_task, ingest_task, sample_task
from llmflow.tasks.posttrain.task import dpo_task, sft_task
from llmflow.tasks.pretrain.curriculum import stage_train_config
from llmflow.tasks.pretrain.steps import StageRun
from llmflow.tasks.pretrain.task import pretrain_task
from llmflow.tasks.framework.store import StepResult
from llmflow.tasks.tokenizer.task import tokenizer_task


class _Run:
    """Collects step results in order, knows when to stop (``--until``), and what was evaluated."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.results: list[StepResult] = []
        self.evaluated: list[tuple[str, StepResult, StepResult]] = []

    def add(self, result: StepResult) -> StepResult:
        self.results.append(result)
        return result

    def stop_after(self, step: str) -> bool:
        return self.config.until == step

    def named(self, label: str) -> dict[str, str]:
        return {"root": self.config.root, "name": f"{self.config.name}-{label}"}


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
    runner = task_runner(config.runner)
    curated = run.add(
        combined(
            "curate",
            curate_flow.with_options(task_runner=runner)(
                config.curate, raw.uri, config.root, config.name
            ),
        )
    )
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
    validation = run.add(
        validation_task(config.validation, inputs={"tokenized": tokenized.uri}, **common)
    )
    mixtures = [
        run.add(
            mixture_task(
                stage.mixture, inputs={"tokenized": tokenized.uri}, **run.named(stage.name)
            )
        )
        for stage in config.pretrain.stages
    ]
    if run.stop_after("mixture"):
        return _finish(run)
    pretrained = None
    for index, (stage, mixture) in enumerate(zip(config.pretrain.stages, mixtures, strict=False)):
        pretrained = _train(
            run,
            stage.name,
            stage_train_config(config.pretrain, index),
            mixture,
            validation,
            pretrained,
        )
    if run.stop_after("pretrain"):
        return _finish(run)
    extended = pretrained
    for index, stage in enumerate(config.extend.stages):
        mixture = run.add(
            mixture_task(
                extension_mixture(config.extend, stage, seed=100 + index),
                inputs={"tokenized": tokenized.uri},
                **run.named(f"ctx{stage.seq_len}"),
            )
        )
        long_validation = run.add(
            validation_task(
                config.validation.model_copy(update={"seq_len": stage.seq_len}),
                inputs={"tokenized": tokenized.uri},
                **run.named(f"ctx{stage.seq_len}"),
            )
        )
        train = extension_train_config(config.pretrain.train, stage)
        extended = _train(run, f"ctx{stage.seq_len}", train, mixture, long_validation, extended)
    run.add(
        longctx_task(
            LongContextEval(extend=config.extend),
            inputs={
                "before": pretrained.uri,
                "after": extended.uri,
                "tokenizer": tokenizer.uri,
                "tokenized": tokenized.uri,
            },
            **common,
        )
    )
    if run.stop_after("extend"):
        return _finish(run)
    base = _export_and_evaluate(run, "base", pretrained, tokenizer, tokenized)
    long = (
        _export_and_evaluate(
            run,
            "extended",
            extended,
            tokenizer,
            tokenized,
            rope_scaling=config.extend.yarn_scaling(),
            max_seq_len=int(config.extend.stages[-1].seq_len * config.extend.yarn_factor),
        )
        if config.extend.stages
        else base
    )
    if run.stop_after("evaluate"):
        return _finish(run)
    sft = run.add(
        sft_task(config.sft, inputs={"model": long.uri}, sources=_data(config.sft.data), **common)
    )
    _evaluate(run, "sft", sft, tokenized)
    if run.stop_after("sft"):
        return _finish(run)
    dpo = run.add(
        dpo_task(config.dpo, inputs={"model": sft.uri}, sources=_data(config.dpo.data), **common)
    )
    _evaluate(run, "dpo", dpo, tokenized)
    return _finish(run)


def _train(
    run: _Run, label: str, train, data: StepResult, validation: StepResult, init: StepResult | None
) -> StepResult:
    """One trainer run (a curriculum or extension stage) from the previous stage's checkpoint."""
    pretrain = run.config.pretrain
    stage_run = StageRun(
        train=train,
        num_processes=pretrain.num_processes,
        accelerate_config=pretrain.accelerate_config,
        timeout_s=pretrain.timeout_s,
    )
    inputs = {"data": data.uri, "validation": validation.uri}
    if init is not None:
        inputs["init"] = init.uri
    return run.add(pretrain_task(stage_run, inputs=inputs, **run.named(label)))


def _export_and_evaluate(
    run: _Run,
    label: str,
    checkpoint: StepResult,
    tokenizer: StepResult,
    tokenized: StepResult,
    **export_options,
) -> StepResult:
    """Export a checkpoint to Hugging Face format, then evaluate the export."""
    exported = run.add(
        export_task(
            ExportConfig(label=label, **export_options),
            inputs={"checkpoint": checkpoint.uri, "tokenizer": tokenizer.uri},
            **run.named(label),
        )
    )
    _evaluate(run, label, exported, tokenized)
    return exported


def _evaluate(run: _Run, label: str, model: StepResult, tokenized: StepResult) -> None:
    scores = run.add(
        evaluate_task(
            run.config.evaluate,
            inputs={"model": model.uri, "heldout": tokenized.uri},
            **run.named(label),
        )
    )
    run.evaluated.append((label, model, scores))


def _data(data: str) -> list[dict] | None:
    """A user's post-training file as a raw source (hashed); None for the generated data."""
    return None if data == "quickstart" else describe_sources_task([data])


def _finish(run: _Run) -> list[StepResult]:
    if run.evaluated:
        run.add(
            leaderboard_task(
                LeaderboardConfig(labels=[label for label, _, _ in run.evaluated]),
                inputs={
                    "evaluations": [scores.uri for _, _, scores in run.evaluated],
                    "models": [model.uri for _, model, _ in run.evaluated],
                },
                root=run.config.root,
                name=run.config.name,
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
    create_table_artifact(
        rows, key="llmflow-outputs", description="Outputs of this run, in DAG order"
    )
    return run.results
