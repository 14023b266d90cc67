"""The go/no-go table: what preflight is asked to run (:class:`PreflightOptions`), its rows
(:class:`Check`) and the report that holds them with the numbers behind them (:class:`Report`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.framework.errors import BadInputError

logger = logging.getLogger("llmflow.preflight")
"""Preflight's progress lines: each check as it starts and ends, each rehearsal step."""


class PreflightOptions(BaseModel):
    """How much of the checklist to run here, and at what size."""

    model_config = ConfigDict(extra="forbid")

    processes: int = Field(2, ge=1, description="Ranks of the test steps (FSDP2 when > 1).")
    seq_len: int | None = Field(
        None, gt=1, description="Sequence length of the test steps (None: the recipe's)."
    )
    micro_batch_size: int | None = Field(
        None, gt=0, description="Sequences per rank per step (None: the recipe's)."
    )
    steps: int = Field(
        4, ge=2, description="Optimizer steps; the resume starts after half of them."
    )
    docs_per_source: int = Field(2, ge=1, description="Documents read from each data source.")
    check_data: bool = Field(True, description="Open every data source and read documents.")
    train: bool = Field(True, description="Run the test steps (False: plan and meta build only).")
    timeout_s: float = Field(1800, gt=0, description="Deadline of each trainer launch.")
    layouts: Literal["plan", "all", "none"] = Field(
        "plan",
        description="Parallel layouts rehearsed at a tiny width against data parallelism alone: "
        "those `llmflow plan` gives the recipe's stages (plan), each of TP, CP and PP (all), or "
        "none. Runs with the test steps.",
    )
    host_memory_gb: float | None = Field(
        None,
        gt=0,
        description="Memory per rank the test steps are scaled to (None: this host's available "
        "memory shared by the ranks, or a GPU's free memory).",
    )


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
