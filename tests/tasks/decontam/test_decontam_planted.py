"""Planted contamination: PIQA, GSM8K and WikiText items copied into a corpus, exact and edited,
with clean near misses; recall and false positives printed and checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmflow.tasks.decontam.ngrams import build_index, scan_texts
from tests.tasks.decontam.planted_corpus import planted_corpus, reference_flags

N = 13


@pytest.fixture(scope="module")
def planted(shared_data: Path):
    docs, sets = planted_corpus(shared_data / "eval", shared_data / "text", n=N)
    items = [item for task_items in sets.values() for item in task_items]
    return docs, items


def flagged_ids(docs: list[dict], items) -> dict[str, set[tuple[str, int]]]:
    index = build_index(items, N)
    found: dict[str, set[tuple[str, int]]] = {}
    for start in range(0, len(docs), 256):
        batch = docs[start : start + 256]
        for hit in scan_texts(index, [d["text"] for d in batch]):
            owners = index.owners[hit.owner_slice[0] : hit.owner_slice[1]].tolist()
            found.setdefault(batch[hit.row]["id"], set()).update(index.items[o] for o in owners)
    return found


def test_planted_items_found_and_clean_documents_kept(planted):
    docs, items = planted
    found = flagged_ids(docs, items)
    planted_ids = [d["id"] for d in docs if d["id"].startswith(("exact-", "edited-"))]
    clean_ids = [d["id"] for d in docs if d["id"].startswith(("clean-", "near-"))]
    recall = sum(i in found for i in planted_ids) / len(planted_ids)
    false_positives = sorted(i for i in clean_ids if i in found)
    print(
        f"\nplanted {len(planted_ids)}, found {recall:.2%}; clean {len(clean_ids)} "
        f"(near misses {sum(i.startswith('near-') for i in clean_ids)}), "
        f"false positives {len(false_positives)}"
    )
    assert recall >= 0.99
    assert false_positives == []
    for doc_id in planted_ids:  # each planted copy is attributed to its own item
        _, task, item = doc_id.split("-", 2)
        assert (task, int(item)) in found.get(doc_id, set()), doc_id


def test_matches_the_plain_reference_exactly(planted):
    """The hashed, batched numpy scan flags exactly what Python sets of word tuples flag."""
    docs, items = planted
    assert set(flagged_ids(docs, items)) == reference_flags(docs, items, N)
