"""A deterministic, resumable loader over a packed dataset (see `tasks.dataprep.pack`).

The data order is an infinite stream of sequences: epoch e is a permutation of all N rows
computed from ``(seed, e)``. Global step k of the whole data-parallel group consumes the next
``world_size * batch_size`` sequences of that stream; rank r takes the r-th block of
``batch_size``. The state is three integers (epoch, position in the epoch, seed), so it does not
grow with the number of steps, and changing the batch size or world size mid-run neither repeats
nor skips a sequence. Rows are read with ``pread`` (no memory map), so resident memory stays
flat however much of the dataset has been read.

Labels: ``labels[b, t] = row[t + 1]``, except ``-100`` (ignored by cross entropy) where the
target is the first token of a new document (the input there is the previous document's eos,
and under document masking that position cannot see the new document) and where the target is
padding (the tail of one row, found by position from ``meta["padding"]``). Padding is never
found by token id: pad equals eos for Qwen2.5, Qwen3 and an imported Llama 3, and masking every
``pad_id`` label would mask every document's end, so the model would never learn to stop.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from llmflow.tasks.dataprep.pack import read_meta

IGNORE_INDEX = -100


class _Files:
    """Open file handles, reopened after a fork so workers never share a file offset."""

    def __init__(self, paths: list[Path]):
        self.paths, self.pid, self.fds = paths, None, []

    def get(self, i: int) -> int:
        if self.pid != os.getpid():
            self.fds = [os.open(p, os.O_RDONLY) for p in self.paths]
            self.pid = os.getpid()
        return self.fds[i]

    def close(self) -> None:
        if self.pid == os.getpid():
            for fd in self.fds:
                os.close(fd)
        self.fds, self.pid = [], None


def _pread(fd: int, dtype: np.dtype, count: int, item_offset: int) -> np.ndarray:
    nbytes = count * dtype.itemsize
    data = os.pread(fd, nbytes, item_offset * dtype.itemsize)
    if len(data) != nbytes:
        raise OSError(f"short read: wanted {nbytes} bytes, got {len(data)}; is the dataset cut?")
    return np.frombuffer(data, dtype=dtype)


def _nonempty_meta(data_dir: Path) -> dict:
    """``meta.json`` of a packed dataset that holds at least one sequence."""
    meta = read_meta(data_dir)
    if meta["num_sequences"] < 1:
        raise ValueError(f"{data_dir} holds no sequences; rebuild the packed dataset")
    return meta


class PackedLoader:
    """Yields batches of packed sequences for one data-parallel rank, forever.

    Each batch is a dict of tensors: ``input_ids`` (B, T) long, ``labels`` (B, T) long,
    ``position_ids`` (B, T) long restarting at 0 at each document start and at each row start,
    and ``cu_seqlens`` 1-D int32 over the flattened B*T tokens (flash-attn varlen convention;
    every multiple of T is a boundary). Example: B=2, T=4, documents [3, 1 | 4] give
    ``cu_seqlens = [0, 3, 4, 8]``. With ``with_domains`` (a set packed with its documents'
    domains), also ``domains`` (B, T) long: the domain of the document each label's target
    belongs to, an index into ``domain_names``, -1 in the padding.
    """

    def __init__(
        self,
        data_dir: str | Path,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        with_domains: bool = False,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.data_dir = Path(data_dir)
        self.meta = _nonempty_meta(self.data_dir)
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.set_batch_size(batch_size)
        self.epoch, self.position = 0, 0
        self._dtype = np.dtype(self.meta["dtype"])
        counts = [s["num_sequences"] for s in self.meta["shards"]]
        self._shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.with_domains = with_domains
        self.domain_names: list[str] | None = self.meta.get("domains")
        self._files = _Files(self._file_paths())
        self._perms: dict[int, np.ndarray] = {}
        self._padding = self._find_padding()

    def _file_paths(self) -> list[Path]:
        """The files `_Files` opens: shards in order, doc offsets, doc starts (and segment
        domains ``with_domains``)."""
        index = self.meta["index"]
        paths = [self.data_dir / s["file"] for s in self.meta["shards"]]
        paths += [self.data_dir / index["doc_offsets"], self.data_dir / index["doc_starts"]]
        if self.with_domains:
            if "segment_domains" not in index:
                raise ValueError(
                    f"{self.data_dir} records no per-document domains; pack the validation set "
                    "with validation.by_domain=true"
                )
            paths.append(self.data_dir / index["segment_domains"])
        return paths

    @property
    def seq_len(self) -> int:
        return int(self.meta["seq_len"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def num_sequences(self) -> int:
        return int(self.meta["num_sequences"])

    def set_batch_size(self, batch_size: int) -> None:
        """Change the per-rank batch size; takes effect at the next batch, nothing is skipped."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.batch_size = batch_size

    def state_dict(self) -> dict:
        """Where the whole data-parallel group is in the stream (identical on every rank)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_sequences": self.num_sequences,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`; refuses a state taken on a different dataset."""
        if state.get("num_sequences", self.num_sequences) != self.num_sequences:
            raise ValueError(
                f"state was taken on a dataset of {state['num_sequences']} sequences, this one "
                f"has {self.num_sequences}; resume with the same packed dataset"
            )
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
        self._perms.clear()

    def __iter__(self):
        while True:
            yield self.next_batch()

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next batch for this rank; advances the group's position by world_size*batch."""
        rows = self._row_ids(self.rank * self.batch_size, self.batch_size)
        step = self.world_size * self.batch_size
        self.epoch += (self.position + step) // self.num_sequences
        self.position = (self.position + step) % self.num_sequences
        return self._collate(rows)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # keep only the current and the next epoch
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.num_sequences)
        return self._perms[epoch]

    def _row_ids(self, offset: int, count: int) -> np.ndarray:
        """Dataset rows at stream positions ``position + offset + [0, count)``."""
        stream = self.epoch * self.num_sequences + self.position + offset + np.arange(count)
        epochs, positions = np.divmod(stream, self.num_sequences)
        rows = np.empty(count, np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            rows[mask] = self._permutation(int(epoch))[positions[mask]]
        return rows

    def _find_padding(self) -> tuple[int, int] | None:
        """(stored row, first padded position) of the padding, or None when there is none."""
        if "padding" in self.meta:
            padding = self.meta["padding"]
            return None if padding is None else (int(padding["row"]), int(padding["start"]))
        # A dataset packed before meta recorded it: the padded row is the one whose last
        # document start is where the padding must begin and whose tail from there is pad_id.
        row_len, rows = self.seq_len + 1, self.num_sequences
        start = int(self.meta["num_tokens"]) - (rows - 1) * row_len
        if start == row_len:
            return None
        return self._search_padding(start)

    def _search_padding(self, start: int) -> tuple[int, int]:
        """The one stored row whose last document starts at ``start`` and whose tail from there
        is pad_id (a dataset packed before meta.json recorded its padding)."""
        index = self.meta["index"]
        offsets = np.fromfile(self.data_dir / index["doc_offsets"], np.int64)
        starts = np.fromfile(self.data_dir / index["doc_starts"], np.int32)
        has = np.flatnonzero(offsets[1:] > offsets[:-1])
        candidates = has[starts[offsets[has + 1] - 1] == start]
        found = [
            int(r)
            for r in candidates
            if (self._read_row(int(r))[0][start:] == self.meta["pad_id"]).all()
        ]
        if len(found) != 1:
            raise ValueError(
                f"{self.data_dir}/meta.json has no 'padding' and {len(found)} rows could hold "
                "it; rebuild the packed dataset"
            )
        return found[0], start

    def _read_row(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens (T+1) and document-start positions (1..T) of one dataset row."""
        shard = int(np.searchsorted(self._shard_starts, row, side="right") - 1)
        row_len = self.seq_len + 1
        local = row - int(self._shard_starts[shard])
        tokens = _pread(self._files.get(shard), self._dtype, row_len, local * row_len)
        num_shards = len(self._shard_starts) - 1
        lo, hi = _pread(self._files.get(num_shards), np.dtype(np.int64), 2, row)
        starts = _pread(self._files.get(num_shards + 1), np.dtype(np.int32), int(hi - lo), int(lo))
        return tokens, starts

    def _row_domains(self, row: int) -> np.ndarray:
        """The domain of each segment of one dataset row (pack.py's ``segment_domains``)."""
        num_shards = len(self._shard_starts) - 1
        lo, hi = _pread(self._files.get(num_shards), np.dtype(np.int64), 2, row)
        fd = self._files.get(num_shards + 2)
        return _pread(fd, np.dtype(np.int32), int(hi - lo) + 1, int(lo) + row)

    def _read_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens (B, T+1) of dataset ``rows`` and where their documents begin (B, T+1 bool)."""
        tokens = np.empty((len(rows), self.seq_len + 1), np.int64)
        begins = np.zeros((len(rows), self.seq_len + 1), bool)  # True where a document begins
        begins[:, 0] = True
        for b, row in enumerate(rows):
            tokens[b], starts = self._read_row(int(row))
            begins[b, starts] = True
        return tokens, begins

    def _collate(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        B, T = len(rows), self.seq_len
        tokens, begins = self._read_rows(rows)
        labels = tokens[:, 1:].copy()
        labels[begins[:, 1:]] = IGNORE_INDEX  # target is the first token of the next document
        if self._padding is not None:
            padded_row, start = self._padding
            labels[rows == padded_row, start - 1 :] = IGNORE_INDEX  # label t is token t+1
        seg = begins[:, :T]
        idx = np.arange(T)
        last_begin = np.maximum.accumulate(np.where(seg, idx, 0), axis=1)
        cu = np.concatenate([np.flatnonzero(seg.ravel()), [B * T]]).astype(np.int32)
        batch = {
            "input_ids": torch.from_numpy(tokens[:, :T].copy()),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(idx - last_begin),
            "cu_seqlens": torch.from_numpy(cu),
        }
        if self.with_domains:
            batch["domains"] = self._label_domains(rows, begins)
        return batch

    def _label_domains(self, rows: np.ndarray, begins: np.ndarray) -> torch.Tensor:
        """The domain of each label's target (B, T) long: its segment's, -1 in the padding."""
        segment = np.cumsum(begins, axis=1)[:, 1:] - 1  # label t: its target's segment
        domains = np.stack(
            [self._row_domains(int(r))[s] for r, s in zip(rows, segment, strict=True)]
        )
        return torch.from_numpy(domains.astype(np.int64))

    def close(self) -> None:
        """Close the shard files (also done on garbage collection)."""
        self._files.close()

    def __del__(self):
        files = getattr(self, "_files", None)  # absent when __init__ raised
        if files is not None:
            files.close()
