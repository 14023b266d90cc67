"""Deployments of llmflow's flows, read from ``deployments/prefect.yaml``, and ``serve()``.

The pipeline's deployments run ``run_preset``: its one parameter (a preset, dotted overrides,
root, until) is what the UI's Run form shows; it resolves the config exactly as ``llmflow run``
does and runs the pipeline flow as a subflow.

``prefect deploy --all --prefect-file deployments/prefect.yaml`` registers every deployment with
its work pool (workers then run them). ``serve()`` registers the one-machine deployments (those of
the ``llmflow-local`` pool) and runs their flow runs from this process: no pool, no worker; it
also registers the alert automations of ``deployments/automations.yaml`` (``flows/automations.py``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from prefect import flow
from pydantic import BaseModel, ConfigDict, Field

from llmflow.flows.pipeline import pipeline
from llmflow.tasks.config import PHASES, PipelineConfig, load_config
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.resources import data_dir

PRESET_ROOT = data_dir("configs").parent  # the checkout, or the installed package's data
PREFECT_FILE = data_dir("deployments") / "prefect.yaml"
LOCAL_POOL = "llmflow-local"
PRESETS = sorted(p.stem for p in data_dir("configs").glob("*.yaml"))


class PipelineRun(BaseModel):
    """A pipeline run as the UI asks for it: a preset, then overrides of any of its fields."""

    model_config = ConfigDict(extra="forbid")

    preset: str = Field(
        "quickstart",
        description=f"A preset in configs/ ({', '.join(PRESETS)}) or a YAML path in the checkout.",
    )
    overrides: list[str] = Field(
        default_factory=list,
        description="Dotted overrides of any field, as `llmflow run --set`: ingest.max_chars=20000.",
    )
    root: str | None = Field(None, description="Artifact root (a folder or s3://bucket/prefix).")
    until: Literal[PHASES] | None = Field(None, description="Stop after this step.")  # type: ignore[valid-type]
    data: list[str] = Field(
        default_factory=list, description="Raw data files, folders or globs instead of the sample."
    )

    def config(self) -> PipelineConfig:
        """The resolved, validated config (a bad value fails here, before any compute)."""
        path = Path(self.preset if self.preset.endswith(".yaml") else f"configs/{self.preset}.yaml")
        overrides = [*self.overrides]
        overrides += [f"{k}={v}" for k, v in (("root", self.root), ("until", self.until)) if v]
        config = load_config(PRESET_ROOT / path, overrides)
        return config.model_copy(update={"data": list(self.data)}) if self.data else config


@flow(name="llmflow", log_prints=True)
def run_preset(run: PipelineRun = PipelineRun()) -> list[str]:  # noqa: B008
    """Resolve a preset with overrides and run the pipeline on it; return the output URIs."""
    return [result.uri for result in pipeline(run.config())]


def deployment_specs(prefect_file: Path = PREFECT_FILE) -> list[dict[str, Any]]:
    """The ``deployments`` entries of a prefect.yaml (YAML anchors resolved)."""
    return yaml.safe_load(Path(prefect_file).read_text())["deployments"]


def load_flow(entrypoint: str):
    """Import ``flows/file.py:flow_name`` (a prefect.yaml entrypoint) from the installed llmflow."""
    path, name = entrypoint.rsplit(":", 1)
    module = importlib.import_module("llmflow." + path.removesuffix(".py").replace("/", "."))
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
        concurrency_limit=spec.get("concurrency_limit"),
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
        raise BadInputError(f"unknown deployment(s) {sorted(unknown)}; known: {known}")
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

    from llmflow.flows.automations import register_automations

    deployments = local_deployments(names, prefect_file)
    register_automations()  # alerts become notifications (deployments/automations.yaml)
    os.chdir(PRESET_ROOT)
    prefect_serve(*deployments, limit=limit)
