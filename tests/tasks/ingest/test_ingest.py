"""Ingest: formats, rejects with reasons, counts that add up, stable ids; the sample corpus."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.ingest.ingest import IngestConfig, ingest, list_files
from llmflow.tasks.ingest.sample import SampleConfig, make_sample


def read_docs(out_dir):
    return pa.concat_tables(
        [pq.read_table(p) for p in sorted((out_dir / "shards").glob("*.parquet"))]
    ).to_pylist()


def test_rejects_every_malformed_line_with_reason_and_counts_add_up(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    lines = [
        json.dumps({"text": "good one", "domain": "prose"}).encode(),
        b"{not json",
        json.dumps({"txt": "missing field"}).encode(),
        json.dumps({"text": 42}).encode(),
        json.dumps({"text": "   "}).encode(),
        json.dumps({"text": "x" * 500}).encode(),
        b'{"text": "bad \xff utf8"}',
        json.dumps({"text": "nul\x00byte"}).encode(),
        json.dumps({"text": "second good", "id": "a"}).encode(),
        json.dumps({"text": "dup id", "id": "a"}).encode(),
        json.dumps([1, 2]).encode(),
    ]
    (raw / "data.jsonl").write_bytes(b"\n".join(lines) + b"\n\n")
    out = tmp_path / "out"
    metrics = ingest(IngestConfig(max_chars=100), list_files([str(raw)]), out)
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert metrics["records"] == len(lines)
    assert metrics["documents"] + metrics["rejected"] == len(lines)
    assert metrics["documents"] == 2 and len(rejects) == 9
    reasons = " | ".join(r["reason"] for r in rejects)
    for expected in (
        "malformed JSON",
        "missing field",
        "not a string",
        "empty",
        "oversized",
        "invalid UTF-8",
        "binary",
        "duplicate id",
        "not an object",
    ):
        assert expected in reasons, expected
    assert sorted(r["record"] for r in rejects) == [1, 2, 3, 4, 5, 6, 7, 9, 10]
    docs = read_docs(out)
    assert [d["text"] for d in docs] == ["good one", "second good"]
    assert docs[0]["domain"] == "prose" and docs[1]["domain"] == "web" and docs[1]["id"] == "a"


def test_reads_parquet_and_text_with_domain_map_and_stable_ids(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(pa.table({"text": ["p1", "p2"], "domain": ["code", None]}), raw / "a.parquet")
    (raw / "book.txt").write_text("first para\n\n\nsecond para\n")
    cfg = IngestConfig(domain_map={"book": "books"})
    ingest(cfg, list_files([str(raw)]), tmp_path / "o1")
    ingest(cfg, list_files([str(raw)]), tmp_path / "o2")
    docs = read_docs(tmp_path / "o1")
    assert [(d["text"].strip(), d["domain"]) for d in docs] == [
        ("p1", "code"),
        ("p2", "web"),
        ("first para", "books"),
        ("second para", "books"),
    ]
    assert [d["id"] for d in docs] == [d["id"] for d in read_docs(tmp_path / "o2")]
    assert len({d["id"] for d in docs}) == 4


def test_no_usable_documents_is_a_clear_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(BadInputError, match="no usable documents"):
        ingest(IngestConfig(), [str(tmp_path / "empty.jsonl")], tmp_path / "out")
    with pytest.raises(BadInputError, match="does not exist"):
        list_files([str(tmp_path / "nope")])


def test_sample_is_deterministic_and_plants_what_the_manifest_says(tmp_path):
    cfg = SampleConfig(
        num_code_files=5,
        num_math_docs=20,
        num_exact_duplicates=5,
        num_near_duplicates=5,
        num_junk=3,
    )
    make_sample(cfg, tmp_path / "a")
    make_sample(cfg, tmp_path / "b")
    for f in sorted((tmp_path / "a").iterdir()):
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes()
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    records = {}
    for f in sorted((tmp_path / "a").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            records[r["id"]] = r
    assert {r["domain"] for r in records.values()} == {"prose", "code", "math"}
    kinds = [m["kind"] for m in manifest.values()]
    assert (
        kinds.count("exact_copy") == 5
        and kinds.count("near_copy") == 5
        and kinds.count("junk") == 3
    )
    for doc_id, m in manifest.items():
        if m["kind"] == "exact_copy":
            assert records[doc_id]["text"] == records[m["of"]]["text"]
        if m["kind"] == "near_copy":
            a, b = records[doc_id]["text"].split(" "), records[m["of"]]["text"].split(" ")
            assert len(a) == len(b) and 1 <= sum(x != y for x, y in zip(a, b, strict=False)) <= 3
