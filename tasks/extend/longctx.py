"""Long-context evaluation: loss by token position, and passkey retrieval in RULER's format.

Both run on our own ``Transformer`` (no export needed), so they can be run on the same model with
different RoPE settings (base, YaRN) by swapping the config: before and after extension. The
``longctx`` step compares the model before extension, after it, and after it with YaRN.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from llmflow.model.transformer import Transformer
from llmflow.tasks.extend.config import ExtendConfig, LongContextEvalConfig
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, report_table, step

# RULER's "essay-free" haystack: repeated filler sentences.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic numbers for {key} is: {number}."
QUESTION = (
    "What is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
_KEYS = ["amber-fox", "cold-river", "silent-hill", "brave-owl", "quiet-lake", "red-stone"]


def with_rope(model: Transformer, **changes: Any) -> Transformer:
    """The same weights under another RoPE setting (e.g. ``rope_scaling`` for YaRN)."""
    cfg = dataclasses.replace(model.cfg, **changes)
    other = Transformer(cfg)
    other.load_state_dict(model.state_dict())
    return other.eval()


def _loss_totals(model: Transformer, rows: list[np.ndarray], seq_len: int) -> torch.Tensor:
    """(seq_len,) next-token loss at each position, summed over the rows."""
    totals = torch.zeros(seq_len)
    for row in rows:
        ids = torch.from_numpy(row)[None]
        logits = model(ids[:, :-1])  # (1, T, V)
        loss = torch.nn.functional.cross_entropy(logits[0].float(), ids[0, 1:], reduction="none")
        totals += loss
    return totals


@torch.no_grad()
def position_loss(
    model: Transformer, docs: list[np.ndarray], seq_len: int, num_buckets: int = 16
) -> dict[str, list[float]]:
    """Mean next-token loss by position bucket over documents at least ``seq_len + 1`` long.

    Each document contributes its first ``seq_len + 1`` tokens, so position p always means "the
    p-th token of a document" (no packing, no mask tricks). Returns bucket start positions,
    the mean loss per bucket and the number of documents used.
    """
    model.eval()
    rows = [d[: seq_len + 1].astype(np.int64) for d in docs if len(d) > seq_len]
    if not rows:
        raise BadInputError(f"no held-out document has more than {seq_len} tokens")
    mean = (_loss_totals(model, rows, seq_len) / len(rows)).numpy()
    edges = np.linspace(0, seq_len, num_buckets + 1).astype(int)
    return {
        "bucket_start": edges[:-1].tolist(),
        "loss": [float(mean[a:b].mean()) for a, b in zip(edges[:-1], edges[1:], strict=False)],
        "num_docs": len(rows),
    }


def passkey_prompt(
    tokenizer, length: int, depth: float, rng: random.Random
) -> tuple[list[int], str]:
    """Token ids of a haystack of about ``length`` tokens with the needle at ``depth`` (0..1)."""
    key, number = rng.choice(_KEYS), str(rng.randint(10000, 99999))
    needle = NEEDLE.format(key=key, number=number)
    question = QUESTION.format(key=key)
    budget = length - len(tokenizer.encode(needle + " " + question))
    filler_ids = tokenizer.encode(" " + FILLER)
    haystack = (filler_ids * (budget // max(len(filler_ids), 1) + 1))[: max(budget, 0)]
    # Cut the haystack at a sentence boundary near the requested depth.
    cut = int(len(haystack) * depth)
    before = tokenizer.decode(haystack[:cut])
    cut_text = before[: before.rfind(".") + 1] if "." in before else before
    after_ids = haystack[len(tokenizer.encode(cut_text)) :] if cut_text else haystack
    text = f"{cut_text} {needle}{tokenizer.decode(after_ids)} {question}"
    return tokenizer.encode(text), number


@torch.no_grad()
def greedy_generate(model: Transformer, ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding without a KV cache (contexts here are short enough)."""
    out = list(ids)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([out]))
        out.append(int(logits[0, -1].argmax()))
    return out[len(ids) :]


def passkey_grid(
    model: Transformer,
    tokenizer,
    lengths: list[int],
    depths: list[float],
    trials: int = 2,
    seed: int = 0,
    max_new_tokens: int = 8,
) -> dict[str, Any]:
    """Retrieval accuracy for each (length, depth): the number must appear in the generation."""
    rng = random.Random(seed)
    grid = []
    for length in lengths:
        row = []
        for depth in depths:
            hits = 0
            for _ in range(trials):
                ids, number = passkey_prompt(tokenizer, length, depth, rng)
                generated = tokenizer.decode(greedy_generate(model, ids, max_new_tokens))
                hits += number in generated
            row.append(hits / trials)
        grid.append(row)
    return {"lengths": lengths, "depths": depths, "accuracy": grid}


def plot_position_loss(curves: dict[str, dict[str, Any]], original_len: int, path: Path) -> None:
    """Loss by position for several models; a vertical line marks the original context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, curve in curves.items():
        ax.plot(curve["bucket_start"], curve["loss"], marker="o", label=label)
    ax.axvline(original_len, color="grey", linestyle="--", label="original context")
    ax.set_xlabel("token position in document")
    ax.set_ylabel("mean next-token loss")
    ax.set_title("Loss by position, before and after context extension")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_passkey(grids: dict[str, dict[str, Any]], path: Path) -> None:
    """One heat map (length x depth) per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(grids), figsize=(4.5 * len(grids), 3.8), squeeze=False)
    for ax, (label, grid) in zip(axes[0], grids.items(), strict=False):
        image = ax.imshow(np.array(grid["accuracy"]), vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(grid["depths"])), [f"{d:.0%}" for d in grid["depths"]])
        ax.set_yticks(range(len(grid["lengths"])), grid["lengths"])
        ax.set_xlabel("needle depth")
        ax.set_ylabel("context length (tokens)")
        ax.set_title(f"passkey: {label}")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ the step
class LongContextEval(BaseModel):
    """The long-context evaluation's config plus the YaRN setting it compares."""

    model_config = ConfigDict(extra="forbid")

    extend: ExtendConfig


class _TextTokenizer:
    """encode/decode without special tokens, over the raw `tokenizers` object."""

    def __init__(self, tokenizer_dir: Path):
        from llmflow.tasks.dataprep.tokenize import load_tokenizer

        self.tok = load_tokenizer(tokenizer_dir)

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
    plot_position_loss(report["position_loss"], original, out / "position_loss.png")
    plot_passkey(report["passkey"], out / "passkey.png")


def _mean_beyond(curve: dict[str, Any], original: int) -> float:
    values = [
        loss
        for start, loss in zip(curve["bucket_start"], curve["loss"], strict=False)
        if start >= original
    ]
    return float(np.mean(values)) if values else float("nan")
