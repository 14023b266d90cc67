"""Where a mapped stage's shards run: a thread pool, a process pool or Ray, a bounded number at once.

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

import concurrent.futures as cf
import functools
import json
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Step, StepResult
from llmflow.tasks.framework.store import Store

log = logging.getLogger("llmflow.engine")
FAULT_ENV = "LLMFLOW_ENGINE_FAULT"

# (output label, inputs) of one shard: what ``Step.run`` takes besides the config
ShardCall = tuple[str, dict[str, Any]]


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


class Engine:
    """Runs ``run_shard`` over a stage's shards in batches (one shard each unless the engine
    batches), at most ``limit`` batches at once, results in shard order."""

    limit = 1

    def batch_size(self, shards: int) -> int:
        """Shards per submitted unit; a unit runs its shards one after another."""
        return 1

    def run_stage(
        self,
        step: Step,
        config: Any,
        root: str,
        stage: str,
        shards: list[ShardCall],
        progress: Progress | None = None,
    ) -> list[StepResult]:
        """Every shard's result, in order, each committed into the stage output at ``stage``;
        raises after the in-flight shards finish if any failed (a ``BadInputError`` first,
        since a retry would fail the same way)."""
        self.prepare(step, config)
        results: list[StepResult | None] = [None] * len(shards)
        failures: dict[int, BaseException] = {}
        pending: dict[Any, list[int]] = {}
        size = max(1, self.batch_size(len(shards)))
        todo = iter(_batches(len(shards), size))
        while True:
            while not failures and len(pending) < self.limit:
                indices = next(todo, None)
                if indices is None:
                    break
                batch = [shards[i] for i in indices]
                pending[self.submit(step, config, root, stage, batch)] = indices
            if not pending:
                break
            for handle, values in self.wait(list(pending)):
                indices = pending.pop(handle)
                if isinstance(values, BaseException):  # the whole unit (a killed worker)
                    failures.update((i, values) for i in indices)
                    continue
                for index, value in zip(indices, values, strict=True):
                    if isinstance(value, BaseException):
                        failures[index] = value
                    elif value is not None:
                        results[index] = value
                        if progress is not None:
                            progress.advance(value)
        if failures:
            raise _stage_error(step, shards, failures, results)
        return results  # type: ignore[return-value]

    def prepare(self, step: Step, config: Any) -> None:
        """Before a stage's first shard (ship the step to the workers once)."""

    def submit(self, step, config, root, stage: str, batch: list[ShardCall]) -> Any:
        """Start one unit: ``run_batch`` over ``batch``; a handle for ``wait``."""
        raise NotImplementedError

    def wait(self, handles: list[Any]) -> Iterable[tuple[Any, list | BaseException]]:
        """At least one finished handle, with its unit's results (``run_batch``) or the error
        that lost the whole unit."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the workers (and a Ray cluster this engine started)."""


def _batches(total: int, size: int) -> Iterator[list[int]]:
    for start in range(0, total, size):
        yield list(range(start, min(total, start + size)))


def run_batch(
    step: Step, config: Any, root: str, stage: str, batch: list[ShardCall]
) -> list[StepResult | BaseException | None]:
    """A unit's shards one after another, each through the store (its own output and marker):
    per shard its result, or its error; after the first error no further shard starts (None)."""
    out: list[StepResult | BaseException | None] = [None] * len(batch)
    for i, (name, inputs) in enumerate(batch):
        try:
            out[i] = run_shard(step, config, root, stage, name, inputs)
        except Exception as err:
            out[i] = err
            break
    return out


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


def _futures_wait(handles: list[cf.Future]):
    done, _ = cf.wait(handles, return_when=cf.FIRST_COMPLETED)
    for future in done:
        error = future.exception()
        yield future, error if error is not None else future.result()


class ThreadEngine(Engine):
    """Shards on a thread pool in this process (the step functions release the GIL in Arrow)."""

    def __init__(self, max_workers: int | None = None):
        self.pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="shard")
        self.limit = 2 * self.pool._max_workers

    def submit(self, step, config, root, stage, batch):
        return self.pool.submit(run_batch, step, config, root, stage, batch)

    def wait(self, handles):
        return _futures_wait(handles)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class ProcessEngine(Engine):
    """Shards on a pool of spawned processes; the step goes over once per stage (cloudpickle:
    a declared step's function is shadowed by its ``Step`` in its module)."""

    def __init__(self, max_workers: int | None = None):
        context = multiprocessing.get_context("spawn")
        self.pool = cf.ProcessPoolExecutor(max_workers=max_workers, mp_context=context)
        self.limit = 2 * self.pool._max_workers
        self.payload = b""

    def prepare(self, step, config):
        import cloudpickle

        self.payload = cloudpickle.dumps((step, config))

    def submit(self, step, config, root, stage, batch):
        return self.pool.submit(_pickled_batch, self.payload, root, stage, batch)

    def wait(self, handles):
        return _futures_wait(handles)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


@functools.lru_cache(maxsize=4)
def _unpickle(payload: bytes) -> tuple[Step, Any]:
    import cloudpickle

    return cloudpickle.loads(payload)


def _pickled_batch(payload: bytes, root, stage, batch) -> list:
    step, config = _unpickle(payload)
    return run_batch(step, config, root, stage, batch)


class RayEngine(Engine):
    """Shards as Ray tasks, each running a batch of shards, at most ``max_in_flight`` tasks
    submitted at once (``ray.wait``).

    A Ray task costs a few milliseconds more than a thread pool's call; ``shards_per_task``
    (None: enough for about eight tasks per CPU, at most 32 shards each) spreads that over the
    batch. Each shard still commits on its own as it finishes.

    ``address='local'`` starts a Ray cluster on 127.0.0.1 with this machine's cores (shut down
    by ``close``); a Ray already initialised in this process is used and left running. Ray does
    not retry a shard itself (``max_retries=0``): a killed worker fails the stage, and its retry
    redoes only the shards without a marker, as on every engine.
    """

    TASKS_PER_CPU = 8
    MAX_SHARDS_PER_TASK = 32

    def __init__(
        self,
        address: str = "local",
        max_in_flight: int | None = None,
        cpus: float = 1,
        shards_per_task: int | None = None,
    ):
        import ray

        from llmflow.tasks.framework.ray_cluster import check_reachable, forwarded_env, init_ray

        self.started = False
        if not ray.is_initialized():
            check_reachable(address)
            init_ray(address, runtime_env={"env_vars": forwarded_env(dict(os.environ))})
            self.started = True
        self.ray = ray
        self.cpus = cpus
        self.slots = max(1, int(ray.cluster_resources().get("CPU", 1) / cpus))
        self.limit = max_in_flight or max(2, 2 * self.slots)
        self.shards_per_task = shards_per_task
        self.remote = ray.remote(run_batch).options(num_cpus=cpus, max_retries=0)
        self.refs: tuple[Any, Any] | None = None

    def batch_size(self, shards: int) -> int:
        if self.shards_per_task is not None:
            return self.shards_per_task
        per_task = -(-shards // (self.TASKS_PER_CPU * self.slots))
        return max(1, min(self.MAX_SHARDS_PER_TASK, per_task))

    def prepare(self, step, config):
        self.refs = (self.ray.put(step), self.ray.put(config))

    def submit(self, step, config, root, stage, batch):
        step_ref, config_ref = self.refs
        return self.remote.remote(step_ref, config_ref, root, stage, batch)

    def wait(self, handles):
        ready, _ = self.ray.wait(handles, num_returns=1)
        for ref in ready:
            try:
                yield ref, self.ray.get(ref)
            except Exception as err:  # a RayTaskError is also an instance of its cause's class
                yield ref, err

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
            self.started = False


def make_engine(runner: Any) -> Engine:
    """The engine of a ``RunnerConfig``: threads, processes or ray."""
    if runner.kind == "threads":
        return ThreadEngine(runner.max_workers)
    if runner.kind == "processes":
        return ProcessEngine(runner.max_workers)
    if runner.kind == "ray":
        try:
            import ray  # noqa: F401
        except ImportError as err:
            raise BadInputError(
                "runner.kind='ray' needs the optional extra: pip install 'llmflow[ray]'"
            ) from err
        cfg = runner.ray
        return RayEngine(cfg.address, cfg.max_in_flight, cfg.cpus_per_shard, cfg.shards_per_task)
    raise BadInputError(
        f"runner.kind={runner.kind!r} has no stage engine: set runner.fan_out=shard "
        "(one Prefect task per shard on its task runner)"
    )
