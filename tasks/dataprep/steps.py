"""Store adapters for tokenize, per-stage mixtures and the validation set (no Prefect)."""

from __future__ import annotations

from typing import Any

from llmflow.tasks.dataprep.mixture import build_mixture, build_validation
from llmflow.tasks.dataprep.tokenize import tokenize_corpus
from llmflow.tasks.framework.store import StepContext

TOKENIZE_VERSION = "1"
MIXTURE_VERSION = "1"
VALIDATION_VERSION = "1"


def tokenize_step(ctx: StepContext) -> dict[str, Any]:
    """Tokenize every curated document once (train and held-out validation split)."""
    return tokenize_corpus(ctx.config, ctx.inputs["corpus"], ctx.inputs["tokenizer"], ctx.out_dir)


def mixture_step(ctx: StepContext) -> dict[str, Any]:
    """Pack one stage's mixture: weights, budget, offline sequence shuffle."""
    metrics = build_mixture(ctx.config, ctx.inputs["tokenized"], ctx.out_dir)
    return {k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}


def validation_step(ctx: StepContext) -> dict[str, Any]:
    """Pack the held-out documents for in-training validation loss."""
    metrics = build_validation(ctx.config, ctx.inputs["tokenized"], ctx.out_dir)
    return {k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}
