"""Store adapters for export, evaluation and the leaderboard (plain Python, no Prefect)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file

from llmflow.model.config import ModelConfig
from llmflow.model.hf import export_hf
from llmflow.tasks.evaluation.harness import evaluate, table_rows
from llmflow.tasks.evaluation.leaderboard import (
    leaderboard_rows,
    markdown_table,
    plot_metrics,
    signal_quality,
    wide_table,
)
from llmflow.tasks.framework.store import StepContext

EXPORT_VERSION = "1"
EVALUATE_VERSION = "1"
LEADERBOARD_VERSION = "1"


class ExportConfig(BaseModel):
    """Export a trained checkpoint to Hugging Face format, optionally with new RoPE settings."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field(description="Human name of the checkpoint (stage3, extended, sft...).")
    rope_scaling: dict[str, Any] | None = Field(
        None, description="RoPE scaling to write into the export (YaRN at inference)."
    )
    max_seq_len: int | None = Field(None, description="Context length the export advertises.")


class LeaderboardConfig(BaseModel):
    """Which evaluations make one leaderboard, with their labels in order."""

    model_config = ConfigDict(extra="forbid")

    labels: list[str]


def export_step(ctx: StepContext) -> dict[str, Any]:
    """Write an HF directory (weights, config with rope parameters, tokenizer) for a checkpoint."""
    cfg: ExportConfig = ctx.config
    final = ctx.inputs["checkpoint"] / "final"
    fields = json.loads((final / "model_config.json").read_text())
    if cfg.rope_scaling is not None:
        fields["rope_scaling"] = cfg.rope_scaling
    if cfg.max_seq_len is not None:
        fields["max_seq_len"] = cfg.max_seq_len
    model_cfg = ModelConfig(**fields)
    export_hf(
        load_file(final / "model.safetensors"), model_cfg, ctx.out_dir, ctx.inputs["tokenizer"]
    )
    summary_path = ctx.inputs["checkpoint"] / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {
        "label": cfg.label,
        "tokens_seen": _total_tokens(ctx.inputs["checkpoint"], summary),
        "step": summary.get("step", summary.get("steps")),
        "num_parameters": model_cfg.num_parameters(),
    }


def _total_tokens(checkpoint: Path, summary: dict[str, Any]) -> int | None:
    """Tokens seen over the whole curriculum (the pretrain step records it), else this stage's."""
    lineage = checkpoint / "lineage.json"
    if lineage.exists():
        total = json.loads(lineage.read_text()).get("metrics", {}).get("total_tokens_seen")
        if total is not None:
            return total
    return summary.get("tokens_seen")


def evaluate_step(ctx: StepContext) -> dict[str, Any]:
    """Run the lm-eval suite on one export; publish the scores as a table."""
    heldout = ctx.inputs.get("heldout")
    heldout_docs = heldout / "validation_docs" if heldout is not None else None
    metrics = evaluate(ctx.config, ctx.inputs["model"], ctx.out_dir, heldout_dir=heldout_docs)
    rows = table_rows(json.loads((ctx.out_dir / "results.json").read_text()))
    ctx.report_table("evaluation", rows, f"lm-eval scores of {ctx.inputs['model'].name}")
    return metrics


def leaderboard_step(ctx: StepContext) -> dict[str, Any]:
    """Every evaluated model x task in one table, plots against tokens seen, signal quality."""
    records = []
    for label, eval_dir, model_dir in zip(
        ctx.config.labels, ctx.inputs["evaluations"], ctx.inputs["models"], strict=False
    ):
        record = json.loads((eval_dir / "results.json").read_text())
        lineage = json.loads((model_dir / "lineage.json").read_text())
        metrics = lineage.get("metrics", {})
        record["checkpoint"] = {
            "key": label,
            "tokens_seen": metrics.get("tokens_seen"),
            "step": metrics.get("step"),
        }
        records.append(record)
    rows = leaderboard_rows(records)
    wide = wide_table(rows)
    (ctx.out_dir / "leaderboard.json").write_text(json.dumps(wide, indent=1))
    (ctx.out_dir / "leaderboard.md").write_text(markdown_table(wide))
    quality = signal_quality(rows)
    (ctx.out_dir / "signal_quality.md").write_text(markdown_table(quality))
    num_plots = plot_metrics(rows, ctx.out_dir / "plots")
    ctx.report_markdown("leaderboard", markdown_table(wide), "Every checkpoint x task")
    return {"num_models": len(records), "num_plots": num_plots}
