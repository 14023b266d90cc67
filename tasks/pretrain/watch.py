"""``llmflow watch ROOT``: the training stages under a store root, live in the terminal.

A stage being trained lives in its step's partial folder, ``{root}/{step}/.partial/{name}-{hash}``
(the trainer's run folder), until the store commits it to ``{root}/{step}/{name}-{hash}``. Any
such folder with a ``metrics.jsonl`` is a stage. Its status:

- ``running``: a process holds the partial folder's lock (``{name}-{hash}.lock``, held for the
  whole step by the store's ``workdir``);
- ``failed`` / ``stopped``: a partial folder nobody holds, with or without a rank's failure report
  (a retry or a re-run resumes it);
- ``done``: committed.

Running stages are always shown; the others while their last row is younger than ``recent_s``.
Per stage: step / its last step, loss, held-out loss, tokens/s, data share, MFU, the time to go
at the recent pace, and its last alerts (``events.jsonl`` rows with ``"event": "alert"``).
Everything is read from the files, so it works beside any launcher, from any shell on the host.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.store import COMMIT_MARKER, PARTIAL_DIR
from llmflow.tasks.pretrain.notices import CONFIG_FILE, RANKS, SUMMARY
from llmflow.tasks.pretrain.stage_report import METRICS, alerts

TAIL_BYTES = 256 * 1024  # metrics.jsonl can grow to many MB: only its tail is read
ALERTS_SHOWN = 3


@dataclass
class StageView:
    """What ``watch`` shows of one stage."""

    step_name: str
    label: str
    digest: str
    path: Path
    status: str
    updated: float
    last: dict[str, Any] = field(default_factory=dict)
    val_loss: float | None = None
    step: int | None = None
    total: int | None = None
    eta_s: float | None = None
    alerts: list[dict[str, Any]] = field(default_factory=list)


def _local_root(root: str | os.PathLike) -> Path:
    """The store root as a local folder; an S3 root or a missing folder is a BadInputError."""
    root_path = Path(root).expanduser()
    if "://" in str(root):
        raise BadInputError(
            f"watch reads a local store root, not {root}: a stage trains in a local working "
            "folder (LLMFLOW_CACHE/partial/...) whatever its root; watch the host that trains it"
        )
    if not root_path.is_dir():
        raise BadInputError(f"watch: store root {root} is not a folder")
    return root_path


def find_stages(root: str | os.PathLike, recent_s: float = 3600.0) -> list[StageView]:
    """The stages under a local store root: running ones first, then the latest finished."""
    root_path = _local_root(root)
    now = time.time()
    stages = []
    for step_dir in sorted(p for p in root_path.iterdir() if p.is_dir()):
        candidates = [(p, False) for p in step_dir.iterdir() if not p.name.startswith(".")]
        partial = step_dir / PARTIAL_DIR
        if partial.is_dir():
            candidates += [(p, True) for p in partial.iterdir()]
        for folder, in_progress in candidates:
            if not (folder / METRICS).is_file():
                continue
            view = read_stage(step_dir.name, folder, in_progress)
            if view.status == "running" or now - view.updated <= recent_s:
                stages.append(view)
    order = {"running": 0, "failed": 1, "stopped": 1, "done": 2}
    return sorted(stages, key=lambda s: (order[s.status], -s.updated))


def read_stage(step_name: str, folder: Path, in_progress: bool) -> StageView:
    """One stage's latest numbers, read from its run folder."""
    label, _, digest = folder.name.rpartition("-")
    rows = tail_rows(folder / METRICS)
    updated = (folder / METRICS).stat().st_mtime
    status = _status(folder, in_progress)
    view = StageView(step_name, label, digest, folder, status, updated, rows[-1] if rows else {})
    view.step = view.last.get("step")
    view.val_loss = next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None)
    view.total = _last_step(folder)
    view.eta_s = _eta(rows, view.total) if status == "running" else None
    view.alerts = alerts(folder)[-ALERTS_SHOWN:]
    return view


def tail_rows(path: Path, tail_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The complete rows in the last ``tail_bytes`` of a JSON-lines file."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - tail_bytes))
        data = f.read()
    lines = data.split(b"\n")
    if size > tail_bytes:
        lines = lines[1:]  # the first line is cut
    rows = []
    for line in lines:
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _status(folder: Path, in_progress: bool) -> str:
    if not in_progress:
        return "done" if (folder / COMMIT_MARKER).exists() else "stopped"
    lock = folder.with_name(folder.name + ".lock")
    if lock.exists() and _held(lock):
        return "running"
    return "failed" if (folder / "failures").is_dir() else "stopped"


def _held(lock: Path) -> bool:
    """Whether another process holds ``lock`` (the store's workdir lock, an exclusive flock).

    A shared lock taken and dropped at once: a writer that wants it waits microseconds.
    """
    try:
        with open(lock) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
    except OSError:
        return False


def _last_step(folder: Path) -> int | None:
    """The step the stage stops at: from its summary once trained, else from its newest
    checkpoint's trainer state, else its first step plus the configured steps."""
    summary = _json(folder / SUMMARY)
    if summary and "steps" in summary:
        return summary["steps"]
    states = sorted(folder.glob("checkpoints/*/trainer_state.json"), key=_mtime)
    for path in reversed(states):
        state = _json(path)
        if state and state.get("end_step"):
            return state["end_step"]
    config = _json(folder / CONFIG_FILE) or {}
    rank0 = _json(folder / RANKS / "rank-00000.json") or {}
    # NOTE: before the first checkpoint, rank 0's info names the step this process started at,
    # which is the stage's first step (a resume always has a checkpoint to read above).
    if config.get("max_steps") and "step" in rank0:
        return rank0["step"] + config["max_steps"]
    return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _eta(rows: list[dict[str, Any]], total: int | None, window: int = 10) -> float | None:
    """Seconds to the last step at the pace of the last ``window`` rows (validations and
    checkpoints included: the pace the stage really keeps)."""
    timed = [r for r in rows if isinstance(r.get("time"), (int, float)) and "step" in r]
    if total is None or len(timed) < 2:
        return None
    first, last = timed[-min(window, len(timed))], timed[-1]
    steps = last["step"] - first["step"]
    if steps <= 0:
        return None
    return max(0, total - last["step"]) * (last["time"] - first["time"]) / steps


# ------------------------------------------------------------------------------- rendering
COLUMNS = (
    ("stage", 26),
    ("status", 7),
    ("step", 13),
    ("loss", 7),
    ("val_loss", 8),
    ("tok/s", 9),
    ("data", 4),
    ("mfu", 5),
    ("eta", 6),
    ("updated", 9),
)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d"


def _num(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def stage_cells(view: StageView, now: float) -> list[str]:
    last = view.last
    step = "-" if view.step is None else str(view.step)
    if view.total is not None:
        step += f"/{view.total}"
    return [
        f"{view.label} {view.digest[:6]}",
        view.status,
        step,
        _num(last.get("loss"), ".4f"),
        _num(view.val_loss, ".4f"),
        _num(last.get("tokens_per_s"), ",.0f"),
        _num(last.get("data_share"), ".0%"),
        _num(last.get("mfu"), ".1%"),
        _duration(view.eta_s),
        _duration(max(0.0, now - view.updated)) + " ago",
    ]


def alert_line(alert: dict[str, Any]) -> str:
    cause = f" (cause: {alert['cause']})" if alert.get("cause") else ""
    return (
        f"    alert [{alert.get('kind')}] step {alert.get('step')}: {alert.get('message')}{cause}"
    )


def frame_lines(
    root: str, stages: list[StageView], now: float, interval: float | None = None
) -> list[tuple[str, str]]:
    """One frame as (text, style) lines: a header, a row per stage, its alerts under it."""
    clock = datetime.fromtimestamp(now).strftime("%H:%M:%S")
    every = f", every {interval:g} s, Ctrl-C to stop" if interval else ""
    lines = [(f"llmflow watch {root}  {clock}{every}", "bold")]
    if not stages:
        return [*lines, ("no running or recent training stage under this root", "dim")]
    header = "  ".join(f"{name:<{width}}" for name, width in COLUMNS).rstrip()
    lines.append((header, "bold"))
    for view in stages:
        cells = stage_cells(view, now)
        text = "  ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, COLUMNS, strict=True)).rstrip()
        style = {"running": "green", "failed": "red", "stopped": "yellow"}.get(view.status, "")
        lines.append((text, style))
        lines += [(alert_line(a), "red") for a in view.alerts]
    return lines


def frame_text(root: str, recent_s: float = 3600.0, interval: float | None = None) -> str:
    stages = find_stages(root, recent_s)
    return "\n".join(text for text, _ in frame_lines(str(root), stages, time.time(), interval))


def watch(
    root: str,
    interval: float = 2.0,
    once: bool = False,
    recent_s: float = 3600.0,
    out: TextIO | None = None,
) -> int:
    """Show the frame once, or redraw it in place every ``interval`` seconds until Ctrl-C."""
    out = out or sys.stdout
    if once:
        print(frame_text(root, recent_s), file=out, flush=True)
        return 0
    try:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text
    except ImportError:  # NOTE: rich comes with prefect; a plain redraw without it
        return _plain_loop(root, interval, recent_s, out)

    def render() -> Text:
        stages = find_stages(root, recent_s)
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, (line, style) in enumerate(frame_lines(root, stages, time.time(), interval)):
            text.append(("\n" if i else "") + line, style=style or None)
        return text

    # NOTE: rich reads the environment it saw at import (Console._environ); read it now, so
    # FORCE_COLOR and COLUMNS set since (a test, a wrapper) are honoured
    columns = os.environ.get("COLUMNS", "")
    console = Console(
        file=out,
        force_terminal=True if os.environ.get("FORCE_COLOR") else None,
        width=int(columns) if columns.isdigit() else None,
    )
    try:
        with Live(render(), console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(render(), refresh=True)
    except KeyboardInterrupt:
        return 0


def _plain_loop(root: str, interval: float, recent_s: float, out: TextIO) -> int:
    try:
        while True:
            out.write("\x1b[H\x1b[2J" + frame_text(root, recent_s, interval) + "\n")
            out.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
