"""Starting or joining Ray: the one place every Ray user of llmflow goes through (the data
engine under ``runner.kind: ray``, the partitioned dedup, the trainer's Ray launcher, the Ray sweep).

A local cluster listens on 127.0.0.1 only and sends no usage report; a remote address is checked
within seconds, naming it, before Ray's own client waits for it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlparse

CONNECT_TIMEOUT_S = 5.0


class RayClusterUnreachable(RuntimeError):
    """The configured Ray address does not answer."""


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail in seconds, naming the address, when a HOST:PORT or ray:// head does not answer."""
    if address in ("local", "auto"):
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    if parsed.hostname is None or parsed.port is None:
        raise RayClusterUnreachable(f"ray address {address!r} is not HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=timeout_s).close()
    except OSError as exc:
        raise RayClusterUnreachable(
            f"no Ray cluster answers at {address!r} ({exc}); start one (`ray start --head`) or "
            "set pretrain.ray.address"
        ) from exc


def forwarded_env(environ: dict[str, str], exclude: Iterable[str] = ()) -> dict[str, str]:
    """The variables Ray workers get from this process: llmflow's own (``LLMFLOW_*``), as a
    local child process would inherit them, less ``exclude``."""
    excluded = set(exclude)
    return {k: v for k, v in environ.items() if k.startswith("LLMFLOW_") and k not in excluded}


def init_ray(address: str | None, num_cpus: int | None = None, **options: Any) -> None:
    """Join the Ray cluster at ``address``, or start one (``local`` or None) on 127.0.0.1 only,
    with ``num_cpus`` (default: this machine's cores). The data engine, the partitioned dedup,
    the trainer's Ray launcher and the Ray sweep all start Ray here."""
    import ray

    if address not in (None, "local"):
        ray.init(address=address, **options)
        return
    with _loopback_only():
        ray.init(
            num_cpus=num_cpus or os.cpu_count(),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            **options,
        )


@contextlib.contextmanager
def _loopback_only():
    """The environment Ray's processes start in for a local cluster: loopback only.

    NOTE: ``_node_ip_address="127.0.0.1"`` alone still leaves the GCS and the raylet listening
    on every interface: Ray binds them to loopback only as a single-machine ("Windows or OSX")
    cluster, a flag Ray reads when it is imported, so it is set here for the start; and no
    usage report phoning home.
    """
    from ray._private import ray_constants

    changed = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    saved = {key: os.environ.get(key) for key in changed}
    os.environ.update({k: v for k, v in changed.items() if saved[k] is None})
    enabled, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = enabled
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
