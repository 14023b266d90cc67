"""The go/no-go table: what preflight is asked to run (:class:`PreflightOptions`), its rows
(:class:`Check`) and the report that holds them with the numbers behind them (:class:`Report`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from llmflow.tasks.command_config import PreflightOptions
from llmflow.tasks.framework.errors import BadInputError

__all__ = ["Check", "PreflightOptions", "Report"]

logger = logging.getLogger("llmflow.preflight")
"""Preflight's progress lines: each check as it starts and ends, each rehearsal step."""


@dataclass
class Check:
    """One row of the go/no-go table."""

    check: str
    go: bool
    detail: str
    seconds: float = 0.0


@dataclass
class Report:
    """Everything preflight found: the table's rows and the numbers behind them."""

    recipe: str
    checks: list[Check] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def go(self) -> bool:
        return all(c.go for c in self.checks)

    def rows(self) -> list[dict[str, Any]]:
        return [asdict(c) | {"go": "go" if c.go else "NO-GO"} for c in self.checks]

    def table(self) -> str:
        """The go/no-go table as text."""
        width = max(len(c.check) for c in self.checks)
        lines = [f"{'check':<{width}}  result  seconds  detail"]
        for c in self.checks:
            mark = "go" if c.go else "NO-GO"
            lines.append(f"{c.check:<{width}}  {mark:<6}  {c.seconds:7.1f}  {c.detail}")
        verdict = "GO" if self.go else "NO-GO"
        lines.append(
            f"{self.recipe}: {verdict} ({sum(c.go for c in self.checks)}/{len(self.checks)} checks pass)"
        )
        return "\n".join(lines)


@contextlib.contextmanager
def timed(report: Report, name: str) -> Iterator[dict]:
    """Run a check; its body fills ``row["go"]`` and ``row["detail"]``; a BadInputError is a no-go
    naming the problem."""
    row: dict[str, Any] = {"go": True, "detail": ""}
    logger.info("preflight: %s ...", name)
    started = time.perf_counter()
    try:
        yield row
    except BadInputError as err:
        row.update(go=False, detail=" ".join(line.strip() for line in str(err).splitlines()))
    check = Check(name, bool(row["go"]), row["detail"], time.perf_counter() - started)
    report.checks.append(check)
    logger.info("preflight: %s: %s (%.1f s)", name, "go" if check.go else "NO-GO", check.seconds)
