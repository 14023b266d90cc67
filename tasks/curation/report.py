"""The curation report: documents and tokens in/out per stage and per domain, removal reasons,
dedup clusters and classifier quality, plus a markdown summary for a Prefect artifact."""

from __future__ import annotations

from pathlib import Path

from llmflow.tasks.curation.shards import read_json, read_jsonl
from llmflow.tasks.summaries import CurationStage


def _totals(by_domain: dict[str, dict], key: str) -> dict[str, int]:
    docs = sum(d.get(key, {}).get("docs", 0) for d in by_domain.values())
    tokens = sum(d.get(key, {}).get("tokens", 0) for d in by_domain.values())
    return {"docs": docs, "tokens": tokens}


def merge_stats(stats_dirs: list[Path], stage: str) -> tuple[dict, list[dict]]:
    """Merges the per-shard `*.stats.json` of one stage into {domain: {key: counts}}; also
    returns the other per-shard fields (cleaned counts, PII counts) as a list."""
    merged: dict[str, dict] = {}
    extras: list[dict] = []
    for d in stats_dirs:
        for path in sorted(Path(d).glob("*.stats.json")):
            stats = read_json(path)
            if stats.get("stage") != stage:
                continue
            extras.append({k: v for k, v in stats.items() if k not in ("domains", "stage")})
            for domain, table in stats["domains"].items():
                for key, counts in table.items():
                    entry = merged.setdefault(domain, {}).setdefault(key, {"docs": 0, "tokens": 0})
                    entry["docs"] += counts["docs"]
                    entry["tokens"] += counts["tokens"]
    return merged, extras


def stage_entry(name: str, by_domain: dict[str, dict]) -> dict:
    """One row of the stage table from {domain: {"in", "out", "<removed-key>": counts}}."""
    removed: dict[str, dict] = {}
    for table in by_domain.values():
        for key, counts in table.items():
            if key in ("in", "out"):
                continue
            reason = key.split(":", 1)[1] if ":" in key else key
            entry = removed.setdefault(reason, {"docs": 0, "tokens": 0})
            entry["docs"] += counts["docs"]
            entry["tokens"] += counts["tokens"]
    totals_in, totals_out = _totals(by_domain, "in"), _totals(by_domain, "out")
    return CurationStage.written(
        {
            "stage": name,
            "documents_in": totals_in["docs"],
            "documents_out": totals_out["docs"],
            "tokens_in": totals_in["tokens"],
            "tokens_out": totals_out["tokens"],
            "removed": dict(sorted(removed.items(), key=lambda kv: -kv[1]["docs"])),
            "by_domain": {
                domain: {
                    "documents_in": t.get("in", {}).get("docs", 0),
                    "documents_out": t.get("out", {}).get("docs", 0),
                    "tokens_in": t.get("in", {}).get("tokens", 0),
                    "tokens_out": t.get("out", {}).get("tokens", 0),
                }
                for domain, t in sorted(by_domain.items())
            },
        }
    )


def samples(stats_dirs: list[Path], suffix: str, limit: int = 50) -> list[dict]:
    """Up to `limit` records from the `*.<suffix>.jsonl` files of the given dirs."""
    found: list[dict] = []
    for d in stats_dirs:
        for path in sorted(Path(d).glob(f"*.{suffix}.jsonl")):
            found += read_jsonl(path)[: max(0, limit - len(found))]
    return found


def markdown_summary(report: dict) -> str:
    """A markdown summary of the curation report (for a Prefect markdown artifact)."""
    lines = [
        "# Curation report",
        "",
        "| stage | docs in | docs out | tokens in | tokens out | top reasons |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for stage in report["stages"]:
        reasons = ", ".join(f"{r} ({c['docs']})" for r, c in list(stage["removed"].items())[:4])
        lines.append(
            f"| {stage['stage']} | {stage['documents_in']:,} | {stage['documents_out']:,} "
            f"| {stage['tokens_in']:,} | {stage['tokens_out']:,} | {reasons} |"
        )
    lines += ["", "## Output by domain", "", "| domain | docs | tokens |", "|---|---:|---:|"]
    for domain, counts in report["output"]["by_domain"].items():
        lines.append(f"| {domain} | {counts['documents']:,} | {counts['tokens']:,} |")
    near = report.get("near_dedup", {})
    lines += [
        "",
        f"Near-duplicate clusters: {near.get('clusters', 0)}, size histogram "
        f"{near.get('cluster_size_histogram', {})}.",
    ]
    quality = report.get("quality_model", {})
    if "holdout" in quality:
        h = quality["holdout"]
        lines.append(
            f"Quality classifier (teacher `{quality['teacher']}`): held-out precision "
            f"{h['precision']:.3f}, recall {h['recall']:.3f}, threshold "
            f"{quality['threshold']}."
        )
    elif quality:
        lines.append(f"Quality classifier: {quality.get('skipped', 'not run')}.")
    lines.append(f"PII replaced: {report.get('pii', {})}.")
    return "\n".join(lines) + "\n"
