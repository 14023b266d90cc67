"""Per-shard orchestration overhead of a mapped stage: a no-op step over N shards, wall time / N.

Each shard still goes through the store (address, lock, lineage, commit marker), as every
mapped step does; what differs between the ways is the orchestration around it:

- ``"stage"``: one Prefect task for the stage, its shards on the runner's engine;
- ``"local"``: no Prefect, the shards on the engine (the store's own cost per shard).

``"stage"`` needs a Prefect API (a server, or ``prefect_test_harness``).

    from llmflow.tasks.framework.stage_overhead import measure
    measure("/tmp/overhead", 500, "stage")  # {'shards': 500, 'seconds': ..., 'ms_per_shard': ...}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field

from llmflow.tasks.framework.step import Metrics, step


class OverheadShards(BaseModel):
    """How many one-row shards the source writes."""

    num_shards: int = Field(100, ge=1)


@step("overhead-shards")
def overhead_shards(cfg: OverheadShards, out: Path) -> Metrics:
    """One-row Parquet shards, the input of the no-op stage."""
    (out / "shards").mkdir()
    for i in range(cfg.num_shards):
        pq.write_table(pa.table({"i": [i]}), out / "shards" / f"part-{i:06d}.parquet")
    return {"num_shards": cfg.num_shards}


@step("overhead-noop")
def overhead_noop(cfg: OverheadShards, shard: Path, out: Path) -> Metrics:
    """Write the shard's name: the least a mapped step can do."""
    (out / "name.txt").write_text(shard.name)
    return {}


def measure(root: str, num_shards: int, way: str = "stage", kind: str = "threads") -> dict:
    """Run the no-op stage over ``num_shards`` fresh shards under ``root``; its wall time.

    Args:
        root: An empty folder (a used one would serve the shards Cached).
        num_shards: Shards in the stage.
        way: ``"stage"`` or ``"local"`` (see the module docstring).
        kind: The runner for ``"stage"`` and ``"local"``: threads, processes or ray.
    """
    from llmflow.tasks.config import RunnerConfig
    from llmflow.tasks.framework.engine import make_engine
    from llmflow.tasks.framework.executor import Executor
    from llmflow.tasks.framework.graph import Graph

    graph = Graph()
    source = graph.add(overhead_shards, OverheadShards(num_shards=num_shards), "n")
    noop = graph.add(overhead_noop, OverheadShards(), "n", map_over="shard", shard=source)
    runner = RunnerConfig(kind=kind, max_workers=2)
    if way == "local":
        engine = make_engine(runner)
        try:
            outcome = Executor(root, engine=engine).run(graph)
        finally:
            engine.close()
    else:
        outcome = _on_prefect(root, graph, runner)
    seconds = outcome[noop].seconds
    return {
        "way": way,
        "kind": kind,
        "shards": num_shards,
        "seconds": round(seconds, 3),
        "ms_per_shard": round(1000 * seconds / num_shards, 2),
    }


def _on_prefect(root: str, graph: Any, runner: Any):
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from llmflow.tasks.framework.executor import PrefectExecutor

    @flow(name="stage-overhead", task_runner=ThreadPoolTaskRunner(max_workers=2))
    def run():
        return PrefectExecutor(root, runner=runner).run(graph)

    return run()
