"""Stage 1, per shard: decode, Unicode-normalize and clean whitespace; reject unusable documents.

Every input document is counted and ends up either in the normalized shard or in the rejects
JSONL with a reason: null, empty, whitespace_only, binary, non_utf8, too_long, long_line,
duplicate_id. A bad document never fails the shard.
"""

from __future__ import annotations

import re
from pathlib import Path

from tqdm import tqdm

from llmflow.tasks.curation.config import NormalizeConfig
from llmflow.tasks.curation.shards import (
    ErrorBudget,
    ShardWriter,
    add_count,
    iter_rows,
    preview,
    write_json,
    write_jsonl,
)
from llmflow.tasks.curation.text import clean_whitespace, count_tokens, normalize_unicode
from llmflow.tasks.framework.step import Metrics, step

_BINARY_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")


def _decode(raw: object) -> tuple[str | None, bool]:
    """Text of a cell; bytes are decoded as UTF-8 with replacement. Returns (text, was_invalid)."""
    if raw is None or isinstance(raw, str):
        return raw, False
    try:
        return bytes(raw).decode("utf-8"), False
    except UnicodeDecodeError:
        return bytes(raw).decode("utf-8", errors="replace"), True


def normalize_text(cfg: NormalizeConfig, raw: object, domain: str) -> tuple[str | None, str]:
    """Normalizes one document. Returns (text, "") when kept or (None, reason) when rejected;
    kept documents' second value names what was cleaned ("" when nothing), comma-separated."""
    text, invalid = _decode(raw)
    if text is None:
        return None, "null"
    if not text:
        return None, "empty"
    if len(text) > cfg.max_doc_chars:
        return None, "too_long"
    if len(_BINARY_CONTROL.findall(text)) > cfg.max_control_ratio * len(text):
        return None, "binary"
    if text.count("\ufffd") > cfg.max_replacement_ratio * len(text):
        return None, "non_utf8"
    cleaned = ["invalid_utf8_replaced"] if invalid else []
    normal = normalize_unicode(text, cfg.unicode_form)
    if normal != text:
        cleaned.append("unicode")
    collapse = cfg.collapse_inner_spaces and domain not in cfg.verbatim_domains
    tidy = clean_whitespace(normal, collapse_inner_spaces=collapse)
    if tidy != normal:
        cleaned.append("whitespace")
    if not tidy.strip():
        return None, "whitespace_only"
    if max(map(len, tidy.split("\n"))) > cfg.max_line_chars:
        return None, "long_line"
    return tidy, ",".join(cleaned)


def _reject(row: dict, raw: object, reason: str) -> dict:
    return {
        **{k: row.get(k) for k in ("id", "domain", "source")},
        "reason": reason,
        "preview": preview(raw),
    }


@step("curate-normalize", version=1)
def normalize_shard(cfg: NormalizeConfig, shard: Path, out: Path) -> Metrics:
    """Normalize one ingested shard: Unicode, whitespace, and rejection of unusable documents.

    Writes `out/<name>.parquet`, with `<stem>.rejects.jsonl` and `<stem>.stats.json` beside it.
    """
    table: dict = {}
    rejects, cleaned, seen_ids = [], {}, set()
    budget = ErrorBudget("curate-normalize", cfg.max_error_share)
    with ShardWriter(out / shard.name) as writer:
        for row in tqdm(
            iter_rows(shard), desc=f"normalize {shard.stem}", leave=False, disable=None
        ):
            domain = row.get("domain") or "unknown"
            raw = row.get("text")
            tokens = count_tokens(raw) if isinstance(raw, str) else 0
            add_count(table, domain, "in", 1, tokens)
            try:
                text, note = normalize_text(cfg, raw, domain)
            except Exception as error:  # noqa: BLE001 - one bad document must not fail the shard...
                text, note = None, budget.record("normalization", error)
            if text is not None and row.get("id") in seen_ids:
                text, note = None, "duplicate_id"
            if text is None:
                add_count(table, domain, f"rejected:{note}", 1, tokens)
                rejects.append(_reject(row, raw, note))
                continue
            seen_ids.add(row.get("id"))
            for kind in filter(None, note.split(",")):
                cleaned[kind] = cleaned.get(kind, 0) + 1
            add_count(table, domain, "out", 1, count_tokens(text))
            writer.write({**row, "text": text, "domain": domain})
    budget.check(shard, sum(d["in"]["docs"] for d in table.values()))  # ...nor many of them
    write_jsonl(out / f"{shard.stem}.rejects.jsonl", rejects)
    stats = {"stage": "normalize", "shard": shard.stem, "domains": table, "cleaned": cleaned}
    write_json(out / f"{shard.stem}.stats.json", stats)
    num_in = sum(d["in"]["docs"] for d in table.values())
    return {"documents_in": num_in, "documents_out": writer.num_rows, "rejected": len(rejects)}
