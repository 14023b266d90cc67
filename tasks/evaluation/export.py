"""The ``export`` step: a trainer checkpoint as a Hugging Face folder in ``<output>/hf/``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file

from llmflow.model.config import ModelConfig
from llmflow.model.hf import export_hf
from llmflow.tasks.evaluation.models import hf_dir, write_progress
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.summaries import ModelSize, MoeModelSize


class ExportConfig(BaseModel):
    """Export a trained checkpoint to Hugging Face format, optionally with new RoPE settings."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field(description="Human name of the checkpoint (stage3, extended, sft...).")
    rope_scaling: dict[str, Any] | None = Field(
        None, description="RoPE scaling to write into the export (YaRN at inference)."
    )
    max_seq_len: int | None = Field(None, description="Context length the export advertises.")


@step("export")
def export(cfg: ExportConfig, checkpoint: Path, tokenizer: Path, out: Path) -> Metrics:
    """Write a checkpoint's Hugging Face folder (weights, config, tokenizer) into hf/."""
    final = checkpoint / "final"
    fields = json.loads((final / "model_config.json").read_text())
    if cfg.rope_scaling is not None:
        fields["rope_scaling"] = cfg.rope_scaling
    if cfg.max_seq_len is not None:
        fields["max_seq_len"] = cfg.max_seq_len
    model_cfg = ModelConfig(**fields)
    export_hf(load_file(final / "model.safetensors"), model_cfg, hf_dir(out), tokenizer)
    summary_path = checkpoint / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    # The trainer's summary counts the whole curriculum in total_tokens_seen (older: tokens_seen).
    tokens_seen = summary.get("total_tokens_seen", summary.get("tokens_seen"))
    train_step = summary.get("step", summary.get("steps"))
    write_progress(out, tokens_seen, train_step)
    size = {
        "label": cfg.label,
        "tokens_seen": tokens_seen,
        "step": train_step,
        "num_parameters": model_cfg.num_parameters(),
    }
    if model_cfg.num_experts:  # a mixture of experts: also what one token goes through
        return MoeModelSize.written({**size, "active_parameters": model_cfg.active_parameters()})
    return ModelSize.written(size)
