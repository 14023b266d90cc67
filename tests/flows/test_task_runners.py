"""A mapped step on each backend under Prefect for real, and which failures a step task retries."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel, Field

from llmflow.tasks.config import RunnerConfig
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.executor import PrefectExecutor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.step import Metrics, step

NUMBERS = list(range(1, 13))


class ShardsConfig(BaseModel):
    numbers: list[int]
    num_shards: int = 3


class FlakyConfig(BaseModel):
    """``attempts`` counts calls in a file; the step fails ``failures`` times with ``error``."""

    error: str = "OSError"
    failures: int = 1
    attempts: str = Field("", json_schema_extra={"versioned": False})


@step("runner-shards")
def shards(cfg: ShardsConfig, out: Path) -> Metrics:
    """The numbers, round-robin over shards."""
    (out / "shards").mkdir()
    for i in range(cfg.num_shards):
        table = pa.table({"n": cfg.numbers[i :: cfg.num_shards]})
        pq.write_table(table, out / "shards" / f"part-{i}.parquet")
    return {}


@step("runner-square")
def square(cfg: ShardsConfig, shard: Path, out: Path) -> Metrics:
    """Sum of squares of one shard, and the process that computed it."""
    values = pq.read_table(shard).column("n").to_pylist()
    (out / "sum.json").write_text(
        json.dumps({"sum": sum(v * v for v in values), "pid": os.getpid()})
    )
    return {"sum": sum(v * v for v in values)}


@step("runner-total")
def total(cfg: ShardsConfig, sums: list[Path], out: Path) -> Metrics:
    """The sum over shards."""
    value = sum(json.loads((p / "sum.json").read_text())["sum"] for p in sums)
    return {"total": value}


@step("runner-flaky", retries=2, execution=("attempts",))
def flaky(cfg: FlakyConfig, out: Path) -> Metrics:
    """Fail the first ``failures`` calls with ``error`` (counted in the ``attempts`` file)."""
    attempts = Path(cfg.attempts)
    calls = int(attempts.read_text()) + 1 if attempts.exists() else 1
    attempts.write_text(str(calls))
    if calls <= cfg.failures:
        raise {"OSError": OSError, "BadInputError": BadInputError}[cfg.error](f"call {calls}")
    return {"calls": calls}


def _mapped_graph() -> Graph:
    graph = Graph()
    numbers = graph.add(shards, ShardsConfig(numbers=NUMBERS), "n")
    sums = graph.add(square, ShardsConfig(numbers=[]), "n", map_over="shard", shard=numbers)
    graph.add(total, ShardsConfig(numbers=[]), "n", sums=sums)
    return graph


def _run_mapped(kind: str, root: Path) -> tuple[int, set[int]]:
    """Run the mapped graph in a flow on the runner ``kind``; the total and the worker pids."""
    from prefect import flow

    @flow(name=f"runner-{kind}")
    def run() -> int:
        runner = RunnerConfig(kind=kind, max_workers=2)
        outcome = PrefectExecutor(str(root), runner=runner).run(_mapped_graph())
        return outcome.results[_last(outcome)].metrics["total"]

    value = run()
    pids = {
        json.loads(p.read_text())["pid"] for p in root.glob("runner-square/*/shards/*/sum.json")
    }
    return value, pids


def _last(outcome):
    return [n for n in outcome.results if n.step.name == "runner-total"][0]


@pytest.mark.slow
def test_process_pool_runs_each_shard_in_a_worker_process(prefect_harness, tmp_path):
    value, pids = _run_mapped("processes", tmp_path)
    assert value == sum(n * n for n in NUMBERS)
    assert len(list(tmp_path.glob("runner-square/*/shards/*/sum.json"))) == 3
    assert pids and os.getpid() not in pids


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("runner.fan_out=shard", r"runner.fan_out='shard' was removed: .* delete the field"),
        ("runner.kind=dask", r"runner.kind='dask' was removed: use threads, processes or ray"),
    ],
)
def test_a_recipe_with_a_removed_runner_field_names_it_and_what_to_use(override, message):
    from llmflow.tasks.config import load_config
    from llmflow.tasks.framework.errors import ConfigError

    repo = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError, match=message):
        load_config(repo / "configs" / "quickstart.yaml", [override])


@pytest.mark.slow
def test_ray_runner_runs_each_shard_on_a_local_cluster(prefect_harness, tmp_path, monkeypatch):
    # Ray's workers unpickle the steps by module: this test module must be importable there, as
    # a user's own step module is (an installed package, or PYTHONPATH / a Ray runtime_env).
    here = str(Path(__file__).parent)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a loopback-only local cluster
    value, pids = _run_mapped("ray", tmp_path)
    assert value == sum(n * n for n in NUMBERS)
    assert pids and os.getpid() not in pids


@pytest.mark.parametrize(
    ("error", "failures", "calls", "ok"),
    [("OSError", 1, 2, True), ("OSError", 5, 3, False), ("BadInputError", 1, 1, False)],
)
def test_step_task_retries_transient_failures_only(
    prefect_harness, tmp_path, error, failures, calls, ok
):
    """An OSError is retried (up to ``retries``); a BadInputError fails on its first call."""
    from prefect import flow

    attempts = tmp_path / "attempts"
    cfg = FlakyConfig(error=error, failures=failures, attempts=str(attempts))
    graph = Graph()
    graph.add(flaky, cfg, "f")

    @flow(name="runner-retries")
    def run():
        return PrefectExecutor(str(tmp_path / "store"), keep_going=True).run(graph)

    outcome = run()
    assert int(attempts.read_text()) == calls
    assert bool(outcome.results) is ok
    if not ok:
        (err,) = outcome.failed.values()
        assert f"call {calls}" in str(err)
