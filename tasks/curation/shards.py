"""Reading and writing document shards, reject/sample JSONL files and per-stage stats."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from llmflow.tasks.framework.errors import BadInputError

COLUMNS = ("id", "text", "domain", "source")
SCHEMA = pa.schema([(name, pa.string()) for name in COLUMNS])
PREVIEW_CHARS = 300


def iter_rows(
    path: Path, columns: tuple[str, ...] = COLUMNS, batch_size: int = 1024
) -> Iterator[dict]:
    """Yields the rows of a Parquet shard as dicts; text may be bytes if stored as binary."""
    parquet = pq.ParquetFile(path)
    present = [c for c in columns if c in parquet.schema_arrow.names]
    for batch in parquet.iter_batches(batch_size=batch_size, columns=present):
        yield from batch.to_pylist()


def read_column(path: Path, column: str) -> list:
    """One column of a shard as a Python list."""
    return pq.read_table(path, columns=[column]).column(column).to_pylist()


class ShardWriter:
    """Streams rows into a Parquet shard with the curated schema (id, text, domain, source)."""

    def __init__(self, path: Path, batch_rows: int = 2048):
        self.path = path
        self._rows: list[dict] = []
        self._batch_rows = batch_rows
        self._writer = pq.ParquetWriter(path, SCHEMA, compression="zstd")
        self.num_rows = 0

    def write(self, row: dict) -> None:
        self._rows.append({name: row.get(name) for name in COLUMNS})
        if len(self._rows) >= self._batch_rows:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=SCHEMA))
            self.num_rows += len(self._rows)
            self._rows = []

    def close(self) -> None:
        self._flush()
        self._writer.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def preview(text: object) -> str:
    """A short, JSON-safe preview of a document's text."""
    if isinstance(text, bytes):
        text = text[:PREVIEW_CHARS].decode("utf-8", errors="replace")
    return "" if text is None else str(text)[:PREVIEW_CHARS]


def write_jsonl(path: Path, records: list[dict]) -> None:
    """Writes records as JSON lines (an empty file when there are none)."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def shards_in(directory: Path) -> list[Path]:
    """Document shards in a stage directory (or its `shards/` subfolder), sorted by name."""
    directory = Path(directory)
    found = sorted(p for p in directory.glob("*.parquet") if "." not in p.stem)
    return found or sorted(p for p in (directory / "shards").glob("*.parquet") if "." not in p.stem)


def add_count(table: dict, domain: str, key: str, docs: int = 1, tokens: int = 0) -> None:
    """Adds documents and tokens to `table[domain][key]` (a {"docs", "tokens"} pair)."""
    entry = table.setdefault(domain, {}).setdefault(key, {"docs": 0, "tokens": 0})
    entry["docs"] += docs
    entry["tokens"] += tokens


def add_metrics(per_shard: Iterable[dict[str, int]]) -> dict[str, int]:
    """Per-shard metrics summed key by key (a step over a directory of shards reports once)."""
    total: dict[str, int] = {}
    for metrics in per_shard:
        for key, value in metrics.items():
            total[key] = total.get(key, 0) + value
    return total


def write_drops(out: Path, ids: list[str], reasons: list[str] | str, **extra: pa.Array) -> None:
    """A global stage's removed documents: ``drops.parquet`` with id, reason and extra columns."""
    reasons = [reasons] * len(ids) if isinstance(reasons, str) else reasons
    columns = {"id": pa.array(ids, pa.string()), "reason": pa.array(reasons, pa.string())}
    pq.write_table(pa.table({**columns, **extra}), out / "drops.parquet")


class ErrorBudget:
    """Counts documents that raised in a stage, per place (a filter, normalization), and stops
    the step when more than ``max_share`` of a shard's documents did: a bug must not silently
    drop the corpus."""

    def __init__(self, stage: str, max_share: float):
        self.stage, self.max_share = stage, max_share
        self.errors: dict[str, int] = {}
        self.first: dict[str, str] = {}

    def record(self, where: str, error: BaseException) -> str:
        """Count one document's exception; the reason to write beside it."""
        self.errors[where] = self.errors.get(where, 0) + 1
        self.first.setdefault(where, f"{type(error).__name__}: {error}")
        return f"error:{type(error).__name__}"

    def check(self, shard: Path, documents: int) -> None:
        """Raise, naming the place that failed most, when the shard's error share is too high."""
        total = sum(self.errors.values())
        if not total or total <= self.max_share * documents:
            return
        where = max(self.errors, key=self.errors.get)
        raise BadInputError(
            f"{self.stage}: {total} of {documents} documents of {shard.name} raised an exception "
            f"({total / documents:.1%} > max_error_share={self.max_share}); {where} raised on "
            f"{self.errors[where]}, first: {self.first[where]}. This is a bug in {where}, not "
            "bad text: fix it, or raise max_error_share to keep going"
        )
