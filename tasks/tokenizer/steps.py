"""Store adapter for tokenizer training (plain Python, no Prefect)."""

from __future__ import annotations

import json
from typing import Any

from llmflow.tasks.framework.store import StepContext
from llmflow.tasks.tokenizer.train import train_tokenizer

TOKENIZER_VERSION = "1"


def tokenizer_step(ctx: StepContext) -> dict[str, Any]:
    """Train the BPE tokenizer on the curated corpus; publish its fertility table."""
    metrics = train_tokenizer(ctx.config, ctx.inputs["corpus"], ctx.out_dir)
    report = ctx.out_dir / "tokenizer_eval.json"
    if report.exists():
        data = json.loads(report.read_text())
        rows = data.get("rows", data) if isinstance(data, dict) else data
        ctx.report_table(
            "tokenizer-eval", rows, "Fertility, continued-word rate, bytes/token per domain"
        )
    return metrics
