"""Shared helpers for dataprep tests: tiny packed datasets built from hand-made documents."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llmflow.tasks.dataprep.pack import write_packed

EOS, PAD, VOCAB = 1, 0, 1000


def make_docs(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    """Documents of the given lengths (eos included as the last token), tokens in [2, VOCAB)."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(2, VOCAB, n - 1), EOS) for n in lengths]


def pack_docs(docs: list[np.ndarray], out_dir: Path, seq_len: int, seed: int = 0, rows_per_shard=7):
    """Pack ``docs`` (in order) with `write_packed`, in chunks of three documents."""
    out_dir.mkdir(parents=True, exist_ok=True)
    chunks = [
        (np.concatenate(docs[i : i + 3]), [len(d) for d in docs[i : i + 3]])
        for i in range(0, len(docs), 3)
    ]
    return write_packed(
        chunks,
        out_dir,
        seq_len=seq_len,
        vocab_size=VOCAB,
        eos_id=EOS,
        pad_id=PAD,
        seed=seed,
        rows_per_shard=rows_per_shard,
    )


@pytest.fixture
def packed_36(tmp_path) -> Path:
    """36 rows of T=16 exactly (no padding), documents of mixed lengths, 6 shards."""
    rng = np.random.default_rng(1)
    total, lengths = 36 * 17, []
    while sum(lengths) < total:
        lengths.append(int(min(rng.integers(2, 40), total - sum(lengths))))
    if lengths[-1] < 2:  # keep every document at least one token plus eos
        tail = lengths.pop()
        lengths[-1] += tail
    pack_docs(make_docs(lengths), tmp_path / "packed", seq_len=16)
    return tmp_path / "packed"
