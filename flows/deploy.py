"""Deployments of llmflow's flows, read from ``deployments/prefect.yaml``, and ``serve()``.

``prefect deploy --all --prefect-file deployments/prefect.yaml`` registers every deployment with
its work pool (workers then run them). ``serve()`` registers the one-machine deployments (those of
the ``llmflow-local`` pool) and runs their flow runs from this process: no pool, no worker.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

import flows  # noqa: F401  (sets Prefect env defaults before prefect is imported)

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = REPO_ROOT / "deployments" / "prefect.yaml"
LOCAL_POOL = "llmflow-local"


def deployment_specs(prefect_file: Path = PREFECT_FILE) -> list[dict[str, Any]]:
    """The ``deployments`` entries of a prefect.yaml (YAML anchors resolved)."""
    return yaml.safe_load(Path(prefect_file).read_text())["deployments"]


def load_flow(entrypoint: str):
    """Import ``path/to/file.py:flow_name`` (relative to the repository root)."""
    path, name = entrypoint.rsplit(":", 1)
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    return getattr(module, name)


def _schedules(spec: dict[str, Any]) -> list[Any]:
    from prefect.schedules import Cron

    return [
        Cron(s["cron"], timezone=s.get("timezone"), active=s.get("active", True))
        for s in spec.get("schedules") or []
        if "cron" in s
    ]


def to_runner_deployment(spec: dict[str, Any]):
    """One prefect.yaml entry as a deployment served by this process (pool settings dropped)."""
    return load_flow(spec["entrypoint"]).to_deployment(
        name=spec["name"],
        parameters=spec.get("parameters") or {},
        description=spec.get("description"),
        tags=spec.get("tags"),
        schedules=_schedules(spec),
    )


def local_deployments(
    names: Sequence[str] | None = None, prefect_file: Path = PREFECT_FILE
) -> list[Any]:
    """The one-machine deployments (``llmflow-local`` pool), optionally only those named."""
    specs = [
        s
        for s in deployment_specs(prefect_file)
        if (s.get("work_pool") or {}).get("name") == LOCAL_POOL
    ]
    unknown = set(names or ()) - {s["name"] for s in specs}
    if unknown:
        known = ", ".join(s["name"] for s in specs)
        raise ValueError(f"unknown deployment(s) {sorted(unknown)}; known: {known}")
    return [to_runner_deployment(s) for s in specs if not names or s["name"] in names]


def serve(
    names: Sequence[str] | None = None,
    *,
    limit: int | None = None,
    prefect_file: Path = PREFECT_FILE,
) -> None:
    """Serve the one-machine deployments from this process until interrupted.

    Flow runs (from the UI, ``prefect deployment run`` or a schedule) start as subprocesses of
    this one, in the repository root, so relative roots such as ``./runs`` mean the checkout's.

    Args:
        names: Deployment names to serve (e.g. ``["quickstart"]``); all local ones when empty.
        limit: The most flow runs to run at once; None for no limit.
        prefect_file: The prefect.yaml to read deployments from.
    """
    from prefect import serve as prefect_serve

    deployments = local_deployments(names, prefect_file)
    os.chdir(REPO_ROOT)
    prefect_serve(*deployments, limit=limit)
