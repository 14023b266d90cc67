"""Store adapters for context extension and the long-context evaluation (no Prefect)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from llmflow.tasks.dataprep.config import StageMixture
from llmflow.tasks.extend.config import ExtendConfig, ExtensionStage
from llmflow.tasks.framework.store import StepContext
from llmflow.tasks.pretrain.config import TrainConfig

LONGCTX_VERSION = "1"


def extension_mixture(cfg: ExtendConfig, stage: ExtensionStage, seed: int) -> StageMixture:
    """The packed data of one extension stage, at its sequence length."""
    return StageMixture(
        weights=cfg.weights,
        num_tokens=stage.num_tokens,
        seq_len=stage.seq_len,
        max_epochs=cfg.max_epochs,
        on_overflow="reweight",
        seed=seed,
    )


def extension_train_config(base: TrainConfig, stage: ExtensionStage) -> TrainConfig:
    """The trainer config of one extension stage: longer context, raised RoPE base, own schedule."""
    overrides = {
        **base.model.overrides,
        "max_seq_len": stage.seq_len,
        "rope_theta": stage.rope_theta,
    }
    data = base.model_dump()
    data["model"]["overrides"] = overrides
    data["optimizer"]["lr"] = stage.lr
    data["schedule"].update(
        name="cosine", warmup_steps=stage.warmup_steps, total_steps=None, per_stage=True
    )
    data["batch"].update(micro_batch_size=stage.micro_batch_size, warmup_start_micro_batch=None)
    data.update(max_steps=None, num_tokens=stage.num_tokens)
    return TrainConfig.model_validate(data)


class LongContextEval(BaseModel):
    """The long-context evaluation's config plus the YaRN setting it compares."""

    model_config = ConfigDict(extra="forbid")

    extend: ExtendConfig


class _TextTokenizer:
    """encode/decode without special tokens, over the raw `tokenizers` object."""

    def __init__(self, tokenizer_dir: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def long_documents(tokenized: Path, min_tokens: int) -> tuple[list[np.ndarray], str]:
    """Held-out documents longer than ``min_tokens`` (training ones only if none is held out)."""
    meta = json.loads((tokenized / "meta.json").read_text())
    for split in ("validation", "train"):
        docs = []
        for info in meta[split].values():
            folder = tokenized / info["dir"]
            if not (folder / "tokens.bin").exists():
                continue
            tokens = np.fromfile(folder / "tokens.bin", dtype=meta["dtype"])
            offsets = np.load(folder / "offsets.npy")
            docs += [
                tokens[a:b]
                for a, b in zip(offsets[:-1], offsets[1:], strict=False)
                if b - a > min_tokens
            ]
        if docs:
            return docs, split
    raise ValueError(f"no document in {tokenized} has more than {min_tokens} tokens")


def longctx_step(ctx: StepContext) -> dict[str, Any]:
    """Loss by position and passkey retrieval: before extension, after, and after + YaRN."""
    from llmflow.model.hf import load_model
    from llmflow.tasks.extend.longctx import (
        passkey_grid,
        plot_passkey,
        plot_position_loss,
        position_loss,
        with_rope,
    )

    cfg = ctx.config.extend
    ev = cfg.eval
    before = load_model(ctx.inputs["before"] / "final").eval()
    after = load_model(ctx.inputs["after"] / "final").eval()
    yarn = with_rope(after, rope_scaling=cfg.yarn_scaling())
    models = {"before": before, "after": after, "after+yarn": yarn}
    docs, split = long_documents(ctx.inputs["tokenized"], ev.position_loss_len)
    curves = {
        k: position_loss(m, docs, ev.position_loss_len, ev.num_buckets) for k, m in models.items()
    }
    tokenizer = _TextTokenizer(ctx.inputs["tokenizer"])
    grids = {
        k: passkey_grid(m, tokenizer, ev.lengths, ev.depths, ev.trials, ev.seed)
        for k, m in models.items()
    }
    original = json.loads((ctx.inputs["before"] / "final" / "model_config.json").read_text())[
        "max_seq_len"
    ]
    plot_position_loss(curves, original, ctx.out_dir / "position_loss.png")
    plot_passkey(grids, ctx.out_dir / "passkey.png")
    report = {
        "documents_split": split,
        "original_len": original,
        "position_loss": curves,
        "passkey": grids,
    }
    (ctx.out_dir / "longctx.json").write_text(json.dumps(report, indent=1))
    beyond = {k: _mean_beyond(c, original) for k, c in curves.items()}
    rows = [
        {
            "model": k,
            "loss_beyond_original": round(beyond[k], 4),
            "passkey_accuracy": round(float(np.mean(grids[k]["accuracy"])), 3),
        }
        for k in models
    ]
    ctx.report_table("long-context", rows, f"Loss past position {original} and passkey accuracy")
    return {
        "loss_beyond_original_before": beyond["before"],
        "loss_beyond_original_after": beyond["after"],
        "passkey_accuracy_before": float(np.mean(grids["before"]["accuracy"])),
        "passkey_accuracy_after": float(np.mean(grids["after"]["accuracy"])),
        "num_long_docs": curves["after"]["num_docs"],
        "documents_split": split,
    }


def _mean_beyond(curve: dict[str, Any], original: int) -> float:
    values = [
        loss
        for start, loss in zip(curve["bucket_start"], curve["loss"], strict=False)
        if start >= original
    ]
    return float(np.mean(values)) if values else float("nan")
