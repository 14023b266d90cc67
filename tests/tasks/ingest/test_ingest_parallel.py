"""ingest reading its files on workers (a spawned process pool, Ray tasks) against this process.

The reference is the sequential read (``LLMFLOW_DATA_WORKERS`` unset, Ray not connected): the
shards, rejects and report must have the same sha256 on the parallel paths, on a multi-file
--data input (the quickstart sample's JSONL plus Parquet, a JSON array, plain text, malformed
lines and ids duplicated across files), cut into shards that straddle files.
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

from llmflow.tasks.dataprep.tokenize import WORKERS_ENV
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


def _ingest(files: list[str], out: Path) -> tuple[dict, dict, float]:
    start = time.perf_counter()
    metrics = ingest(CFG, files, out)
    seconds = time.perf_counter() - start
    return metrics, sha256s(out), seconds


@pytest.fixture(scope="module")
def sequential(data, tmp_path_factory):
    os.environ.pop(WORKERS_ENV, None)
    return _ingest(data, tmp_path_factory.mktemp("seq"))


def test_sequential_reference_has_rejects_and_straddling_shards(sequential):
    metrics, files, _ = sequential
    assert metrics["rejected"] >= 5 and metrics["shards"] >= 10
    assert "rejects.jsonl" in files and "shards/shard-00000.parquet" in files


def test_process_pool_read_is_byte_identical(data, sequential, tmp_path, monkeypatch):
    monkeypatch.setenv(WORKERS_ENV, "2")
    metrics, files, seconds = _ingest(data, tmp_path)
    print(f"ingest: sequential {sequential[2]:.2f} s, 2 processes {seconds:.2f} s")
    assert metrics == sequential[0]
    assert files == sequential[1]


def test_reordered_input_changes_the_output(data, sequential, tmp_path, monkeypatch):
    """The comparison can fail: files read in another order cut and number differently."""
    monkeypatch.setenv(WORKERS_ENV, "2")
    _, files, _ = _ingest(data[::-1], tmp_path)
    assert files != sequential[1]


@pytest.mark.slow
def test_ray_read_is_byte_identical(data, sequential, tmp_path):
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        metrics, files, seconds = _ingest(data, tmp_path)
    finally:
        ray.shutdown()
    print(f"ingest: sequential {sequential[2]:.2f} s, ray {seconds:.2f} s")
    assert metrics == sequential[0]
    assert files == sequential[1]
