"""Stage engines run a mapped step's shards through the store as the sequential walk does: the
same outputs, a bounded number at once, a failure that stops new shards and a re-run that redoes
only the shards without a marker; progress in a few lines; a stage linked as one asset."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel, Field

from llmflow.tasks.config import RunnerConfig
from llmflow.tasks.framework.backend import ProcessBackend, ThreadBackend
from llmflow.tasks.framework.engine import Progress, StageEngine, make_engine
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.executor import Executor, Mapped
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.stage_overhead import OverheadShards, overhead_shards
from llmflow.tasks.framework.step import Metrics, StepResult, step


class FailAt(BaseModel):
    fail_at: int = -1


@step("engine-double")
def double(cfg: FailAt, shard: Path, out: Path) -> Metrics:
    """The shard's number doubled; a BadInputError at shard ``fail_at``."""
    (i,) = pq.read_table(shard).column("i").to_pylist()
    if i == cfg.fail_at:
        raise BadInputError(f"shard {i} is bad")
    (out / "value.json").write_text(json.dumps({"value": 2 * i, "pid": os.getpid()}))
    return {"value": 2 * i}


def graph_of(num_shards: int, fail_at: int = -1) -> tuple[Graph, object]:
    graph = Graph()
    source = graph.add(overhead_shards, OverheadShards(num_shards=num_shards), "n")
    return graph, graph.add(double, FailAt(fail_at=fail_at), "n", map_over="shard", shard=source)


def values(root: Path) -> dict[str, int]:
    return {
        p.parent.name: json.loads(p.read_text())["value"]
        for p in root.glob("engine-double/*/shards/*/value.json")
    }


def run_closing(engine, root: Path, graph: Graph):
    """The graph's outcome on ``engine`` under ``root``; the engine closed even on failure."""
    try:
        return Executor(str(root), engine=engine).run(graph)
    finally:
        engine.close()


def test_thread_engine_gives_the_sequential_walks_outputs(tmp_path):
    graph, node = graph_of(12)
    reference = Executor(str(tmp_path / "seq")).run(graph)[node]
    mapped = run_closing(StageEngine(ThreadBackend(2)), tmp_path / "thr", graph)[node]
    assert isinstance(mapped, Mapped) and mapped.labels == reference.labels
    assert [r.hash for r in mapped.results] == [r.hash for r in reference.results]
    assert (
        values(tmp_path / "thr") == values(tmp_path / "seq") and len(values(tmp_path / "seq")) == 12
    )
    assert mapped.seconds is not None


def test_a_failing_shard_stops_new_shards_and_those_in_flight_commit(tmp_path):
    graph, _ = graph_of(40, fail_at=5)
    engine = StageEngine(
        ThreadBackend(1)
    )  # two in flight: after shard 5 fails, at most shard 6 finishes
    root = tmp_path / "store"
    with pytest.raises(BadInputError, match="shard 5 is bad"):
        run_closing(engine, root, graph)
    done = sorted(p.parent.name for p in root.glob("engine-double/*/shards/*/_COMMITTED"))
    assert [name.split("-")[1] for name in done][:5] == [f"{i:06d}" for i in range(5)]
    assert len(done) in (5, 6)


def test_rerun_after_a_failure_keeps_committed_shards(tmp_path):
    """The same config again, once the cause is gone (a flag file): only uncommitted shards run."""
    graph, node = graph_of(30)
    root = tmp_path / "store"
    engine = StageEngine(ThreadBackend(1))
    try:
        Executor(str(root), engine=engine).run(graph)
        (stage_marker,) = root.glob("engine-double/*/_COMMITTED")
        stage_marker.unlink()  # as if the stage died after 10 shards
        committed = sorted(root.glob("engine-double/*/shards/*/_COMMITTED"))
        for marker in committed[10:]:
            marker.unlink()
        mapped = Executor(str(root), engine=engine).run(graph)[node]
    finally:
        engine.close()
    assert sum(r.cached for r in mapped.results) == 10
    assert sum(not r.cached for r in mapped.results) == 20
    assert len(values(root)) == 30


class BatchedThreads(ThreadBackend):
    """A thread backend that submits shards in units of ``size``, as the Ray backend does."""

    def __init__(self, size: int):
        super().__init__(1)
        self.size, self.units = size, []

    def unit_size(self, items: int) -> int:
        return self.size

    def submit(self, fn, job, items):
        self.units.append([name for name, _ in items])
        return super().submit(fn, job, items)


def test_batched_units_give_every_shard_its_own_output_in_order(tmp_path):
    graph, node = graph_of(11)
    backend = BatchedThreads(4)
    mapped = run_closing(StageEngine(backend), tmp_path / "b", graph)[node]
    reference = Executor(str(tmp_path / "seq")).run(graph)[node]
    assert [len(u) for u in backend.units] == [4, 4, 3]
    assert [r.hash for r in mapped.results] == [r.hash for r in reference.results]
    assert values(tmp_path / "b") == values(tmp_path / "seq")


def test_a_failure_inside_a_unit_commits_the_shards_before_it_and_starts_none_after(tmp_path):
    """Units of 4, shard 5 bad: shards 0-4 commit (unit 0, and 4 in unit 1), shard 6-7 of its
    unit never start, and no unit is submitted after the failure (at most one more in flight)."""
    graph, _ = graph_of(40, fail_at=5)
    backend = BatchedThreads(4)
    root = tmp_path / "store"
    with pytest.raises(BadInputError, match="shard 5 is bad"):
        run_closing(StageEngine(backend), root, graph)
    markers = root.glob("engine-double/*/shards/*/_COMMITTED")
    done = sorted(int(p.parent.name.split("-")[1]) for p in markers)
    assert done[:5] == [0, 1, 2, 3, 4]
    assert 6 not in done and 7 not in done
    assert len(backend.units) <= 3 and set(done) <= {0, 1, 2, 3, 4, 8, 9, 10, 11}


def test_process_engine_runs_shards_in_other_processes(tmp_path):
    graph, node = graph_of(6)
    mapped = run_closing(StageEngine(ProcessBackend(2)), tmp_path / "p", graph)[node]
    reference = Executor(str(tmp_path / "seq")).run(graph)[node]
    assert [r.hash for r in mapped.results] == [r.hash for r in reference.results]
    pids = {
        json.loads(p.read_text())["pid"] for p in (tmp_path / "p").glob("*/*/shards/*/value.json")
    }
    assert pids and os.getpid() not in pids


def test_progress_logs_a_line_per_tenth_not_per_shard(caplog):
    reports: list[float] = []
    progress = Progress("stage x", 1000, reports.append, every_s=3600)
    result = StepResult("s", "u", "h", False, 0.0)
    with caplog.at_level(logging.INFO, logger="llmflow.engine"):
        for _ in range(1000):
            progress.advance(result)
    lines = [r.getMessage() for r in caplog.records if r.name == "llmflow.engine"]
    assert len(lines) == 10 and lines[-1].startswith("stage x: 1000/1000 shards (100%")
    assert reports == [pytest.approx(k / 10) for k in range(1, 11)]


def test_stage_summary_is_its_wall_time_not_the_shards_summed():
    shards = [StepResult("s", f"u{i}", "h", False, 2.0) for i in range(10)]
    assert Mapped(["a"] * 10, shards, seconds=3.0).summary("s").seconds == 3.0
    assert Mapped(["a"] * 10, shards).summary("s").seconds == 20.0


def test_an_event_links_at_most_100_assets():
    from llmflow.tasks.framework.prefect_task import MAX_RELATED, _related

    shards = [f"/r/curate-minhash/q-shard-{i:05d}-abc" for i in range(2000)]
    related = _related(shards + ["/r/curate-filter/q-x"])
    assert [r["prefect.resource.id"] for r in related] == [
        "file:///r/curate-minhash",
        "file:///r/curate-filter",
    ]
    assert len(_related([f"/r/s{i}/x" for i in range(500)])) == MAX_RELATED


def test_unknown_engine_kind_names_the_field():
    with pytest.raises(BadInputError, match=r"runner.kind='dask': use threads, processes or ray"):
        make_engine(RunnerConfig.model_construct(kind="dask"))


class Flaky(BaseModel):
    """Shard 3 fails once with an OSError (``folder/failed`` marks it); each shard computed
    appends its number to ``folder/computed``."""

    folder: str = Field("", json_schema_extra={"versioned": False})


@step("engine-flaky", execution=("folder",))
def flaky(cfg: Flaky, shard: Path, out: Path) -> Metrics:
    """The shard's number, after one transient failure at shard 3."""
    (i,) = pq.read_table(shard).column("i").to_pylist()
    folder = Path(cfg.folder)
    if i == 3 and not (folder / "failed").exists():
        (folder / "failed").write_text("once")
        raise OSError("transient: the disk went away")
    with open(folder / "computed", "a") as f:
        f.write(f"{i}\n")
    return {"i": i}


def test_a_prefect_retry_of_the_stage_task_computes_each_shard_once(prefect_harness, tmp_path):
    """One task for the whole stage; a transient shard failure fails it, Prefect retries it,
    and the retry runs only the shards without a commit marker."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from llmflow.tasks.framework.executor import PrefectExecutor

    graph = Graph()
    source = graph.add(overhead_shards, OverheadShards(num_shards=24), "n")
    node = graph.add(flaky, Flaky(folder=str(tmp_path)), "n", map_over="shard", shard=source)

    @flow(name="engine-retry")
    def run():
        from prefect.runtime import flow_run

        outcome = PrefectExecutor(str(tmp_path / "store"), runner=RunnerConfig(max_workers=2))
        return outcome.run(graph)[node], flow_run.id

    mapped, flow_run_id = run()
    computed = [int(x) for x in (tmp_path / "computed").read_text().split()]
    assert sorted(computed) == list(range(24))  # each shard once, over two attempts
    assert [r.metrics["i"] for r in mapped.results] == list(range(24))
    mine = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    deadline = time.monotonic() + 60  # the API records task runs from events, soon after
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=mine)
            stage = [r for r in runs if r.name.startswith("engine-flaky")]
            if (stage and stage[0].run_count == 2) or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert len(runs) == 2 and len(stage) == 1 and stage[0].run_count == 2


def _pids(root: Path) -> set[int]:
    return {json.loads(p.read_text())["pid"] for p in root.glob("*/*/shards/*/value.json")}


def test_threads_move_a_stage_to_processes_from_its_input_size(tmp_path, caplog):
    """runner.processes_from_mb: a stage whose mapped input reaches it runs on spawned processes
    (the same outputs); below it, and with None, on the thread pool in this process."""
    graph, _ = graph_of(6)
    (source,) = graph.find(step="overhead-shards")
    reference_run = Executor(str(tmp_path / "size"))
    input_mb = reference_run.store.output_bytes(reference_run.run(graph)[source].uri) / 1e6
    reference = values(tmp_path / "size")
    ways = {"below": 2 * input_mb, "above": input_mb / 2, "off": None}
    for way, threshold in ways.items():
        runner = RunnerConfig(kind="threads", max_workers=2, processes_from_mb=threshold)
        with caplog.at_level(logging.INFO, logger="llmflow.engine"):
            run_closing(make_engine(runner), tmp_path / way, graph)
        assert values(tmp_path / way) == reference, way
        in_this_process = _pids(tmp_path / way) == {os.getpid()}
        assert in_this_process == (way != "above"), way
    assert "MB of input" in caplog.text and "processes" in caplog.text
