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

import fsspec

from llmflow.tasks.framework.lineage import LINEAGE_FILE

STEP_NAME = "decontaminate"
REPORT_FILE = "contamination.json"
MAX_OUTPUTS = 500  # a recipe has a few dozen outputs upstream of a model


def _read_json(uri: str) -> dict[str, Any] | None:
    try:
        with fsspec.open(uri, "r") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def find_upstream(output: Path | str, step: str) -> list[tuple[str, dict[str, Any]]]:
    """``(uri, lineage record)`` of every output of ``step`` upstream of ``output``, nearest first."""
    start = str(output).rstrip("/")
    queue, seen, found = deque([start]), {start}, []
    while queue and len(seen) <= MAX_OUTPUTS:
        uri = queue.popleft()
        record = _read_json(f"{uri}/{LINEAGE_FILE}")
        if record is None:
            continue
        if record.get("step") == step and uri != start:
            found.append((uri, record))
        for upstream in record.get("inputs", []):
            if upstream["uri"] not in seen:
                seen.add(upstream["uri"])
                queue.append(upstream["uri"])
    return found


def training_contamination(model: Path | str) -> dict[str, Any] | None:
    """The ``contamination.json`` of the corpus the model was trained on; None if there is no
    decontaminate step in its lineage (a model trained before it existed, a foreign model)."""
    found = find_upstream(model, STEP_NAME)
    if not found:
        return None
    uri, _ = found[0]
    report = _read_json(f"{uri}/{REPORT_FILE}")
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
