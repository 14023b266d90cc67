"""The last curation stage, the ``curate`` step: the curated corpus and its report.

It reads the filtered shards, drops what the global stages (exact dedup, near dedup, quality
model) dropped, and writes `shards/<domain>/<shard>.parquet` (id, text, domain, source),
`curation_report.json` and `summary.md`: what the tokenizer and tokenize steps read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
from tqdm import tqdm

from llmflow.tasks.curation.config import CorpusConfig
from llmflow.tasks.curation.exact_dedup import PARAGRAPH_SEPARATOR
from llmflow.tasks.curation.report import markdown_summary, merge_stats, samples, stage_entry
from llmflow.tasks.curation.shards import (
    ShardWriter,
    add_count,
    iter_rows,
    read_json,
    shards_in,
    write_json,
)
from llmflow.tasks.curation.text import count_tokens
from llmflow.tasks.framework.step import Metrics, report_markdown, report_table, step


def _drop_table(drop_dirs: list[Path]) -> dict[str, tuple[str, str]]:
    """id -> (stage, reason); the first stage listed that drops a document claims it."""
    drops: dict[str, tuple[str, str]] = {}
    for d in drop_dirs:
        stage = read_json(d / "report.json").get("stage", d.name)
        table = pq.read_table(d / "drops.parquet", columns=["id", "reason"]).to_pylist()
        for row in table:
            drops.setdefault(row["id"], (stage, row["reason"]))
    return drops


def _paragraph_drops(drop_dirs: list[Path]) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for d in drop_dirs:
        path = d / "paragraph_drops.parquet"
        if path.exists():
            for row in pq.read_table(path).to_pylist():
                found.setdefault(row["id"], set()).add(row["paragraph"])
    return found


def _safe(domain: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", domain) or "unknown"


def _fate(row: dict, drops: dict, paragraphs: dict) -> tuple[dict, str | None, str | None]:
    """(row with repeated paragraphs cut, stage that drops it, reason) for one document."""
    stage, reason = drops.get(row["id"], (None, None))
    if row["id"] in paragraphs and stage is None:
        parts = row["text"].split(PARAGRAPH_SEPARATOR)
        kept = [p for i, p in enumerate(parts) if i not in paragraphs[row["id"]]]
        row = {**row, "text": PARAGRAPH_SEPARATOR.join(kept).strip()}
        if not row["text"]:
            stage, reason = "exact_dedup", "exact_paragraphs"
    return row, stage, reason


def _count(tables: dict, stage_names: list[str], domain: str, tokens: int, stage, reason) -> None:
    """Counts one document in and out of each global stage, up to the one that drops it."""
    for name in stage_names:
        add_count(tables[name], domain, "in", 1, tokens)
        if name == stage:
            add_count(tables[name], domain, f"removed:{reason}", 1, tokens)
            return
        add_count(tables[name], domain, "out", 1, tokens)


def _write_outputs(shard_dirs, drops, paragraphs, stage_names, out_dir) -> tuple[dict, dict]:
    """Writes the kept documents per domain; returns (per-stage tables, output counts)."""
    tables = {name: {} for name in stage_names}
    output: dict[str, dict] = {}
    writers: dict[tuple[str, str], ShardWriter] = {}
    for shard in [s for d in shard_dirs for s in shards_in(d)]:
        for row in tqdm(iter_rows(shard), desc=f"finalize {shard.stem}", leave=False, disable=None):
            domain, tokens = row["domain"], count_tokens(row["text"])
            row, stage, reason = _fate(row, drops, paragraphs)
            _count(tables, stage_names, domain, tokens, stage, reason)
            if stage is not None:
                continue
            key = (domain, shard.stem)
            if key not in writers:
                (out_dir / "shards" / _safe(domain)).mkdir(parents=True, exist_ok=True)
                writers[key] = ShardWriter(out_dir / "shards" / _safe(domain) / shard.name)
            writers[key].write(row)
            entry = output.setdefault(domain, {"documents": 0, "tokens": 0})
            entry["documents"] += 1
            entry["tokens"] += count_tokens(row["text"])
    for writer in writers.values():
        writer.close()
    return tables, output


def _summed(extras: list[dict], key: str) -> dict[str, int]:
    """Per-shard counts under ``key`` (PII kinds, cleaning kinds) added up."""
    total: dict[str, int] = {}
    for extra in extras:
        for kind, num in extra.get(key, {}).items():
            total[kind] = total.get(kind, 0) + num
    return total


def _report(stats_dirs: list[Path], reports: dict, tables: dict, output: dict) -> dict:
    """The curation report: per-stage counts, PII and cleaning totals, samples, stage reports."""
    normalize_stats, normalize_extra = merge_stats(stats_dirs, "normalize")
    filter_stats, filter_extra = merge_stats(stats_dirs, "filters")
    stages = [stage_entry("normalize", normalize_stats), stage_entry("filters", filter_stats)]
    stages += [stage_entry(name, tables[name]) for name in reports]
    return {
        "stages": stages,
        "pii": _summed(filter_extra, "pii"),
        "normalize_cleaned": _summed(normalize_extra, "cleaned"),
        "rejected_samples": samples(stats_dirs, "rejects"),
        "removed_samples": samples(stats_dirs, "removed"),
        **reports,
        "output": {
            "documents": sum(o["documents"] for o in output.values()),
            "tokens": sum(o["tokens"] for o in output.values()),
            "by_domain": dict(sorted(output.items())),
        },
    }


@step("curate", version=1)
def finalize(
    cfg: CorpusConfig,
    normalized: list[Path],
    filtered: list[Path],
    exact: Path,
    near: Path,
    quality: Path,
    out: Path,
) -> Metrics:
    """Write the curated corpus per domain, with its report (markdown and per-stage table).

    Args:
        cfg: no settings (the corpus follows from the inputs).
        normalized: normalize outputs (their `*.stats.json` and rejects JSONL).
        filtered: filter outputs: the documents, their stats and removed samples.
        exact: exact dedup output; near: near dedup output; quality: quality model output
            (each a `drops.parquet` and `report.json`; a document's first drop names it).
        out: receives `shards/<domain>/<shard>.parquet` (id, text, domain, source),
            `curation_report.json` and `summary.md`.
    """
    drop_dirs = [exact, near, quality]
    reports = {
        read_json(d / "report.json")["stage"]: read_json(d / "report.json") for d in drop_dirs
    }
    drops, paragraphs = _drop_table(drop_dirs), _paragraph_drops(drop_dirs)
    tables, output = _write_outputs(filtered, drops, paragraphs, list(reports), out)
    report = _report([*normalized, *filtered], reports, tables, output)
    write_json(out / "curation_report.json", report)
    summary = markdown_summary(report)
    (out / "summary.md").write_text(summary)
    report_markdown("curation-report", summary, "Curation: what was removed and why")
    report_table("curation-stages", report["stages"], "Documents and tokens in/out per stage")
    first = report["stages"][0]
    return {
        "documents_in": first["documents_in"],
        "tokens_in": first["tokens_in"],
        "documents_out": report["output"]["documents"],
        "tokens_out": report["output"]["tokens"],
    }
