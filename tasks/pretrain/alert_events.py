"""Alerts as Prefect events, sent by the process that runs the stage's Prefect task.

The trainer's ranks run under torchrun (or Ray, or on another node) and may have no Prefect API;
they only append alert rows to the stage's ``events.jsonl`` (``alerts.py``). The stage's task
follows that file while the trainer runs (:func:`forward_alerts`: a daemon thread polling it every
few seconds, and once more when the trainer has exited) and sends each new alert once:

- as the Prefect event ``llmflow.alert.<kind>`` whose resource is the stage,
  ``llmflow.stage.<run>.<stage>`` (``run``: the flow run's name), labelled with the alert's
  ``kind``, ``step``, ``cause`` and ``message`` (the whole row is the payload);
- as one WARNING line in the task's log (``llmflow alert [K] stage S step N: message``).

Once means once per ``(stage, kind, step)``, over a retry or a resume in another process too: the
keys already sent are appended to ``alerts_emitted.jsonl`` beside ``events.jsonl``. A resumed
trainer truncates ``events.jsonl`` to its checkpoint and writes the same alerts again as it
replays the steps; those keys were sent and stay quiet. The event's id is derived from the same
key, so an alert sent twice anyway (a crash between the event and its key) is one event to the
Prefect server's event store.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from llmflow.tasks.framework import live
from llmflow.tasks.pretrain.alerts import EVENTS, alert_line

EVENT_PREFIX = "llmflow.alert"  # the event of an alert of kind K is "llmflow.alert.K"
RESOURCE_PREFIX = "llmflow.stage"  # the resource of a stage is "llmflow.stage.<run>.<stage>"
EMITTED = "alerts_emitted.jsonl"  # the (stage, kind, step) keys already sent, one a line
POLL_S = 2.0
MAX_LABEL_CHARS = 1000  # a label is one line of a notification, not the alert's details

log = logging.getLogger("llmflow.alert")
Key = tuple[str, str, int]


def alert_key(row: dict[str, Any]) -> Key:
    """What makes an alert the same alert again: its stage, kind and step."""
    return str(row.get("stage") or ""), str(row["kind"]), int(row["step"])


def alert_resource(row: dict[str, Any], run: str) -> dict[str, str]:
    """The event's resource: the stage of the run, labelled with what the alert says."""
    stage, kind, step = alert_key(row)
    return {
        "prefect.resource.id": f"{RESOURCE_PREFIX}.{run}.{stage}",
        "prefect.resource.name": stage,
        "prefect.resource.role": "stage",
        "run": run,
        "stage": stage,
        "kind": kind,
        "step": str(step),
        "cause": str(row.get("cause") or "")[:MAX_LABEL_CHARS],
        "message": str(row.get("message") or "")[:MAX_LABEL_CHARS],
    }


def alert_event_id(out_dir: Path, key: Key) -> uuid.UUID:
    """A stable id for one alert of one stage output: sent twice, it is still one event."""
    stage, kind, step = key
    return uuid.uuid5(
        uuid.NAMESPACE_URL, f"llmflow-alert:{Path(out_dir).resolve()}:{stage}:{kind}:{step}"
    )


def emit_alert(row: dict[str, Any], run: str, out_dir: Path) -> Any:
    """Send one alert row as its Prefect event; the event (None when events are off)."""
    return live.emit(
        f"{EVENT_PREFIX}.{row['kind']}",
        alert_resource(row, run),
        {"alert": row},
        alert_event_id(out_dir, alert_key(row)),
    )


run_name = live.run_name
events_enabled = live.events_enabled


class AlertForwarder:
    """Reads a stage's ``events.jsonl`` and sends each alert row it has not sent yet.

    Args:
        out_dir: The stage's output folder (``events.jsonl`` and ``alerts_emitted.jsonl``).
        run: The run's name in the events' resource.
        emit: Sends one row (``emit_alert``); None sends nothing, the log line still goes out.
    """

    def __init__(
        self,
        out_dir: Path,
        run: str,
        emit: Callable[[dict[str, Any], str, Path], Any] | None = emit_alert,
    ) -> None:
        self.out_dir, self.run, self.emit = Path(out_dir), run, emit
        self.sent: set[Key] = set(_read_keys(self.out_dir / EMITTED))
        self.seen: tuple[int, int] | None = None  # events.jsonl's (size, mtime) at the last read
        self.lock = threading.Lock()

    def poll(self) -> list[dict[str, Any]]:
        """Send the alerts new since the last poll; the rows sent now."""
        with self.lock:
            return self._poll()

    def _poll(self) -> list[dict[str, Any]]:
        path = self.out_dir / EVENTS
        try:
            stat = path.stat()
        except FileNotFoundError:
            return []
        # NOTE: the whole file, read again when it changed: a resumed trainer truncates it in
        # place, so an offset into it would point past its end or into another row.
        if (stat.st_size, stat.st_mtime_ns) == self.seen:
            return []
        self.seen = (stat.st_size, stat.st_mtime_ns)
        sent = []
        for row in _alert_rows(path):
            key = alert_key(row)
            if key in self.sent:
                continue
            self.send(row, key)
            sent.append(row)
        return sent

    def send(self, row: dict[str, Any], key: Key) -> None:
        """The event and the log line of one alert; its key recorded as sent."""
        log.warning(alert_line({**row, "stage": key[0]}))
        if self.emit is not None:
            self.emit(row, self.run, self.out_dir)
        self.sent.add(key)
        with open(self.out_dir / EMITTED, "a") as f:
            f.write(json.dumps({"stage": key[0], "kind": key[1], "step": key[2]}) + "\n")


def _alert_rows(path: Path) -> list[dict[str, Any]]:
    """The complete alert rows of an events file (a line still being written is left)."""
    data = path.read_bytes()
    rows = []
    for line in data[: data.rfind(b"\n") + 1].splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict) and row.get("event") == "alert" and "kind" in row:
                rows.append(row)
    return rows


def _read_keys(path: Path) -> list[Key]:
    if not path.exists():
        return []
    keys = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError):
            row = json.loads(line)
            keys.append((str(row["stage"]), str(row["kind"]), int(row["step"])))
    return keys


@contextlib.contextmanager
def forward_alerts(
    out_dir: Path, run: str | None = None, poll_s: float = POLL_S
) -> Iterator[AlertForwarder]:
    """Follow ``out_dir/events.jsonl`` while the body runs (the trainer); send each new alert.

    A daemon thread polls every ``poll_s`` seconds in a copy of this context, so its events and
    log lines belong to the Prefect task run that called this; a last poll runs when the body
    ends (also by an exception), then the thread stops.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    emit = emit_alert if events_enabled() else None
    forwarder = AlertForwarder(out_dir, run or run_name(), emit)
    stop = threading.Event()

    def follow() -> None:
        while not stop.wait(poll_s):
            _poll_quietly(forwarder)

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(follow,), name="alerts", daemon=True)
    thread.start()
    try:
        yield forwarder
    finally:
        stop.set()
        thread.join(timeout=max(10.0, 2 * poll_s))
        forwarder.seen = None  # NOTE: a row appended within the mtime's granularity
        _poll_quietly(forwarder)


def _poll_quietly(forwarder: AlertForwarder) -> None:
    """A poll whose failure (an unreadable file, an unreachable API) never stops the stage."""
    try:
        forwarder.poll()
    except Exception:  # noqa: BLE001 (alerts are reports; the training goes on)
        log.exception("forwarding alerts from %s failed", forwarder.out_dir)


__all__ = [
    "EMITTED",
    "EVENT_PREFIX",
    "RESOURCE_PREFIX",
    "AlertForwarder",
    "alert_resource",
    "emit_alert",
    "forward_alerts",
    "run_name",
]
