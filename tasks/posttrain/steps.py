"""Store adapters for SFT and DPO (plain Python, no Prefect)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmflow.tasks.evaluation.harness import resolve_hf_dir
from llmflow.tasks.framework.store import StepContext

SFT_VERSION = "1"
DPO_VERSION = "1"


def _data_path(ctx: StepContext) -> Path | None:
    return Path(ctx.sources[0]["uri"]) if ctx.sources else None


def sft_step(ctx: StepContext) -> dict[str, Any]:
    """Supervised fine-tuning of the base export with TRL; the model lands in ``model/``."""
    from llmflow.tasks.posttrain.sft import sft

    return sft(ctx.config, resolve_hf_dir(ctx.inputs["model"]), ctx.out_dir, _data_path(ctx))


def dpo_step(ctx: StepContext) -> dict[str, Any]:
    """DPO of the SFT model (also the frozen reference) with TRL; the model lands in ``model/``."""
    from llmflow.tasks.posttrain.dpo import dpo, heldout_rows

    metrics = dpo(ctx.config, resolve_hf_dir(ctx.inputs["model"]), ctx.out_dir, _data_path(ctx))
    ctx.report_table(
        "dpo-heldout", heldout_rows(metrics), "Held-out preference metrics before and after DPO"
    )
    return metrics
