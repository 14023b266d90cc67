"""A filter or normalization that raises on documents: a few are counted with their reason, many
stop the step naming the place that raised, and nothing that looks complete is written."""

from __future__ import annotations

import json
import random

import pytest

from llmflow.tasks.curation import heuristics, normalize
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.store import Store
from tests.tasks.curation.helpers import curation_graph, prose

MARK = "zzbug"


def records(num: int, marked: int) -> list[dict]:
    rng = random.Random(0)
    return [
        {"id": f"d{i}", "text": prose(rng, 12) + (f" {MARK}" if i < marked else ""),
         "domain": "prose", "source": "t"}
        for i in range(num)
    ]  # fmt: skip


@pytest.fixture
def buggy_quality_filter(monkeypatch):
    """gopher_quality raises on the marked documents, as a buggy filter would."""
    real = heuristics.gopher_quality_filter

    def buggy(cfg, doc):
        if MARK in doc.text:
            raise ZeroDivisionError("division by zero")
        return real(cfg, doc)

    monkeypatch.setattr(heuristics, "gopher_quality_filter", buggy)


def test_a_document_a_filter_raises_on_is_removed_with_the_filter_named(
    tmp_path, buggy_quality_filter
):
    graph, _ = curation_graph(records(100, marked=1), num_shards=1)
    Executor(str(tmp_path)).run(graph)
    (uri,) = Store(str(tmp_path)).list_outputs("curate-filter")  # the stage output
    (folder,) = Store(str(tmp_path)).local_path(uri).glob("shards/*")  # its one shard
    (stats,) = [json.loads(p.read_text()) for p in folder.glob("*.stats.json")]
    assert stats["domains"]["prose"]["removed:gopher_quality:error:ZeroDivisionError"]["docs"] == 1
    removed = [json.loads(line) for p in folder.glob("*.removed.jsonl") for line in p.open()]
    assert {"id": "d0", "filter": "gopher_quality"}.items() <= removed[0].items()


def test_a_filter_raising_on_many_documents_stops_the_step_naming_it(
    tmp_path, buggy_quality_filter
):
    graph, _ = curation_graph(records(100, marked=100), num_shards=1)
    with pytest.raises(BadInputError, match=r"100 of 100 documents.*gopher_quality raised on 100"):
        Executor(str(tmp_path)).run(graph)
    assert not Store(str(tmp_path)).list_outputs("curate-filter")  # nothing looks complete


def test_normalization_raising_on_many_documents_stops_the_step(tmp_path, monkeypatch):
    def buggy(cfg, raw, domain):
        raise KeyError("unicode table")

    monkeypatch.setattr(normalize, "normalize_text", buggy)
    graph, _ = curation_graph(records(40, marked=0), num_shards=1)
    with pytest.raises(BadInputError, match=r"curate-normalize: 40 of 40.*normalization"):
        Executor(str(tmp_path)).run(graph)
    assert not Store(str(tmp_path)).list_outputs("curate-normalize")
