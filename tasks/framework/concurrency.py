"""A global concurrency slot for work that needs a GPU (training, evaluation).

On a cluster, ``prefect gcl create gpu --limit N`` (N = the GPUs the pool may use) makes every task
that enters ``gpu_slot()`` wait for a free slot, whatever flow run or worker it belongs to. Where
no ``gpu`` limit exists (a laptop, CI) or no Prefect run is active, ``gpu_slot()`` does nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

GPU_LIMIT = "gpu"
log = logging.getLogger("llmflow.concurrency")


def _limit_exists(name: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            return False
    return True


def _in_prefect_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


@contextlib.contextmanager
def gpu_slot(
    occupy: int = 1, name: str = GPU_LIMIT, timeout_seconds: float | None = None
) -> Iterator[bool]:
    """Hold ``occupy`` slots of the global concurrency limit ``name`` around the work inside.

    Args:
        occupy: Slots to hold (GPUs the work uses).
        name: The global concurrency limit's name.
        timeout_seconds: Give up waiting after this long (``TimeoutError``); None waits forever.

    Yields:
        True when slots are held, False when there was no limit (or no Prefect run) to take.
    """
    if not _in_prefect_run() or not _limit_exists(name):
        log.debug("no %r concurrency limit (or no Prefect run): running without a slot", name)
        yield False
        return
    from prefect.concurrency.sync import concurrency

    # NOTE: strict=False also keeps a failed lease renewal (a server hiccup) from killing a
    # days-long training run; the lease is renewed in the background while the work runs.
    with concurrency(name, occupy=occupy, timeout_seconds=timeout_seconds, strict=False):
        yield True
