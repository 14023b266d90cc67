"""The step declaration, the graph and the in-process executor, on toy steps."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel, Field

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.executor import Executor, Mapped
from llmflow.tasks.framework.graph import Graph, Raw
from llmflow.tasks.framework.step import Metrics, report_table, step


class WriteConfig(BaseModel):
    words: list[str]
    num_shards: int = 2
    workers: int = Field(1, json_schema_extra={"versioned": False})


class CountConfig(BaseModel):
    min_len: int = 1
    workers: int = Field(1, json_schema_extra={"versioned": False})


@step("toy-write")
def write(cfg: WriteConfig, out: Path) -> Metrics:
    """Write the words round-robin into shards."""
    (out / "shards").mkdir()
    for i in range(cfg.num_shards):
        table = pa.table({"text": cfg.words[i :: cfg.num_shards]})
        pq.write_table(table, out / "shards" / f"part-{i}.parquet")
    return {"num_words": len(cfg.words)}


@step("toy-count", execution=("workers",))
def count(cfg: CountConfig, shard: Path, out: Path) -> Metrics:
    """Count the words of one shard at least ``min_len`` long."""
    words = pq.read_table(shard).column("text").to_pylist()
    kept = [w for w in words if len(w) >= cfg.min_len and cfg.workers > 0]
    (out / "count.json").write_text(json.dumps(len(kept)))
    return {"count": len(kept)}


@step("toy-total")
def total(cfg: CountConfig, counts: list[Path], out: Path, extra: Path | None = None) -> Metrics:
    """Sum the shard counts."""
    value = sum(json.loads((c / "count.json").read_text()) for c in counts)
    report_table("toy-total", [{"total": value}])
    (out / "total.json").write_text(json.dumps(value))
    return {"total": value}


@step("toy-leaky")
def leaky(cfg: CountConfig, counts: list[Path], out: Path) -> Metrics:
    """Reads an execution-only field without declaring it: the audit must catch this."""
    return {"workers": cfg.workers}


WORDS = ["a", "bb", "ccc", "dddd", "ee", "f"]


def recipe(min_len: int = 2, workers: int = 1, step_fn=total) -> Graph:
    graph = Graph()
    words = graph.add(write, WriteConfig(words=WORDS), "toy")
    counts = graph.add(
        count, CountConfig(min_len=min_len, workers=workers), "toy", map_over="shard", shard=words
    )
    graph.add(step_fn, CountConfig(), "toy", counts=counts)
    return graph


def test_a_declared_step_is_still_the_plain_function(tmp_path):
    write(WriteConfig(words=WORDS), out=tmp_path)
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [
        "part-0.parquet",
        "part-1.parquet",
    ]
    assert [s.name for s in count.inputs] == ["shard"] and count.config_type is CountConfig
    assert count.doc.startswith("Count the words")


def test_mapped_graph_runs_caches_and_reruns_only_what_changed(tmp_path):
    graph = recipe()
    first = Executor(str(tmp_path)).run(graph)
    mapped = first[graph.nodes[1]]
    assert isinstance(mapped, Mapped) and mapped.labels == ["part-0", "part-1"]
    assert first[graph.nodes[2]].metrics == {"total": sum(len(w) >= 2 for w in WORDS)}
    again = Executor(str(tmp_path)).run(recipe(workers=7))  # execution-only: same addresses
    assert all(r.cached for r in again.rows())
    changed = Executor(str(tmp_path)).run(recipe(min_len=3))
    assert [r.cached for r in changed.rows()] == [True, False, False]
    assert changed[changed_total := list(changed.results)[2]].metrics == {"total": 2}
    record = json.loads((Path(changed[changed_total].uri) / "lineage.json").read_text())
    stage = changed[list(changed.results)[1]]
    # the two shards read are one upstream: their stage output, with its hash and shard count
    assert record["inputs"] == [
        {"name": "counts", "uri": stage.uri, "hash": stage.hash, "shards": 2}
    ]


def test_graph_checks_input_names_before_anything_runs():
    graph = Graph()
    with pytest.raises(
        BadInputError, match=r"unknown inputs \['shards'\], missing inputs \['shard'\]"
    ):
        graph.add(count, CountConfig(), "x", shards=Raw(("a",)))
    with pytest.raises(BadInputError, match="takes a CountConfig"):
        graph.add(count, WriteConfig(words=[]), "x", shard=Raw(("a",)))


def test_until_keeps_earlier_phases_and_their_upstream():
    graph = Graph(phases=("data", "count", "total"))
    words = graph.add(write, WriteConfig(words=WORDS), "toy", phase="data")
    counts = graph.add(count, CountConfig(), "toy", phase="count", map_over="shard", shard=words)
    graph.add(total, CountConfig(), "toy", phase="total", counts=counts)
    assert [n.step.name for n in graph.until("count").nodes] == ["toy-write", "toy-count"]
    with pytest.raises(BadInputError, match="not a phase"):
        graph.until("nope")


def test_audit_catches_a_read_of_an_unhashed_field(tmp_path):
    clean = Executor(str(tmp_path / "a"), audit=True)
    graph = recipe()
    clean.run(graph)
    assert clean.reads["toy-count"] >= {"min_len", "workers"}
    assert clean.unhashed_reads(graph) == {}  # count declares workers execution-only
    planted = Executor(str(tmp_path / "b"), audit=True)
    graph = recipe(step_fn=leaky)
    planted.run(graph)
    assert planted.unhashed_reads(graph) == {"toy-leaky": ["workers"]}


def test_audit_sees_reads_through_model_dump(tmp_path):
    from llmflow.tasks.framework.audit import recording

    reads: set[str] = set()
    seen = recording(WriteConfig(words=["x"]), reads)
    assert isinstance(seen, WriteConfig) and seen.model_dump()["words"] == ["x"]
    assert reads == {"words", "num_shards", "workers"}
