"""Where a data step's own units run: the files ingest reads, tokenize encodes, the mixture packs.

One rule for every such step (`data_units`): Ray tasks when this process is connected to a
cluster (the data engine connected it under ``runner.kind: ray``) or ``LLMFLOW_RAY_ADDRESS``
names one (`distributed_dedup.data_map` decides); else ``LLMFLOW_DATA_WORKERS=N`` (N > 1)
spawned processes; else this process. Every way gives the results in the items' order with a
bounded number in flight, so the step writes the same bytes wherever its units ran (execution
only: the output's address does not change).

    with data_units() as units:
        for encoded in units.stream(encode_file, job, paths):  # fn(job, item), in order
            ...
        units.map(write_unit, units_list)  # [fn(item) ...], Ray tasks batching items
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from llmflow.tasks.framework.errors import BadInputError

WORKERS_ENV = "LLMFLOW_DATA_WORKERS"
"""Processes that read (ingest), encode (tokenize) or pack (mixture) units when Ray is not
connected; unset, 0 or 1: this process alone. Execution only: the output is byte-identical.

NOTE: off by default. Measured on 2 shared cores (load 6-9), 40 files of 745 documents (12.7M
tokens): this process 7-14.5 s, 2 spawned processes 10.3-13.3 s (each spawn imports the stack
and builds its own pre-token cache), Ray's 2 warm workers 5.0-6.8 s (after ``ray.init``). The
sequential tokenize path already shares a batch of 1 MiB or more with a forked helper process."""


def data_workers() -> int:
    """``LLMFLOW_DATA_WORKERS`` as a number (0 when unset); a bad value names the variable."""
    value = os.environ.get(WORKERS_ENV, "").strip() or "0"
    if not value.isdigit():
        raise BadInputError(
            f"{WORKERS_ENV}={value!r} must be a whole number of processes (0: none)"
        )
    return int(value)


@dataclass
class Units:
    """Where a step's units run: ``kind`` is ``ray``, ``processes`` or ``local``."""

    kind: str
    workers: int
    pool: ProcessPoolExecutor | None = None
    map_fn: Callable[[Callable[[Any], Any], Sequence[Any]], list] | None = None

    @property
    def parallel(self) -> bool:
        return self.kind != "local"

    def stream(self, fn: Callable[[Any, Any], Any], job: Any, items: Sequence[Any]) -> Iterator:
        """``fn(job, item)`` for every item, results in the items' order (a generator: close
        it to cancel the items still in flight)."""
        if self.kind == "ray":
            return ray_stream(fn, job, items)
        if self.kind == "processes" and len(items) > 1:
            return process_stream(fn, job, items, self.workers, self.pool)
        return (fn(job, item) for item in items)

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list:
        """``[fn(item) for item in items]``; on Ray, consecutive items share a task."""
        if self.kind == "ray" and self.map_fn is not None:
            return self.map_fn(fn, items)
        return list(self.stream(_apply, fn, items))


def _apply(fn: Callable[[Any], Any], item: Any) -> Any:
    return fn(item)


@contextlib.contextmanager
def data_units() -> Iterator[Units]:
    """The units' engine by the module's rule; a process pool is shut down on exit."""
    # NOTE: imported here: the dedup module imports the curation stack
    from llmflow.tasks.curation.distributed_dedup import data_map, local_map

    workers = data_workers()
    with data_map() as map_fn:
        if map_fn is not local_map:
            import ray

            cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
            yield Units("ray", cpus, map_fn=map_fn)
        elif workers < 2:
            yield Units("local", 1)
        else:
            with process_pool(workers) as pool:
                yield Units("processes", workers, pool)


def process_pool(workers: int) -> ProcessPoolExecutor:
    """``workers`` spawned processes (forking a process that runs Prefect's threads is unsafe).
    They start on demand: a step with one unit starts none."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


def process_stream(fn, job, items: Sequence[Any], workers: int, pool=None) -> Iterator:
    """``fn(job, item)`` for every item on ``workers`` spawned processes (``pool``'s, else a
    pool of its own), results in the items' order, at most ``2 x workers`` submitted at once.
    Closed early (or failing), it cancels the units not started and waits for the running ones."""
    with contextlib.nullcontext(pool) if pool is not None else process_pool(workers) as pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, job, item))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
            # NOTE: a running unit cannot be cancelled: it ends before the caller removes
            # what it writes to (ingest's scratch folder), as on Ray
            wait(pending)


def ray_stream(fn, job, items: Sequence[Any], max_in_flight: int = 0) -> Iterator:
    """``fn(job, item)`` for every item as Ray tasks on the cluster this process is connected
    to, results in the items' order, at most ``max_in_flight`` submitted at once (0: twice the
    cluster's CPUs)."""
    import ray

    limit = max_in_flight or max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    remote = ray.remote(num_cpus=1, max_retries=2)(fn)
    job_ref = ray.put(job)
    pending: deque = deque()
    try:
        for item in items:
            pending.append(remote.remote(job_ref, item))
            if len(pending) >= limit:
                yield ray.get(pending.popleft())
        while pending:
            yield ray.get(pending.popleft())
    finally:
        for ref in pending:
            ray.cancel(ref)
        if pending:  # NOTE: cancelled tasks end before the caller removes what they write to
            ray.wait(list(pending), num_returns=len(pending), timeout=60)
