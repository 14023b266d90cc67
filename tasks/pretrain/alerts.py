"""Alerts: what a detector tells the user, as a row in the stage's ``events.jsonl`` and a log line.

Every alert, whatever raised it (the trainer's detectors, the stability guard, the evaluation of
a running stage), is one JSON row appended by rank 0 to the stage's ``events.jsonl``::

    {"event": "alert", "kind": K, "step": N, "stage": S, "message": ..., "cause": ... | null,
     "details": {...}, "time": unix_seconds}

and one WARNING line ``llmflow alert [K] stage S step N: message`` on the ``llmflow.alert``
logger. Readers (``llmflow watch``, the
card, the Prefect events) pick the rows out by ``event == "alert"``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

EVENTS = "events.jsonl"
KINDS = ("throughput", "stall", "spike", "nonfinite", "eval_regression")

log = logging.getLogger("llmflow.alert")


def alert_line(row: dict[str, Any]) -> str:
    """The one log line of an alert row."""
    return (
        f"llmflow alert [{row['kind']}] stage {row['stage']} step {row['step']}: {row['message']}"
    )


def record_alert(
    out_dir: Path,
    kind: str,
    step: int,
    stage: str,
    message: str,
    cause: str | None = None,
    details: dict[str, Any] | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Append an alert row to ``out_dir/events.jsonl``, log it at WARNING; return the row.

    Call it on one rank only (rank 0). ``extra`` holds top-level fields an existing event row
    already had (the stability guard's ``policy``, ``loss``, ...): they stay beside the alert's
    fields so older readers of that row keep working; the alert's own fields win.

    Raises:
        ValueError: ``kind`` is not one of ``KINDS``.
    """
    if kind not in KINDS:
        raise ValueError(f"alert kind must be one of {KINDS}, got {kind!r}")
    row = {
        **(extra or {}),
        "event": "alert",
        "kind": kind,
        "step": int(step),
        "stage": str(stage),
        "message": message,
        "cause": cause,
        "details": details or {},
        "time": time.time(),
    }
    path = Path(out_dir) / EVENTS
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=_plain) + "\n")
    # NOTE: with no handler configured (the trainer's process) logging's last resort writes
    # WARNING lines to stderr, which the launcher captures.
    log.warning(alert_line(row))
    return row


def read_alerts(out_dir: Path) -> list[dict[str, Any]]:
    """The alert rows of a stage's ``events.jsonl`` (none when it has none)."""
    path = Path(out_dir) / EVENTS
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("event") == "alert"]


def _plain(value: Any) -> Any:
    """JSON for numpy / torch scalars a detail may hold."""
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)
