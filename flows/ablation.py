"""Annealing ablation (how SmolLM3 chose late-stage data): from a curriculum checkpoint, anneal a
fixed token budget on the baseline mix and on 40% baseline + 60% candidate source; evaluate both
and report the difference. The arms extend the recipe's graph cut at ``pretrain``, so everything
upstream is the pipeline's own (cached) outputs.
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact

from llmflow.flows.model_evaluation import Evaluated
from llmflow.flows.recipe import export_and_evaluate, recipe, stage_run
from llmflow.tasks.command_config import AblationConfig
from llmflow.tasks.config import PipelineConfig
from llmflow.tasks.dataprep.mixture import mixture
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.executor import PrefectExecutor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.curriculum import stage_train_config
from llmflow.tasks.pretrain.step import pretrain


def arm_weights(baseline: dict[str, float], candidate: str, share: float) -> dict[str, float]:
    """(1 - share) x the baseline mix plus share on the candidate domain.

    Raises:
        BadInputError: the baseline names no domain (``weights: {}``, the data's own domains by
            their tokens): the arm would train on the candidate alone, not 40% baseline.
    """
    if not baseline:
        raise BadInputError(
            "ablation: the last pretraining stage's mixture.weights is {} (the data's domains by "
            "their tokens), so there is no baseline mix to keep 40% of; name the baseline's "
            "domains, e.g. --set 'pretrain.stages.N.mixture.weights={web: 1.0}' (N: the last stage)"
        )
    total = sum(baseline.values())
    weights = {k: (1 - share) * v / total for k, v in baseline.items()}
    weights[candidate] = weights.get(candidate, 0.0) + share
    return weights


def annealing_train_config(config: PipelineConfig, num_tokens: int) -> TrainConfig:
    """The last stage's trainer config, annealing ``num_tokens`` linearly to the floor."""
    last = stage_train_config(config.pretrain, len(config.pretrain.stages) - 1)
    return last.replaced(
        max_steps=None,
        num_tokens=num_tokens,
        schedule={"name": "linear", "warmup_steps": 0, "total_steps": None, "per_stage": True},
    )


def ablation_graph(
    config: PipelineConfig, ablation: AblationConfig
) -> tuple[Graph, list[Evaluated]]:
    """The recipe up to pretraining, plus each arm's mixture, annealing run, export and evaluation
    (baseline first)."""
    ablation.required_candidate()
    graph = recipe(config).until("pretrain")
    start = graph.find(step="pretrain")[ablation.from_stage]
    (tokenizer,), (tokenized,) = graph.find(step="tokenizer"), graph.find(step="tokenize")
    (held_out,) = graph.find(step="validation")
    baseline = config.pretrain.stages[-1].mixture
    arms = {
        "baseline": baseline.weights,
        f"plus-{ablation.candidate}": arm_weights(
            baseline.weights, ablation.candidate, ablation.candidate_share
        ),
    }
    run = stage_run(config, annealing_train_config(config, ablation.num_tokens))
    models = []
    for label, weights in arms.items():
        name = f"{config.name}-ablation-{label}"
        data_cfg = baseline.model_copy(
            update={"weights": weights, "num_tokens": ablation.num_tokens}
        )
        data = graph.add(mixture, data_cfg, name, phase="pretrain", tokenized=tokenized)
        annealed = graph.add(
            pretrain, run, name, phase="pretrain", data=data, validation=held_out, init=start
        )
        models.append(
            export_and_evaluate(graph, config, f"ablation-{label}", annealed, tokenizer, tokenized)
        )
    return graph, models


def difference(base: dict, candidate: dict) -> list[dict]:
    """Per task metric: baseline, candidate and candidate minus baseline."""
    return [
        {
            "metric": k,
            "baseline": base[k],
            "candidate": candidate[k],
            "difference": candidate[k] - base[k],
        }
        for k in sorted(base)
        if "/" in k and isinstance(base[k], (int, float)) and k in candidate
    ]


@flow(name="llmflow-annealing-ablation", log_prints=True)
def annealing_ablation(config: PipelineConfig, ablation: AblationConfig) -> list[dict]:
    """Anneal baseline vs baseline+candidate from one checkpoint; table of metric differences."""
    graph, models = ablation_graph(config, ablation)
    outcome = PrefectExecutor(config.root, runner=config.runner).run(graph)
    base, cand = models
    rows = difference(outcome[base.scores].metrics, outcome[cand.scores].metrics)
    create_table_artifact(
        rows,
        key="llmflow-annealing-ablation",
        description=f"Annealing with {ablation.candidate} minus baseline",
    )
    return rows
