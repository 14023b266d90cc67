"""The ``decontaminate`` step: the curated corpus less (or flagged for) what overlaps the eval sets.

Between curation and tokenization: it indexes every eval set the evaluate step runs, scans the
curated corpus, and writes the same corpus layout plus ``contamination.json`` (per task: items,
contaminated items, the share of the set seen in training) and ``contamination.parquet`` (per
training document: the task, the item and the matched n-gram). The evaluate step finds this
output in the lineage of the model it scores and marks each score with its task's share.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from llmflow.tasks.decontam.config import DecontamConfig, decontam_config
from llmflow.tasks.decontam.evalsets import eval_items
from llmflow.tasks.decontam.lineage import REPORT_FILE
from llmflow.tasks.decontam.ngrams import (
    NGramIndex,
    build_index,
    unindexed_items,
    whole_item_indexes,
)
from llmflow.tasks.decontam.scan import ScanResult, scan_corpus, task_counts, write_matches
from llmflow.tasks.evaluation.suite import REAL_SET_FILES
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.graph import Raw
from llmflow.tasks.framework.s3config import filesystem
from llmflow.tasks.framework.step import Metrics, RawFiles, report_table, step

MATCHES_FILE = "contamination.parquet"
CARRIED_FILES = ("curation_report.json", "summary.md")  # the curated output's reports
log = logging.getLogger("llmflow.decontam")


@step("decontaminate", version=3)  # 3: arithmetic items apart from post-training
def decontaminate(
    cfg: DecontamConfig, corpus: Path, out: Path, eval_files: RawFiles | None = None
) -> Metrics:
    """Index the eval sets' n-grams, scan the curated corpus, remove or flag what matches."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llmflow-evalsets-") as tmp:
        items, skipped = eval_items(cfg, _local_files(eval_files, Path(tmp)))
    flat = [item for task_items in items.values() for item in task_items]
    indexes = [build_index(flat, cfg.n, cfg.query_ngrams, cfg.overlap_ngrams)]
    indexes += whole_item_indexes(flat, cfg.n, cfg.min_item_words)
    indexed = time.perf_counter()
    result = scan_corpus(indexes, corpus, out, cfg.mode)
    result.scan_seconds = time.perf_counter() - indexed
    carry_reports(corpus, out)
    unindexed = unindexed_items(flat, cfg.n, cfg.min_item_words)
    rows = task_counts(indexes, items, result.matches, unindexed)
    write_matches(result.matches, out / MATCHES_FILE)
    seconds = time.perf_counter() - started
    report = contamination_report(cfg, indexes, rows, skipped, result, seconds)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1))
    report_table("contamination", rows, "Eval items seen in the training corpus, per task")
    _log_uncheckable(rows, cfg.n)
    return metrics(report)


def _local_files(files: RawFiles | None, tmp: Path) -> list[Path]:
    """The real sets' files as local paths (remote ones are copied into ``tmp``)."""
    local = []
    for uri in files or ():
        fs, path = filesystem(uri)
        if isinstance(fs, LocalFileSystem):
            local.append(Path(path))
        else:
            target = tmp / Path(path).name
            fs.get_file(path, str(target))
            local.append(target)
    return local


def carry_reports(corpus: Path, out: Path) -> None:
    """The curation report and summary travel with the corpus (its format stays the curated one)."""
    for name in CARRIED_FILES:
        if (corpus / name).is_file():
            (out / name).write_bytes((corpus / name).read_bytes())


def _method(cfg: DecontamConfig) -> dict:
    """The report's method fields: n-gram size, mode, n-gram counts, shortest item."""
    return {
        "n": cfg.n,
        "mode": cfg.mode,
        "query_ngrams": cfg.query_ngrams,
        "overlap_ngrams": cfg.overlap_ngrams,
        "min_item_words": cfg.min_item_words,
    }


def contamination_report(
    cfg: DecontamConfig,
    indexes: list[NGramIndex],
    rows: list[dict],
    skipped: dict[str, str],
    result: ScanResult,
    seconds: float,
) -> dict:
    """``contamination.json``: the method, per-task counts, skipped tasks and document counts."""
    return {
        **_method(cfg),
        "tasks": {row["task"]: {k: v for k, v in row.items() if k != "task"} for row in rows},
        "skipped": skipped,
        "index_ngrams": int(len(indexes[0].hashes)),
        "whole_item_windows": int(sum(len(index.hashes) for index in indexes[1:])),
        "documents": result.documents,
        "documents_contaminated": result.contaminated,
        "documents_removed": result.removed,
        "seconds": round(seconds, 3),
        "scan_seconds": round(result.scan_seconds, 3),
        "docs_per_second": round(result.documents / max(result.scan_seconds, 1e-9), 1),
    }


def metrics(report: dict) -> Metrics:
    """Flat scalars for lineage and Prefect: counts, speed, and per task its share."""
    out: Metrics = {
        k: report[k]
        for k in ("documents", "documents_contaminated", "documents_removed", "docs_per_second")
    }
    for task, counts in report["tasks"].items():
        out[f"{task}/contaminated_items"] = counts["contaminated_items"]
        out[f"{task}/share"] = counts["share"]
    return out


def _log_uncheckable(rows: list[dict], n: int) -> None:
    for row in rows:
        if row["unindexed_items"]:
            reasons = ", ".join(f"{c} {r}" for r, c in sorted(row["unindexed_reasons"].items()))
            log.info(
                "decontaminate: %d of %d items of %s cannot be checked (%s)",
                row["unindexed_items"],
                row["items"],
                row["task"],
                reasons,
            )


def eval_set_files(cfg: DecontamConfig, data_root: str | None) -> tuple[str, ...]:
    """The files the step reads (real sets under ``data_root``, custom task YAMLs), checked now
    so that a missing eval set fails before any compute, naming it."""
    files: list[str] = []
    for task in cfg.tasks:
        if task not in REAL_SET_FILES:
            continue
        if data_root is None:
            raise BadInputError(f"eval set {task!r} cannot be read: evaluate.data_root is not set")
        for name in REAL_SET_FILES[task]:
            path = f"{data_root.rstrip('/')}/{name}"
            if "://" not in path and not Path(path).is_file():
                raise BadInputError(f"eval set {task!r} cannot be read: {path} does not exist")
            files.append(path)
    for custom in cfg.custom_tasks:
        if not Path(custom).exists():
            raise BadInputError(f"custom eval task path {custom!r} does not exist")
        found = sorted(Path(custom).rglob("*")) if Path(custom).is_dir() else [Path(custom)]
        files += [str(p) for p in found if p.is_file()]
    return tuple(files)


def add_decontamination(graph, settings, evaluate, curated, name: str):
    """Add the decontaminate node after ``curated``; the tokenizer and tokenize read its output.

    Args:
        graph: The recipe (a ``Graph``).
        settings: The pipeline's ``decontaminate`` section (``DecontamSettings``).
        evaluate: The pipeline's ``EvalConfig``: which eval sets to index.
        curated: The curate node (or a committed curated output).
        name: The output label.
    """
    cfg = decontam_config(settings, evaluate)
    files = eval_set_files(cfg, evaluate.data_root)
    raw = Raw(files) if files else None
    return graph.add(decontaminate, cfg, name, corpus=curated, eval_files=raw)
