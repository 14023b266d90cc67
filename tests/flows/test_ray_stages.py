"""Mapped data stages as one Prefect task each, their shards on threads or a local Ray (127.0.0.1):
the quickstart's curation gives byte-identical outputs on both, and a Ray worker SIGKILLed in the
middle of a stage leaves committed shards that the re-run keeps, redoing only the others."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from llmflow.tasks.config import load_config
from llmflow.tasks.framework.engine import FAULT_ENV

REPO = Path(__file__).resolve().parents[2]
MIN_SHARDS = 64
DOCS_PER_SHARD = 9  # the quickstart sample's ~590 documents in 80-odd shards


@pytest.fixture
def local_ray(monkeypatch):
    """A loopback-only Ray with 2 CPUs, started here and shut down whatever happens."""
    import ray

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
        yield ray
    finally:
        ray.shutdown()


def curate_config(root: Path, kind: str):
    return load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            f"root={root}",
            "until=curate",
            f"ingest.docs_per_shard={DOCS_PER_SHARD}",
            f"runner.kind={kind}",
            "runner.max_workers=2",
        ],
    )


def outputs(root: Path) -> dict[str, tuple[str, dict]]:
    """Every committed output under ``root``: its address, with its hash and each file's sha256
    (the lineage manifest written at commit), less timestamps and run ids."""
    found = {}
    for record in root.glob("*/*/lineage.json"):
        data = json.loads(record.read_text())
        found[record.parent.relative_to(root).as_posix()] = (data["hash"], data["files"])
    return found


def task_runs_of(root: Path, step: str) -> set[str]:
    """The Prefect task runs the lineage of ``step``'s outputs records."""
    runs = set()
    for record in root.glob(f"{step}/*/lineage.json"):
        runs.add(json.loads(record.read_text())["run"].get("task_run_id"))
    return runs


@pytest.mark.slow
def test_threads_and_ray_curate_the_same_bytes_one_task_per_stage(
    prefect_harness, local_ray, tmp_path
):
    from llmflow.flows.pipeline import run_pipeline

    # NOTE: one root path for both runs (moved aside in between): documents record their source
    # file's path, so outputs under two roots differ by that string.
    root = tmp_path / "run"
    started = time.perf_counter()
    threads_rows = run_pipeline(curate_config(root, "threads"))
    walls = [time.perf_counter() - started]
    shutil.move(root, tmp_path / "threads")
    started = time.perf_counter()
    ray_rows = run_pipeline(curate_config(root, "ray"))
    walls.append(time.perf_counter() - started)
    threads, on_ray = outputs(tmp_path / "threads"), outputs(root)

    (stage,) = [k for k in threads if k.startswith("curate-normalize/")]  # one stage output
    normalized = [f for f in threads[stage][1] if f.endswith(".parquet")]  # its shards' files
    assert len(normalized) >= MIN_SHARDS
    assert sorted(on_ray) == sorted(threads)
    assert {k: v[0] for k, v in on_ray.items()} == {k: v[0] for k, v in threads.items()}
    assert on_ray == threads  # every file's sha256
    # Ray ran the shards: in worker processes, none cached
    assert not any(r.cached for r in ray_rows)
    # One Prefect task per mapped stage: its one lineage record names that task run.
    for step in ("curate-normalize", "curate-filter", "curate-exact-hashes", "curate-minhash"):
        (run,) = task_runs_of(root, step)
        assert run is not None
    # The summary gives the stage's wall time, not the shards' seconds summed.
    for rows, wall in zip((threads_rows, ray_rows), walls, strict=True):
        stages = [r for r in rows if r.step.endswith(f"({len(normalized)} shards)")]
        assert len(stages) == 4
        assert sum(r.seconds for r in stages) <= wall


def _stage_markers(root: Path, step: str) -> int:
    return len(list(root.glob(f"{step}/*/shards/*/_COMMITTED")))


@pytest.mark.slow
def test_a_ray_worker_killed_mid_stage_rerun_redoes_only_unfinished_shards(
    local_ray, tmp_path, monkeypatch
):
    """The worker running shard 10 of curate-normalize is SIGKILLed: the stage fails once the
    shards in flight finish; the re-run computes exactly the shards without a marker, and the
    result is byte-identical to a run without the fault."""
    from llmflow.flows.pipeline import planned
    from llmflow.tasks.framework.backend import RayBackend, ThreadBackend
    from llmflow.tasks.framework.engine import StageEngine
    from llmflow.tasks.framework.executor import Executor

    root = tmp_path / "run"
    graph = planned(curate_config(root, "ray"))
    reference_engine = StageEngine(ThreadBackend(2))
    try:
        Executor(str(root), engine=reference_engine).run(graph)
    finally:
        reference_engine.close()
    shutil.move(root, tmp_path / "reference")
    total = _stage_markers(tmp_path / "reference", "curate-normalize")

    log, once = tmp_path / "computed.log", tmp_path / "killed"
    fault = {"kill_shard": "shard-00010", "once": str(once), "log": str(log)}
    monkeypatch.setenv(FAULT_ENV, json.dumps(fault))
    # NOTE: the running cluster's workers were forked without the fault: restart Ray with it
    local_ray.shutdown()
    local_ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    engine = StageEngine(RayBackend(max_in_flight=4))
    assert engine.backend.unit_size(total) > 1  # shard 10 dies inside a Ray task of several shards
    try:
        with pytest.raises(local_ray.exceptions.RayError):
            Executor(str(root), engine=engine).run(graph)
        assert once.exists()  # the worker did kill itself
        done = _stage_markers(root, "curate-normalize")
        first = log.read_text().splitlines()
        assert len(first) == done and 0 < done < total - 1  # later shards never started

        outcome = Executor(str(root), engine=engine).run(graph)
    finally:
        engine.close()
    node = next(n for n in graph.nodes if n.step.name == "curate-normalize")
    results = outcome[node].results
    assert sum(not r.cached for r in results) == total - done
    rerun = log.read_text().splitlines()[len(first) :]
    normalize_rerun = [line for line in rerun if line.startswith("curate-normalize ")]
    assert len(normalize_rerun) == total - done
    assert not set(normalize_rerun) & set(first)  # no committed shard ran twice
    assert "curate-normalize shard-00010" in normalize_rerun
    assert outputs(root) == outputs(tmp_path / "reference")


@pytest.mark.slow
def test_address_local_starts_a_loopback_only_cluster_and_shuts_it_down(tmp_path):
    """``runner.ray.address: local``: every socket the cluster's processes listen on is on
    127.0.0.1, the stage runs there, and closing the engine shuts the cluster down."""
    import psutil
    import ray

    from llmflow.tasks.framework.engine import make_engine
    from llmflow.tasks.framework.executor import Executor
    from llmflow.tasks.framework.graph import Graph
    from llmflow.tasks.framework.stage_overhead import (
        OverheadShards,
        overhead_noop,
        overhead_shards,
    )

    assert not ray.is_initialized()
    graph = Graph()
    source = graph.add(overhead_shards, OverheadShards(num_shards=20), "n")
    noop = graph.add(overhead_noop, OverheadShards(), "n", map_over="shard", shard=source)
    engine = make_engine(curate_config(tmp_path, "ray").runner)
    try:
        assert engine.backend.started and ray.is_initialized()
        children = psutil.Process().children(recursive=True)
        listening = {
            c.laddr.ip
            for p in children
            if p.name() in ("gcs_server", "raylet")
            for c in p.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        }
        assert listening and all(ip.removeprefix("::ffff:") == "127.0.0.1" for ip in listening)
        mapped = Executor(str(tmp_path / "store"), engine=engine).run(graph)[noop]
    finally:
        engine.close()
    assert not ray.is_initialized()
    assert len(mapped.results) == 20 and not any(r.cached for r in mapped.results)
