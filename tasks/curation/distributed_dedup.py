"""Exact and near deduplication as partitioned map/reduce stages: bounded memory per worker.

The single-process global steps hold every document at once: the near-dedup step loads every
band key into one table and runs a union-find over all documents. Here each stage is a map over
units (source files, or partitions), and each unit holds only its slice of the data:

1. **survivors**: a map over the source files (hash or band-key files) gives every row its
   global position ``pos`` (file index in name order << 32 | row), the order the single-process
   steps keep by. When the step is given the alive (filtered) shards, rows and alive ids are
   both shuffled by a hash of the id and each id partition keeps the rows whose id is alive (a
   semi-join: no worker ever holds every id).
2. **shuffle by key**: the surviving rows go to partitions by a prefix of their key: the
   document hash (exact), or the (band, key) pair (near).
3. **per partition**: exact dedup keeps the first row (lowest ``pos``) of every hash and drops
   the others; near dedup groups equal (band, key) and emits the group's duplicate pairs as a
   star (each member paired with the group's lowest ``pos``), not all pairs.
4. **driver**: only the drops (exact) or the pairs (near) come back. Near dedup runs the
   union-find over the documents in pairs only, then looks up their ids and lengths: memory
   grows with duplicates, not with documents.

The result is the single-process steps' own: the same drops in the same order, the same clusters
and keepers (tests/tasks/curation/test_distributed_dedup.py compares them).

The stages run through a map function: in-process (`local_map`), or a backend's ``map``
(`backend.Backend`: Ray tasks or spawned processes with a bounded number in flight; fresh
processes per item measure a worker's memory). Without one they run on the run's backend
(`backend.current`: Ray or processes, else this process). The partitions
are files in a scratch folder inside the step's output, removed at the end: on Ray, workers must
see it (one machine, or a volume shared by the nodes).

``run_partitioned(kind, cfg, sources, out, alive_shards, map_fn=...)`` is the entry the two
global steps call (``method: partitioned``) and that an engine may call with its own map.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from llmflow.tasks.curation.minhash import UnionFind, _mix
from llmflow.tasks.curation.shards import shards_in
from llmflow.tasks.framework.errors import BadInputError

ROW_BITS = 32
"""``pos`` = file index << ROW_BITS | row: rows per source file must stay below 2**32."""
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # spreads the band number over the key's bits

MapFn = Callable[[Callable[[Any], Any], Sequence[Any]], list]
"""``map_fn(fn, items)`` returns ``[fn(item) for item in items]``, wherever it runs them."""


# --- map functions -----------------------------------------------------------------------------


def local_map(fn: Callable[[Any], Any], items: Sequence[Any]) -> list:
    """Runs every item in this process, in order."""
    return [fn(item) for item in items]


# --- partitioned files -------------------------------------------------------------------------


def _range_partition(prefix: np.ndarray, partitions: int) -> np.ndarray:
    """The partition of each 64-bit key by its top 32 bits (a prefix range per partition)."""
    return ((prefix >> np.uint64(32)) * np.uint64(partitions) >> np.uint64(32)).astype(np.int64)


def _id_partitions(ids: pa.ChunkedArray | pa.Array, partitions: int) -> np.ndarray:
    prefixes = np.fromiter(
        (
            int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "big")
            for i in ids.to_pylist()
        ),
        np.uint64,
        len(ids),
    )
    return _range_partition(prefixes, partitions)


def _write_pieces(
    table: pa.Table, part: np.ndarray, directory: Path, unit: int, partitions: int
) -> None:
    """Writes the rows of `table` into ``directory/part-PPPPP/unit-UUUUUU.parquet`` by `part`."""
    order = np.argsort(part, kind="stable")
    table, part = table.take(pa.array(order)), part[order]
    bounds = np.searchsorted(part, np.arange(partitions + 1))
    for p in range(partitions):
        lo, hi = int(bounds[p]), int(bounds[p + 1])
        if hi > lo:
            folder = directory / f"part-{p:05d}"
            folder.mkdir(parents=True, exist_ok=True)
            pq.write_table(table.slice(lo, hi - lo), folder / f"unit-{unit:06d}.parquet")


def _read_pieces(directory: Path, p: int) -> pa.Table | None:
    files = sorted((directory / f"part-{p:05d}").glob("*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files]) if files else None


def source_files(dirs: list[Path], suffix: str) -> list[Path]:
    """The per-shard files of a global step in the order it keeps by (name; then dir order)."""
    return sorted(
        (p for d in dirs for p in Path(d).glob(f"*.{suffix}.parquet")), key=lambda p: p.name
    )


# --- jobs: what a stage does with its unit ------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """The settings every task of one run reads (picklable: it travels to the workers)."""

    scratch: str
    partitions: int
    columns: tuple[str, ...]
    with_alive: bool
    exclude: tuple[str, ...] = ()

    @property
    def root(self) -> Path:
        return Path(self.scratch)

    def emit(self, table: pa.Table, unit: int) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class ExactJob(_Job):
    """Exact dedup: rows (id[, paragraph], hash, pos) shuffled by a prefix of the hash."""

    def emit(self, table: pa.Table, unit: int) -> int:
        hashes = table.column("hash").combine_chunks()
        prefix = np.frombuffer(b"".join(h[:8] for h in hashes.to_pylist()), ">u8")
        part = _range_partition(prefix.astype(np.uint64), self.partitions)
        _write_pieces(table, part, self.root / "keys", unit, self.partitions)
        return table.num_rows


@dataclass(frozen=True)
class NearJob(_Job):
    """Near dedup: (band, key, pos) rows shuffled by (band, key); (pos, id, length) kept aside."""

    num_buckets: int = 14

    def emit(self, table: pa.Table, unit: int) -> int:
        nodes = table.select(["pos", "id", "length"])
        (self.root / "nodes").mkdir(parents=True, exist_ok=True)
        pq.write_table(nodes, self.root / "nodes" / f"unit-{unit:06d}.parquet")
        n = table.num_rows
        keys = np.concatenate(
            [table.column(f"band_{b:02d}").to_numpy() for b in range(self.num_buckets)]
            or [np.zeros(0, np.uint64)]
        ).astype(np.uint64)
        bands = np.repeat(np.arange(self.num_buckets, dtype=np.int16), n)
        pos = np.tile(table.column("pos").to_numpy(), self.num_buckets)
        with np.errstate(over="ignore"):
            part = _range_partition(
                _mix(keys ^ (bands.astype(np.uint64) * _GOLDEN)), self.partitions
            )
        rows = pa.table({"band": bands, "key": keys, "pos": pos})
        _write_pieces(rows, part, self.root / "bands", unit, self.partitions)
        return n


def _with_positions(path: str, file_index: int, columns: tuple[str, ...]) -> pa.Table:
    table = pq.read_table(path, columns=list(columns))
    if table.num_rows >= 1 << ROW_BITS:
        raise BadInputError(f"{path} has {table.num_rows} rows; at most 2**{ROW_BITS} - 1")
    pos = (np.int64(file_index) << ROW_BITS) + np.arange(table.num_rows, dtype=np.int64)
    return table.append_column("pos", pa.array(pos, pa.int64()))


UNIT_BYTES = 32 << 20
"""Source files are read in units of up to this many bytes of Parquet (at least one file): a
unit writes one piece per partition, so 100,000 small shards don't make 100,000 x P files."""
MIN_UNITS = 64
"""Units are smaller where the sources hold less than ``MIN_UNITS x UNIT_BYTES``, so that a
small stage still spreads over the workers."""


def _units(paths: Sequence[Path]) -> list[list[tuple[int, str]]]:
    """Consecutive (index, path) runs of about equal bytes: at most `UNIT_BYTES` each, and about
    `MIN_UNITS` of them when the files hold less."""
    sizes = [os.path.getsize(p) for p in paths]
    limit = max(1, min(UNIT_BYTES, -(-sum(sizes) // MIN_UNITS)))
    units: list[list[tuple[int, str]]] = []
    size = limit
    for index, (path, length) in enumerate(zip(paths, sizes, strict=True)):
        if size + length > limit:
            units.append([])
            size = 0
        units[-1].append((index, str(path)))
        size += length
    return units


def _source_task(job: _Job, unit: list[tuple[int, str]]) -> int:
    """Source files: positions, minus excluded ids; then to id partitions or straight on."""
    table = pa.concat_tables([_with_positions(path, i, job.columns) for i, path in unit])
    if job.exclude:
        excluded = pc.is_in(table.column("id"), value_set=pa.array(job.exclude, pa.string()))
        table = table.filter(pc.invert(excluded))
    first = unit[0][0]
    if not job.with_alive:
        return job.emit(table, first)
    part = _id_partitions(table.column("id"), job.partitions)
    _write_pieces(table, part, job.root / "rows", first, job.partitions)
    return table.num_rows


def _alive_task(job: _Job, unit: list[tuple[int, str]]) -> int:
    """Alive (filtered) shards' ids, to id partitions."""
    ids = pa.concat_tables([pq.read_table(path, columns=["id"]) for _, path in unit])
    _write_pieces(
        ids,
        _id_partitions(ids.column("id"), job.partitions),
        job.root / "alive",
        unit[0][0],
        job.partitions,
    )
    return ids.num_rows


def _join_task(job: _Job, p: int) -> int:
    """One id partition: its rows whose id is alive, passed on."""
    rows = _read_pieces(job.root / "rows", p)
    if rows is None:
        return 0
    alive = _read_pieces(job.root / "alive", p)
    ids = alive.column("id") if alive is not None else pa.array([], pa.string())
    return job.emit(rows.filter(pc.is_in(rows.column("id"), value_set=ids)), p)


def _survivors(
    job: _Job, sources: list[Path], alive_shards: list[Path] | None, map_fn: MapFn
) -> int:
    """Runs the survivors stage; returns how many rows survived (and were emitted)."""
    counts = map_fn(partial(_source_task, job), _units(sources))
    if not job.with_alive:
        return sum(counts)
    map_fn(partial(_alive_task, job), _units(alive_shards or []))
    return sum(map_fn(partial(_join_task, job), list(range(job.partitions))))


# --- exact dedup -------------------------------------------------------------------------------


def _exact_partition(job: ExactJob, out_columns: tuple[str, ...], p: int) -> pa.Table | None:
    """One hash partition: every row whose hash an earlier row (lower pos) has, and that row's id."""
    table = _read_pieces(job.root / "keys", p)
    if table is None:
        return None
    table = table.take(pa.array(np.argsort(table.column("pos").to_numpy(), kind="stable")))
    hashes = np.array(table.column("hash").to_pylist(), dtype="S16")
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    first_of = first[inverse.ravel()]
    dropped = np.flatnonzero(first_of != np.arange(len(hashes)))
    ids = table.column("id")
    columns = {c: table.column(c).take(pa.array(dropped)) for c in out_columns}
    columns["duplicate_of"] = ids.take(pa.array(first_of[dropped]))
    columns["pos"] = table.column("pos").take(pa.array(dropped))
    return pa.table(columns)


def partitioned_exact(
    sources: list[Path],
    columns: tuple[str, ...],
    alive_shards: list[Path] | None,
    partitions: int,
    scratch: Path,
    map_fn: MapFn = local_map,
) -> tuple[list[dict], dict]:
    """Exact dedup of the hash files `sources`: (dropped rows in (file, row) order, stats).

    Each dropped row holds `columns` and ``duplicate_of``, the id of the hash's first row, as
    `exact_dedup._dedup_keys` gives them. `alive_shards`: the shards whose ids are alive (None:
    every id).
    """
    job = ExactJob(str(scratch), partitions, (*columns, "hash"), alive_shards is not None)
    rows = _survivors(job, sources, alive_shards, map_fn)
    parts = map_fn(partial(_exact_partition, job, columns), list(range(partitions)))
    found = [t for t in parts if t is not None and t.num_rows]
    dropped: list[dict] = []
    if found:
        table = pa.concat_tables(found)
        table = table.take(pa.array(np.argsort(table.column("pos").to_numpy(), kind="stable")))
        dropped = table.select([*columns, "duplicate_of"]).to_pylist()
    sizes = [0 if t is None else t.num_rows for t in parts]
    return dropped, {
        "rows_hashed": rows,
        "partitions": partitions,
        "max_partition_drops": max(sizes, default=0),
    }


# --- near dedup --------------------------------------------------------------------------------


def _near_partition(job: NearJob, p: int) -> np.ndarray:
    """One (band, key) partition: the star pairs (group's lowest pos, member pos), (E, 2)."""
    table = _read_pieces(job.root / "bands", p)
    if table is None or table.num_rows < 2:
        return np.zeros((0, 2), np.int64)
    band = table.column("band").to_numpy()
    key = table.column("key").to_numpy()
    pos = table.column("pos").to_numpy()
    order = np.lexsort((pos, key, band))
    band, key, pos = band[order], key[order], pos[order]
    start = np.ones(len(pos), bool)
    start[1:] = (band[1:] != band[:-1]) | (key[1:] != key[:-1])
    head = np.maximum.accumulate(np.where(start, np.arange(len(pos)), 0))
    member = np.flatnonzero(~start)
    pairs = np.stack([pos[head[member]], pos[member]], axis=1)
    return np.unique(pairs, axis=0) if len(pairs) else pairs


def _lookup_task(job: NearJob, wanted: np.ndarray, path: str) -> pa.Table:
    """The (pos, id, length) rows of one nodes file whose pos is wanted."""
    table = pq.read_table(path)
    return table.filter(pa.array(np.isin(table.column("pos").to_numpy(), wanted)))


@dataclass
class NearResult:
    """What the near-dedup step writes: drops (id, kept id), clusters, counts."""

    drops: list[tuple[str, str]]
    histogram: dict[int, int]
    clusters: list[dict]
    documents_indexed: int
    stats: dict


def partitioned_near(
    sources: list[Path],
    alive_shards: list[Path] | None,
    excluded: set[str],
    num_buckets: int,
    keep: str,
    partitions: int,
    scratch: Path,
    map_fn: MapFn = local_map,
) -> NearResult:
    """Near dedup of the band-key files `sources`, as `minhash.near_dedup`'s union-find decides.

    Documents sharing a key in some band are one cluster (connected components); the keeper is
    the first by (file, row) or the longest (ties: first). Clusters and drops come in the
    single-process order: by the cluster's first member, then member order.
    """
    columns = ("id", "length", *(f"band_{b:02d}" for b in range(num_buckets)))
    job = NearJob(
        str(scratch),
        partitions,
        columns,
        alive_shards is not None,
        tuple(sorted(excluded)),
        num_buckets,
    )
    indexed = _survivors(job, sources, alive_shards, map_fn)
    parts = map_fn(partial(_near_partition, job), list(range(partitions)))
    pairs = np.concatenate([np.zeros((0, 2), np.int64), *parts])
    pairs = np.unique(pairs, axis=0) if len(pairs) else pairs
    nodes = np.unique(pairs)  # sorted by pos: the union-find's smaller index is the first member
    union_find = UnionFind(len(nodes))
    for a, b in np.searchsorted(nodes, pairs).tolist():
        union_find.union(a, b)
    node_files = (
        sorted(str(p) for p in (job.root / "nodes").glob("*.parquet")) if len(nodes) else []
    )
    found = [t for t in map_fn(partial(_lookup_task, job, nodes), node_files) if t.num_rows]
    info = pa.concat_tables(found) if found else pa.table({"pos": pa.array([], pa.int64())})
    order = np.argsort(info.column("pos").to_numpy())
    ids = info.column("id").to_pylist() if found else []
    lengths = info.column("length").to_pylist() if found else []
    ids, lengths = [ids[i] for i in order], [lengths[i] for i in order]
    groups: dict[int, list[int]] = {}
    for index in range(len(nodes)):
        groups.setdefault(union_find.find(index), []).append(index)
    drops, histogram, clusters = [], {}, []
    for members in groups.values():
        best = members[0] if keep == "first" else max(members, key=lambda m: (lengths[m], -m))
        histogram[len(members)] = histogram.get(len(members), 0) + 1
        drops += [(ids[m], ids[best]) for m in members if m != best]
        clusters.append({"keep": ids[best], "members": [ids[m] for m in members]})
    stats = {
        "partitions": partitions,
        "duplicate_pairs": int(len(pairs)),
        "documents_in_pairs": int(len(nodes)),
        "max_partition_pairs": max((len(p) for p in parts), default=0),
    }
    return NearResult(drops, histogram, clusters, indexed, stats)


# --- the steps' entry --------------------------------------------------------------------------


@contextmanager
def scratch_folder(out: Path) -> Iterator[Path]:
    """A folder for the partitions inside `out` (workers see it where they see `out`), removed
    on exit, also on failure: the committed output never holds it."""
    folder = Path(tempfile.mkdtemp(prefix=".partitions-", dir=out))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def alive_shards_of(filtered: list[Path] | None, enabled: bool) -> list[Path] | None:
    """The shards whose ids are alive, as the single-process steps read them: every shard of the
    `filtered` dirs; none when the stage is off (nothing is alive); None (all) without them."""
    if not enabled:
        return []
    if filtered is None:
        return None
    return [shard for d in filtered for shard in shards_in(d)]


def run_partitioned(kind: str, *args: Any, map_fn: MapFn | None = None, **kwargs: Any) -> Any:
    """`partitioned_exact` (kind 'exact') or `partitioned_near` ('near') on `map_fn`, else on
    the run's backend (`backend.current`)."""
    from llmflow.tasks.framework import backend

    run = {"exact": partitioned_exact, "near": partitioned_near}[kind]
    return run(*args, map_fn=map_fn or backend.current().map, **kwargs)
