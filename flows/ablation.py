"""Annealing ablation (how SmolLM3 chose late-stage data): from a curriculum checkpoint, anneal a
fixed token budget on the baseline mix and on 40% baseline + 60% candidate source; evaluate both
and report the difference. Every run is a content-addressed step, so re-runs are free.
"""

from __future__ import annotations  # noqa: I001  (flows must be imported before prefect)


import llmflow.flows  # noqa: F401  (sets Prefect env defaults before prefect is imported)
from prefect import flow
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field

from llmflow.flows.pipeline import _export_and_evaluate, _Run, _train, pipeline
from llmflow.tasks.config import PipelineConfig
from llmflow.tasks.dataprep.task import mixture_task
from llmflow.tasks.pretrain.curriculum import stage_train_config
from llmflow.tasks.framework.store import StepResult, Store


class AblationConfig(BaseModel):
    """Which checkpoint to anneal from, the candidate source and the budget."""

    model_config = ConfigDict(extra="forbid")

    candidate: str = Field(description="Domain to test as late-stage data (e.g. math).")
    from_stage: int = Field(
        -2, description="Curriculum stage index to start from (-2: stage 2 of 3)."
    )
    candidate_share: float = Field(0.6, gt=0, lt=1, description="Share of the candidate source.")
    num_tokens: int = Field(50_000, gt=0, description="Annealing budget of each arm.")


def arm_weights(baseline: dict[str, float], candidate: str, share: float) -> dict[str, float]:
    """(1 - share) x the baseline mix plus share on the candidate domain."""
    total = sum(baseline.values())
    weights = {k: (1 - share) * v / total for k, v in baseline.items()}
    weights[candidate] = weights.get(candidate, 0.0) + share
    return weights


@flow(name="llmflow-annealing-ablation", log_prints=True)
def annealing_ablation(config: PipelineConfig, ablation: AblationConfig) -> list[dict]:
    """Anneal baseline vs baseline+candidate from one checkpoint; table of metric differences."""
    upstream = pipeline(config.model_copy(update={"until": "pretrain"}))
    by_step = {r.step: r for r in upstream}
    stages = [r for r in upstream if r.step == "pretrain"]
    start = stages[ablation.from_stage]
    run = _Run(config)
    last = len(config.pretrain.stages) - 1
    baseline = config.pretrain.stages[last].mixture
    train = stage_train_config(config.pretrain, last).model_copy(
        update={"max_steps": None, "num_tokens": ablation.num_tokens}
    )
    train = type(train).model_validate(
        {
            **train.model_dump(),
            "schedule": {
                **train.schedule.model_dump(),
                "name": "linear",
                "warmup_steps": 0,
                "total_steps": None,
                "per_stage": True,
            },
        }
    )
    arms = {
        "baseline": baseline.weights,
        f"plus-{ablation.candidate}": arm_weights(
            baseline.weights, ablation.candidate, ablation.candidate_share
        ),
    }
    for label, weights in arms.items():
        mixture = run.add(
            mixture_task(
                baseline.model_copy(update={"weights": weights, "num_tokens": ablation.num_tokens}),
                inputs={"tokenized": by_step["tokenize"].uri},
                **run.named(f"ablation-{label}"),
            )
        )
        checkpoint = _train(run, f"ablation-{label}", train, mixture, by_step["validation"], start)
        _export_and_evaluate(
            run, f"ablation-{label}", checkpoint, by_step["tokenizer"], by_step["tokenize"]
        )
    rows = _difference(run.evaluated, Store(config.root))
    create_table_artifact(
        rows,
        key="llmflow-annealing-ablation",
        description=f"Annealing with {ablation.candidate} minus baseline",
    )
    return rows


def _difference(evaluated: list[tuple[str, StepResult, StepResult]], store: Store) -> list[dict]:
    (_, _, base), (_, _, cand) = evaluated
    a, b = (store.read_lineage(r.uri)["metrics"] for r in (base, cand))
    return [
        {"metric": k, "baseline": a[k], "candidate": b[k], "difference": b[k] - a[k]}
        for k in sorted(a)
        if "/" in k and isinstance(a[k], (int, float)) and k in b
    ]
