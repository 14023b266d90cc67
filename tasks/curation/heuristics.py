"""Stage 2, per shard: heuristic filters (FineWeb order) and PII scrubbing.

Filters run in datatrove's FineWeb order: Gopher repetition, Gopher quality, C4, FineWeb
quality; the first that fails names the removal reason. Each filter skips the domains in its
`skip_domains` (in a recipe, `curate.skip_domains`: the quickstart skips code and math, which
prose rules would remove whole). The step,
`filter_shards`, runs on one normalized output.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from llmflow.tasks.curation.config import FiltersConfig, FilterStepConfig
from llmflow.tasks.curation.filters import (
    Doc,
    c4_filter,
    fineweb_quality_filter,
    gopher_quality_filter,
    gopher_repetition_filter,
)
from llmflow.tasks.curation.pii import scrub_pii
from llmflow.tasks.curation.shards import (
    ErrorBudget,
    ShardWriter,
    add_count,
    add_metrics,
    iter_rows,
    preview,
    shards_in,
    write_json,
    write_jsonl,
)
from llmflow.tasks.curation.text import count_tokens
from llmflow.tasks.framework.step import Metrics, step

FILTER_ORDER = ("gopher_repetition", "gopher_quality", "c4", "fineweb")


class FilterFailed(Exception):
    """A filter raised on a document (its exception is the cause)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def apply_filters(cfg: FiltersConfig, text: str, domain: str) -> tuple[str | None, str, str]:
    """Runs the filter chain on one document.

    Returns (filter name or None, reason or "", text after optional C4 line rewriting).
    """
    doc = Doc(text)
    for name in FILTER_ORDER:
        fcfg = getattr(cfg, name)
        if not fcfg.enabled or domain in fcfg.skip_domains:
            continue
        try:
            reason, doc = _run_filter(name, fcfg, doc)
        except Exception as error:
            raise FilterFailed(name) from error
        if reason is not None:
            return name, reason, text
    return None, "", doc.text


def _run_filter(name: str, fcfg, doc: Doc) -> tuple[str | None, Doc]:
    """One filter's reason (None: kept) and the document after it (C4 may rewrite lines)."""
    if name == "c4":
        reason, kept = c4_filter(fcfg, doc)
        if reason is None and fcfg.rewrite_lines and kept != doc.text:
            doc = Doc(kept)
        return reason, doc
    if name == "gopher_repetition":
        return gopher_repetition_filter(fcfg, doc), doc
    if name == "gopher_quality":
        return gopher_quality_filter(fcfg, doc), doc
    return fineweb_quality_filter(fcfg, doc), doc


def _filter_file(cfg: FilterStepConfig, in_shard: Path, out_dir: Path) -> dict[str, int]:
    """Filters one shard into `out_dir/<name>.parquet` (kept documents, PII scrubbed), with
    `<stem>.removed.jsonl` (samples per reason) and `<stem>.stats.json`."""
    table: dict = {}
    samples: dict[str, list[dict]] = {}
    pii_counts = {"email": 0, "ip_address": 0, "phone": 0}
    budget = ErrorBudget("curate-filter", cfg.filters.max_error_share)
    with ShardWriter(out_dir / in_shard.name) as writer:
        for row in tqdm(
            iter_rows(in_shard), desc=f"filter {in_shard.stem}", leave=False, disable=None
        ):
            domain, text = row["domain"], row["text"]
            tokens = count_tokens(text)
            add_count(table, domain, "in", 1, tokens)
            try:
                name, reason, text = apply_filters(cfg.filters, text, domain)
            except FilterFailed as failed:  # one bad document must not fail the shard...
                name, reason = failed.name, budget.record(failed.name, failed.__cause__)
            if name is not None:
                add_count(table, domain, f"removed:{name}:{reason}", 1, tokens)
                bucket = samples.setdefault(f"{name}:{reason}", [])
                if len(bucket) < cfg.filters.num_removed_samples:
                    bucket.append(_sample(row, domain, name, reason, text))
                continue
            if cfg.pii.enabled:
                text, counts = scrub_pii(cfg.pii, text)
                for kind, num in counts.items():
                    pii_counts[kind] += num
            add_count(table, domain, "out", 1, count_tokens(text))
            writer.write({**row, "text": text})
    budget.check(in_shard, sum(d["in"]["docs"] for d in table.values()))  # ...nor many
    removed = [r for bucket in samples.values() for r in bucket]
    write_jsonl(out_dir / f"{in_shard.stem}.removed.jsonl", removed)
    stats = {"stage": "filters", "shard": in_shard.stem, "domains": table, "pii": pii_counts}
    write_json(out_dir / f"{in_shard.stem}.stats.json", stats)
    num_in = sum(d["in"]["docs"] for d in table.values())
    return {
        "documents_in": num_in,
        "documents_out": writer.num_rows,
        "pii_replaced": sum(pii_counts.values()),
    }


def _sample(row: dict, domain: str, name: str, reason: str, text: str) -> dict:
    return {
        "id": row["id"],
        "domain": domain,
        "filter": name,
        "reason": reason,
        "preview": preview(text),
    }


@step("curate-filter", version=1)
def filter_shards(cfg: FilterStepConfig, normalized: Path, out: Path) -> Metrics:
    """Filter normalized documents with the FineWeb heuristics, then scrub PII."""
    return add_metrics(_filter_file(cfg, shard, out) for shard in shards_in(normalized))
