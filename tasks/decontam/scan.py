"""Scanning a curated corpus against the index and writing the decontaminated corpus.

The output keeps the curated corpus's layout (``shards/<domain>/<shard>.parquet``, same columns,
same compression), so the tokenizer and tokenize steps read it unchanged. A shard with nothing
removed is hard-linked (or copied), not rewritten.
"""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from llmflow.tasks.decontam.ngrams import NGramIndex, scan_texts
from llmflow.tasks.framework.errors import BadInputError

MATCH_COLUMNS = ("doc_id", "domain", "shard", "task", "item", "ngram", "action")
BATCH_DOCS = 512


@dataclass
class ScanResult:
    """What the scan found: one record per (document, task, item), and counts."""

    matches: list[dict] = field(default_factory=list)
    documents: int = 0
    contaminated: int = 0
    removed: int = 0
    scan_seconds: float = 0.0


def corpus_files(corpus: Path) -> list[Path]:
    """The corpus's shards in a stable order; a corpus without any is bad input."""
    files = sorted(Path(corpus).glob("shards/**/*.parquet"))
    if not files:
        raise BadInputError(f"no parquet shards under {Path(corpus) / 'shards'} to decontaminate")
    return files


def scan_corpus(indexes: list[NGramIndex], corpus: Path, out: Path, mode: str) -> ScanResult:
    """Scan every shard; write each to ``out`` with contaminated documents removed (``remove``)
    or all kept (``flag``)."""
    result = ScanResult()
    for path in tqdm(corpus_files(corpus), desc="decontaminate", leave=False):
        relative = path.relative_to(corpus)
        table = pq.read_table(path)
        contaminated = scan_shard(indexes, table, relative.as_posix(), mode, result)
        write_shard(path, table, contaminated, out / relative, mode)
        result.documents += table.num_rows
        result.contaminated += int(contaminated.sum())
        result.removed += int(contaminated.sum()) if mode == "remove" else 0
    return result


def scan_shard(
    indexes: list[NGramIndex], table: pa.Table, shard: str, mode: str, result: ScanResult
) -> np.ndarray:
    """A mask of the shard's contaminated rows; their matches are appended to ``result``.

    ``indexes``: the n-gram index, then the whole-item indexes of shorter items."""
    mask = np.zeros(table.num_rows, dtype=bool)
    indexes = [index for index in indexes if len(index.hashes)]
    if not indexes:  # no eval item is long enough: nothing can match
        return mask
    texts = [t if isinstance(t, str) else "" for t in table.column("text").to_pylist()]
    ids, domains = table.column("id").to_pylist(), table.column("domain").to_pylist()
    action = "removed" if mode == "remove" else "flagged"
    for start in range(0, len(texts), BATCH_DOCS):
        seen: dict[tuple[int, str, int], str] = {}
        for index in indexes:
            for hit in scan_texts(index, texts[start : start + BATCH_DOCS]):
                row = start + hit.row
                mask[row] = True
                for owner in index.owners[hit.owner_slice[0] : hit.owner_slice[1]].tolist():
                    task, item = index.items[owner]
                    seen.setdefault((row, task, item), hit.ngram)
        for (row, task, item), ngram in seen.items():
            result.matches.append(
                {
                    "doc_id": str(ids[row]),
                    "domain": domains[row],
                    "shard": shard,
                    "task": task,
                    "item": item,
                    "ngram": ngram,
                    "action": action,
                }
            )
    return mask


def write_shard(source: Path, table: pa.Table, contaminated: np.ndarray, dest: Path, mode: str):
    """The shard as it leaves: linked when unchanged, rewritten without removed rows, or
    absent when every row was removed (as curation writes no empty shard)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if mode == "flag" or not contaminated.any():
        link_or_copy(source, dest)
    elif not contaminated.all():
        kept = table.filter(pa.array(~contaminated))
        pq.write_table(kept, dest, compression="zstd")


def link_or_copy(source: Path, dest: Path) -> None:
    """``dest`` as a hard link to ``source`` (no bytes copied; outputs are immutable), or a
    copy across file systems.

    A file already at ``dest`` (left by an earlier try of the step in its working folder, and
    maybe itself a link into another committed output) is replaced by a rename, never opened
    for writing: copying into it would change every output that shares its inode.
    """
    dest = Path(dest)
    if dest.exists() and os.path.samefile(source, dest):
        return  # already this link (rename() between two links to one file does nothing)
    tmp = dest.with_name(f".{dest.name}.link-tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, dest)


def task_counts(
    indexes: list[NGramIndex],
    items: dict[str, list],
    matches: list[dict],
    unindexed: dict[tuple[str, int], str] | None = None,
) -> list[dict]:
    """Per task: items, items long enough to index (by n-grams or whole), n-grams, contaminated
    items, the share of the set seen in training (None when no item is long enough to tell),
    documents, and the items that could not be indexed, counted by reason."""
    indexed: dict[str, set[int]] = defaultdict(set)
    ngrams: dict[str, int] = defaultdict(int)
    whole: dict[str, set[int]] = defaultdict(set)
    for position, index in enumerate(indexes):
        for owner in index.owners.tolist():
            task, item = index.items[owner]
            indexed[task].add(item)
            ngrams[task] += 1
            if position:
                whole[task].add(item)
    reasons: dict[str, dict[str, int]] = defaultdict(dict)
    for (task, _), reason in (unindexed or {}).items():
        kind = reason.split(" ", 1)[1] if reason[0].isdigit() else reason
        reasons[task][kind] = reasons[task].get(kind, 0) + 1
    hit_items: dict[str, set[int]] = defaultdict(set)
    hit_docs: dict[str, set[str]] = defaultdict(set)
    for m in matches:
        hit_items[m["task"]].add(m["item"])
        hit_docs[m["task"]].add(m["doc_id"])
    rows = []
    for task, task_items in items.items():
        count, contaminated = len(task_items), len(hit_items[task])
        rows.append(
            {
                "task": task,
                "items": count,
                "indexed_items": len(indexed[task]),
                "whole_items": len(whole[task]),
                "unindexed_items": count - len(indexed[task]),
                "unindexed_reasons": reasons[task],
                "ngrams": ngrams[task],
                "contaminated_items": contaminated,
                "share": round(contaminated / count, 6) if indexed[task] else None,
                "documents": len(hit_docs[task]),
            }
        )
    return rows


def write_matches(matches: list[dict], path: Path) -> None:
    """The per-document record: one row per (training document, eval task, item)."""
    columns = {c: [m[c] for m in matches] for c in MATCH_COLUMNS}
    schema = pa.schema([(c, pa.int64() if c == "item" else pa.string()) for c in MATCH_COLUMNS])
    pq.write_table(pa.table(columns, schema=schema), path, compression="zstd")
