"""The curate step as stages, and `curate` running them all in one call.

Stage order (per-shard stages can be mapped over shards; global ones take all shards' outputs):

1. `normalize_shard`          per shard   ingested shard -> normalized shard + rejects
2. `filter_shard`             per shard   normalized -> filtered shard (heuristics, PII)
3. `exact_hashes_shard`       per shard   normalized -> document (and paragraph) hashes
4. `minhash_signatures_shard` per shard   normalized -> LSH band keys
5. `exact_dedup`              global      hashes (+ filtered shards alive) -> drops
6. `near_dedup`               global      band keys (+ alive, - exact drops) -> drops, clusters
7. `quality_model`            global      filtered shards (- dedup drops) -> drops, classifier
8. `finalize`                 global      filtered shards + drops -> per-domain shards, report

Stages 3 and 4 read normalized shards, so changing a filter threshold re-runs only stage 2 and
the cheap global stages, never the hashing or MinHash signatures (see `stage_config`).
"""

from __future__ import annotations

import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
from tqdm import tqdm

from llmflow.tasks.curation.config import CurateConfig
from llmflow.tasks.curation.exact_dedup import PARAGRAPH_SEPARATOR, exact_dedup, exact_hashes_shard
from llmflow.tasks.curation.heuristics import filter_shard
from llmflow.tasks.curation.minhash import minhash_signatures_shard, near_dedup
from llmflow.tasks.curation.normalize import normalize_shard
from llmflow.tasks.curation.quality_model import quality_model
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

__all__ = [
    "curate",
    "exact_dedup",
    "exact_hashes_shard",
    "filter_shard",
    "finalize",
    "minhash_signatures_shard",
    "near_dedup",
    "normalize_shard",
    "quality_model",
    "stage_config",
]

_STAGE_FIELDS = {
    "normalize": {"normalize": None},
    "filter": {"filters": None, "pii": None},
    "exact_hashes": {"exact_dedup": {"level", "min_paragraph_chars"}},
    "minhash_signatures": {"minhash": {"n_grams", "num_buckets", "hashes_per_bucket", "seed"}},
    "exact_dedup": {"exact_dedup": None},
    "near_dedup": {"minhash": None},
    "quality_model": {"quality_model": None},
    "finalize": {"exact_dedup": {"level"}},
}


def stage_config(cfg: CurateConfig, stage: str) -> dict:
    """The config fields a stage's output depends on: hash these (plus the input hashes) for
    the stage's cache key, so e.g. a filter threshold never invalidates MinHash signatures."""
    dumped = cfg.model_dump(mode="json")
    out = {}
    for section, fields in _STAGE_FIELDS[stage].items():
        values = dumped[section]
        out[section] = values if fields is None else {k: values[k] for k in sorted(fields)}
    return out


def _drop_table(drop_dirs: list[Path]) -> dict[str, tuple[str, str]]:
    """id -> (stage, reason); the first stage listed that drops a document claims it."""
    drops: dict[str, tuple[str, str]] = {}
    for d in drop_dirs:
        stage = read_json(Path(d) / "report.json").get("stage", Path(d).name)
        table = pq.read_table(Path(d) / "drops.parquet", columns=["id", "reason"]).to_pylist()
        for row in table:
            drops.setdefault(row["id"], (stage, row["reason"]))
    return drops


def _paragraph_drops(drop_dirs: list[Path]) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for d in drop_dirs:
        path = Path(d) / "paragraph_drops.parquet"
        if path.exists():
            for row in pq.read_table(path).to_pylist():
                found.setdefault(row["id"], set()).add(row["paragraph"])
    return found


def _safe(domain: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", domain) or "unknown"


def _write_outputs(shard_dirs, drops, paragraphs, stage_names, out_dir) -> tuple[dict, dict]:
    tables = {name: {} for name in stage_names}
    output: dict[str, dict] = {}
    writers: dict[tuple[str, str], ShardWriter] = {}
    for shard in [s for d in shard_dirs for s in shards_in(d)]:
        for row in tqdm(iter_rows(shard), desc=f"finalize {shard.stem}", leave=False):
            domain, tokens = row["domain"], count_tokens(row["text"])
            stage, reason = drops.get(row["id"], (None, None))
            if row["id"] in paragraphs and stage is None:
                parts = row["text"].split(PARAGRAPH_SEPARATOR)
                kept = [p for i, p in enumerate(parts) if i not in paragraphs[row["id"]]]
                row = {**row, "text": PARAGRAPH_SEPARATOR.join(kept).strip()}
                if not row["text"]:
                    stage, reason = "exact_dedup", "exact_paragraphs"
            for name in stage_names:
                add_count(tables[name], domain, "in", 1, tokens)
                if name == stage:
                    add_count(tables[name], domain, f"removed:{reason}", 1, tokens)
                    break
                add_count(tables[name], domain, "out", 1, tokens)
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


def finalize(
    cfg: CurateConfig,
    shard_dirs: list[Path],
    drop_dirs: list[Path],
    out_dir: Path,
    stats_dirs: list[Path] = (),
) -> dict:
    """Writes the curated corpus and its report.

    Args:
        cfg: the curate config.
        shard_dirs: filtered shard dirs (outputs of `filter_shard`).
        drop_dirs: global stage outputs in stage order (exact dedup, near dedup, quality model),
            each with `drops.parquet` and `report.json`.
        out_dir: receives `shards/<domain>/<shard>.parquet` (id, text, domain, source),
            `curation_report.json` and `summary.md`.
        stats_dirs: normalize and filter outputs (their `*.stats.json` and sample JSONL).
    """
    out_dir = Path(out_dir)
    drops, paragraphs = _drop_table(drop_dirs), _paragraph_drops(drop_dirs)
    reports = {
        read_json(Path(d) / "report.json")["stage"]: read_json(Path(d) / "report.json")
        for d in drop_dirs
    }
    tables, output = _write_outputs(shard_dirs, drops, paragraphs, list(reports), out_dir)
    normalize_stats, normalize_extra = merge_stats(stats_dirs, "normalize")
    filter_stats, filter_extra = merge_stats(stats_dirs, "filters")
    stages = [stage_entry("normalize", normalize_stats), stage_entry("filters", filter_stats)]
    stages += [stage_entry(name, tables[name]) for name in reports]
    pii: dict[str, int] = {}
    for extra in filter_extra:
        for kind, num in extra.get("pii", {}).items():
            pii[kind] = pii.get(kind, 0) + num
    cleaned: dict[str, int] = {}
    for extra in normalize_extra:
        for kind, num in extra.get("cleaned", {}).items():
            cleaned[kind] = cleaned.get(kind, 0) + num
    report = {
        "stages": stages,
        "pii": pii,
        "normalize_cleaned": cleaned,
        "rejected_samples": samples(stats_dirs, "rejects"),
        "removed_samples": samples(stats_dirs, "removed"),
        **reports,
        "output": {
            "documents": sum(o["documents"] for o in output.values()),
            "tokens": sum(o["tokens"] for o in output.values()),
            "by_domain": dict(sorted(output.items())),
        },
    }
    write_json(out_dir / "curation_report.json", report)
    summary = markdown_summary(report)
    (out_dir / "summary.md").write_text(summary)
    first = stages[0]
    return {
        "documents_in": first["documents_in"],
        "tokens_in": first["tokens_in"],
        "documents_out": report["output"]["documents"],
        "tokens_out": report["output"]["tokens"],
    }


def _map(fn, cfg: CurateConfig, shards: list[Path], out_dir: Path, num_workers: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    if num_workers <= 1:
        for shard in shards:
            fn(cfg, shard, out_dir)
        return
    with ProcessPoolExecutor(num_workers) as pool:
        list(pool.map(fn, [cfg] * len(shards), shards, [out_dir] * len(shards)))


def curate(cfg: CurateConfig, in_dir: Path, out_dir: Path, num_workers: int = 1) -> dict:
    """Runs every stage in order on `<in_dir>/shards/*.parquet`; intermediate outputs go to
    `out_dir/work/<stage>/`, the curated corpus and report to `out_dir` (see `finalize`)."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    work = out_dir / "work"
    dirs = {
        name: work / name
        for name in (
            "normalize",
            "filter",
            "exact_hashes",
            "minhash",
            "exact_dedup",
            "near_dedup",
            "quality_model",
        )
    }
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    workers = max(num_workers, cfg.num_workers)
    _map(normalize_shard, cfg, shards_in(in_dir), dirs["normalize"], workers)
    normalized = shards_in(dirs["normalize"])
    _map(filter_shard, cfg, normalized, dirs["filter"], workers)
    _map(exact_hashes_shard, cfg, normalized, dirs["exact_hashes"], workers)
    _map(minhash_signatures_shard, cfg, normalized, dirs["minhash"], workers)
    alive = [dirs["filter"]]
    exact_dedup(cfg, [dirs["exact_hashes"]], dirs["exact_dedup"], keep_dirs=alive)
    near_dedup(
        cfg,
        [dirs["minhash"]],
        dirs["near_dedup"],
        keep_dirs=alive,
        exclude_dirs=[dirs["exact_dedup"]],
    )
    quality_model(
        cfg, alive, dirs["quality_model"], exclude_dirs=[dirs["exact_dedup"], dirs["near_dedup"]]
    )
    drop_dirs = [dirs["exact_dedup"], dirs["near_dedup"], dirs["quality_model"]]
    return finalize(cfg, alive, drop_dirs, out_dir, stats_dirs=[dirs["normalize"], dirs["filter"]])
