"""Tokenizer quality per domain: fertility, continued-word rate, bytes per token; table and plot."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer


def _word_counts(tokenizer: Tokenizer, texts: list[str]) -> tuple[int, int, int]:
    """Words, their tokens (each word encoded alone after a space) and words of 2+ tokens."""
    words = Counter(w for t in texts for w in t.split())
    vocab = list(words)
    lengths = [len(e.ids) for e in tokenizer.encode_batch_fast([" " + w for w in vocab])]
    num_words = sum(words.values())
    word_tokens = sum(words[w] * n for w, n in zip(vocab, lengths, strict=True))
    continued = sum(words[w] for w, n in zip(vocab, lengths, strict=True) if n > 1)
    return num_words, word_tokens, continued


def domain_stats(tokenizer: Tokenizer, texts: list[str]) -> dict:
    """Statistics of ``tokenizer`` on ``texts``.

    Words are whitespace-separated strings, each encoded on its own with a leading space (as it
    appears mid-sentence), as in Rust et al. 2021 ("How good is your tokenizer?"):

    - fertility: tokens per word;
    - continued_word_rate: share of words split into more than one token;
    - bytes_per_token: UTF-8 bytes of the whole texts per token of the whole texts.
    """
    num_tokens = sum(len(e.ids) for e in tokenizer.encode_batch_fast(texts))
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)
    num_words, word_tokens, continued = _word_counts(tokenizer, texts)
    return {
        "num_docs": len(texts),
        "num_words": num_words,
        "num_tokens": num_tokens,
        "fertility": round(word_tokens / max(num_words, 1), 4),
        "continued_word_rate": round(continued / max(num_words, 1), 4),
        "bytes_per_token": round(num_bytes / max(num_tokens, 1), 4),
    }


def evaluate_tokenizer(tokenizer: Tokenizer, docs_by_domain: dict[str, list[str]]) -> list[dict]:
    """One row per domain plus an ``all`` row, each tagged with the vocabulary size."""
    size = tokenizer.get_vocab_size()
    tokenizer.encode_special_tokens = True  # NOTE: literal "<|endoftext|>" in text is just text
    rows = [
        {"vocab_size": size, "domain": domain, **domain_stats(tokenizer, texts)}
        for domain, texts in sorted(docs_by_domain.items())
    ]
    every = [t for texts in docs_by_domain.values() for t in texts]
    rows.append({"vocab_size": size, "domain": "all", **domain_stats(tokenizer, every)})
    tokenizer.encode_special_tokens = False
    return rows


def write_report(rows: list[dict], out_dir: Path, chosen_vocab_size: int) -> None:
    """Write ``tokenizer_eval.json`` (the rows) and ``tokenizer_eval.png`` (metric vs size)."""
    report = {"chosen_vocab_size": chosen_vocab_size, "rows": rows}
    (Path(out_dir) / "tokenizer_eval.json").write_text(json.dumps(report, indent=2))
    plot_report(rows, Path(out_dir) / "tokenizer_eval.png")


def plot_report(rows: list[dict], path: Path) -> None:
    """Three panels (one per metric) of value against vocabulary size, one line per domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["fertility", "continued_word_rate", "bytes_per_token"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, metric in zip(axes, metrics, strict=True):
        for domain in sorted({r["domain"] for r in rows}):
            points = sorted((r["vocab_size"], r[metric]) for r in rows if r["domain"] == domain)
            ax.plot(*zip(*points, strict=True), marker="o", label=domain)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("vocabulary size")
        ax.set_title(metric)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
