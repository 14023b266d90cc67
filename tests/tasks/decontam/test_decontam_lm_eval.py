"""Decontamination of eval sets defined by lm-eval's own task YAMLs (ARC-Easy, PIQA, HellaSwag,
GSM8K, MMLU astronomy, a custom templated task), through the ``decontaminate`` step as a user
configures it (``custom_tasks``), on items planted verbatim and edited in a corpus of real
prose with near misses. Goals: >= 99% of items of >= 13 words found verbatim, >= 95% edited,
no clean document flagged."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmflow.tasks.decontam.config import DecontamConfig
from llmflow.tasks.decontam.step import MATCHES_FILE, decontaminate
from tests.needs import shared_path
from tests.tasks.decontam.lm_eval_sets import corpus, recall_table, write_tasks

N = 13


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_decontam")
    planted = write_tasks(shared_path("eval"), root / "tasks")
    docs = corpus(planted, shared_path("text"))
    (root / "corpus" / "shards" / "prose").mkdir(parents=True)
    table = pa.Table.from_pylist(docs)
    pq.write_table(table, root / "corpus" / "shards" / "prose" / "part-00000.parquet")
    cfg = DecontamConfig(tasks=["cf_arith"], custom_tasks=[str(root / "tasks")], mode="flag")
    (root / "out").mkdir()
    decontaminate(cfg, corpus=root / "corpus", out=root / "out")
    matches = pq.read_table(root / "out" / MATCHES_FILE).to_pylist()
    report = json.loads((root / "out" / "contamination.json").read_text())
    return planted, docs, matches, report


def test_items_of_lm_eval_task_yamls_are_found_verbatim_and_edited(planted_run):
    planted, _, matches, report = planted_run
    rows, _ = recall_table(planted, matches, {m["doc_id"] for m in matches}, N)
    assert {r["task"] for r in rows} == {
        "arc_easy_local", "hellaswag_local", "piqa_local_yaml", "gsm8k_local_yaml",
        "mmlu_astronomy_local", "templated_qa",
    }  # fmt: skip
    for row in rows:
        assert row["long"] >= 20, row  # enough items of >= 13 words to measure
        assert row["exact"] / row["long"] >= 0.99, row
        assert row["edited"] / row["long"] >= 0.95, row
    long = sum(r["long"] for r in rows)
    assert sum(r["exact"] for r in rows) / long >= 0.99
    for task in report["tasks"].values():  # every item is indexed or counted with a reason
        assert task["indexed_items"] + task["unindexed_items"] == task["items"]


def test_no_clean_document_or_near_miss_is_flagged(planted_run):
    planted, docs, matches, _ = planted_run
    _, clean_flagged = recall_table(planted, matches, {m["doc_id"] for m in matches}, N)
    assert sum(d["id"].startswith("clean-") for d in docs) >= 400
    assert sum(d["id"].startswith(("near-", "stem-")) for d in docs) >= 600
    assert clean_flagged == []
