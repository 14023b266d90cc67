"""Curation speed and fidelity against datatrove 0.10 (the FineWeb pipeline), side by side.

Corpus: the quickstart sample (`tasks.ingest.sample`), plus, with ``--text-dir DIR`` (a folder
holding ``wikitext2_valid.txt`` and ``tinyshakespeare.txt``), WikiText-2 validation articles and
tinyshakespeare in 2,000-character chunks, plus planted near copies (1-3 words replaced) of those
real documents. Both sides read the same Parquet file, written before the clocks start.

1. Filter chain, one process, in memory, same thresholds: datatrove GopherRepetition ->
   GopherQuality -> C4QualityFilter(filter_no_terminal_punct=False) -> FineWebQuality, against
   ours (`apply_filters`, C4 rewriting on as datatrove does it, no domain skipped). The keep /
   remove agreement is reported twice: with ``alpha_ratio_skips_punctuation`` false (datatrove's
   rule) and true (what configs/quickstart.yaml runs); each disagreement of the first is
   re-run with spaCy's words to tell tokenization differences from rule differences.
2. MinHash near dedup (5-grams, 14 bands x 8), from the Parquet file to the kept documents
   written as Parquet: datatrove's whole pipeline (signatures, buckets, cluster, then reader +
   MinhashDedupFilter + ParquetWriter) in a one-worker LocalPipelineExecutor, against our steps
   `minhash_signatures` + `near_dedup` plus writing the kept rows. Recall and precision on the
   planted near copies are reported for both.

Each comparison runs once untimed, then in alternating wall-time rounds (A B B A ...); the
ratio is datatrove's median over ours. Prints ONE JSON line. Without datatrove installed, it
stops with a message (``pip install -e ".[bench]"``).

    python benchmarks/bench_curation.py [--near-copies 200] [--rounds 2] [--text-dir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from benchmarks.common import alternate, emit, ratio  # noqa: E402
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

NEAR_PREFIXES = ("planted-", "near-")  # our planted copies, the sample's near copies


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


def bench_config(skip_punctuation: bool = False) -> FiltersConfig:
    """datatrove's FineWeb chain: default thresholds, C4 rewrites lines, no domain skipped."""
    return FiltersConfig.model_validate(
        {
            "gopher_repetition": {"skip_domains": []},
            "gopher_quality": {
                "skip_domains": [],
                "alpha_ratio_skips_punctuation": skip_punctuation,
            },
            "c4": {"skip_domains": [], "rewrite_lines": True},
            "fineweb": {"skip_domains": []},
        }
    )


def ours_filters(records: list[dict], skip_punctuation: bool = False) -> list[str | None]:
    """Our removal reason per record (None: kept)."""
    cfg = bench_config(skip_punctuation)
    return [apply_filters(cfg, r["text"], r["domain"])[1] or None for r in records]


def datatrove_chain():
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.utils.text import split_into_words

    split_into_words("warm up spaCy.")  # model load is not part of the timing
    return [
        GopherRepetitionFilter(),
        GopherQualityFilter(),
        C4QualityFilter(filter_no_terminal_punct=False),
        FineWebQualityFilter(),
    ]


def datatrove_filters(records: list[dict], chain) -> list[str | None]:
    """datatrove's removal reason per record (None: kept)."""
    from datatrove.data import Document

    reasons: list[str | None] = []
    for r in records:
        doc, reason = Document(text=r["text"], id=r["id"]), None
        for f in chain:
            out = f.filter(doc)
            if out is not True:
                reason = out[1] if isinstance(out, tuple) else "removed"
                break
        reasons.append(reason)
    return reasons


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
    """Recall on the planted near copies, ours and the sample's (a pair counts when one of
    the two is removed); precision: removed documents that are planted copies/originals (ours or the sample's) or
    have a true 5-gram Jaccard >= 0.5 with some other document."""
    ours = {c: o for c, o in planted.items() if c.startswith(NEAR_PREFIXES)}
    caught = sum(1 for c, o in ours.items() if c in removed or o in removed)
    linked = set(planted) | set(planted.values())
    false = [i for i in removed if i not in linked and _max_jaccard(i, sets) < 0.5]
    return {
        "recall": round(caught / max(1, len(ours)), 4),
        "precision": round(1 - len(false) / max(1, len(removed)), 4),
        "false_positives": sorted(false),
    }


def agreement(ours: list, theirs: list) -> float:
    same = sum((a is None) == (b is None) for a, b in zip(ours, theirs, strict=True))
    return round(same / max(1, len(ours)), 4)


def write_kept(in_dir: Path, drops: Path, out_dir: Path) -> None:
    """Our glue after near_dedup: the input rows not dropped, written as Parquet."""
    dropped = pq.read_table(drops / "drops.parquet", columns=["id"]).column("id")
    out_dir.mkdir(parents=True)
    for shard in sorted((in_dir / "shards").glob("*.parquet")):
        table = pq.read_table(shard)
        kept = table.filter(pc.invert(pc.is_in(table.column("id"), value_set=dropped)))
        pq.write_table(kept, out_dir / shard.name)


def run_ours_minhash(in_dir: Path, work: Path) -> None:
    """Signatures, clustering, then the kept documents written, under a fresh ``work``."""
    cfg = MinhashConfig()
    sigs, near = work / "sigs", work / "near"
    sigs.mkdir(parents=True)
    near.mkdir()
    minhash_signatures(cfg.signature_config(), in_dir, sigs)
    near_dedup(cfg, [sigs], near)
    write_kept(in_dir, near, work / "kept")


def run_datatrove_minhash(in_dir: Path, work: Path) -> None:
    """datatrove's four stages, the last writing the kept documents as Parquet."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig as DatatroveMinhashConfig
    from datatrove.pipeline.readers import ParquetReader
    from datatrove.pipeline.writers import ParquetWriter

    cfg, shards = DatatroveMinhashConfig(), str(in_dir / "shards")

    def run(name, pipeline, tasks=1):
        logs = str(work / "logs" / name)
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1, logging_dir=logs).run()

    sigs, buckets, remove = (str(work / n) for n in ("sigs", "buckets", "remove"))
    run("sig", [ParquetReader(shards), MinhashDedupSignature(sigs, config=cfg)])
    run("buckets", [MinhashDedupBuckets(sigs, buckets, config=cfg)], tasks=cfg.num_buckets)
    run("cluster", [MinhashDedupCluster(buckets, remove, config=cfg)])
    run(
        "filter",
        [ParquetReader(shards), MinhashDedupFilter(remove), ParquetWriter(str(work / "kept"))],
    )


def kept_ids(folder: Path) -> set[str]:
    return {i for p in folder.rglob("*.parquet") for i in pq.read_table(p).column("id").to_pylist()}


def fresh(work: Path, name: str):
    """A callable running ``name``'s pipeline into a new folder each call; keeps the last."""
    counter, runner = (
        itertools.count(),
        {"ours": run_ours_minhash, "datatrove": run_datatrove_minhash},
    )

    def call() -> None:
        folder = work / f"{name}-{next(counter)}"
        runner[name](work / "in", folder)
        shutil.rmtree(work / f"{name}-last", ignore_errors=True)
        folder.rename(work / f"{name}-last")

    return call


def bench_filters(records: list[dict], rounds: int) -> dict:
    chain = datatrove_chain()
    results: dict = {}
    times = alternate(
        {
            "datatrove": lambda: results.__setitem__(
                "datatrove", datatrove_filters(records, chain)
            ),
            "ours": lambda: results.__setitem__("ours", ours_filters(records)),
        },
        rounds,
        warmup=True,
    )
    ours, theirs = results["ours"], results["datatrove"]
    quickstart = ours_filters(records, skip_punctuation=True)
    diff = disagreements(records, ours, theirs)
    return {
        "ratio": ratio(times, "datatrove", "ours"),
        "identical_work": not diff,
        "seconds": times,
        "agreement_alpha_ratio_skips_punctuation_false": agreement(ours, theirs),
        "agreement_alpha_ratio_skips_punctuation_true": agreement(quickstart, theirs),
        "quickstart_extra_kept": sum(
            a is None and b is not None for a, b in zip(quickstart, theirs, strict=True)
        ),
        "ours_removed": dict(Counter(r for r in ours if r).most_common()),
        "disagreement_causes": dict(Counter(d["cause"] for d in diff)),
        "disagreements": diff,
    }


def bench_minhash(work: Path, records: list[dict], planted: dict, rounds: int) -> dict:
    write_shards(work / "in", records, num_shards=1)
    times = alternate(
        {"datatrove": fresh(work, "datatrove"), "ours": fresh(work, "ours")}, rounds, warmup=True
    )
    every = {r["id"] for r in records}
    sets = _shingle_sets(records)
    removed = {
        name: every - kept_ids(work / f"{name}-last" / "kept") for name in ("ours", "datatrove")
    }
    same = removed["ours"] == removed["datatrove"]
    union = removed["ours"] | removed["datatrove"]
    return {
        "ratio": ratio(times, "datatrove", "ours"),
        "identical_work": same,
        "identical_work_means": "same documents in, same kept documents written",
        "seconds": times,
        "same_removals_jaccard": round(
            len(removed["ours"] & removed["datatrove"]) / max(1, len(union)), 4
        ),
        **{
            name: {**_scores(removed[name], planted, sets), "removed": len(removed[name])}
            for name in removed
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--near-copies", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per side")
    parser.add_argument(
        "--text-dir", type=Path, help="Folder with wikitext2_valid.txt and tinyshakespeare.txt."
    )
    args = parser.parse_args()
    try:
        import datatrove  # noqa: F401
    except ImportError:
        sys.exit('datatrove is not installed: pip install -e ".[bench]"')
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        records, planted = build_corpus(tmp, args.near_copies, args.text_dir)
        filters = bench_filters(records, args.rounds)
        minhash = bench_minhash(tmp, records, planted, args.rounds)
    emit(
        "curation",
        ratio={"filters": filters["ratio"], "minhash": minhash["ratio"]},
        ratio_means="datatrove median wall s / ours median wall s (above 1: ours faster)",
        rounds=args.rounds,
        identical_work={"filters": filters["identical_work"], "minhash": minhash["identical_work"]},
        documents=len(records),
        words=sum(len(r["text"].split()) for r in records),
        planted_near_copies=sum(1 for k in planted if k.startswith(NEAR_PREFIXES)),
        filters=filters,
        minhash=minhash,
    )


if __name__ == "__main__":
    main()
