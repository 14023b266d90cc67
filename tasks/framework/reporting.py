"""What a running step publishes with its output: tables and markdown reports (Prefect artifacts
under the executor) and checkpoint notices (the store mirrors a resumable working directory).
The step being run is a context variable the store sets around the function."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Running:
    """The step being run here: where its reports and checkpoint notices go."""

    step: str
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    on_checkpoint: Callable[[], None] = lambda: None


_CURRENT: contextvars.ContextVar[_Running | None] = contextvars.ContextVar("step", default=None)


def report_table(key: str, rows: list[dict[str, Any]], description: str = "") -> None:
    """Publish a table with the step's output (a Prefect table artifact under the executor)."""
    running = _CURRENT.get()
    if running is not None:
        running.artifacts.append(
            {"kind": "table", "key": key, "rows": rows, "description": description}
        )


def report_markdown(key: str, markdown: str, description: str = "") -> None:
    """Publish a markdown report with the step's output."""
    running = _CURRENT.get()
    if running is not None:
        running.artifacts.append(
            {"kind": "markdown", "key": key, "markdown": markdown, "description": description}
        )


def checkpoint_saved() -> None:
    """Tell the store a resumable checkpoint is in the working directory (mirrored on S3)."""
    running = _CURRENT.get()
    if running is not None:
        running.on_checkpoint()


@contextmanager
def _running(running: _Running) -> Iterator[_Running]:
    token = _CURRENT.set(running)
    try:
        yield running
    finally:
        _CURRENT.reset(token)
