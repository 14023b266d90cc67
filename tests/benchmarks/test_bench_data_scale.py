"""bench_data_scale: the corpus it builds (size, shards, planted copies) and a quick run whose
task-run counts follow from the curate graph: one per stage, on threads and on processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from benchmarks.bench_data_scale import ScaleCorpus, build_corpus, detokenize
from tests.needs import shared_path

REPO = Path(__file__).resolve().parents[2]


def test_detokenize_turns_wikitext_tokens_back_into_prose():
    line = 'The <unk> half @-@ time riff , sampled in 1 @,@ 988 ( live ) , isn \'t " it " .'
    assert detokenize(line) == 'The half-time riff, sampled in 1,988 (live), isn\'t " it ".'


def test_corpus_has_its_size_its_shards_and_the_planted_copies(tmp_path):
    text_dir = shared_path("text")
    cfg = ScaleCorpus(text_dir=str(text_dir), gb=0.0004, num_shards=7, seed=3)
    uri, counts = build_corpus(tmp_path / "store", cfg)
    shards = sorted(Path(uri, "shards").glob("*.parquet"))
    assert len(shards) == 7
    rows = [r for s in shards for r in pq.read_table(s).to_pylist()]
    assert len(rows) == counts["documents"] and len({r["id"] for r in rows}) == len(rows)
    size = sum(len(r["text"].encode()) for r in rows)
    assert size == counts["bytes"] and 0.0004e9 <= size < 0.0004e9 + 20_000
    originals = {r["text"] for r in rows if r["id"].startswith("doc-")}
    exact = [r for r in rows if r["id"].startswith("exact-")]
    near = [r for r in rows if r["id"].startswith("near-")]
    assert len(exact) == counts["exact_copies"] > 0 and len(near) == counts["near_copies"] > 0
    assert all(r["text"] in originals for r in exact)
    for r in near:  # 1-3 words replaced in one original of the same length in words
        words = r["text"].split(" ")
        diffs = [
            sum(a != b for a, b in zip(words, o.split(" "), strict=True))
            for o in originals
            if len(o.split(" ")) == len(words)
        ]
        assert diffs and min(diffs) <= 3


@pytest.mark.slow
def test_quick_run_counts_one_task_run_per_stage_on_threads_and_processes(tmp_path):
    text_dir = shared_path("text")
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_data_scale.py"), "--quick",
         "--text-dir", str(text_dir), "--ways", "stage", "processes",
         "--results", str(tmp_path / "results.jsonl")],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["bench"] for r in records] == ["data_scale", "data_scale.processes_vs_stage"]
    head = records[0]
    shards, ways = head["scale"]["shards"], head["ways"]
    # the curate graph: 4 mapped stages (normalize, filter, exact hashes, MinHash) and 4 global
    assert ways["stage"]["prefect_task_runs"] == ways["processes"]["prefect_task_runs"] == 8
    assert shards == 8 and head["same_kept_ours"]
    assert ways["processes"]["kept_digest"] == ways["stage"]["kept_digest"]
    assert 0 < ways["stage"]["kept"] <= head["scale"]["documents"]
    assert records[1]["ratio"] == pytest.approx(
        ways["stage"]["wall_s"] / ways["processes"]["wall_s"], abs=1e-3
    )
    assert head["quick"] and len(head["load_start"]) == 3 and len(head["load_avg"]) == 3
