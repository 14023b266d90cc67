"""Finding, from any output, the decontamination of the corpus it was trained on.

Every output's ``lineage.json`` lists its inputs' URIs; walking them upstream from a model
reaches the ``decontaminate`` output its training data came from. A model's hash covers its
inputs' hashes, transitively, so what this walk finds is fixed by the model's own hash.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

from llmflow.tasks.framework.lineage import LINEAGE_FILE
from llmflow.tasks.framework.s3config import filesystem

STEP_NAME = "decontaminate"
REPORT_FILE = "contamination.json"
MAX_OUTPUTS = 500  # a recipe has a few dozen outputs upstream of a model


def read_json(uri: str) -> dict[str, Any] | None:
    try:
        fs, path = filesystem(uri)
        with fs.open(path, "r") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def upstream_records(output: Path | str) -> list[tuple[str, dict[str, Any]]]:
    """``(uri, lineage record)`` of ``output`` and of every output upstream of it, nearest first."""
    start = str(output).rstrip("/")
    queue, seen, found = deque([start]), {start}, []
    while queue and len(seen) <= MAX_OUTPUTS:
        uri = queue.popleft()
        record = read_json(f"{uri}/{LINEAGE_FILE}")
        if record is None:
            continue
        found.append((uri, record))
        for upstream in record.get("inputs", []):
            if upstream["uri"] not in seen:
                seen.add(upstream["uri"])
                queue.append(upstream["uri"])
    return found


def find_upstream(output: Path | str, step: str) -> list[tuple[str, dict[str, Any]]]:
    """``(uri, lineage record)`` of every output of ``step`` upstream of ``output``, nearest first."""
    start = str(output).rstrip("/")
    return [(u, r) for u, r in upstream_records(output) if r.get("step") == step and u != start]


def training_contamination(model: Path | str) -> dict[str, Any] | None:
    """The ``contamination.json`` of the corpus the model was trained on; None if there is no
    decontaminate step in its lineage (a model trained before it existed, a foreign model)."""
    found = find_upstream(model, STEP_NAME)
    if not found:
        return None
    uri, _ = found[0]
    report = read_json(f"{uri}/{REPORT_FILE}")
    if report is not None:
        report["uri"] = uri
    return report


def share_label(counts: dict[str, Any] | None, n: int | None = None) -> str:
    """How a score is marked: '2.5% (3/120 items)', 'not measurable (...)' or 'not checked'."""
    if counts is None:
        return "not checked"
    if counts.get("share") is None:
        words = f"{n} words" if n else "n-gram length"
        return f"not measurable (no item reaches {words})"
    share = 100 * counts["share"]
    return f"{share:.1f}% ({counts['contaminated_items']}/{counts['items']} items)"


def task_marks(report: dict[str, Any] | None, tasks: list[str]) -> dict[str, dict[str, Any]]:
    """Each evaluated task's contamination mark: share, counts and a label for people.

    Held-out perplexity tasks score documents the tokenize step split from this very corpus,
    so they are marked as held out, not as checked. In ``remove`` mode the matching documents
    left the corpus, so the model saw none of the matched items: ``share`` is 0 and
    ``matched_share`` says how many were found and removed.
    """
    marks = {}
    for task in tasks:
        counts = (report or {}).get("tasks", {}).get(task)
        if counts is not None:
            marks[task] = _checked_mark(report, counts)
        elif report is not None and task.startswith("ppl_"):
            marks[task] = {"share": None, "label": "held out (split after decontamination)"}
        else:
            marks[task] = {"share": None, "label": share_label(None)}
    return marks


def _checked_mark(report: dict[str, Any], counts: dict[str, Any]) -> dict[str, Any]:
    """The mark of a task the report checked; in ``remove`` mode its matches count as removed."""
    label = share_label(counts, report.get("n"))
    mark = {**_shares(counts), "label": label}
    if report.get("mode") == "remove" and counts.get("share") is not None:
        mark.update(
            share=0.0,
            matched_share=counts["share"],
            label=f"0% (removed before training: {label} matched)",
        )
    return mark


def _shares(counts: dict[str, Any]) -> dict[str, Any]:
    keys = ("share", "contaminated_items", "items", "indexed_items")
    return {k: counts.get(k) for k in keys}


def corpus_contamination(corpus: Path | str) -> dict[str, Any] | None:
    """The ``contamination.json`` of a corpus given by hand (a ``decontaminate`` output, or an
    output downstream of one): the corpus itself if it holds one, else the nearest upstream."""
    uri = str(corpus).rstrip("/")
    report = read_json(f"{uri}/{REPORT_FILE}")
    if report is not None:
        report["uri"] = uri
        return report
    return training_contamination(uri)


def mark_results(
    results: dict[str, Any], model: Path | str, corpus: Path | str | None = None
) -> dict[str, Any]:
    """``results`` with ``contamination``: per task, the share of its items seen in the
    training corpus of ``model`` (from its lineage), or in ``corpus`` when one is given (a
    model trained elsewhere, checked against a curated output), and where that was measured."""
    report = training_contamination(model) if corpus is None else corpus_contamination(corpus)
    marked = dict(results)
    marked["contamination"] = task_marks(report, sorted(results.get("metrics", {})))
    marked["contamination_source"] = (report or {}).get("uri")
    if report is not None:
        marked["contamination_method"] = {k: report.get(k) for k in ("n", "mode")}
    return marked
