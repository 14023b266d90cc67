"""Critical batch size: from a checkpoint, branch at batch B and k·B for the same tokens, compare.

A trunk trains at the base batch with a constant learning rate (after warmup) and is checkpointed
at two points. From each point, branches train ``branch_tokens`` more tokens at batch k·B with the
learning rate rescaled by sqrt(k) (the square-root rule for Adam, Malladi et al. 2022; ``linear``
is the SGD rule, Goyal et al. 2017) and a constant schedule, so the rescaled LR is the only other
change. The critical batch of a point is the largest k·B whose validation loss is within
``tolerance`` of the base batch's: past it, a bigger batch buys fewer steps at the price of loss.
Measured at two points of training, it should grow as the loss falls (McCandlish et al. 2018).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from llmflow.flows.recipe import recipe, stage_run
from llmflow.tasks.command_config import CriticalBatchConfig
from llmflow.tasks.config import PipelineConfig
from llmflow.tasks.framework.executor import PrefectExecutor
from llmflow.tasks.framework.graph import Graph, Node
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.step import pretrain


@dataclass
class CriticalBatchGraph:
    graph: Graph
    branches: dict[tuple[int, int], Node]


def trunk_train(base: TrainConfig, batch: int, tokens: int) -> TrainConfig:
    """A trunk segment: the base batch, a constant LR after the recipe's warmup; a later segment
    continues the data where the previous one stopped."""
    return base.replaced(
        batch={"micro_batch_size": batch, "grad_accum_steps": 1},
        max_steps=None,
        num_tokens=tokens,
        schedule={"name": "constant", "total_steps": None, "per_stage": False},
        checkpoint={"interval": 10**6, "keep_last": 1},
        continue_data=True,
    )


def branch_train(base: TrainConfig, cb: CriticalBatchConfig, k: int) -> TrainConfig:
    """A branch: batch k·B, LR rescaled by the rule (Muon's too), constant, for
    ``branch_tokens``, on the data after the trunk's; validated on the same held-out sequences
    as every other branch (``eval_batches`` scaled so batches × k·B is one count)."""
    common = math.lcm(*cb.factors)
    return base.replaced(
        batch={"micro_batch_size": cb.base_batch * k, "grad_accum_steps": 1},
        max_steps=None,
        num_tokens=cb.branch_tokens,
        schedule={"name": "constant", "warmup_steps": 0, "total_steps": None, "per_stage": True},
        checkpoint={"interval": 10**6, "keep_last": 1},
        continue_data=True,
        eval_batches=base.eval_batches * common // k,
        **{
            "optimizer.lr": base.optimizer.lr * cb.lr_factor(k),
            "optimizer.muon_lr": base.optimizer.muon_lr * cb.lr_factor(k),
        },
    )


def critical_batch_graph(config: PipelineConfig, cb: CriticalBatchConfig) -> CriticalBatchGraph:
    """The trunk (one segment per point) and, from each point, one branch per factor."""
    full = recipe(config)
    data, held_out = full.find(step="mixture")[0], full.find(step="validation")[0]
    graph = full.closure([data, held_out])
    base, name = config.pretrain.train, f"{config.name}-critical-batch"
    branches, trunk, done = {}, None, 0
    for point in cb.points:
        run = stage_run(config, trunk_train(base, cb.base_batch, point - done))
        trunk = graph.add(
            pretrain, run, name, phase="pretrain", data=data, validation=held_out, init=trunk
        )
        done = point
        for k in cb.factors:
            branch = stage_run(config, branch_train(base, cb, k))
            branches[(point, k)] = graph.add(
                pretrain, branch, name, phase="pretrain", data=data, validation=held_out, init=trunk
            )
    return CriticalBatchGraph(graph, branches)


def critical_rows(
    cb: CriticalBatchConfig, losses: dict[tuple[int, int], float]
) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """Per branch: loss relative to the base batch; per point: the largest batch within tolerance.

    The critical batch is the largest k·B such that every batch up to it stays within tolerance.
    """
    rows, critical = [], {}
    for point in cb.points:
        baseline = losses[(point, 1)]
        critical[point] = cb.base_batch
        holding = True
        for k in cb.factors:
            loss = losses[(point, k)]
            within = loss <= baseline * (1 + cb.tolerance)
            holding = holding and within
            if holding:
                critical[point] = cb.base_batch * k
            rows.append(
                {
                    "trunk_tokens": point,
                    "batch": cb.base_batch * k,
                    "lr_factor": round(cb.lr_factor(k), 4),
                    "val_loss": round(loss, 5),
                    "vs_base": round(loss / baseline - 1, 5),
                    "within_tolerance": within,
                }
            )
    return rows, critical


@flow(name="llmflow-critical-batch", log_prints=True)
def critical_batch(config: PipelineConfig, cb: CriticalBatchConfig) -> dict[str, Any]:
    """Branch at each point for each batch; report the critical batch at each point."""
    planned = critical_batch_graph(config, cb)
    outcome = PrefectExecutor(config.root, runner=config.runner).run(planned.graph)
    losses = {key: outcome[node].metrics["val_loss"] for key, node in planned.branches.items()}
    rows, critical = critical_rows(cb, losses)
    create_table_artifact(
        rows,
        key="critical-batch",
        description=(
            f"Branches of {cb.branch_tokens} tokens, LR rule {cb.lr_scaling}; critical batch "
            + ", ".join(f"{c} at {p} tokens" for p, c in critical.items())
        ),
    )
    return {"rows": rows, "critical": critical, "lr_scaling": cb.lr_scaling}
