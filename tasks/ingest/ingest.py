"""Ingest: raw JSONL, Parquet and text files (local or any fsspec URI) into sharded Parquet.

Every document gets ``id``, ``text``, ``domain`` and ``source``. Anything unusable (a line that is
not JSON, invalid UTF-8, a missing or non-string text field, an empty or oversized document, a
duplicate id) is counted and written to ``rejects.jsonl`` with its reason: ``read + rejected``
always equals the records seen.

Files are read and parsed in parallel on the run's backend when it is Ray or processes
(`backend.current`): a worker returns one file's (index, record) list and this process takes the files in
their sorted order, at most ``2 x workers`` in flight, and checks, numbers, deduplicates and
shards the records exactly as when it reads them itself: the same documents, ids, rejects and
shard cut points (execution only). Hub sources come after the files, each read the same way
one data file per worker (``datasets``' shards, `hub.file_streams`), its records numbered end to
end as the one stream numbers them; a source whose caps are reached cancels its files in flight.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import pickle
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tqdm import tqdm

from llmflow.tasks.framework import s3config
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.hashing import UNVERSIONED
from llmflow.tasks.framework.step import Metrics, RawFiles, report_table, step
from llmflow.tasks.ingest import hub as hub_sources
from llmflow.tasks.ingest.idset import IdSet

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
    hub: list[str] = Field(
        default_factory=list,
        description="Hugging Face Hub sources (hf://datasets/... URIs pinned to a revision), "
        "streamed after the files; the recipe fills this from the hf:// entries of --data.",
    )
    excerpt_chars: int = Field(
        200,
        ge=0,
        description="Characters of each rejected record kept in the rejects file.",
        json_schema_extra=UNVERSIONED,
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
        fs, _ = s3config.filesystem(path)
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
    fs, path = s3config.filesystem(uri)
    with fs.open(path, "rb") as f:
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


class _Source:
    """One input as ingest reads it: a file, or a Hub dataset split with its overrides and caps."""

    def __init__(self, uri: str, cfg: IngestConfig, hub: hub_sources.HubSource | None = None):
        self.uri, self.hub = uri, hub
        self.cfg = (
            cfg
            if hub is None or not hub.text_field
            else cfg.model_copy(update={"text_field": hub.text_field})
        )
        self.fallback_id = hashlib.sha1(uri.rsplit("/", 1)[-1].encode()).hexdigest()[:8]
        self.fallback_id = f"{Path(uri).stem}-{self.fallback_id}" if hub is None else hub.dataset
        self.kept_bytes = 0

    def records(self) -> Iterator[tuple[int, Any]]:
        if self.hub is None:
            return _records(self.uri, SUFFIXES[Path(self.uri).suffix], self.cfg)
        return enumerate(hub_sources.stream(self.hub))

    def domain(self, record: dict) -> str:
        if self.hub is not None and self.hub.domain:
            return self.hub.domain
        return _domain_for(self.uri, record, self.cfg)

    def full(self, kept: int, text: str) -> bool:
        """Count a kept document; True when this source's caps are reached."""
        if self.hub is None:
            return False
        self.kept_bytes += len(text.encode("utf-8"))
        return self.hub.full(kept, self.kept_bytes)

    def describe(self) -> dict[str, Any]:
        """What the report and the lineage say of the source besides its counts."""
        if self.hub is None:
            return {}
        h = self.hub
        return {"dataset": h.repo, "config": h.config, "split": h.split, "revision": h.revision}


def ingest(
    cfg: IngestConfig, files: list[str], out_dir: Path, hub: list[str] | None = None
) -> dict[str, Any]:
    """Read ``files`` then the Hub sources ``hub`` (URIs) into ``out_dir/shards/shard-NNNNN.parquet``;
    rejects go to ``rejects.jsonl``.

    Memory stays bounded: documents go out in shards of ``docs_per_shard``, and the ids seen so
    far (to reject duplicates) live in an on-disk ``IdSet``.

    Returns headline metrics: records seen, documents kept, rejected by reason, per source.
    """
    shard_dir = out_dir / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    sources = [_Source(uri, cfg) for uri in files]
    sources += [_Source(u, cfg, hub_sources.parse_uri(u)) for u in hub or []]
    rejects = _Rejects(out_dir / "rejects.jsonl", cfg.excerpt_chars)
    writer = _ShardWriter(shard_dir, cfg.docs_per_shard)
    per_source: dict[str, Counter[str]] = {}
    with IdSet(out_dir) as seen_ids, _worker_map(out_dir) as work:
        many = work is not None and len(files) > 1
        parsed = work(_file_records, cfg, files) if many else (r for r in ())
        with contextlib.closing(parsed):
            for source in tqdm(sources, desc="ingest", unit="source"):
                if source.hub is None:
                    spilled = next(parsed, None)
                    records = None if spilled is None else _unspill(spilled)
                    per_source[source.uri] = _read_source(
                        source, seen_ids, writer, rejects, records
                    )
                    continue
                with _hub_records(source, work) as records:
                    per_source[source.uri] = _read_source(
                        source, seen_ids, writer, rejects, records
                    )
    writer.flush()
    rejects.file.close()
    report = {
        "sources": {s.uri: {**s.describe(), **per_source[s.uri]} for s in sources},
        "rejected_by_reason": dict(rejects.counts),
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    records = sum(c["records"] for c in per_source.values())
    kept = sum(c["kept"] for c in per_source.values())
    if kept == 0:
        raise BadInputError(
            f"no usable documents in {len(sources)} source(s); see the reasons in {out_dir}/rejects.jsonl"
        )
    metrics = {"records": records, "documents": kept, "rejected": records - kept}
    metrics["shards"] = writer.num_shards
    taken = {s.hub.uri: per_source[s.uri]["kept"] for s in sources if s.hub is not None}
    return {**metrics, "hub_taken": taken} if taken else metrics


SCRATCH = ".ingest-scratch"
"""The folder inside the output where workers spill the records they read (removed at the end;
on Ray, workers must see it: one machine, or a volume shared by the nodes)."""


def _spill(scratch: str, items: Iterable[Any]) -> str:
    """Write ``items`` one pickle each to a new file in ``scratch``; returns its path."""
    fd, name = tempfile.mkstemp(suffix=".pkl", dir=scratch)
    with os.fdopen(fd, "wb") as f:
        for item in items:
            pickle.dump(item, f, protocol=pickle.HIGHEST_PROTOCOL)
    return name


def _unspill(path: str) -> Iterator[Any]:
    """A spilled file's items, one at a time; the file is removed once read."""
    try:
        with open(path, "rb") as f:
            while True:
                try:
                    yield pickle.load(f)
                except EOFError:
                    return
    finally:
        os.unlink(path)


def _file_records(job: tuple[str, IngestConfig], uri: str) -> str:
    """In a worker: one file's (index, record or error string) pairs, as `_records` yields them,
    spilled to the scratch folder (the driver holds one record at a time, not a file)."""
    scratch, cfg = job
    return _spill(scratch, _records(uri, SUFFIXES[Path(uri).suffix], cfg))


@contextlib.contextmanager
def _worker_map(out_dir: Path) -> Iterator[Callable | None]:
    """``stream(fn, job, items)``: ``fn((scratch, job), item)`` per item on the data units'
    backend (`backend.current`: Ray or processes), results in order with a bounded number in
    flight; None where this process reads everything itself."""
    from llmflow.tasks.framework import backend

    scratch = out_dir / SCRATCH
    # NOTE: one backend (a process pool) for the files and every Hub source: a spawned worker
    # imports pyarrow and datasets once
    units = backend.current()
    if not units.parallel:
        yield None
        return
    scratch.mkdir()
    try:
        yield lambda fn, job, items: units.stream(fn, (str(scratch), job), items)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _hub_records(source: _Source, work: Callable | None) -> Iterator[Iterator | None]:
    """A Hub source's (index, record) pairs read one data file per worker; None (this process
    streams the source) without workers or with a single file."""
    shards = hub_sources.file_streams(source.hub) if work is not None else []
    if len(shards) < 2:
        yield None
        return
    parsed = work(_shard_records, None, shards)
    try:
        yield enumerate(itertools.chain.from_iterable(_unspill(path) for path in parsed))
    finally:
        parsed.close()


def _shard_records(job: tuple[str, None], dataset: Any) -> str:
    """In a worker: one Hub data file's records, spilled to the scratch folder."""
    return _spill(job[0], hub_sources.read_all(dataset))


def _read_source(
    source: _Source,
    seen_ids: IdSet,
    writer: _ShardWriter,
    rejects: _Rejects,
    records: Iterable[tuple[int, Any]] | None = None,
) -> Counter:
    """Stream one source into the writer (its ``records`` when a worker read them); returns its
    counts (records, kept, rejected)."""
    cfg, counts = source.cfg, Counter(records=0, kept=0, rejected=0)
    for index, record in source.records() if records is None else records:
        counts["records"] += 1
        reason = _check(record, cfg)
        doc_id = None if reason else record.get(cfg.id_field)
        doc_id = str(doc_id) if doc_id not in (None, "") else f"{source.fallback_id}-{index}"
        if reason is None and not seen_ids.add(doc_id):
            reason = f"duplicate id {doc_id!r}"
        if reason:
            rejects.add(source.uri, index, reason, record)
            counts["rejected"] += 1
            continue
        text = record[cfg.text_field]
        writer.add(
            {"id": doc_id, "text": text, "domain": source.domain(record), "source": source.uri}
        )
        counts["kept"] += 1
        if source.full(counts["kept"], text):
            break
    return counts


class _ShardWriter:
    """Buffers documents and writes a Parquet shard every ``docs_per_shard`` of them."""

    def __init__(self, shard_dir: Path, docs_per_shard: int):
        self.shard_dir, self.docs_per_shard = shard_dir, docs_per_shard
        self.buffer: list[dict[str, str]] = []
        self.num_shards = 0

    def add(self, doc: dict[str, str]) -> None:
        self.buffer.append(doc)
        if len(self.buffer) >= self.docs_per_shard:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            table = pa.Table.from_pylist(self.buffer, schema=SCHEMA)
            pq.write_table(table, self.shard_dir / f"shard-{self.num_shards:05d}.parquet")
            self.num_shards, self.buffer = self.num_shards + 1, []


def first_documents(uri: str, cfg: IngestConfig, count: int) -> list[str]:
    """The first ``count`` usable texts of one file (fewer when it has fewer)."""
    texts = []
    for _, record in _records(uri, SUFFIXES[Path(uri).suffix], cfg):
        if _check(record, cfg) is None:
            texts.append(record[cfg.text_field])
            if len(texts) >= count:
                break
    return texts


def file_domains(files: list[str], cfg: IngestConfig, wanted: set[str]) -> set[str]:
    """The domains ingest gives the usable records of ``files``, read in order until every
    domain in ``wanted`` is seen. A file whose records cannot name one (plain text, Parquet
    without the domain column) is not read: its domain is its name's or the default."""
    found: set[str] = set()
    for uri in files:
        kind = SUFFIXES[Path(uri).suffix]
        if kind == "text" or (kind == "parquet" and not _has_column(uri, cfg.domain_field)):
            found.add(_domain_for(uri, {}, cfg))
        else:
            for _, record in _records(uri, kind, cfg):
                if _check(record, cfg) is None:
                    found.add(_domain_for(uri, record, cfg))
                    if wanted <= found:
                        break
        if wanted <= found:
            break
    return found


def _has_column(uri: str, name: str) -> bool:
    fs, path = s3config.filesystem(uri)
    with fs.open(path, "rb") as f:
        return name in pq.ParquetFile(f).schema_arrow.names


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


@step("ingest", version=2, execution=("excerpt_chars",), data_engine=True)
def ingest_sources(
    cfg: IngestConfig, out: Path, sample: Path | None = None, files: RawFiles | None = None
) -> Metrics:
    """Read the quickstart sample, or the user's raw files and Hub sources, into Parquet shards,
    rejects counted."""
    if sample is not None and (files is not None or cfg.hub):
        raise BadInputError("ingest reads either the generated sample or the user's data, not both")
    if sample is None and files is None and not cfg.hub:
        raise BadInputError("ingest has nothing to read: no sample, no files, no Hub sources")
    uris = list_files([str(sample / "files")]) if sample is not None else list(files or ())
    metrics = ingest(cfg, uris, out, cfg.hub)
    report = json.loads((out / "report.json").read_text())
    rows = [{"source": uri, **counts} for uri, counts in report["sources"].items()]
    report_table("ingest-sources", rows, "Records read, kept and rejected per source")
    return metrics
