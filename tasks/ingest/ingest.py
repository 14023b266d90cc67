"""Ingest: raw JSONL, Parquet and text files (local or any fsspec URI) into sharded Parquet.

Every document gets ``id``, ``text``, ``domain`` and ``source``. Anything unusable (a line that is
not JSON, invalid UTF-8, a missing or non-string text field, an empty or oversized document, a
duplicate id) is counted and written to ``rejects.jsonl`` with its reason: ``read + rejected``
always equals the records seen.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tqdm import tqdm

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, RawFiles, report_table, step

SUFFIXES = {
    ".jsonl": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".md": "text",
}
SCHEMA = pa.schema(
    [("id", pa.string()), ("text", pa.string()), ("domain", pa.string()), ("source", pa.string())]
)


class IngestConfig(BaseModel):
    """How raw files become documents."""

    model_config = ConfigDict(extra="forbid")

    text_field: str = Field("text", description="Field holding the document text in JSONL/Parquet.")
    domain_field: str = Field(
        "domain", description="Field naming the domain; absent -> default_domain."
    )
    id_field: str = Field(
        "id", description="Field holding a document id; absent -> derived from file and line."
    )
    default_domain: str = Field("web", description="Domain of documents that name none.")
    domain_map: dict[str, str] = Field(
        default_factory=dict,
        description="File-name substring -> domain, for files whose records carry no domain.",
    )
    text_mode: Literal["file", "paragraphs"] = Field(
        "paragraphs",
        description="Plain text: one document per file, or split on blank-line runs of 2+.",
    )
    min_chars: int = Field(
        1, ge=1, description="Shorter documents (after strip) are rejected as empty."
    )
    max_chars: int = Field(
        1_000_000, ge=100, description="Longer documents are rejected as oversized."
    )
    docs_per_shard: int = Field(2000, ge=1, description="Documents per output Parquet shard.")
    excerpt_chars: int = Field(
        200,
        ge=0,
        description="Characters of each rejected record kept in the rejects file.",
        json_schema_extra={"versioned": False},
    )

    @field_validator("domain_map")
    @classmethod
    def _no_empty_keys(cls, value: dict[str, str]) -> dict[str, str]:
        if any(not k for k in value):
            raise ValueError("domain_map keys must be non-empty file-name substrings")
        return value


def list_files(paths: list[str]) -> list[str]:
    """Expand files, directories and globs (local or remote) into a sorted list of data files."""
    found: list[str] = []
    for path in paths:
        fs, _ = fsspec.core.url_to_fs(path)
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        prefix = "" if protocol in ("file", "local") else f"{protocol}://"
        if any(ch in path for ch in "*?["):
            candidates = fs.glob(path)
        elif fs.isdir(path):
            candidates = fs.find(path)
        elif fs.exists(path):
            candidates = [path.split("://", 1)[-1] if prefix else path]
        else:
            raise BadInputError(f"--data path does not exist: {path}")
        for c in candidates:
            if Path(c).suffix in SUFFIXES:
                found.append(prefix + c if prefix and not c.startswith(prefix) else c)
    if not found:
        raise BadInputError(f"no .jsonl, .json, .parquet, .txt or .md files under {paths}")
    return sorted(set(found))


class _Rejects:
    def __init__(self, path: Path, excerpt_chars: int):
        self.file = open(path, "w", encoding="utf-8")
        self.excerpt_chars = excerpt_chars
        self.counts: Counter[str] = Counter()

    def add(self, source: str, index: int, reason: str, raw: Any) -> None:
        self.counts[reason] += 1
        excerpt = raw if isinstance(raw, str) else repr(raw)
        record = {
            "source": source,
            "record": index,
            "reason": reason,
            "excerpt": excerpt[: self.excerpt_chars],
        }
        self.file.write(json.dumps(record, ensure_ascii=False) + "\n")


def _records(uri: str, kind: str, cfg: IngestConfig) -> Iterator[tuple[int, Any]]:
    """Yield (index, record or error string) for every record in one file."""
    with fsspec.open(uri, "rb") as f:
        if kind == "parquet":
            index = 0
            for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    yield index, row
                    index += 1
            return
        data = f.read()
    if kind in ("jsonl", "json"):
        lines = data.split(b"\n")
        if kind == "json" and data.lstrip()[:1] == b"[":
            try:
                items = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                yield 0, f"!file is not valid JSON: {err}"
                return
            yield from enumerate(items)
            return
        for index, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                yield index, json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                yield index, "!invalid UTF-8"
            except json.JSONDecodeError as err:
                yield index, f"!malformed JSON: {err.msg}"
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        yield 0, "!invalid UTF-8"
        return
    if cfg.text_mode == "file":
        yield 0, {cfg.text_field: text}
        return
    for index, chunk in enumerate(re.split(r"\n\s*\n\s*\n|\n\n(?= = [^=])", text)):
        if chunk.strip():
            yield index, {cfg.text_field: chunk}


def _domain_for(uri: str, record: dict, cfg: IngestConfig) -> str:
    value = record.get(cfg.domain_field)
    if isinstance(value, str) and value:
        return value
    name = uri.rsplit("/", 1)[-1]
    for key, domain in cfg.domain_map.items():
        if key in name:
            return domain
    return cfg.default_domain


def ingest(cfg: IngestConfig, files: list[str], out_dir: Path) -> dict[str, Any]:
    """Read ``files`` into ``out_dir/shards/shard-NNNNN.parquet``; rejects go to ``rejects.jsonl``.

    Returns headline metrics: records seen, documents kept, rejected by reason, per source.
    """
    shard_dir = out_dir / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    rejects = _Rejects(out_dir / "rejects.jsonl", cfg.excerpt_chars)
    buffer: list[dict[str, str]] = []
    seen_ids: set[str] = set()
    per_source: dict[str, Counter[str]] = {}
    num_shards = 0

    def flush() -> None:
        nonlocal num_shards, buffer
        if buffer:
            table = pa.Table.from_pylist(buffer, schema=SCHEMA)
            pq.write_table(table, shard_dir / f"shard-{num_shards:05d}.parquet")
            num_shards, buffer = num_shards + 1, []

    for uri in tqdm(files, desc="ingest", unit="file"):
        counts = per_source.setdefault(uri, Counter())
        file_key = hashlib.sha1(uri.rsplit("/", 1)[-1].encode()).hexdigest()[:8]
        for index, record in _records(uri, SUFFIXES[Path(uri).suffix], cfg):
            counts["records"] += 1
            reason = _check(record, cfg)
            if reason:
                rejects.add(uri, index, reason, record)
                counts["rejected"] += 1
                continue
            text = record[cfg.text_field]
            doc_id = record.get(cfg.id_field)
            doc_id = (
                str(doc_id) if doc_id not in (None, "") else f"{Path(uri).stem}-{file_key}-{index}"
            )
            if doc_id in seen_ids:
                rejects.add(uri, index, f"duplicate id {doc_id!r}", record)
                counts["rejected"] += 1
                continue
            seen_ids.add(doc_id)
            buffer.append(
                {"id": doc_id, "text": text, "domain": _domain_for(uri, record, cfg), "source": uri}
            )
            counts["kept"] += 1
            if len(buffer) >= cfg.docs_per_shard:
                flush()
    flush()
    rejects.file.close()
    report = {
        "sources": {uri: dict(c) for uri, c in per_source.items()},
        "rejected_by_reason": dict(rejects.counts),
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    records = sum(c["records"] for c in per_source.values())
    kept = sum(c["kept"] for c in per_source.values())
    if kept == 0:
        raise BadInputError(
            f"no usable documents in {len(files)} file(s); see the reasons in {out_dir}/rejects.jsonl"
        )
    return {"records": records, "documents": kept, "rejected": records - kept, "shards": num_shards}


def _check(record: Any, cfg: IngestConfig) -> str | None:
    """Why a record is unusable, or None."""
    if isinstance(record, str) and record.startswith("!"):
        return record[1:]
    if not isinstance(record, dict):
        return f"record is a {type(record).__name__}, not an object"
    if cfg.text_field not in record:
        return f"missing field {cfg.text_field!r}"
    text = record[cfg.text_field]
    if not isinstance(text, str):
        return f"field {cfg.text_field!r} is {type(text).__name__}, not a string"
    if "\x00" in text:
        return "binary content (NUL bytes)"
    if len(text.strip()) < cfg.min_chars:
        return "empty document"
    if len(text) > cfg.max_chars:
        return f"oversized document ({len(text)} chars > max_chars {cfg.max_chars})"
    return None


@step("ingest", execution=("excerpt_chars",))
def ingest_sources(
    cfg: IngestConfig, out: Path, sample: Path | None = None, files: RawFiles | None = None
) -> Metrics:
    """Read the quickstart sample or the user's raw files into Parquet shards, rejects counted."""
    if (sample is None) == (files is None):
        raise BadInputError("ingest reads either the generated sample or raw files, not both")
    uris = list_files([str(sample / "files")]) if sample is not None else list(files)
    metrics = ingest(cfg, uris, out)
    report = json.loads((out / "report.json").read_text())
    rows = [{"source": uri, **counts} for uri, counts in report["sources"].items()]
    report_table("ingest-sources", rows, "Records read, kept and rejected per source file")
    return metrics
