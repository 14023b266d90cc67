"""Curation speed and fidelity against datatrove 0.10 (the FineWeb pipeline), side by side.

Corpus: the quickstart sample (`tasks.ingest.sample`), plus, with ``--text-dir DIR`` (a folder
holding ``wikitext2_valid.txt`` and ``tinyshakespeare.txt``), WikiText-2 validation articles and
tinyshakespeare in 2,000-character chunks, plus planted near copies (1-3 words replaced) of those
real documents.

1. Filter chain, one process, in memory, same thresholds: datatrove GopherRepetition ->
   GopherQuality -> C4QualityFilter(filter_no_terminal_punct=False) -> FineWebQuality, against
   ours (`apply_filters`, C4 rewriting on as datatrove does it, no domain skipped). Reports
   docs/s, the ratio, the fraction of identical keep/remove decisions and each disagreement,
   re-run with spaCy's words to tell tokenization differences from rule differences.
2. MinHash near dedup (5-grams, 14 bands x 8): datatrove's four stages in a one-task
   LocalPipelineExecutor against the steps `minhash_signatures` + `near_dedup` (called as plain
   functions); docs/s, ratio, recall/precision on the planted copies, index bytes per document.

Throughput is documents per CPU second of one process (per core), so a busy machine does not
skew the ratio. Prints ONE JSON line. Without datatrove installed, only our half runs (with a message).

    pip install "datatrove==0.10.*" spacy regex "xxhash<4"
    python benchmarks/bench_curation.py [--near-copies 200] [--text-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow.parquet as pq  # noqa: E402

from llmflow.tasks.curation.config import FiltersConfig, MinhashConfig  # noqa: E402
from llmflow.tasks.curation.filters import (  # noqa: E402
    Doc,
    c4_filter,
    fineweb_quality_filter,
    gopher_quality_filter,
    gopher_repetition_filter,
)
from llmflow.tasks.curation.heuristics import apply_filters  # noqa: E402
from llmflow.tasks.curation.minhash import minhash_signatures, near_dedup  # noqa: E402
from tests.tasks.curation.helpers import near_copy, real_documents, write_shards  # noqa: E402

try:
    import datatrove  # noqa: F401

    HAVE_DATATROVE = True
except ImportError:
    HAVE_DATATROVE = False


def build_corpus(
    tmp: Path, num_near: int, text_dir: Path | None, seed: int = 0
) -> tuple[list[dict], dict[str, str]]:
    """Returns (records, planted copy id -> original id)."""
    from llmflow.tasks.ingest.sample import SampleConfig, make_sample

    make_sample(SampleConfig(seed=seed), tmp / "sample")
    records = [
        json.loads(line)
        for p in sorted((tmp / "sample").glob("*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    manifest = json.loads((tmp / "sample" / "manifest.json").read_text())
    planted = {k: v["of"] for k, v in manifest.items() if "of" in v}
    real = real_documents(text_dir=text_dir) if text_dir is not None else []
    records += [{"id": f"real-{i:05d}", "text": t, "domain": "prose"} for i, t in enumerate(real)]
    rng = random.Random(seed)
    sources = [r for r in records if r["id"].startswith("real-") and len(r["text"].split()) > 150]
    for i, source in enumerate(rng.sample(sources, min(num_near, len(sources)))):
        copy_id = f"planted-{i:05d}"
        planted[copy_id] = source["id"]
        records.append(
            {
                "id": copy_id,
                "domain": "prose",
                "text": near_copy(rng, source["text"], rng.randint(1, 3)),
            }
        )
    for r in records:
        r.setdefault("source", "bench")
    return records, planted


def bench_config() -> FiltersConfig:
    """datatrove's FineWeb chain: default thresholds, C4 rewrites lines, no domain skipped."""
    return FiltersConfig.model_validate(
        {
            "gopher_repetition": {"skip_domains": []},
            "gopher_quality": {"skip_domains": []},
            "c4": {"skip_domains": [], "rewrite_lines": True},
            "fineweb": {"skip_domains": []},
        }
    )


def run_ours_filters(records: list[dict]) -> tuple[list[str | None], float]:
    cfg = bench_config()
    start = _cpu()
    reasons = [apply_filters(cfg, r["text"], r["domain"])[1] or None for r in records]
    return reasons, _cpu() - start


def run_datatrove_filters(records: list[dict]) -> tuple[list[str | None], float]:
    from datatrove.data import Document
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.utils.text import split_into_words

    split_into_words("warm up spaCy.")  # model load is not part of the timing
    chain = [
        GopherRepetitionFilter(),
        GopherQualityFilter(),
        C4QualityFilter(filter_no_terminal_punct=False),
        FineWebQualityFilter(),
    ]
    reasons: list[str | None] = []
    start = _cpu()
    for r in records:
        doc, reason = Document(text=r["text"], id=r["id"]), None
        for f in chain:
            out = f.filter(doc)
            if out is not True:
                reason = out[1] if isinstance(out, tuple) else "removed"
                break
        reasons.append(reason)
    return reasons, _cpu() - start


def _with_spacy_words(text: str) -> str | None:
    """Our chain fed spaCy's words: tells a tokenization difference from a rule difference."""
    from datatrove.utils.text import split_into_words

    cfg = bench_config()
    doc = Doc(text, _words=split_into_words(text))
    reason = gopher_repetition_filter(cfg.gopher_repetition, doc) or gopher_quality_filter(
        cfg.gopher_quality, doc
    )
    if reason is None:
        reason, kept = c4_filter(cfg.c4, doc)
        if reason is None:
            reason = fineweb_quality_filter(cfg.fineweb, Doc(kept, _words=split_into_words(kept)))
    return reason


def disagreements(records, ours, theirs) -> list[dict]:
    out = []
    for r, a, b in zip(records, ours, theirs, strict=True):
        if (a is None) != (b is None):
            cause = (
                "word splitting"
                if (_with_spacy_words(r["text"]) is None) == (b is None)
                else "rule"
            )
            out.append({"id": r["id"], "ours": a, "datatrove": b, "cause": cause})
    return out


def _shingle_sets(records: list[dict]) -> dict[str, set[int]]:
    from llmflow.tasks.curation.text import simplify_text

    sets = {}
    for r in records:
        w = simplify_text(r["text"]).split()
        sets[r["id"]] = {hash(tuple(w[i : i + 5])) for i in range(len(w) - 4)}
    return sets


def _max_jaccard(doc_id: str, sets: dict[str, set[int]]) -> float:
    mine, best = sets[doc_id], 0.0
    for other, theirs in sets.items():
        if other != doc_id and mine and theirs:
            union = len(mine | theirs)
            best = max(best, len(mine & theirs) / union)
    return best


def _scores(removed: set[str], planted: dict[str, str], sets: dict[str, set[int]]) -> dict:
    """Recall on our planted near copies (a pair counts when one of the two is removed);
    precision: removed documents that are planted copies/originals (ours or the sample's) or
    have a true 5-gram Jaccard >= 0.5 with some other document."""
    ours = {c: o for c, o in planted.items() if c.startswith("planted-")}
    caught = sum(1 for c, o in ours.items() if c in removed or o in removed)
    linked = set(planted) | set(planted.values())
    false = [i for i in removed if i not in linked and _max_jaccard(i, sets) < 0.5]
    return {
        "recall": round(caught / max(1, len(ours)), 4),
        "precision": round(1 - len(false) / max(1, len(removed)), 4),
        "false_positives": sorted(false),
    }


def _cpu() -> float:
    """CPU seconds of this process and its finished children (per-core throughput)."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_ours_minhash(tmp: Path, records: list[dict]) -> tuple[set[str], dict]:
    cfg = MinhashConfig()
    write_shards(tmp / "ours_in", records, num_shards=1)
    sigs, out = tmp / "ours_sigs", tmp / "ours_near"
    sigs.mkdir()
    out.mkdir()
    start = _cpu()
    minhash_signatures(cfg.signature_config(), tmp / "ours_in", sigs)
    signed = _cpu()
    near_dedup(cfg, [sigs], out)
    done = _cpu()
    removed = set(pq.read_table(out / "drops.parquet").column("id").to_pylist())
    index_bytes = sum(p.stat().st_size for p in sigs.iterdir())
    return removed, {
        "signature_s": signed - start,
        "total_s": done - start,
        "index_bytes_per_doc": index_bytes / len(records),
    }


def run_datatrove_minhash(tmp: Path, records: list[dict]) -> tuple[set[str], dict]:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    (tmp / "dt_in").mkdir()
    with open(tmp / "dt_in" / "docs.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({"id": r["id"], "text": r["text"]}) + "\n")
    cfg, logs = MinhashConfig(), tmp / "dt_logs"

    def run(name, pipeline, tasks=1):
        LocalPipelineExecutor(
            pipeline=pipeline, tasks=tasks, workers=1, logging_dir=str(logs / name)
        ).run()

    start = _cpu()
    run(
        "sig",
        [JsonlReader(str(tmp / "dt_in")), MinhashDedupSignature(str(tmp / "dt_sigs"), config=cfg)],
    )
    signed = _cpu()
    run(
        "buckets",
        [MinhashDedupBuckets(str(tmp / "dt_sigs"), str(tmp / "dt_buckets"), config=cfg)],
        tasks=cfg.num_buckets,
    )
    run(
        "cluster",
        [MinhashDedupCluster(str(tmp / "dt_buckets"), str(tmp / "dt_remove"), config=cfg)],
    )
    run(
        "filter",
        [
            JsonlReader(str(tmp / "dt_in")),
            MinhashDedupFilter(
                str(tmp / "dt_remove"),
                exclusion_writer=JsonlWriter(str(tmp / "dt_removed"), compression=None),
            ),
        ],
    )
    done = _cpu()
    removed = {
        json.loads(line)["id"]
        for p in (tmp / "dt_removed").glob("*.jsonl")
        for line in p.read_text().splitlines()
    }
    index_bytes = sum(p.stat().st_size for p in (tmp / "dt_sigs").rglob("*.sig"))
    return removed, {
        "signature_s": signed - start,
        "total_s": done - start,
        "index_bytes_per_doc": index_bytes / len(records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--near-copies", type=int, default=200)
    parser.add_argument(
        "--text-dir", type=Path, help="Folder with wikitext2_valid.txt and tinyshakespeare.txt."
    )
    args = parser.parse_args()
    if not HAVE_DATATROVE:
        print(
            "datatrove is not installed: running our half only "
            '(pip install "datatrove==0.10.*" spacy regex "xxhash<4")',
            file=sys.stderr,
        )
    result: dict = {"datatrove": HAVE_DATATROVE}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        records, planted = build_corpus(tmp, args.near_copies, args.text_dir)
        words = sum(len(r["text"].split()) for r in records)
        result.update(
            {"documents": len(records), "words": words, "planted_near_copies": args.near_copies}
        )
        ours, ours_s = run_ours_filters(records)
        result["filters_ours_docs_per_s"] = round(len(records) / ours_s, 1)
        result["filters_ours_removed"] = dict(Counter(r for r in ours if r).most_common())
        if HAVE_DATATROVE:
            theirs, theirs_s = run_datatrove_filters(records)
            result["filters_datatrove_docs_per_s"] = round(len(records) / theirs_s, 1)
            result["filters_speedup"] = round(theirs_s / ours_s, 2)
            diff = disagreements(records, ours, theirs)
            result["filters_decision_agreement"] = round(1 - len(diff) / len(records), 4)
            result["filters_disagreements"] = diff
            result["filters_disagreement_causes"] = dict(Counter(d["cause"] for d in diff))
        removed, stats = run_ours_minhash(tmp, records)
        result["minhash_ours_docs_per_s"] = round(len(records) / stats["total_s"], 1)
        result["minhash_ours_signature_docs_per_s"] = round(len(records) / stats["signature_s"], 1)
        sets = _shingle_sets(records)
        result["minhash_ours"] = {
            **_scores(removed, planted, sets),
            "removed": len(removed),
            "index_bytes_per_doc": round(stats["index_bytes_per_doc"], 1),
        }
        if HAVE_DATATROVE:
            removed_dt, stats_dt = run_datatrove_minhash(tmp, records)
            result["minhash_datatrove_docs_per_s"] = round(len(records) / stats_dt["total_s"], 1)
            result["minhash_datatrove_signature_docs_per_s"] = round(
                len(records) / stats_dt["signature_s"], 1
            )
            result["minhash_speedup"] = round(stats_dt["total_s"] / stats["total_s"], 2)
            result["minhash_signature_speedup"] = round(
                stats_dt["signature_s"] / stats["signature_s"], 2
            )
            result["minhash_datatrove"] = {
                **_scores(removed_dt, planted, sets),
                "removed": len(removed_dt),
                "index_bytes_per_doc": round(stats_dt["index_bytes_per_doc"], 1),
            }
            result["minhash_same_removals"] = round(
                len(removed & removed_dt) / max(1, len(removed | removed_dt)), 4
            )
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
