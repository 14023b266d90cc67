"""Scaling ladder: isoflop runs, a fitted Chinchilla law, a held-out prediction, rank consistency.

For each compute budget C (in 6·N·D FLOPs, N the non-embedding parameters) every model size of
the ladder trains on D = C / 6N tokens (isoflop curves). The ``scaling-fit`` step fits
L(N, D) = E + A/N^alpha + B/D^beta to those runs; then a larger held-out model trains and the
flow reports how far the law's prediction was from its real validation loss. Two recipe variants
(cosine vs WSD by default) also train at three sizes to check that their ranking holds across
scales. Every run is a cached pretrain step on the recipe's first-stage mixture.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field

from llmflow.flows.recipe import recipe, stage_run
from llmflow.tasks.config import PipelineConfig
from llmflow.tasks.framework.executor import PrefectExecutor
from llmflow.tasks.framework.graph import Graph, Node
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.step import pretrain
from llmflow.tasks.scaling.fit import LAW_FILE, ScalingFitConfig, ScalingLaw, scaling_fit
from llmflow.tasks.scaling.space import scaled_learning_rates


class Size(BaseModel):
    """One model of the ladder: width and depth (heads of 16 dims, a 3x MLP)."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = Field(gt=0, multiple_of=16)
    num_layers: int = Field(gt=0)

    def overrides(self) -> dict[str, int]:
        heads = self.hidden_size // 16
        return {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": heads,
            "num_kv_heads": heads,
            "intermediate_size": 3 * self.hidden_size,
        }


def _sizes(*shapes: tuple[int, int]) -> list[Size]:
    return [Size(hidden_size=h, num_layers=n) for h, n in shapes]


class LadderConfig(BaseModel):
    """The ladder's sizes and budgets, the held-out model and the ranking check."""

    model_config = ConfigDict(extra="forbid")

    sizes: list[Size] = Field(
        default_factory=lambda: _sizes((32, 2), (48, 2), (64, 3), (96, 3)),
        description="Models of the fitted ladder.",
    )
    flops: list[float] = Field(
        default_factory=lambda: [2e10, 6e10, 1.8e11],
        description="Compute budgets, 6·N·D with N non-embedding parameters.",
    )
    min_tokens: int = Field(8192, gt=0, description="Skip ladder points below this many tokens.")
    max_tokens: int = Field(600_000, gt=0, description="Skip ladder points above this.")
    heldout: Size = Field(
        default_factory=lambda: Size(hidden_size=128, num_layers=4),
        description="The larger model whose loss the law predicts.",
    )
    heldout_tokens: int = Field(300_000, gt=0, description="Tokens of the held-out run.")
    warmup_steps: int = Field(5, ge=0, description="LR warmup of every ladder run.")
    lr_scale: float = Field(
        1.0,
        gt=0,
        description="Multiplies every learning rate of the recipe's optimizer in every ladder "
        "run: AdamW's lr; Muon's muon_lr and its AdamW groups' lr together (their ratio kept).",
    )
    variants: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: {
            "cosine": {"schedule.name": "cosine"},
            "wsd": {"schedule.name": "wsd"},
        },
        description="Two trainer variants (dotted TrainConfig fields) ranked at three sizes.",
    )
    ranking_sizes: list[Size] = Field(
        default_factory=lambda: _sizes((32, 2), (64, 3), (128, 4)),
        description="Sizes at which the variants are ranked.",
    )
    ranking_tokens: int = Field(200_000, gt=0, description="Tokens of each ranking run.")


@dataclass
class LadderResult:
    """The law, the held-out prediction and its error, the ranking table.

    With a degenerate fit ``degenerate`` says why, and ``predicted`` and ``error`` are None.
    """

    law: dict[str, Any]
    predicted: float | None
    actual: float
    error: float | None
    points: list[dict[str, Any]]
    ranking: list[dict[str, Any]]
    consistent: bool
    degenerate: str | None = None


def size_model(base: TrainConfig, size: Size) -> dict[str, Any]:
    """The model of one ladder size: the recipe's preset and overrides, with the size's shape."""
    overrides = {**base.model.overrides.model_dump(exclude_none=True), **size.overrides()}
    return {"preset": base.model.preset, "overrides": overrides}


def ladder_train(base: TrainConfig, size: Size, tokens: int, warmup: int, **changes) -> TrainConfig:
    """The trainer config of one ladder run: ``size`` on ``tokens`` tokens, cosine to the floor."""
    return base.replaced(
        model=size_model(base, size),
        max_steps=None,
        num_tokens=tokens,
        schedule={"name": "cosine", "warmup_steps": warmup, "total_steps": None},
        checkpoint={"interval": 10**6, "keep_last": 1},
        eval_interval=10**6,
        **changes,
    )


def isoflop_points(ladder: LadderConfig, base: TrainConfig) -> list[tuple[Size, int]]:
    """(size, tokens) of every ladder run: D = C / 6N for each budget, within the token bounds."""
    points = []
    for budget in ladder.flops:
        for size in ladder.sizes:
            n = _non_embedding(base, size)
            tokens = int(budget / (6 * n))
            if ladder.min_tokens <= tokens <= ladder.max_tokens:
                points.append((size, tokens))
    return points


def _non_embedding(base: TrainConfig, size: Size) -> int:
    """Non-embedding parameters of the model the ladder run of ``size`` really trains."""
    model = base.replaced(model=size_model(base, size)).model_config_obj()
    return model.num_parameters(non_embedding=True)


@dataclass
class LadderGraph:
    graph: Graph
    points: list[Node]
    fit: Node
    heldout: Node
    ranking: dict[tuple[str, int], Node]


def ladder_graph(config: PipelineConfig, ladder: LadderConfig) -> LadderGraph:
    """Data and held-out set of the recipe's first stage, the ladder, the fit, the checks."""
    full = recipe(config)
    data, held_out = full.find(step="mixture")[0], full.find(step="validation")[0]
    graph = full.closure([data, held_out])
    base, name = config.pretrain.train, f"{config.name}-ladder"
    # NOTE: the recipe's optimizer decides which rates move (Muon's are not AdamW's); at 1.0
    # every run keeps the recipe's own values, and its address.
    base = base.replaced(**scaled_learning_rates(base, ladder.lr_scale))

    def add(train: TrainConfig) -> Node:
        run = stage_run(config, train)
        return graph.add(pretrain, run, name, phase="pretrain", data=data, validation=held_out)

    warm = ladder.warmup_steps
    points = [add(ladder_train(base, s, d, warm)) for s, d in isoflop_points(ladder, base)]
    fit = graph.add(scaling_fit, ScalingFitConfig(), config.name, phase="pretrain", runs=points)
    heldout = add(ladder_train(base, ladder.heldout, ladder.heldout_tokens, warm))
    ranking = {}
    for label, changes in ladder.variants.items():
        for size in ladder.ranking_sizes:
            train = ladder_train(base, size, ladder.ranking_tokens, warm).replaced(**changes)
            ranking[(label, size.hidden_size)] = add(train)
    return LadderGraph(graph, points, fit, heldout, ranking)


def rank_table(losses: dict[tuple[str, int], float]) -> tuple[list[dict[str, Any]], bool]:
    """Per size: each variant's loss and the order; consistent when the order never changes."""
    sizes = sorted({size for _, size in losses})
    rows, orders = [], set()
    for size in sizes:
        here = {label: loss for (label, s), loss in losses.items() if s == size}
        order = tuple(sorted(here, key=here.get))
        orders.add(order)
        rows.append({"hidden_size": size, **here, "order": " < ".join(order)})
    return rows, len(orders) <= 1


def heldout_check(law: ScalingLaw, n: float, summary: dict[str, Any]) -> dict[str, Any]:
    """The held-out run against the law: its N, D, the prediction, the loss and the error.

    A degenerate law predicts nothing: ``predicted`` and ``relative_error`` are None and
    ``degenerate`` says why.
    """
    actual, d = summary["val_loss"], summary["total_tokens_seen"]
    predicted = None if law.degenerate else law.predict(n, d)
    error = None if predicted is None else abs(predicted - actual) / actual
    return {"n": n, "d": d, "predicted": predicted, "actual": actual, "relative_error": error,
            "degenerate": law.degenerate}  # fmt: skip


def _law_text(law: ScalingLaw, error: float | None) -> str:
    if law.degenerate:
        return f"{law.degenerate}; no prediction"
    return (
        f"L = {law.E:.3g} + {law.A:.3g}/N^{law.alpha:.3g} + {law.B:.3g}/D^{law.beta:.3g}; "
        f"prediction error {error:.2%}"
    )


def _heldout_check(config: PipelineConfig, ladder: LadderConfig, law: ScalingLaw, uri: str) -> dict:
    """The law's prediction for the held-out model against the loss in its summary."""
    summary = json.loads((Path(uri) / "summary.json").read_text())
    return heldout_check(law, _non_embedding(config.pretrain.train, ladder.heldout), summary)


@flow(name="llmflow-scaling-ladder", log_prints=True)
def scaling_ladder(config: PipelineConfig, ladder: LadderConfig) -> LadderResult:
    """Train the ladder, fit the law, check it on a larger model, rank two variants by size."""
    planned = ladder_graph(config, ladder)
    outcome = PrefectExecutor(config.root, runner=config.runner).run(planned.graph)
    fitted = json.loads((Path(outcome[planned.fit].uri) / LAW_FILE).read_text())
    law = ScalingLaw(**fitted["law"])
    check = _heldout_check(config, ladder, law, outcome[planned.heldout].uri)
    if law.degenerate:
        print(f"{law.degenerate}: the held-out model's loss is not predicted")
    losses = {key: outcome[node].metrics["val_loss"] for key, node in planned.ranking.items()}
    ranking, consistent = rank_table(losses)
    create_table_artifact(fitted["points"] + [check], key="scaling-ladder", description=(
        f"Ladder runs and the held-out model: {_law_text(law, check['relative_error'])}"
    ))  # fmt: skip
    create_table_artifact(ranking, key="scaling-ranking", description=(
        f"Validation loss of {' vs '.join(ladder.variants)} by size: "
        + ("the ranking holds" if consistent else "the ranking changes with size")
    ))  # fmt: skip
    return LadderResult(
        asdict(law), check["predicted"], check["actual"], check["relative_error"],
        fitted["points"], ranking, consistent, law.degenerate,
    )  # fmt: skip
