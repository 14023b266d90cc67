"""Exact deduplication across all shards: a 128-bit hash of each document's text-normal form,
a Bloom filter streamed over the hashes, and an exact check behind it.

Per shard, `exact_hashes` writes `<stem>.exact.parquet` (id, hash; and with level
"paragraph" `<stem>.paragraphs.parquet`: id, paragraph, hash). Globally, `exact_dedup` streams
the hash files once through a Bloom filter sized from `expected_documents` and the target
false-positive rate; a hit only marks the hash as a candidate. A second streaming pass keeps the
first occurrence of every candidate hash and drops the later ones, so a Bloom false positive can
never cost a unique document. Memory: the Bloom bits plus the candidate hashes; the ids of the
surviving documents stay on disk (`IdSet`).

With ``method: partitioned`` the hashes are shuffled by prefix into partitions that each decide
their duplicates (tasks/curation/distributed_dedup.py, on Ray when one is connected): the same
drops, in the same order, with memory per worker bounded by its partition.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from llmflow.tasks.curation.config import ExactDedupConfig, ExactHashConfig
from llmflow.tasks.curation.shards import (
    add_metrics,
    iter_rows,
    read_column,
    shards_in,
    write_drops,
    write_json,
)
from llmflow.tasks.curation.text import simplify_text
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.ingest.idset import IdSet

PARAGRAPH_SEPARATOR = "\n\n"
BLOOM_BATCH = 4096
"""Hashes checked against the Bloom filter at once (within a batch, repeats are found exactly)."""


def text_hash(text: str) -> bytes:
    """16-byte BLAKE2b digest of the text-normal form (lowercase, no punctuation, digits 0)."""
    return hashlib.blake2b(simplify_text(text).encode("utf-8"), digest_size=16).digest()


class BloomFilter:
    """A numpy bit-array Bloom filter over 16-byte digests (double hashing from the digest)."""

    def __init__(self, capacity: int, false_positive_rate: float):
        self.num_bits = max(
            64, math.ceil(-capacity * math.log(false_positive_rate) / math.log(2) ** 2)
        )
        self.num_hashes = max(1, round(self.num_bits / capacity * math.log(2)))
        self.bits = np.zeros((self.num_bits + 7) // 8, dtype=np.uint8)

    def _positions(self, digests: list[bytes]) -> np.ndarray:
        words = np.frombuffer(b"".join(digests), dtype="<u8").reshape(-1, 2)
        steps = np.arange(self.num_hashes, dtype=np.uint64)
        with np.errstate(over="ignore"):
            combined = words[:, :1] + steps[None, :] * (words[:, 1:] | np.uint64(1))
        return combined % np.uint64(self.num_bits)  # (N, k)

    def add_and_check(self, digests: list[bytes]) -> np.ndarray:
        """Adds a batch; returns for each digest whether it may have been seen before it
        (earlier batches, or an earlier position in this batch)."""
        if not digests:
            return np.zeros(0, bool)
        pos = self._positions(digests)
        present = (self.bits[pos >> np.uint64(3)] >> (pos & np.uint64(7)).astype(np.uint8)) & 1
        maybe = present.all(axis=1)
        _, first = np.unique(np.array(digests, dtype="S16"), return_index=True)
        repeated = np.ones(len(digests), bool)
        repeated[first] = False
        flat = pos.ravel()
        np.bitwise_or.at(
            self.bits, flat >> np.uint64(3), (1 << (flat & np.uint64(7))).astype(np.uint8)
        )
        return maybe | repeated

    @property
    def num_bytes(self) -> int:
        return int(self.bits.nbytes)


def _paragraphs(text: str, min_chars: int) -> Iterator[tuple[int, str]]:
    for index, paragraph in enumerate(text.split(PARAGRAPH_SEPARATOR)):
        if len(paragraph.strip()) >= min_chars:
            yield index, paragraph


def _hash_file(cfg: ExactHashConfig, in_shard: Path, out_dir: Path) -> dict[str, int]:
    """Hashes every document (and paragraph, at level "paragraph") of one shard."""
    ids, hashes, para_rows = [], [], {"id": [], "paragraph": [], "hash": []}
    for row in tqdm(
        iter_rows(in_shard, ("id", "text")), desc=f"hash {in_shard.stem}", leave=False, disable=None
    ):
        ids.append(row["id"])
        hashes.append(text_hash(row["text"]))
        if cfg.level == "paragraph":
            for index, paragraph in _paragraphs(row["text"], cfg.min_paragraph_chars):
                para_rows["id"].append(row["id"])
                para_rows["paragraph"].append(index)
                para_rows["hash"].append(text_hash(paragraph))
    table = pa.table({"id": pa.array(ids, pa.string()), "hash": pa.array(hashes, pa.binary(16))})
    pq.write_table(table, out_dir / f"{in_shard.stem}.exact.parquet")
    if cfg.level == "paragraph":
        pq.write_table(pa.table(para_rows), out_dir / f"{in_shard.stem}.paragraphs.parquet")
    return {"documents": len(ids), "paragraphs": len(para_rows["id"])}


@step("curate-exact-hashes", version=1)
def exact_hashes(cfg: ExactHashConfig, normalized: Path, out: Path) -> Metrics:
    """Hash each normalized document (and paragraph) for exact dedup: `<stem>.exact.parquet`."""
    return add_metrics(_hash_file(cfg, shard, out) for shard in shards_in(normalized))


def _hash_files(dirs: list[Path], suffix: str) -> list[Path]:
    return sorted(
        (p for d in dirs for p in Path(d).glob(f"*.{suffix}.parquet")), key=lambda p: p.name
    )


def _dedup_keys(
    files: list[Path], columns: tuple[str, ...], keep: IdSet | set | None, cfg: ExactDedupConfig
) -> tuple[list, dict]:
    """Two streaming passes (Bloom, then exact) over hash files; returns (dropped rows, stats)."""
    bloom = BloomFilter(cfg.expected_documents, cfg.false_positive_rate)
    candidates: set[bytes] = set()
    for path in tqdm(files, desc="exact dedup: bloom", leave=False, disable=None):
        table = pq.read_table(path)
        rows = [r for r in table.to_pylist() if keep is None or r["id"] in keep]
        for start in range(0, len(rows), BLOOM_BATCH):
            hashes = [r["hash"] for r in rows[start : start + BLOOM_BATCH]]
            hits = bloom.add_and_check(hashes)
            candidates.update(h for h, hit in zip(hashes, hits, strict=True) if hit)
    first: dict[bytes, dict] = {}
    dropped, duplicated = [], set()
    for path in tqdm(files, desc="exact dedup: check", leave=False, disable=None):
        for row in pq.read_table(path).to_pylist():
            if (keep is not None and row["id"] not in keep) or row["hash"] not in candidates:
                continue
            if row["hash"] in first:
                original = first[row["hash"]]
                duplicated.add(row["hash"])
                dropped.append({**{c: row[c] for c in columns}, "duplicate_of": original["id"]})
            else:
                first[row["hash"]] = row
    stats = {
        "bloom_bits": bloom.num_bits,
        "bloom_hashes": bloom.num_hashes,
        "bloom_bytes": bloom.num_bytes,
        "bloom_candidates": len(candidates),
        "bloom_false_positives": len(first) - len(duplicated),
    }
    return dropped, stats


def surviving_ids(shard_dirs: list[Path] | None) -> IdSet | None:
    """Ids of the documents in the shards of `shard_dirs` (None when not given), in an on-disk
    set: memory stays bounded however many documents survive."""
    if shard_dirs is None:
        return None
    ids = IdSet()
    for shard in (shard for d in shard_dirs for shard in shards_in(d)):
        ids.update(read_column(shard, "id"))
    return ids


def _paragraph_drops(cfg: ExactDedupConfig, hashes: list[Path], keep, out: Path) -> dict:
    """Writes `paragraph_drops.parquet`; returns the report's paragraph fields."""
    para, para_stats = _dedup_keys(
        _hash_files(hashes, "paragraphs"), ("id", "paragraph"), keep, cfg
    )
    _write_paragraph_drops(para, out)
    return {"paragraphs_dropped": len(para), "paragraph_bloom": para_stats}


def _write_paragraph_drops(para: list[dict], out: Path) -> None:
    empty = {
        "id": pa.array([], pa.string()),
        "paragraph": pa.array([], pa.int64()),
        "duplicate_of": pa.array([], pa.string()),
    }
    table = pa.Table.from_pylist(para) if para else pa.table(empty)
    pq.write_table(table, out / "paragraph_drops.parquet")


@step("curate-exact-dedup", version=1, data_engine=True)
def exact_dedup(
    cfg: ExactDedupConfig, hashes: list[Path], out: Path, filtered: list[Path] | None = None
) -> Metrics:
    """Drop exact duplicates across all shards, keeping the first (by shard name, row).

    Args:
        cfg: the exact dedup settings.
        hashes: outputs of `exact_hashes`.
        out: receives `drops.parquet` (id, reason, duplicate_of), at level "paragraph" also
            `paragraph_drops.parquet` (id, paragraph, duplicate_of), and `report.json`.
        filtered: shard dirs of the documents still alive (the filtered shards); documents not
            in them are ignored, so a removed document is never chosen as the one to keep.
    """
    if cfg.method == "partitioned":
        return _partitioned_exact_dedup(cfg, hashes, out, filtered)
    keep = surviving_ids(filtered) if cfg.enabled else set()
    try:
        return _exact_dedup(cfg, hashes, out, keep)
    finally:
        if isinstance(keep, IdSet):
            keep.close()


def _exact_dedup(cfg: ExactDedupConfig, hashes: list[Path], out: Path, keep) -> Metrics:
    dropped, stats = _dedup_keys(_hash_files(hashes, "exact"), ("id",), keep, cfg)
    duplicate_of = pa.array([d["duplicate_of"] for d in dropped], pa.string())
    write_drops(out, [d["id"] for d in dropped], "exact_duplicate", duplicate_of=duplicate_of)
    report = {"stage": "exact_dedup", "documents_dropped": len(dropped), **stats}
    if cfg.level == "paragraph":
        report.update(_paragraph_drops(cfg, hashes, keep, out))
    report["examples"] = dropped[:10]
    write_json(out / "report.json", report)
    return {
        "documents_dropped": len(dropped),
        "bloom_candidates": stats["bloom_candidates"],
        "paragraphs_dropped": report.get("paragraphs_dropped", 0),
    }


def _partitioned_exact_dedup(
    cfg: ExactDedupConfig, hashes: list[Path], out: Path, filtered: list[Path] | None
) -> Metrics:
    """`exact_dedup` with ``method: partitioned``: the same drops, decided per hash-prefix
    partition (tasks/curation/distributed_dedup.py); no Bloom filter, so no candidates."""
    from llmflow.tasks.curation.distributed_dedup import (
        alive_shards_of,
        run_partitioned,
        scratch_folder,
    )

    alive = alive_shards_of(filtered, cfg.enabled)
    with scratch_folder(out) as scratch:
        files = _hash_files(hashes, "exact")
        dropped, stats = run_partitioned("exact", files, ("id",), alive, cfg.partitions, scratch)
        report = {"stage": "exact_dedup", "documents_dropped": len(dropped), **stats}
        if cfg.level == "paragraph":
            para, para_stats = run_partitioned(
                "exact",
                _hash_files(hashes, "paragraphs"),
                ("id", "paragraph"),
                alive,
                cfg.partitions,
                scratch / "paragraphs",
            )
            _write_paragraph_drops(para, out)
            report.update({"paragraphs_dropped": len(para), "paragraph_partitions": para_stats})
    duplicate_of = pa.array([d["duplicate_of"] for d in dropped], pa.string())
    write_drops(out, [d["id"] for d in dropped], "exact_duplicate", duplicate_of=duplicate_of)
    report["examples"] = dropped[:10]
    write_json(out / "report.json", report)
    return {
        "documents_dropped": len(dropped),
        "paragraphs_dropped": report.get("paragraphs_dropped", 0),
    }
