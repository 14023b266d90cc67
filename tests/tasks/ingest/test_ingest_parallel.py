"""ingest reading its files on workers (a spawned process pool, Ray tasks) against this process.

The reference is the sequential read (``LLMFLOW_DATA_WORKERS`` unset, Ray not connected): the
shards, rejects and report must have the same sha256 on the parallel paths, on a multi-file
--data input (the quickstart sample's JSONL plus Parquet, a JSON array, plain text, malformed
lines and ids duplicated across files), cut into shards that straddle files; and with Hub
sources (a local mirror, several data files per split, a cap reached mid-file) after the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmflow.tasks.framework.backend import ProcessBackend, RayBackend, active
from llmflow.tasks.ingest import hub
from llmflow.tasks.ingest.ingest import IngestConfig, ingest, list_files
from llmflow.tasks.ingest.sample import SampleConfig, make_sample

CFG = IngestConfig(docs_per_shard=37, domain_map={"notes": "prose"})


def sha256s(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith("ids")
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("ingest_parallel")
    make_sample(SampleConfig(), root / "raw")
    (root / "raw" / "manifest.json").unlink()
    rows = [
        {"id": f"pq-{i}", "text": f"parquet document {i} " * 3, "domain": "code"} for i in range(90)
    ]
    rows[5]["id"] = "dup-1"
    pq.write_table(pa.Table.from_pylist(rows), root / "raw" / "more.parquet")
    items = [{"id": "dup-1", "text": "the same id again"}, {"text": 7}, {"text": "kept " * 4}]
    (root / "raw" / "array.json").write_text(json.dumps(items))
    lines = [json.dumps({"id": "dup-1", "text": "third"}), "{broken", "", json.dumps({"text": " "})]
    (root / "raw" / "bad.jsonl").write_text("\n".join(lines) + "\n")
    (root / "raw" / "notes.txt").write_text(
        "\n\n\n".join(f"paragraph {i} of notes" for i in range(40))
    )
    files = list_files([str(root / "raw")])
    assert len(files) >= 8
    return files


README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.parquet
---
"""


@pytest.fixture(scope="module")
def hub_sources(tmp_path_factory) -> list[str]:
    """acme/web (4 Parquet files, an id repeated across two) and acme/code (3 JSONL files,
    text in ``content``), laid out as Hub repos in a mirror folder."""
    mirror = tmp_path_factory.mktemp("mirror")
    web = mirror / "acme" / "web" / "data"
    web.mkdir(parents=True)
    (web.parent / "README.md").write_text(README)
    for shard in range(4):
        ids = [f"w{shard}-{i}" for i in range(30)]
        ids[0] = "w-shared" if shard in (1, 2) else ids[0]
        texts = [f"web page {shard}-{i}: " + "words " * (i + 1) for i in range(30)]
        pq.write_table(pa.table({"id": ids, "text": texts}), web / f"train-{shard}.parquet")
    code = mirror / "acme" / "code" / "data"
    code.mkdir(parents=True)
    for part in range(3):
        lines = [json.dumps({"content": f"def f{part}_{i}():\n    return {i}\n"}) for i in range(9)]
        (code / f"part-{part}.jsonl").write_text(
            "\n".join(lines + [json.dumps({"content": "  "})]) + "\n"
        )
    os.environ[hub.MIRROR_ENV] = str(mirror)
    yield [
        "hf://datasets/acme/web?split=train&domain=web&max_docs=70",
        "hf://datasets/acme/code?split=train&domain=code&text_field=content",
    ]
    os.environ.pop(hub.MIRROR_ENV, None)


def _ingest(files: list[str], out: Path, hub_uris=None) -> tuple[dict, dict, float]:
    start = time.perf_counter()
    metrics = ingest(CFG, files, out, hub_uris)
    seconds = time.perf_counter() - start
    return metrics, sha256s(out), seconds


@pytest.fixture(scope="module")
def sequential(data, tmp_path_factory):
    return _ingest(data, tmp_path_factory.mktemp("seq"))


def test_sequential_reference_has_rejects_and_straddling_shards(sequential):
    metrics, files, _ = sequential
    assert metrics["rejected"] >= 5 and metrics["shards"] >= 10
    assert "rejects.jsonl" in files and "shards/shard-00000.parquet" in files


def test_process_pool_read_is_byte_identical(data, sequential, tmp_path, on_backend):
    on_backend(ProcessBackend(2))
    metrics, files, seconds = _ingest(data, tmp_path)
    print(f"ingest: sequential {sequential[2]:.2f} s, 2 processes {seconds:.2f} s")
    assert metrics == sequential[0]
    assert files == sequential[1]


def test_reordered_input_changes_the_output(data, sequential, tmp_path, on_backend):
    """The comparison can fail: files read in another order cut and number differently."""
    on_backend(ProcessBackend(2))
    _, files, _ = _ingest(data[::-1], tmp_path)
    assert files != sequential[1]


def test_hub_sources_split_into_files_stream_as_one(hub_sources):
    web = hub.parse_uri(hub_sources[0])
    shards = hub.file_streams(web)
    assert len(shards) == 4
    assert [r for s in shards for r in hub.read_all(s)] == list(hub.stream(web))


@pytest.fixture(scope="module")
def sequential_hub(data, hub_sources, tmp_path_factory):
    return _ingest(data, tmp_path_factory.mktemp("seq_hub"), hub_sources)


def test_hub_read_on_processes_is_byte_identical(
    data, hub_sources, sequential_hub, tmp_path, on_backend
):
    metrics = sequential_hub[0]
    assert metrics["hub_taken"][hub_sources[0]] == 70 and metrics["rejected"] >= 8
    on_backend(ProcessBackend(2))
    metrics, files, seconds = _ingest(data, tmp_path, hub_sources)
    print(f"ingest with Hub: sequential {sequential_hub[2]:.2f} s, 2 processes {seconds:.2f} s")
    assert metrics == sequential_hub[0]
    assert files == sequential_hub[1]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # the scratch is gone


@pytest.mark.slow
def test_ray_read_is_byte_identical(data, hub_sources, sequential, sequential_hub, tmp_path):
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        with RayBackend() as backend, active(backend):
            metrics, files, seconds = _ingest(data, tmp_path / "files")
            with_hub = _ingest(data, tmp_path / "hub", hub_sources)
    finally:
        ray.shutdown()
    print(f"ingest: sequential {sequential[2]:.2f} s, ray {seconds:.2f} s")
    print(f"ingest with Hub: sequential {sequential_hub[2]:.2f} s, ray {with_hub[2]:.2f} s")
    assert metrics == sequential[0]
    assert files == sequential[1]
    assert with_hub[:2] == sequential_hub[:2]
