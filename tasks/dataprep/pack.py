"""Pack documents into fixed-length rows, shuffle rows offline, write shards and a doc index.

On-disk format of a packed dataset directory (read by `tasks.dataprep.loader.PackedLoader`):

- ``meta.json``: ``seq_len`` T, ``dtype`` ("uint16" | "uint32"), ``vocab_size``, ``eos_id``,
  ``pad_id``, ``num_sequences`` N, ``num_tokens`` (real tokens, padding excluded), ``shards``
  (``[{"file", "num_sequences"}]`` in row order), ``index`` (file names below) and whatever the
  caller adds (mixture report, ...). ``padding``: ``{"row", "start"}``, the stored row that holds
  the padding and the position in it where padding begins, or null when the last row is full.
  The loader masks padding by this position, never by token id: pad may equal eos (Qwen2.5,
  Qwen3, an imported Llama 3), and eos targets must still be trained.
- shard files ``shard_00000.bin``: raw little-endian arrays of shape ``(n, T+1)``, memory-mappable
  with ``np.memmap(path, dtype, mode="r").reshape(-1, T + 1)``. Row i of the dataset is row
  ``i - first_row(shard)`` of its shard; input = ``row[:-1]``, labels = ``row[1:]``.
- ``doc_offsets.bin`` (int64, N+1) and ``doc_starts.bin`` (int32): CSR index of document starts.
  The starts of row i are ``doc_starts[doc_offsets[i]:doc_offsets[i+1]]``: positions p in
  ``1..T`` where a new document begins (position 0 always begins a segment and is not stored).

Documents are written as ``tokens + [eos]`` back to back; the stream is cut into rows of T+1
tokens and the last row is filled with ``pad_id`` (labels there are ignored by the loader, which
finds them by ``padding`` above).
Rows are then permuted with the seed, so one long document never fills a batch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tqdm import tqdm

INDEX_FILES = {"doc_offsets": "doc_offsets.bin", "doc_starts": "doc_starts.bin"}


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id (uint16 up to 65,536 tokens)."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _write_stream(chunks: Iterable[tuple[np.ndarray, np.ndarray]], path: Path, dtype: np.dtype):
    """Write token chunks to ``path``; return the concatenated document lengths (int64)."""
    lengths = []
    with open(path, "wb") as f:
        for tokens, doc_lengths in chunks:
            np.ascontiguousarray(tokens, dtype=dtype).tofile(f)
            lengths.append(np.asarray(doc_lengths, dtype=np.int64))
    return np.concatenate(lengths) if lengths else np.zeros(0, np.int64)


def _row_index(doc_lengths: np.ndarray, num_rows: int, row_len: int):
    """CSR (offsets, starts) of document starts per unshuffled row, positions 1..row_len-1."""
    ends = np.cumsum(doc_lengths)
    starts = ends[ends < num_rows * row_len]  # every doc end is the next doc's (or pad's) start
    starts = starts[starts % row_len != 0]
    rows = starts // row_len
    counts = np.bincount(rows, minlength=num_rows)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return offsets, (starts % row_len).astype(np.int32)


def _permute_index(offsets: np.ndarray, starts: np.ndarray, perm: np.ndarray):
    """Reorder a CSR index so new row j holds old row perm[j]'s entries."""
    counts = np.diff(offsets)[perm]
    new_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    shift = np.repeat(offsets[:-1][perm] - new_offsets[:-1], counts)
    return new_offsets, starts[np.arange(len(starts), dtype=np.int64) + shift]


def write_packed(
    chunks: Iterable[tuple[np.ndarray, np.ndarray]],
    out_dir: Path,
    *,
    seq_len: int,
    vocab_size: int,
    eos_id: int,
    pad_id: int,
    seed: int,
    rows_per_shard: int,
    extra_meta: dict | None = None,
) -> dict:
    """Pack a stream of documents into shuffled fixed-length rows under ``out_dir``.

    Args:
        chunks: ``(tokens, doc_lengths)`` pairs in document order; ``tokens`` is the
            concatenation of whole documents, each already ending with ``eos_id``.
        out_dir: Existing directory that receives shards, index and ``meta.json``.
        seq_len: T; rows hold T+1 tokens.
        vocab_size, eos_id, pad_id: Recorded in ``meta.json``; ``vocab_size`` picks the dtype.
        seed: Seed of the offline row permutation.
        rows_per_shard: Rows per shard file.
        extra_meta: Merged into ``meta.json``.

    Returns:
        The ``meta.json`` contents.
    """
    out_dir = Path(out_dir)
    dtype, row_len = token_dtype(vocab_size), seq_len + 1
    stream_path = out_dir / "stream.tmp"
    doc_lengths = _write_stream(chunks, stream_path, dtype)
    num_tokens = int(doc_lengths.sum())
    if num_tokens == 0:
        stream_path.unlink()
        raise ValueError("nothing to pack: the selected documents hold no tokens")
    num_rows = -(-num_tokens // row_len)
    with open(stream_path, "ab") as f:
        np.full(num_rows * row_len - num_tokens, pad_id, dtype).tofile(f)
    offsets, starts = _row_index(doc_lengths, num_rows, row_len)
    perm = np.random.default_rng(seed).permutation(num_rows)
    pad_start = num_tokens - (num_rows - 1) * row_len  # in 1..row_len; row_len: no padding
    padding = None
    if pad_start < row_len:  # the last unshuffled row, wherever the permutation put it
        padding = {"row": int(np.flatnonzero(perm == num_rows - 1)[0]), "start": int(pad_start)}
    offsets, starts = _permute_index(offsets, starts, perm)
    offsets.tofile(out_dir / INDEX_FILES["doc_offsets"])
    starts.tofile(out_dir / INDEX_FILES["doc_starts"])
    shards = _write_shards(stream_path, perm, out_dir, dtype, row_len, rows_per_shard)
    stream_path.unlink()
    meta = {
        "seq_len": seq_len,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "pad_id": pad_id,
        "num_sequences": int(num_rows),
        "num_tokens": num_tokens,
        "num_documents": int(len(doc_lengths)),
        "padding": padding,
        "shards": shards,
        "index": INDEX_FILES,
        **(extra_meta or {}),
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def _write_shards(stream_path, perm, out_dir, dtype, row_len, rows_per_shard) -> list[dict]:
    """Gather rows of the unshuffled stream in ``perm`` order into shard files."""
    stream = np.memmap(stream_path, dtype=dtype, mode="r").reshape(-1, row_len)
    shards = []
    starts = range(0, len(perm), rows_per_shard)
    for k, begin in enumerate(
        tqdm(starts, desc="write shards", unit="shard", leave=False, disable=None)
    ):
        rows = perm[begin : begin + rows_per_shard]
        # NOTE: gather in sorted order (sequential reads), then undo the sort in memory.
        order = np.argsort(rows, kind="stable")
        block = np.empty((len(rows), row_len), dtype)
        block[order] = stream[rows[order]]
        name = f"shard_{k:05d}.bin"
        block.tofile(out_dir / name)
        shards.append({"file": name, "num_sequences": int(len(rows))})
    del stream
    return shards


def read_meta(data_dir: Path) -> dict:
    """Load ``meta.json`` of a packed dataset."""
    return json.loads((Path(data_dir) / "meta.json").read_text())


def read_all_rows(data_dir: Path) -> np.ndarray:
    """Every row of a packed dataset in stored order, shape (N, T+1). For tests and tools."""
    meta = read_meta(data_dir)
    blocks = [
        np.fromfile(Path(data_dir) / s["file"], dtype=meta["dtype"]).reshape(
            -1, meta["seq_len"] + 1
        )
        for s in meta["shards"]
    ]
    return np.concatenate(blocks)
