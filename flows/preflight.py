"""Preflight's Prefect flow: the checklist of ``tasks/preflight/`` on a recipe, its go/no-go table
published as an artifact. The checks, the rehearsal and the memory sampling live in the package.

    llmflow preflight configs/smollm3-135m.yaml --processes 2 --seq-len 64
    llmflow preflight configs/smollm3-3b.yaml --no-train     # meta build and memory plan only
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.preflight import PreflightOptions, Report, preflight

__all__ = ["PreflightOptions", "PreflightRun", "Report", "preflight", "preflight_flow"]


class PreflightRun(BaseModel):
    """A preflight as the Prefect UI asks for it: a recipe, overrides, and how much to run."""

    model_config = ConfigDict(extra="forbid")

    preset: str = Field("smollm3-1.7b", description="A recipe in configs/ or a YAML path.")
    overrides: list[str] = Field(default_factory=list, description="Dotted overrides (a.b=value).")
    options: PreflightOptions = Field(default_factory=PreflightOptions)

    def path(self) -> str:
        """The recipe file: a path as given when it exists, else a preset shipped in configs/."""
        from llmflow.flows.deploy import PRESET_ROOT

        path = self.preset if self.preset.endswith(".yaml") else f"configs/{self.preset}.yaml"
        return path if Path(path).is_file() else str(PRESET_ROOT / path)

    def config(self):
        """The resolved recipe (a bad value fails here, before any compute)."""
        from llmflow.tasks.config import load_config

        return load_config(self.path(), self.overrides)


@flow(name="llmflow-preflight", log_prints=False)
def preflight_flow(run: PreflightRun = PreflightRun()) -> dict[str, Any]:  # noqa: B008
    """Preflight a recipe: the go/no-go table as an artifact; the report's numbers returned."""
    logger = get_run_logger()
    report = preflight(run.path(), run.overrides, run.options, log=logger.debug)
    verdict = "GO" if report.go else "NO-GO"
    create_table_artifact(
        report.rows(), key="preflight", description=f"Preflight of {report.recipe}: {verdict}"
    )
    logger.info(report.table().splitlines()[-1])  # the verdict; the table is the artifact
    return {"go": report.go, "table": report.table(), "numbers": report.numbers}
