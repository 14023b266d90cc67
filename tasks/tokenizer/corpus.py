"""Streaming access to a curated corpus: ``<dir>/shards/**/*.parquet`` (id, text, domain, source)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from llmflow.tasks.framework.errors import BadInputError

CORPUS_COLUMNS = ["id", "text", "domain", "source"]


def corpus_files(corpus_dir: Path) -> list[Path]:
    """The corpus's parquet files in a stable order; fails if there are none or all are empty."""
    files = sorted(Path(corpus_dir).glob("shards/**/*.parquet"))
    if not files:
        raise BadInputError(
            f"empty corpus: no parquet files under {Path(corpus_dir) / 'shards'}; "
            "point corpus_dir at the curate step's output"
        )
    if sum(pq.ParquetFile(f).metadata.num_rows for f in files) == 0:
        raise BadInputError(
            f"empty corpus: the {len(files)} parquet files in {corpus_dir} hold no rows"
        )
    missing = set(CORPUS_COLUMNS) - set(pq.read_schema(files[0]).names)
    if missing:
        raise BadInputError(
            f"{files[0]} lacks columns {sorted(missing)}; expected {CORPUS_COLUMNS}"
        )
    return files


def iter_batches(
    files: list[Path], batch_rows: int, columns=CORPUS_COLUMNS
) -> Iterator[pa.RecordBatch]:
    """Record batches of ``columns`` over all files, never holding more than one batch."""
    for path in files:
        yield from pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=columns)


def hash_fraction(doc_id: str) -> float:
    """A stable number in [0, 1) from a document id (blake2b), for hold-out splits."""
    digest = hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def holdout_mask(ids: list[str], fraction: float) -> np.ndarray:
    """True for ids whose hash falls in the held-out ``fraction``."""
    if fraction <= 0:
        return np.zeros(len(ids), bool)
    return np.fromiter((hash_fraction(i) < fraction for i in ids), bool, len(ids))


def valid_rows(batch: pa.RecordBatch) -> tuple[dict[str, list], list[dict]]:
    """Split a record batch into well-formed rows (columns as lists) and rejects with a reason.

    A row is malformed when its id or domain is null, or its text is null or empty.
    """
    cols = {c: batch.column(c).to_pylist() for c in CORPUS_COLUMNS}
    keep, rejects = [], []
    for i, (doc_id, text, domain) in enumerate(
        zip(cols["id"], cols["text"], cols["domain"], strict=True)
    ):
        if doc_id is None or domain is None:
            rejects.append({"id": doc_id, "reason": "null id or domain"})
        elif not text:
            rejects.append({"id": doc_id, "reason": "null or empty text"})
        else:
            keep.append(i)
    if len(keep) == len(cols["id"]):
        return cols, rejects
    return {c: [v[i] for i in keep] for c, v in cols.items()}, rejects


class RejectLog:
    """Appends rejected records (each with a ``reason``) to a JSONL file and counts them."""

    def __init__(self, path: Path):
        self.path, self.count = Path(path), 0
        self.path.write_text("")

    def write(self, records: list[dict]) -> None:
        if records:
            with open(self.path, "a") as f:
                for record in records:
                    f.write(json.dumps(record) + "\n")
            self.count += len(records)
