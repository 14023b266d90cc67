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
- only when the caller gives each document's domain (a validation set packed ``by_domain``):
  ``segment_domains.bin`` (int32, ``index["segment_domains"]``), the domain of every segment of
  every row: row i's segments (the one at position 0, then one per start above) are entries
  ``doc_offsets[i] + i`` to ``doc_offsets[i+1] + i`` inclusive, each an index into
  ``meta["domains"]``, -1 for the padding. Without it the folder is byte for byte as before.

Documents are written as ``tokens + [eos]`` back to back; the stream is cut into rows of T+1
tokens and the last row is filled with ``pad_id`` (labels there are ignored by the loader, which
finds them by ``padding`` above).
Rows are then permuted with the seed, so one long document never fills a batch.

Units (execution only: the bytes are the same however they run): `write_packed_units` packs
documents that workers read themselves (a `DocumentSource`, by path on a shared filesystem). The
driver knows every document's length up front, so it preallocates ``stream.tmp`` and cuts the
documents into ranges of about `UNIT_TOKENS` tokens (at most `UNITS_PER_WORKER` per worker); a
unit writes its range's tokens at their prefix-sum offset, a chunk of documents at a time. The
shards are cut into runs of files the same way, and a unit gathers its run's rows from the
stream. Units run on the run's backend (`backend.current`): Ray tasks, spawned processes, or
this process one unit after another (the rule ingest and tokenize follow too). The driver holds the lengths, the row index and the permutation,
never the token stream; ``meta.json`` is written last, after every unit succeeded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm import tqdm

from llmflow.tasks.framework import backend

INDEX_FILES = {"doc_offsets": "doc_offsets.bin", "doc_starts": "doc_starts.bin"}
SEGMENT_DOMAINS = "segment_domains.bin"
UNIT_TOKENS = 8 * 2**20
"""Tokens a unit writes or gathers at least (16 MiB of uint16), so that a unit's start (a Ray
task, a pickled job, a source opened again) stays small beside its work."""
UNITS_PER_WORKER = 8
"""At most this many units per worker, so that unequal units even out."""
CHUNK_DOCS = 4096
"""Documents a stream unit reads and writes at once: its memory is one chunk, not its range."""


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
    doc_domains: np.ndarray | None = None,
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
        doc_domains: Each document's domain index (into ``extra_meta["domains"]``), written as
            ``segment_domains.bin``; None (the default) writes none.

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
    pack = _Pack(out_dir, stream_path, dtype, row_len, rows_per_shard)
    head = _head(seq_len, dtype, vocab_size, eos_id, pad_id)
    local = backend.LocalBackend()
    return _finish(pack, doc_lengths, seed, head, extra_meta, local.map, 1, doc_domains)


class DocumentSource(Protocol):
    """Documents a unit reads itself (picklable: it travels to the unit's worker)."""

    def open(self) -> Callable[[np.ndarray], np.ndarray]:
        """A reader: ``docs`` (a slice of the packed order) -> their tokens back to back, in
        that order, each document as long as its length in the driver's ``doc_lengths``."""
        ...


def write_packed_units(
    source: DocumentSource,
    docs: np.ndarray,
    doc_lengths: np.ndarray,
    out_dir: Path,
    *,
    seq_len: int,
    vocab_size: int,
    eos_id: int,
    pad_id: int,
    seed: int,
    rows_per_shard: int,
    extra_meta: dict | None = None,
    doc_domains: np.ndarray | None = None,
) -> dict:
    """`write_packed` of the documents ``docs`` read by units on the run's backend (module
    docstring).

    Args:
        source: Reads documents in the units.
        docs: The documents in packed order, as ``source``'s reader takes them (one row each).
        doc_lengths: Tokens of each document of ``docs`` (its eos included).
        out_dir, seq_len, vocab_size, eos_id, pad_id, seed, rows_per_shard, extra_meta: As in
            `write_packed`, whose bytes this writes.
        doc_domains: The domain index of each document of ``docs`` (into the caller's
            ``extra_meta["domains"]``), written as ``segment_domains.bin``; None writes none.

    Returns:
        The ``meta.json`` contents.
    """
    out_dir = Path(out_dir)
    dtype, row_len = token_dtype(vocab_size), seq_len + 1
    doc_lengths = np.asarray(doc_lengths, np.int64)
    if len(docs) != len(doc_lengths):
        raise ValueError(f"{len(docs)} documents but {len(doc_lengths)} lengths")
    num_tokens = int(doc_lengths.sum())
    if num_tokens == 0:
        raise ValueError("nothing to pack: the selected documents hold no tokens")
    pack = _Pack(out_dir, out_dir / "stream.tmp", dtype, row_len, rows_per_shard)
    head = _head(seq_len, dtype, vocab_size, eos_id, pad_id)
    try:
        units = backend.current()
        map_fn, workers = units.map, units.workers
        _write_stream_units(source, docs, doc_lengths, pack, pad_id, map_fn, workers)
        return _finish(pack, doc_lengths, seed, head, extra_meta, map_fn, workers, doc_domains)
    finally:
        pack.stream_path.unlink(missing_ok=True)  # NOTE: a failed unit leaves no meta.json


def _write_stream_units(source, docs, doc_lengths, pack: _Pack, pad_id: int, map_fn, workers):
    """The stream of `_write_stream`, padded to whole rows, at ``pack.stream_path``: the file is
    preallocated and each unit writes its documents at their prefix-sum offset."""
    dtype, row_len = pack.dtype, pack.row_len
    ends = np.cumsum(doc_lengths)
    num_tokens = int(ends[-1])
    num_rows = -(-num_tokens // row_len)
    with open(pack.stream_path, "wb") as f:
        f.truncate(num_rows * row_len * dtype.itemsize)
        f.seek(num_tokens * dtype.itemsize)
        f.write(np.full(num_rows * row_len - num_tokens, pad_id, dtype).tobytes())
    starts = ends - doc_lengths
    cuts = _cuts(starts, num_tokens, workers)
    units = [(docs[b:e], int(starts[b])) for b, e in pairwise(cuts)]
    written = map_fn(partial(_write_stream_unit, source, pack), units)
    expected = [int(ends[e - 1] - starts[b]) for b, e in pairwise(cuts)]
    if written != expected:  # a source that disagrees with the lengths would shift every row
        raise ValueError(
            f"the stream units wrote {written} tokens where the document lengths give {expected}"
        )


@dataclass(frozen=True)
class _Pack:
    """Where and how a unit writes: the output folder, the stream and the rows' layout."""

    out_dir: Path
    stream_path: Path
    dtype: np.dtype
    row_len: int
    rows_per_shard: int


def _cuts(starts: np.ndarray, total: int, workers: int) -> list[int]:
    """Boundaries of units over items starting at ``starts`` (sorted, from 0) of ``total``
    tokens: about equal token ranges of `UNIT_TOKENS` or more, at most `UNITS_PER_WORKER` per
    worker, every unit non-empty. Returns ``[0, ..., len(starts)]``."""
    units = max(1, min(-(-total // UNIT_TOKENS), UNITS_PER_WORKER * max(1, workers)))
    targets = np.arange(1, units, dtype=np.int64) * total // units
    inner = np.searchsorted(starts, targets, side="left")
    return sorted({0, len(starts), *(int(i) for i in inner if 0 < i < len(starts))})


def _write_stream_unit(source: DocumentSource, pack: _Pack, unit: tuple[np.ndarray, int]) -> int:
    """Write documents ``unit[0]`` at token ``unit[1]`` of the stream; return tokens written."""
    docs, offset = unit
    read = source.open()
    written = 0
    with open(pack.stream_path, "r+b") as f:
        f.seek(offset * pack.dtype.itemsize)
        for begin in range(0, len(docs), CHUNK_DOCS):
            tokens = np.ascontiguousarray(read(docs[begin : begin + CHUNK_DOCS]), pack.dtype)
            f.write(memoryview(tokens).cast("B"))
            written += len(tokens)
    return written


def _head(seq_len: int, dtype: np.dtype, vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """The first keys of ``meta.json``, in their order."""
    return {
        "seq_len": seq_len,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "pad_id": pad_id,
    }


def _finish(
    pack: _Pack, doc_lengths, seed, head: dict, extra_meta, map_fn, workers, doc_domains=None
) -> dict:
    """Index, permute and shard the padded stream, then write ``meta.json`` (last): ``head``
    (seq_len, dtype, vocab_size, eos_id, pad_id), the layout, ``extra_meta``; with
    ``doc_domains``, each row segment's domain too."""
    num_tokens = int(doc_lengths.sum())
    num_rows = -(-num_tokens // pack.row_len)
    perm = np.random.default_rng(seed).permutation(num_rows)
    index = _write_index(pack, doc_lengths, perm, doc_domains)
    shards = _write_shards(pack, perm, map_fn, workers)
    pack.stream_path.unlink()
    meta = {
        **head,
        "num_sequences": int(num_rows),
        "num_tokens": num_tokens,
        "num_documents": int(len(doc_lengths)),
        "padding": _padding(num_tokens, pack.row_len, perm),
        "shards": shards,
        "index": index,
        **(extra_meta or {}),
    }
    (pack.out_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def _padding(num_tokens: int, row_len: int, perm: np.ndarray) -> dict | None:
    """``meta.json``'s ``padding``: the stored row holding the padding and where it begins, or
    None when the last row is full."""
    num_rows = len(perm)
    pad_start = num_tokens - (num_rows - 1) * row_len  # in 1..row_len; row_len: no padding
    if pad_start >= row_len:
        return None
    # the last unshuffled row, wherever the permutation put it
    return {"row": int(np.flatnonzero(perm == num_rows - 1)[0]), "start": int(pad_start)}


def _write_index(pack: _Pack, doc_lengths, perm: np.ndarray, doc_domains) -> dict:
    """Write the document-start index of the permuted rows (and, given ``doc_domains``, the
    segment domains); return ``meta.json``'s ``index``."""
    offsets, starts = _row_index(doc_lengths, len(perm), pack.row_len)
    offsets, starts = _permute_index(offsets, starts, perm)
    offsets.tofile(pack.out_dir / INDEX_FILES["doc_offsets"])
    starts.tofile(pack.out_dir / INDEX_FILES["doc_starts"])
    if doc_domains is None:
        return INDEX_FILES
    domains = _segment_domains(offsets, starts, perm, doc_lengths, doc_domains, pack.row_len)
    domains.tofile(pack.out_dir / SEGMENT_DOMAINS)
    return {**INDEX_FILES, "segment_domains": SEGMENT_DOMAINS}


def _segment_domains(offsets, starts, perm, doc_lengths, doc_domains, row_len) -> np.ndarray:
    """The domain of every segment of every stored row (layout in the module docstring): the
    document that holds the segment's first position in the unshuffled stream, -1 past the
    last document (padding)."""
    num_rows = len(perm)
    counts = np.diff(offsets) + 1  # the segment at position 0, then one per start
    first = offsets[:-1] + np.arange(num_rows)
    local = np.zeros(int(counts.sum()), np.int64)
    later = np.ones(len(local), bool)
    later[first] = False
    local[later] = starts  # rows in order, each row's starts in order
    position = np.repeat(perm.astype(np.int64) * row_len, counts) + local
    doc = np.searchsorted(np.cumsum(doc_lengths), position, side="right")
    domains = np.full(len(position), -1, np.int32)
    inside = doc < len(doc_lengths)
    domains[inside] = np.asarray(doc_domains)[doc[inside]]
    return domains


def _write_shards(pack: _Pack, perm: np.ndarray, map_fn, workers: int) -> list[dict]:
    """Gather rows of the unshuffled stream in ``perm`` order into shard files, runs of shards
    as units on ``map_fn``."""
    firsts = np.arange(0, len(perm), pack.rows_per_shard, dtype=np.int64)
    cuts = _cuts(firsts * pack.row_len, len(perm) * pack.row_len, workers)
    units = [
        (int(b), perm[firsts[b] : firsts[e - 1] + pack.rows_per_shard]) for b, e in pairwise(cuts)
    ]
    return [shard for run in map_fn(partial(_write_shard_run, pack), units) for shard in run]


def _write_shard_run(pack: _Pack, unit: tuple[int, np.ndarray]) -> list[dict]:
    """Write shard files ``unit[0]``, ... with the stream's rows ``unit[1]``, in that order."""
    first, rows_of_run = unit
    stream = np.memmap(pack.stream_path, dtype=pack.dtype, mode="r").reshape(-1, pack.row_len)
    shards = []
    starts = range(0, len(rows_of_run), pack.rows_per_shard)
    for k, begin in enumerate(
        tqdm(starts, desc="write shards", unit="shard", leave=False, disable=None), first
    ):
        rows = rows_of_run[begin : begin + pack.rows_per_shard]
        # NOTE: gather in sorted order (sequential reads), then undo the sort in memory.
        order = np.argsort(rows, kind="stable")
        block = np.empty((len(rows), pack.row_len), pack.dtype)
        block[order] = stream[rows[order]]
        name = f"shard_{k:05d}.bin"
        block.tofile(pack.out_dir / name)
        shards.append({"file": name, "num_sequences": int(len(rows))})
    del stream
    return shards


def read_meta(data_dir: Path) -> dict:
    """Load ``meta.json`` of a packed dataset."""
    return json.loads((Path(data_dir) / "meta.json").read_text())
