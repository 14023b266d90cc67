"""The long-context evaluation step (the extension stages themselves are pretrain steps)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from llmflow.tasks.extend.config import ExtendConfig, LongContextEvalConfig
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, report_table, step


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
    raise BadInputError(f"no document in {tokenized} has more than {min_tokens} tokens")


@step("longctx", version=1)
def longctx(
    cfg: LongContextEval, before: Path, after: Path, tokenizer: Path, tokenized: Path, out: Path
) -> Metrics:
    """Loss by position and passkey retrieval: before extension, after, and after + YaRN."""
    from llmflow.model.hf import load_model
    from llmflow.tasks.extend.longctx import with_rope

    extend = cfg.extend
    after_model = load_model(after / "final").eval()
    models = {
        "before": load_model(before / "final").eval(),
        "after": after_model,
        "after+yarn": with_rope(after_model, rope_scaling=extend.yarn_scaling()),
    }
    original = json.loads((before / "final" / "model_config.json").read_text())["max_seq_len"]
    report = _evaluate(models, extend.eval, tokenizer, tokenized)
    report["original_len"] = original
    _plot(report, original, out)
    (out / "longctx.json").write_text(json.dumps(report, indent=1))
    curves, grids = report["position_loss"], report["passkey"]
    beyond = {k: _mean_beyond(c, original) for k, c in curves.items()}
    accuracy = {k: float(np.mean(g["accuracy"])) for k, g in grids.items()}
    rows = [
        {
            "model": k,
            "loss_beyond_original": round(beyond[k], 4),
            "passkey_accuracy": round(accuracy[k], 3),
        }
        for k in models
    ]
    report_table("long-context", rows, f"Loss past position {original} and passkey accuracy")
    return {
        "loss_beyond_original_before": beyond["before"],
        "loss_beyond_original_after": beyond["after"],
        "passkey_accuracy_before": accuracy["before"],
        "passkey_accuracy_after": accuracy["after"],
        "num_long_docs": curves["after"]["num_docs"],
        "documents_split": report["documents_split"],
    }


def _evaluate(
    models: dict[str, Any], ev: LongContextEvalConfig, tokenizer: Path, tokenized: Path
) -> dict[str, Any]:
    """Loss-by-position curves and passkey grids of each model."""
    from llmflow.tasks.extend.longctx import passkey_grid, position_loss

    docs, split = long_documents(tokenized, ev.position_loss_len)
    text = _TextTokenizer(tokenizer)
    return {
        "documents_split": split,
        "position_loss": {
            k: position_loss(m, docs, ev.position_loss_len, ev.num_buckets)
            for k, m in models.items()
        },
        "passkey": {
            k: passkey_grid(m, text, ev.lengths, ev.depths, ev.trials, ev.seed)
            for k, m in models.items()
        },
    }


def _plot(report: dict[str, Any], original: int, out: Path) -> None:
    from llmflow.tasks.extend.longctx import plot_passkey, plot_position_loss

    plot_position_loss(report["position_loss"], original, out / "position_loss.png")
    plot_passkey(report["passkey"], out / "passkey.png")


def _mean_beyond(curve: dict[str, Any], original: int) -> float:
    values = [
        loss
        for start, loss in zip(curve["bucket_start"], curve["loss"], strict=False)
        if start >= original
    ]
    return float(np.mean(values)) if values else float("nan")
