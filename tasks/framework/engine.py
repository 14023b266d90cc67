"""A mapped stage's shards on the run's `Backend` (threads, processes or Ray), a bounded number at once.

A mapped stage (``curate-normalize`` over 2,000 shards) is one Prefect task; inside it the
engine runs the step once per shard, through the store exactly as the local path does
(``Step.run_shard``: the same function, each shard committed on its own under the stage output,
``{stage}/shards/{label}/``, with its own ``_COMMITTED`` marker holding its lineage row). A shard
already committed is skipped, so a re-run of the stage (a Prefect retry, or a re-run after a
killed worker) redoes only the shards without a marker. After the first failing shard no new
shard starts; those in flight finish and commit.

Progress (shards done of total) goes to the log every tenth of the stage or every few seconds,
never once per shard, and to an optional callback (the Prefect progress artifact).

``LLMFLOW_ENGINE_FAULT`` (tests only): ``{"kill_shard": NAME, "once": PATH, "log": LOG}`` makes
the worker about to run shard NAME SIGKILL itself, once (PATH marks that it happened); each
shard computed (not found committed) appends its name to LOG.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmflow.tasks.framework.backend import Backend, ProcessBackend, make_backend
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Step, StepResult
from llmflow.tasks.framework.store import Store

log = logging.getLogger("llmflow.engine")
FAULT_ENV = "LLMFLOW_ENGINE_FAULT"

# (output label, inputs) of one shard: what ``Step.run`` takes besides the config
ShardCall = tuple[str, dict[str, Any]]
# the size of a stage's mapped input, read only when the engine's size rule needs it
InputBytes = Callable[[], int | None] | None


def run_shard(
    step: Step, config: Any, root: str, stage: str, name: str, inputs: dict
) -> StepResult:
    """One shard of the stage output at ``stage``, through the store: the worker side of every
    engine."""
    fault = json.loads(os.environ.get(FAULT_ENV) or "{}")
    if fault.get("kill_shard") == name and not Path(fault["once"]).exists():
        Path(fault["once"]).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    result = step.run_shard(Store(root), config, stage, name, inputs)
    if fault.get("log") and not result.cached:
        with open(fault["log"], "a") as f:
            f.write(f"{step.name} {name}\n")
    return result


class Progress:
    """Shards done of total, logged every ``fraction`` of the stage or ``every_s`` seconds."""

    def __init__(
        self,
        label: str,
        total: int,
        report: Callable[[float], None] | None = None,
        every_s: float = 10.0,
        fraction: float = 0.1,
    ):
        self.label, self.total, self.report = label, total, report
        self.every_s, self.step = every_s, max(1, int(total * fraction))
        self.done = self.cached = 0
        self.started = self.last = time.monotonic()
        self.next_mark = self.step

    def advance(self, result: StepResult) -> None:
        self.done += 1
        self.cached += result.cached
        now = time.monotonic()
        if self.done < self.total and self.done < self.next_mark and now - self.last < self.every_s:
            return
        self.last, self.next_mark = now, self.done + self.step
        log.info(
            "%s: %d/%d shards (%d%%, %d cached) in %.1f s",
            self.label,
            self.done,
            self.total,
            100 * self.done // max(1, self.total),
            self.cached,
            now - self.started,
        )
        if self.report is not None:
            self.report(self.done / max(1, self.total))


class StageEngine:
    """Runs ``run_shard`` over a stage's shards on a `Backend`, results in shard order.

    With ``large`` (a function that makes a backend) and ``large_from_bytes``, a stage whose
    mapped input holds at least that many bytes runs on the ``large`` backend instead, made at
    its first such stage and kept for the others (the size rule of ``runner.processes_from_mb``).
    """

    def __init__(
        self,
        backend: Backend,
        large: Callable[[], Backend] | None = None,
        large_from_bytes: int | None = None,
    ):
        self.backend = backend
        self.large, self.large_from_bytes = large, large_from_bytes
        self._large: Backend | None = None

    def backend_for(self, input_bytes: InputBytes, label: str = "stage") -> Backend:
        """The backend of a stage whose mapped input holds ``input_bytes()`` bytes (asked only
        when a size rule is set; None: unknown)."""
        if self.large is None or self.large_from_bytes is None or input_bytes is None:
            return self.backend
        size = input_bytes()
        if size is None or size < self.large_from_bytes:
            return self.backend
        if self._large is None:
            self._large = self.large()
        log.info(
            "%s: %.1f MB of input (>= %.1f MB): shards on %d %s",
            label, size / 1e6, self.large_from_bytes / 1e6,
            self._large.workers, self._large.kind,
        )  # fmt: skip
        return self._large

    def run_stage(
        self,
        step: Step,
        config: Any,
        root: str,
        stage: str,
        shards: list[ShardCall],
        progress: Progress | None = None,
        input_bytes: InputBytes = None,
    ) -> list[StepResult]:
        """Every shard's result, in order, each committed into the stage output at ``stage``;
        raises after the in-flight shards finish if any failed (a ``BadInputError`` first,
        since a retry would fail the same way). ``input_bytes``: gives the size of the mapped
        input (`backend_for`)."""
        results: list[StepResult | None] = [None] * len(shards)
        failures: dict[int, BaseException] = {}
        job = (step, config, root, stage)
        backend = self.backend_for(input_bytes, step.name)
        values = backend.stream(_shard, job, shards, errors=True)
        for index, value in enumerate(values):
            if isinstance(value, BaseException):
                failures[index] = value
            elif value is not None:
                results[index] = value
                if progress is not None:
                    progress.advance(value)
        if failures:
            raise _stage_error(step, shards, failures, results)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Release the workers (and a Ray cluster the backend started)."""
        self.backend.close()
        if self._large is not None:
            self._large.close()
            self._large = None


def _shard(job: tuple, call: ShardCall) -> StepResult:
    step, config, root, stage = job
    return run_shard(step, config, root, stage, *call)


def _stage_error(
    step: Step, shards: list[ShardCall], failures: dict[int, BaseException], results: list
) -> BaseException:
    done = sum(r is not None for r in results)
    names = ", ".join(shards[i][0] for i in sorted(failures)[:5])
    log.error(
        "%s: %d of %d shards failed (%s); %d committed, %d not started: a re-run redoes only the "
        "shards without a marker",
        step.name,
        len(failures),
        len(shards),
        names,
        done,
        len(shards) - done - len(failures),
    )
    bad = [e for e in failures.values() if isinstance(e, BadInputError)]
    return (bad or list(failures.values()))[0]


def make_engine(runner: Any) -> StageEngine:
    """The stage engine of a ``RunnerConfig``, on its backend (`backend.make_backend`); under
    ``threads``, a stage of ``processes_from_mb`` or more runs on spawned processes."""
    backend = make_backend(runner)
    if runner.kind != "threads" or runner.processes_from_mb is None:
        return StageEngine(backend)
    large = functools.partial(ProcessBackend, runner.max_workers)
    return StageEngine(backend, large, int(runner.processes_from_mb * 1e6))
