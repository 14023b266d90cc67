"""A mapped step's output is ONE stage output: its shards under ``shards/{label}/``, each committed
on its own, one ``lineage.json`` with a row per shard, and the stage's own ``_COMMITTED`` last.
Its address is known before any shard runs; a failed stage looks incomplete and its re-run
computes only the shards without a marker; ``llmflow verify`` checks every shard's files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel

from llmflow.tasks.framework.backend import ThreadBackend
from llmflow.tasks.framework.engine import StageEngine
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.lineage import format_tree
from llmflow.tasks.framework.stage_overhead import OverheadShards, overhead_shards
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.framework.store import Store
from llmflow.tasks.framework.verify import committed_outputs, verify_output

FAILING: set[int] = set()  # shard numbers the square step refuses (a cause that goes away)


class Power(BaseModel):
    power: int = 2


@step("stage-square")
def square(cfg: Power, shard: Path, out: Path) -> Metrics:
    """The shard's number to ``power``."""
    (i,) = pq.read_table(shard).column("i").to_pylist()
    if i in FAILING:
        raise BadInputError(f"shard {i} refused")
    (out / "value.json").write_text(json.dumps({"value": i**cfg.power}))
    return {"value": i**cfg.power}


@step("stage-plus-one")
def plus_one(cfg: Power, squared: Path, out: Path) -> Metrics:
    """A second mapped stage: the upstream shard's value plus one."""
    value = json.loads((squared / "value.json").read_text())["value"]
    (out / "value.json").write_text(json.dumps({"value": value + 1}))
    return {"value": value + 1}


@step("stage-total")
def total(cfg: Power, values: list[Path], out: Path) -> Metrics:
    """A global step over every shard of a stage."""
    found = sum(json.loads((p / "value.json").read_text())["value"] for p in values)
    (out / "total.json").write_text(json.dumps(found))
    return {"total": found}


def graph_of(num_shards: int) -> tuple[Graph, dict]:
    graph = Graph()
    source = graph.add(overhead_shards, OverheadShards(num_shards=num_shards), "n")
    squared = graph.add(square, Power(), "n", map_over="shard", shard=source)
    added = graph.add(plus_one, Power(), "n", map_over="squared", squared=squared)
    summed = graph.add(total, Power(), "n", values=added)
    return graph, {"source": source, "squared": squared, "added": added, "total": summed}


@pytest.fixture(autouse=True)
def _nothing_failing():
    FAILING.clear()
    yield
    FAILING.clear()


def test_a_stage_is_one_output_with_its_shards_and_one_lineage_record(tmp_path):
    graph, nodes = graph_of(12)
    outcome = Executor(str(tmp_path)).run(graph)
    stage = outcome[nodes["squared"]]
    folders = [p for p in (tmp_path / "stage-square").iterdir() if not p.name.startswith(".")]
    assert folders == [Path(stage.uri)]  # 12 shards, one output folder
    assert Store(str(tmp_path)).is_complete(stage.uri)
    assert list(Path(stage.uri).rglob("lineage.json")) == [Path(stage.uri, "lineage.json")]
    shard_dirs = sorted(p for p in Path(stage.uri, "shards").iterdir())
    assert [p.name for p in shard_dirs] == stage.labels and len(shard_dirs) == 12
    assert all((p / "_COMMITTED").exists() for p in shard_dirs)

    record = json.loads(Path(stage.uri, "lineage.json").read_text())
    assert record["hash"] == stage.hash and record["metrics"]["num_shards"] == 12
    assert [row["label"] for row in record["shards"]] == stage.labels
    values = [json.loads((p / "value.json").read_text())["value"] for p in shard_dirs]
    assert values == [i * i for i in range(12)]
    assert [row["metrics"]["value"] for row in record["shards"]] == values
    for path in shard_dirs:  # every shard file's checksum is in the one record
        rel = f"shards/{path.name}/value.json"
        want = hashlib.sha256((path / "value.json").read_bytes()).hexdigest()
        assert record["files"][rel]["sha256"] == want
    (upstream,) = record["inputs"]
    assert upstream["uri"] == outcome[nodes["source"]].uri and upstream["mapped"] is True

    assert json.loads(Path(outcome[nodes["total"]].uri, "total.json").read_text()) == sum(
        i * i + 1 for i in range(12)
    )
    summed = json.loads(Path(outcome[nodes["total"]].uri, "lineage.json").read_text())
    added = outcome[nodes["added"]]
    assert summed["inputs"] == [
        {"name": "values", "uri": added.uri, "hash": added.hash, "shards": 12}
    ]


def test_the_stage_address_is_known_before_any_shard_runs(tmp_path):
    graph, nodes = graph_of(5)
    store = Store(str(tmp_path))
    alone = Graph()
    node = alone.add(overhead_shards, OverheadShards(num_shards=5), "n")  # the same source
    source = Executor(str(tmp_path)).run(alone)[node]
    before, _, _ = square.address(store, Power(), "n", {"shard": source.uri})
    assert not Path(before).exists()
    outcome = Executor(str(tmp_path)).run(graph)
    assert outcome[nodes["squared"]].uri == before
    after, _, _ = plus_one.address(store, Power(), "n", {"squared": before})
    assert outcome[nodes["added"]].uri == after
    shard = outcome[nodes["added"]].results[3]
    assert shard.uri == f"{after}/shards/{outcome[nodes['added']].labels[3]}"
    assert shard.hash == f"{Store.address_of(after)[2]}/{outcome[nodes['added']].labels[3]}"


def test_a_failed_stage_looks_incomplete_and_its_rerun_computes_only_missing_shards(tmp_path):
    graph, nodes = graph_of(20)
    FAILING.add(7)
    engine = StageEngine(
        ThreadBackend(1)
    )  # two in flight: once shard 7 fails, at most shard 8 also commits
    try:
        with pytest.raises(BadInputError, match="shard 7 refused"):
            Executor(str(tmp_path), engine=engine).run(graph)
        store = Store(str(tmp_path))
        (stage,) = [p for p in (tmp_path / "stage-square").iterdir() if not p.name.startswith(".")]
        assert not store.is_complete(str(stage)) and not (stage / "lineage.json").exists()
        assert str(stage) not in list(committed_outputs(store))
        done = sorted(p.parent.name for p in stage.glob("shards/*/_COMMITTED"))
        assert done[:7] == [f"part-{i:06d}" for i in range(7)] and len(done) in (7, 8)

        FAILING.clear()
        outcome = Executor(str(tmp_path), engine=engine).run(graph)
    finally:
        engine.close()
    squared = outcome[nodes["squared"]]
    assert squared.uri == str(stage) and store.is_complete(squared.uri)
    assert sorted(r.uri.rsplit("/", 1)[1] for r in squared.results if r.cached) == done
    assert sum(not r.cached for r in squared.results) == 20 - len(done)
    clean = Executor(str(tmp_path / "clean")).run(graph)
    assert _files(squared.uri) == _files(clean[nodes["squared"]].uri)
    record = json.loads(Path(squared.uri, "lineage.json").read_text())
    assert record["metrics"] == {"num_shards": 20, "cached_shards": len(done)}


def _files(uri: str) -> dict[str, bytes]:
    root = Path(uri)
    return {
        p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("value.json"))
    }


def test_a_complete_stage_is_served_whole_from_its_record(tmp_path):
    graph, nodes = graph_of(6)
    first = Executor(str(tmp_path)).run(graph)
    again = Executor(str(tmp_path)).run(graph)
    stage = again[nodes["squared"]]
    assert all(r.cached for r in stage.results) and stage.uri == first[nodes["squared"]].uri
    assert [r.metrics for r in stage.results] == [
        r.metrics for r in first[nodes["squared"]].results
    ]
    assert stage.labels == first[nodes["squared"]].labels
    assert again.rows()[1].cached and again.rows()[1].uri == stage.uri


def test_a_shards_lineage_is_its_stage_record_with_its_row(tmp_path):
    graph, nodes = graph_of(4)
    outcome = Executor(str(tmp_path)).run(graph)
    store = Store(str(tmp_path))
    added = outcome[nodes["added"]]
    shard = added.results[2]
    record = store.read_lineage(shard.uri)
    assert record["step"] == "stage-plus-one" and record["metrics"] == {"value": 5}
    assert record["hash"] == shard.hash and record["stage"] == added.uri
    (upstream,) = record["inputs"]  # the upstream shard this one read, not the whole stage
    assert upstream["uri"] == outcome[nodes["squared"]].results[2].uri
    tree = format_tree(shard.uri, store.read_lineage)
    assert f"stage-square {upstream['uri']}  (value=4)" in tree
    assert "overhead-shards" in tree


def test_verify_checks_every_shard_file_of_a_stage(tmp_path):
    graph, nodes = graph_of(5)
    outcome = Executor(str(tmp_path)).run(graph)
    store = Store(str(tmp_path))
    stage = outcome[nodes["squared"]]
    assert verify_output(store, stage.uri).status == "ok"
    assert verify_output(store, stage.uri).num_files == 5
    bad = Path(stage.results[3].uri, "value.json")
    bad.write_text(bad.read_text() + " ")
    check = verify_output(store, stage.uri)
    assert check.status == "corrupt" and len(check.problems) == 1
    assert check.problems[0].startswith(f"{bad}: size changed")
