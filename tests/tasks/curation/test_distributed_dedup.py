"""Partitioned exact and near dedup (tasks/curation/distributed_dedup.py) against the
single-process steps and against brute-force references, in-process and on a local Ray."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from llmflow.tasks.config import RunnerConfig
from llmflow.tasks.curation.config import ExactDedupConfig, MinhashConfig
from llmflow.tasks.curation.exact_dedup import exact_dedup, exact_hashes, text_hash
from llmflow.tasks.curation.minhash import minhash_signatures, near_dedup
from llmflow.tasks.curation.shards import write_drops
from llmflow.tasks.framework import backend as backend_module
from llmflow.tasks.framework.backend import RayBackend, active, make_backend
from llmflow.tasks.framework.hashing import versioned_fields
from tests.tasks.curation.helpers import near_copy, prose, real_documents, write_shards


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _exact_corpus(seed: int, num_docs: int = 120) -> list[dict]:
    """Unique documents and exact copies (case and punctuation changed), some copied 3 times,
    some copies earlier than their original in (shard, row) order."""
    rng = random.Random(seed)
    records = [
        {"id": f"doc-{i:03d}", "text": prose(rng, 3), "domain": "web"} for i in range(num_docs)
    ]
    for n, i in enumerate(rng.sample(range(num_docs), num_docs // 3)):
        for k in range(1 + n % 3):
            text = records[i]["text"].upper() if k % 2 else records[i]["text"].replace(".", "!")
            records.insert(rng.randrange(len(records)), {"id": f"copy-{i:03d}-{k}", "text": text})
    return records


def _exact_reference(shards: list[Path], alive: set[str] | None) -> list[tuple[str, str]]:
    """First occurrence of each normal-form hash wins, in (shard name, row) order."""
    first: dict[bytes, str] = {}
    drops = []
    for shard in sorted(shards, key=lambda p: p.name):
        for row in pq.read_table(shard).to_pylist():
            if alive is not None and row["id"] not in alive:
                continue
            h = text_hash(row["text"])
            if h in first:
                drops.append((row["id"], first[h]))
            else:
                first[h] = row["id"]
    return drops


def _drops(out: Path, name: str = "drops.parquet") -> list[tuple]:
    rows = pq.read_table(out / name).to_pylist()
    return [tuple(r[c] for c in ("id", "paragraph", "duplicate_of") if c in r) for r in rows]


@pytest.mark.parametrize("partitions", [1, 3, 64])
@pytest.mark.parametrize("with_alive", [False, True])
def test_partitioned_exact_dedup_equals_reference_and_bloom(tmp_path, partitions, with_alive):
    records = _exact_corpus(seed=partitions)
    shards = write_shards(tmp_path / "in", records, num_shards=5)
    hashes = _mkdir(tmp_path / "hashes")
    exact_hashes(ExactDedupConfig().hash_config(), tmp_path / "in", hashes)
    filtered = None
    alive = None
    if with_alive:  # a filter removed every fifth document, originals among them
        kept = [r for i, r in enumerate(records) if i % 5]
        write_shards(tmp_path / "filtered", kept, num_shards=3)
        filtered, alive = [tmp_path / "filtered"], {r["id"] for r in kept}
    reference = _exact_reference(shards, alive)
    assert len(reference) > 20
    # a Bloom filter far too small: most unique documents become candidates
    bloom_cfg = ExactDedupConfig(expected_documents=10, false_positive_rate=0.5)
    part_cfg = ExactDedupConfig(method="partitioned", partitions=partitions)
    bloom_out, part_out = _mkdir(tmp_path / "bloom"), _mkdir(tmp_path / "part")
    bloom_metrics = exact_dedup(bloom_cfg, [hashes], bloom_out, filtered)
    part_metrics = exact_dedup(part_cfg, [hashes], part_out, filtered)
    assert _drops(part_out) == reference
    assert _drops(bloom_out) == reference  # the Bloom step's exact pass: no false drop either
    assert bloom_metrics["bloom_candidates"] > len(reference)
    assert part_metrics["documents_dropped"] == len(reference)
    assert pq.read_table(part_out / "drops.parquet").equals(
        pq.read_table(bloom_out / "drops.parquet")
    )
    assert sorted(p.name for p in part_out.iterdir()) == ["drops.parquet", "report.json"]


def test_partitioned_exact_dedup_paragraphs_and_disabled(tmp_path):
    rng = random.Random(3)
    shared = [prose(rng, 3) for _ in range(4)]
    docs = [
        {"id": f"d{i}", "text": prose(rng, 3) + "\n\n" + shared[i % 4] + "\n\n" + prose(rng, 2)}
        for i in range(20)
    ]
    write_shards(tmp_path / "in", docs, num_shards=3)
    cfg = ExactDedupConfig(level="paragraph")
    hashes = _mkdir(tmp_path / "hashes")
    exact_hashes(cfg.hash_config(), tmp_path / "in", hashes)
    outs = {}
    for method in ("bloom", "partitioned"):
        outs[method] = _mkdir(tmp_path / method)
        exact_dedup(
            cfg.model_copy(update={"method": method, "partitions": 4}), [hashes], outs[method]
        )
    para = _drops(outs["partitioned"], "paragraph_drops.parquet")
    assert len(para) == 16 and para == _drops(outs["bloom"], "paragraph_drops.parquet")
    off = _mkdir(tmp_path / "off")
    exact_dedup(ExactDedupConfig(enabled=False, method="partitioned"), [hashes], off)
    assert _drops(off) == []


def test_new_fields_keep_addresses_at_their_defaults():
    assert "method" not in versioned_fields(ExactDedupConfig())
    assert "partitions" not in versioned_fields(MinhashConfig())
    assert versioned_fields(ExactDedupConfig(method="partitioned"))["method"] == "partitioned"
    assert versioned_fields(MinhashConfig(partitions=8))["partitions"] == 8


# --- near dedup --------------------------------------------------------------------------------


def _near_inputs(tmp_path: Path, records: list[dict], num_shards: int, alive_every: int = 0):
    write_shards(tmp_path / "in", records, num_shards=num_shards)
    sigs = _mkdir(tmp_path / "sigs")
    minhash_signatures(MinhashConfig().signature_config(), tmp_path / "in", sigs)
    filtered = tmp_path / "in"
    if alive_every:
        kept = [r for i, r in enumerate(records) if i % alive_every]
        write_shards(tmp_path / "filtered", kept, num_shards=2)
        filtered = tmp_path / "filtered"
    return sigs, filtered


def _run_near(tmp_path, sigs, filtered, cfg, exact=None, tag=""):
    out = _mkdir(tmp_path / f"near-{cfg.method}-{cfg.keep}-{cfg.partitions}{tag}")
    metrics = near_dedup(cfg, [sigs], out, filtered=[filtered], exact=exact)
    report = json.loads((out / "report.json").read_text())
    return metrics, _drops(out), report, out


def _brute_force_clusters(sigs: Path, alive: set[str], excluded: set[str], num_buckets: int):
    """Connected components of 'shares a key in some band', over all pairs: (members) lists."""
    rows = [
        r
        for p in sorted(sigs.glob("*.minhash.parquet"), key=lambda p: p.name)
        for r in pq.read_table(p).to_pylist()
        if r["id"] in alive and r["id"] not in excluded
    ]
    parent = list(range(len(rows)))

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            if any(
                rows[i][f"band_{b:02d}"] == rows[j][f"band_{b:02d}"] for b in range(num_buckets)
            ):
                a, b = find(i), find(j)
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[str]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(find(i), []).append(row["id"])
    return sorted(sorted(m) for m in groups.values() if len(m) > 1)


def _planted_near_corpus(seed: int, num_docs: int) -> list[dict]:
    """Prose documents; near copies of some, copies of copies (chains), some copies first."""
    rng = random.Random(seed)
    records = [
        {"id": f"doc-{i:03d}", "text": prose(rng, 20), "domain": "web"} for i in range(num_docs)
    ]
    for i in range(0, num_docs, 3):
        text = records[i]["text"]
        for k in range(1 + i % 4):
            text = near_copy(rng, text, rng.randint(1, 3))  # a chain: each a copy of the last
            position = rng.randrange(len(records))
            records.insert(position, {"id": f"near-{i:03d}-{k}", "text": text, "domain": "web"})
    return records


def _write_exact_drops(tmp_path: Path, excluded: set[str]) -> Path:
    exact = _mkdir(tmp_path / "exact")
    write_drops(exact, sorted(excluded), "exact_duplicate")
    return exact


def _clusters_of(drops: list[tuple]) -> list[list[str]]:
    """Each cluster's sorted members, from (dropped, kept) pairs."""
    groups: dict[str, list[str]] = {}
    for dropped, kept in drops:
        groups.setdefault(kept, [kept]).append(dropped)
    return sorted(sorted(m) for m in groups.values())


def _assert_same_as_union_find(
    tmp_path, sigs, filtered, keep, exact, partition_counts, map_fn=None
):
    """The partitioned step gives the union-find step's metrics, drops (same keepers, same
    order) and report (index_bytes aside: the partitioned step has no such table)."""
    metrics, drops, report, _ = _run_near(tmp_path, sigs, filtered, MinhashConfig(keep=keep), exact)
    for partitions in partition_counts:
        cfg = MinhashConfig(keep=keep, method="partitioned", partitions=partitions)
        got_metrics, got_drops, got_report, out = _run_near(tmp_path, sigs, filtered, cfg, exact)
        assert got_drops == drops
        assert got_metrics == metrics
        assert {k: got_report[k] for k in report if k != "index_bytes"} == {
            k: v for k, v in report.items() if k != "index_bytes"
        }
        assert sorted(p.name for p in out.iterdir()) == ["drops.parquet", "report.json"]
    return drops


@pytest.mark.parametrize("keep", ["first", "longest"])
def test_partitioned_near_dedup_equals_union_find_planted(tmp_path, keep):
    records = _planted_near_corpus(seed=11, num_docs=90)
    sigs, filtered = _near_inputs(tmp_path, records, num_shards=4, alive_every=7)
    excluded = {records[i]["id"] for i in range(3, len(records), 11)}
    exact = _write_exact_drops(tmp_path, excluded)
    drops = _assert_same_as_union_find(tmp_path, sigs, filtered, keep, exact, (1, 5, 64))
    # both are the connected components of the pair graph, brute force over all pairs
    alive = {r["id"] for i, r in enumerate(records) if i % 7}
    expected = _brute_force_clusters(sigs, alive, excluded, MinhashConfig().num_buckets)
    assert len(expected) >= 20 and max(len(c) for c in expected) >= 3
    assert _clusters_of(drops) == expected


def test_partitioned_near_dedup_on_held_in_corpus(tmp_path, shared_data):
    """The held-in corpus of test_dedup's real-text test (WikiText-2 validation articles,
    tinyshakespeare), with planted near copies."""
    rng = random.Random(6)
    docs = [d for d in real_documents() if len(d.split()) > 200]
    records = [{"id": f"doc-{i:04d}", "text": t, "domain": "web"} for i, t in enumerate(docs)]
    for i in rng.sample(range(len(records)), 60):
        text = near_copy(rng, records[i]["text"], rng.randint(1, 3))
        records.append({"id": f"near-{i:04d}", "text": text, "domain": "web"})
    sigs, filtered = _near_inputs(tmp_path, records, num_shards=4)
    for keep in ("first", "longest"):
        drops = _assert_same_as_union_find(tmp_path, sigs, filtered, keep, None, (1, 16))
        assert len(drops) >= 57


# --- on Ray ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_ray_backend_starts_and_stops_a_local_cluster(tmp_path, monkeypatch):
    """Runs before the module's cluster starts: ``runner.kind: ray`` starts one on 127.0.0.1
    and closing the backend stops it; outside a run, a step's units run in this process."""
    ray = _ray_pickling_this_module()
    assert not ray.is_initialized()
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    with make_backend(RunnerConfig(kind="ray")) as backend:
        assert ray.is_initialized()
        assert backend.map(_tagged, [1, 2])[1][0] == 2
    assert not ray.is_initialized()
    assert backend_module.current().kind == "local"


def _ray_pickling_this_module():
    """Ray, with this test module's functions sent by value (its workers cannot import it)."""
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray


@pytest.fixture(scope="module")
def local_ray():
    """A 2-CPU Ray cluster on 127.0.0.1 for this module, shut down after it."""
    ray = _ray_pickling_this_module()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _tagged(value: int) -> tuple[int, int]:
    return value, os.getpid()


@pytest.mark.slow
def test_ray_map_keeps_order_with_one_in_flight(local_ray):
    items = list(range(7))
    results = RayBackend(max_in_flight=1, items_per_task=2).map(_tagged, items)
    assert [v for v, _ in results] == items
    assert {pid for _, pid in results} != {os.getpid()}  # they ran in Ray's workers


@pytest.mark.slow
def test_steps_on_ray_equal_union_find_and_reference(tmp_path, local_ray, shared_data, monkeypatch):
    """On a Ray backend (as a run under ``runner.kind: ray`` makes active), the partitioned
    steps run their partitions as Ray tasks and give the single-process steps' drops."""
    monkeypatch.setattr(backend_module, "_LOCAL", None)  # nothing may run in-process
    with active(RayBackend()):
        _steps_on_ray(tmp_path, shared_data)


def _steps_on_ray(tmp_path, shared_data):
    records = _exact_corpus(seed=5)
    shards = write_shards(tmp_path / "in", records, num_shards=4)
    hashes = _mkdir(tmp_path / "hashes")
    exact_hashes(ExactDedupConfig().hash_config(), tmp_path / "in", hashes)
    out = _mkdir(tmp_path / "exact-ray")
    exact_dedup(ExactDedupConfig(method="partitioned", partitions=8), [hashes], out)
    assert _drops(out) == _exact_reference(shards, None)

    rng = random.Random(6)
    docs = [d for d in real_documents() if len(d.split()) > 200]
    near = [{"id": f"doc-{i:04d}", "text": t, "domain": "web"} for i, t in enumerate(docs)]
    for i in rng.sample(range(len(near)), 60):
        near.append({"id": f"near-{i:04d}", "text": near_copy(rng, near[i]["text"], 2)})
    sigs, filtered = _near_inputs(tmp_path / "near", near, num_shards=4, alive_every=9)
    drops = _assert_same_as_union_find(tmp_path, sigs, filtered, "first", None, (8,))
    assert len(drops) >= 45


def _stage_outputs(outcome, graph) -> dict[str, list[str]]:
    """Each step's output addresses, by step name."""
    found: dict[str, list[str]] = {}
    for node in graph.nodes:
        result = outcome[node]
        for one in getattr(result, "results", [result]):  # a mapped node: its shards
            found.setdefault(node.step.name, []).append(one.uri.rsplit("/", 1)[-1])
    return found


def _tables(folder: Path) -> dict[str, object]:
    return {str(p.relative_to(folder)): pq.read_table(p) for p in sorted(folder.rglob("*.parquet"))}


def test_curation_graph_with_partitioned_dedup_curates_the_same_corpus(tmp_path):
    """The whole curate graph, dedup partitioned: the same drops and the same curated shards;
    only the two global steps get new addresses (the per-shard stages are not re-run)."""
    from llmflow.tasks.curation.config import CurateConfig
    from llmflow.tasks.framework.executor import Executor
    from llmflow.tasks.framework.store import Store
    from tests.tasks.curation.helpers import curation_graph
    from tests.tasks.curation.test_quality_and_pipeline import _corpus

    records, _ = _corpus(random.Random(8))
    base = {"skip_domains": ["code", "math"]}
    partitioned = {
        **base,
        "exact_dedup": {"method": "partitioned", "partitions": 4},
        "minhash": {"method": "partitioned", "partitions": 4},
    }
    roots, outputs, addresses = {}, {}, {}
    for tag, raw in (("bloom", base), ("partitioned", partitioned)):
        graph, _ = curation_graph(records, CurateConfig.model_validate(raw), num_shards=3)
        roots[tag] = tmp_path / tag
        outcome = Executor(str(roots[tag])).run(graph)
        addresses[tag] = _stage_outputs(outcome, graph)
        store = Store(str(roots[tag]))
        outputs[tag] = {
            n.step.name: _tables(store.local_path(outcome[n].uri))
            for n in graph.nodes
            if n.step.name in ("curate-exact-dedup", "curate-near-dedup", "curate")
        }
    changed = {
        k for k in addresses["bloom"] if addresses["bloom"][k] != addresses["partitioned"][k]
    }
    assert changed == {"curate-exact-dedup", "curate-near-dedup", "curate-quality-model", "curate"}
    for step_name, tables in outputs["bloom"].items():
        assert tables.keys() == outputs["partitioned"][step_name].keys()
        for name, table in tables.items():
            assert table.equals(outputs["partitioned"][step_name][name]), (step_name, name)
    assert outputs["bloom"]["curate-exact-dedup"]["drops.parquet"].num_rows == 10
    assert outputs["bloom"]["curate-near-dedup"]["drops.parquet"].num_rows >= 9


def _committed_files(root: Path, step: str) -> dict[str, str]:
    """sha256 of each file the committed outputs of `step` hold (from their lineage records)."""
    found = {}
    for record in sorted(root.glob(f"{step}/*/lineage.json")):
        found.update(json.loads(record.read_text())["files"])
    return found


@pytest.mark.slow
def test_quickstart_curate_on_the_ray_engine_with_partitioned_dedup(
    prefect_harness, tmp_path, monkeypatch
):
    """The quickstart's curation under ``runner.kind: ray`` with both dedups partitioned (their
    partitions on the engine's Ray, nothing in-process) drops and curates the same bytes as the
    threads runner with the Bloom filter and the single-process union-find."""
    from llmflow.flows.pipeline import run_pipeline
    from llmflow.tasks.config import load_config

    _ray_pickling_this_module()
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    repo = Path(__file__).resolve().parents[3]

    def config(root: Path, *extra: str):
        sets = [f"root={root}", "until=curate", "runner.max_workers=2", *extra]
        return load_config(repo / "configs" / "quickstart.yaml", sets)

    # NOTE: one root path for both runs (moved aside in between): documents record their
    # source file's path
    root = tmp_path / "run"
    run_pipeline(config(root, "runner.kind=threads"))
    shutil.move(root, tmp_path / "threads")
    monkeypatch.setattr(backend_module, "_LOCAL", None)  # the partitions must go to Ray
    partitioned = (
        "curate.exact_dedup.method=partitioned",
        "curate.exact_dedup.partitions=8",
        "curate.minhash.method=partitioned",
        "curate.minhash.partitions=8",
    )
    run_pipeline(config(root, "runner.kind=ray", *partitioned))
    for step in ("curate-exact-dedup", "curate-near-dedup"):
        threads, on_ray = _committed_files(tmp_path / "threads", step), _committed_files(root, step)
        assert on_ray["drops.parquet"] == threads["drops.parquet"], step
    near = pq.read_table(root.glob("curate-near-dedup/*/drops.parquet").__next__())
    assert near.num_rows > 0
    curated = {k: v for k, v in _committed_files(root, "curate").items() if k.startswith("shards/")}
    expected = _committed_files(tmp_path / "threads", "curate")
    assert curated and curated == {k: v for k, v in expected.items() if k.startswith("shards/")}
