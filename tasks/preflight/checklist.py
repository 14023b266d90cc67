"""The whole checklist, in order: :func:`preflight` runs the checks, then the rehearsal."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmflow.tasks.preflight.checks import (
    check_config,
    check_extension_plan,
    check_meta_build,
    check_plan,
    check_sources,
)
from llmflow.tasks.preflight.layouts import rehearse_layouts
from llmflow.tasks.preflight.rehearsal import run_test_steps
from llmflow.tasks.preflight.report import PreflightOptions, Report, timed


def preflight(
    config_path: str | None,
    overrides: list[str] | None = None,
    options: PreflightOptions | None = None,
    work_dir: Path | None = None,
    log: Callable[[str], Any] = lambda _: None,
) -> Report:
    """Run the checklist; return the report (``report.go`` is the verdict)."""
    options = options or PreflightOptions()
    report = Report(recipe=str(config_path or "quickstart"))
    config = check_config(report, config_path, overrides or [])
    if config is None:
        return report
    if options.check_data:
        check_sources(report, config, options.docs_per_source)
    plan = check_plan(report, config)
    check_extension_plan(report, config)
    if not config.pretrain.stages:
        with timed(report, "training rehearsal") as row:
            row["detail"] = (
                "skipped: pretrain.stages is empty, no stage to rehearse (the meta build, test "
                "steps, resume, throughput, memory and first scores are a stage's)"
            )
        return report
    check_meta_build(report, config, plan)
    if options.train:
        work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="llmflow-preflight-"))
        try:
            run_test_steps(report, config, options, work, log)
            rehearse_layouts(report, config, options, work, log)
        finally:
            if work_dir is None:
                shutil.rmtree(work, ignore_errors=True)
    return report
