"""Where data-parallel work runs: this process, a thread pool, spawned processes or Ray.

One `Backend` runs ``fn(job, item)`` over items and gives the results in the items' order, with
a bounded number of units in flight. A unit is one item, or on Ray a run of consecutive items
(a Ray task costs a few milliseconds more than a pool's call). ``job`` is sent to the workers
once per stream (cloudpickled for processes, ``ray.put`` on Ray), not once per item. Closing a
stream early, or an error in it, cancels the units not started and waits for the running ones,
so a caller may remove what they write to. ``close`` releases the workers (and a Ray cluster the
backend started).

Every consumer takes one: the stage engine (a mapped stage's shards, ``engine.py``), the steps
that map their own units (ingest's files, tokenize's files, the mixture's pack units, the
partitioned dedup) and the Ray sweep. `make_backend` builds it from a ``RunnerConfig`` alone;
the executor makes it `active` while a run's steps execute, and `current` is what a step's own
units run on (this process when no run set one).

    with make_backend(runner) as backend:
        for value in backend.stream(encode_file, job, paths):  # fn(job, item), in order
            ...
        backend.map(write_unit, units)  # [fn(item) for item in items]

A new place to run work (a Slurm array, say) is one subclass: ``submit`` starts a unit and
returns a handle, ``wait`` gives the finished ones, ``cancel`` the not-started ones, ``close``
releases the workers.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from llmflow.tasks.framework.errors import BadInputError


class Failed:
    """An item's error returned by a unit (the unit stops there), so the items before it keep
    their results and a caller that asks for errors gets each in its item's place."""

    def __init__(self, error: BaseException):
        self.error = error


def run_unit(fn: Callable[[Any, Any], Any], job: Any, items: Sequence[Any]) -> list:
    """``fn(job, item)`` for the unit's items one after another; after the first error no
    further item starts (the list ends with its `Failed`)."""
    out: list = []
    for item in items:
        try:
            out.append(fn(job, item))
        except Exception as err:
            out.append(Failed(err))
            break
    return out


def _apply(fn: Callable[[Any], Any], item: Any) -> Any:
    return fn(item)


class Backend:
    """Runs units and streams their results in order (see the module)."""

    kind = "local"
    workers = 1

    @property
    def limit(self) -> int:
        """Units submitted at once: enough to keep every worker busy while results are taken."""
        return 2 * self.workers

    def unit_size(self, items: int) -> int:
        """Consecutive items one unit runs."""
        return 1

    def share(self, job: Any) -> Any:
        """``job`` as the workers receive it (once per stream)."""
        return job

    def submit(self, fn: Callable, job: Any, items: Sequence[Any]) -> Any:
        """Start ``run_unit(fn, job, items)``; a handle for ``wait``."""
        future: cf.Future = cf.Future()
        try:
            future.set_result(run_unit(fn, job, items))
        except Exception as err:  # handed to the caller as the unit's error
            future.set_exception(err)
        return future

    def wait(self, handles: list[Any]) -> Iterable[tuple[Any, list | BaseException]]:
        """At least one finished handle with its unit's list, or the error that lost the unit."""
        done, _ = cf.wait(handles, return_when=cf.FIRST_COMPLETED)
        for future in done:
            error = future.exception()
            yield future, error if error is not None else future.result()

    def cancel(self, handles: list[Any]) -> None:
        """Cancel the units not started and wait for the running ones."""
        for future in handles:
            future.cancel()
        cf.wait(handles)

    def close(self) -> None:
        """Release the workers."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def parallel(self) -> bool:
        return self.kind != "local"

    def stream(
        self, fn: Callable[[Any, Any], Any], job: Any, items: Iterable[Any], errors: bool = False
    ) -> Iterator:
        """``fn(job, item)`` for every item, in the items' order (a generator: close it to stop).
        An error is raised where its item's result would be. With ``errors`` it is yielded in its
        place instead, no further unit starts, the units in flight finish and give their results
        (None for an item its unit did not start), and the stream ends there."""
        size = max(1, self.unit_size(len(items) if hasattr(items, "__len__") else 0))
        units = _units(iter(items), size)  # drawn as units start, not ahead
        shared = self.share(job)
        pending: deque = deque()
        finished: dict[Any, list | BaseException] = {}
        failed = False
        try:
            while True:
                while not failed and len(pending) < self.limit and (unit := next(units, None)):
                    pending.append((self.submit(fn, shared, unit), len(unit)))
                if not pending:
                    return
                head, count = pending[0]
                while head not in finished:
                    finished.update(self.wait([h for h, _ in pending if h not in finished]))
                pending.popleft()
                values = finished.pop(head)
                failed = failed or _has_failed(values)
                yield from _unit_values(values, count, errors)
        finally:
            if pending:
                self.cancel([h for h, _ in pending])

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list:
        """``[fn(item) for item in items]``, run on this backend."""
        return list(self.stream(_apply, fn, items))


def _units(items: Iterator, size: int) -> Iterator[list]:
    while unit := list(itertools.islice(items, size)):
        yield unit


def _has_failed(values: list | BaseException) -> bool:
    return isinstance(values, BaseException) or any(isinstance(v, Failed) for v in values)


def _unit_values(values: list | BaseException, size: int, errors: bool) -> Iterator:
    if isinstance(values, BaseException):
        if not errors:
            raise values
        values = [Failed(values)] * size
    for value in values:
        if isinstance(value, Failed):
            if not errors:
                raise value.error
            yield value.error
        else:
            yield value
    if errors and values and isinstance(values[-1], Failed):
        yield from [None] * (size - len(values))


class LocalBackend(Backend):
    """This process, one unit after another (each unit runs as it is submitted)."""

    @property
    def limit(self) -> int:
        return 1


class ThreadBackend(Backend):
    """A thread pool in this process (work that releases the GIL: Arrow, numpy, I/O)."""

    kind = "threads"

    def __init__(self, max_workers: int | None = None):
        self.pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="unit")
        self.workers = self.pool._max_workers

    def submit(self, fn, job, items):
        return self.pool.submit(run_unit, fn, job, items)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class ProcessBackend(Backend):
    """Spawned processes (forking a process that runs Prefect's threads is unsafe); they start
    on demand, so a stream of one unit starts one. The job is cloudpickled once per stream (a
    declared step's function is shadowed by its ``Step`` in its module)."""

    kind = "processes"

    def __init__(self, max_workers: int | None = None, fresh_workers: bool = False):
        context = multiprocessing.get_context("spawn")
        self.pool = cf.ProcessPoolExecutor(
            max_workers, mp_context=context, max_tasks_per_child=1 if fresh_workers else None
        )
        self.workers = self.pool._max_workers

    def share(self, job):
        import cloudpickle

        return cloudpickle.dumps(job)

    def submit(self, fn, job, items):
        return self.pool.submit(_pickled_unit, fn, job, items)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


@functools.lru_cache(maxsize=4)
def _unpickle(payload: bytes) -> Any:
    import cloudpickle

    return cloudpickle.loads(payload)


def _pickled_unit(fn, payload: bytes, items) -> list:
    return run_unit(fn, _unpickle(payload), items)


class RayBackend(Backend):
    """Ray tasks, a run of consecutive items each (``items_per_task``; None: about eight tasks
    per CPU, at most 32 items each), at most ``max_in_flight`` submitted at once (None: twice
    the cluster's CPUs), so a million units never sit in Ray's queue at once.

    ``address='local'`` starts a cluster on 127.0.0.1 with ``num_cpus`` (None: this machine's
    cores; shut down by ``close``); a Ray already initialised in this process is used and left
    running. ``init_options`` go to ``ray.init``. Ray does not retry a unit itself
    (``max_retries=0``): a killed worker fails the stream, and the caller's retry redoes what
    is not committed.
    """

    kind = "ray"
    TASKS_PER_CPU = 8
    MAX_ITEMS_PER_TASK = 32

    def __init__(
        self,
        address: str = "local",
        max_in_flight: int | None = None,
        cpus: float = 1,
        items_per_task: int | None = None,
        num_cpus: int | None = None,
        **init_options: Any,
    ):
        import ray

        from llmflow.tasks.framework.ray_cluster import check_reachable, forwarded_env, init_ray

        self.started = False
        if not ray.is_initialized():
            check_reachable(address)
            env = {"env_vars": forwarded_env(dict(os.environ))}
            init_ray(address, num_cpus, runtime_env=env, **init_options)
            self.started = True
        self.ray = ray
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1) / cpus))
        self.max_in_flight, self.items_per_task = max_in_flight, items_per_task
        self.remote = ray.remote(run_unit).options(num_cpus=cpus, max_retries=0)

    @property
    def limit(self) -> int:
        return self.max_in_flight or max(2, 2 * self.workers)

    def unit_size(self, items: int) -> int:
        if self.items_per_task is not None:
            return self.items_per_task
        per_task = -(-items // (self.TASKS_PER_CPU * self.workers))
        return max(1, min(self.MAX_ITEMS_PER_TASK, per_task))

    def share(self, job):
        return self.ray.put(job)

    def submit(self, fn, job, items):
        return self.remote.remote(fn, job, list(items))

    def wait(self, handles):
        ready, _ = self.ray.wait(handles, num_returns=1)
        for ref in ready:
            try:
                yield ref, self.ray.get(ref)
            except Exception as err:  # a RayTaskError is also an instance of its cause's class
                yield ref, err

    def cancel(self, handles):
        for ref in handles:
            self.ray.cancel(ref)
        # NOTE: cancelled tasks end before the caller removes what they write to
        self.ray.wait(handles, num_returns=len(handles), timeout=60)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
            self.started = False


def make_backend(runner: Any) -> Backend:
    """The backend of a ``RunnerConfig``: ``threads``, ``processes`` or ``ray``."""
    if runner.kind == "threads":
        return ThreadBackend(runner.max_workers)
    if runner.kind == "processes":
        return ProcessBackend(runner.max_workers)
    if runner.kind == "ray":
        try:
            import ray  # noqa: F401
        except ImportError as err:
            raise BadInputError(
                "runner.kind='ray' needs the optional extra: pip install 'llmflow[ray]'"
            ) from err
        cfg = runner.ray
        return RayBackend(cfg.address, cfg.max_in_flight, cfg.cpus_per_shard, cfg.shards_per_task)
    raise BadInputError(f"runner.kind={runner.kind!r}: use threads, processes or ray")


_LOCAL = LocalBackend()
_active: list[Backend] = []


def current() -> Backend:
    """What a step's own units run on: the run's backend (`active`), else this process.

    A thread pool runs them here too: their work (parsing records, the tokenizer's Python
    side) holds the GIL, so threads would add only overhead and shared-state hazards."""
    backend = _active[-1] if _active else _LOCAL
    return _LOCAL if backend.kind == "threads" else backend


@contextlib.contextmanager
def active(backend: Backend) -> Iterator[Backend]:
    """Makes ``backend`` the one `current` gives (within this process) until the block ends."""
    _active.append(backend)
    try:
        yield backend
    finally:
        _active.remove(backend)
