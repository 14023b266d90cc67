"""Decontamination speed against datatrove 0.10's n-gram decontamination, side by side.

Both sides index the same eval sets (PIQA gold solutions with their goals, GSM8K answers with
their questions, WikiText-2 test paragraphs; 13-grams, answer-aware as datatrove's indexer takes
them) and scan the same corpus: Shakespeare passages with planted PIQA/GSM8K/WikiText items,
exact and edited, and clean near misses (the decontamination test's corpus, larger).

- datatrove: ``NGramsDecontIndexer.compute_hashes`` (spaCy word tokenizer, xxhash64) for the
  index, written as its ``*.index.hashes`` files, then ``NGramsDecontFilter.filter`` per
  document. (Its indexer's ``run`` needs lighteval, not installed; ``compute_hashes`` is the
  indexing it runs.)
- ours: ``build_index`` and ``scan_texts`` in batches of 512 documents.

The sides run in alternating rounds (ABBA...), one process; the headline is the ratio of the
median scan times (documents per second, ours over datatrove's), with the index build times
(one round each: datatrove's takes about a minute) beside it. ``identical_work`` says both sides flagged exactly the same documents. Prints ONE
JSON line.

    python benchmarks/bench_decontam.py --data DIR [--rounds 3] [--clean 600] [--per-set 40]
        [--lm-eval]

``--lm-eval`` adds a second line, ``decontam_lm_eval``: eval sets defined by lm-eval's own task
YAMLs (ARC-Easy, PIQA, HellaSwag, GSM8K, MMLU astronomy, included and pointed at local data, and
a custom task templated ``Question: {{q}}`` ... ``Answer:``), their items planted verbatim and
edited in prose with near misses (the test's corpus). Per task, the share of items of >= 13
words whose documents each side flags, and the clean documents flagged. Ours indexes as the
``decontaminate`` step does (template cut, options resolved, question n-grams for short
answers, short items whole); datatrove indexes each item as lm-eval renders it, the prompt
(``doc_to_text``) as the query and the gold choice as the answer, with its default settings.

``DIR`` holds ``eval/`` (piqa_valid.jsonl, piqa_valid_labels.lst, gsm8k_test.jsonl,
wikitext2_test.txt) and ``text/`` (tinyshakespeare.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmflow.tasks.decontam.ngrams import build_index, scan_texts  # noqa: E402
from tests.tasks.decontam.planted_corpus import planted_corpus  # noqa: E402

N = 13
BATCH = 512


def ours_index(items):
    return build_index(items, N)


def ours_scan(index, docs) -> set[str]:
    flagged = set()
    for start in range(0, len(docs), BATCH):
        batch = docs[start : start + BATCH]
        flagged.update(batch[h.row]["id"] for h in scan_texts(index, [d["text"] for d in batch]))
    return flagged


def datatrove_index(items, folder: Path) -> Path:
    """datatrove's indexer hashing, its index files written as its ``run`` writes them."""
    import numpy as np
    from datatrove.pipeline.decont.n_grams import NGramsDecontConfig, NGramsDecontIndexer
    from datatrove.utils.hashing import create_hash_func
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    config = NGramsDecontConfig(n_grams=N)
    indexer = object.__new__(NGramsDecontIndexer)  # skips the lighteval check of __new__
    indexer.config, indexer.tokenizer = config, load_word_tokenizer("en")
    indexer.hash_func = create_hash_func(config.hash_config)
    hashes: dict[str, set[int]] = {}
    for item in items:
        for gold in item.golds:
            found = indexer.compute_hashes(gold, item.query)
            hashes.setdefault(item.task, set()).update(found)
    folder.mkdir(parents=True, exist_ok=True)
    for task, task_hashes in hashes.items():
        array = np.array(sorted(task_hashes), dtype=config.hash_config.np_descr)
        array.tofile(folder / f"{task}.index.hashes")
    return folder


def datatrove_scan(folder: Path, docs) -> set[str]:
    from datatrove.data import Document
    from datatrove.pipeline.decont.n_grams import NGramsDecontConfig, NGramsDecontFilter

    decont = NGramsDecontFilter(str(folder), config=NGramsDecontConfig(n_grams=N), language="en")
    decont.load_index_hashes()
    flagged = set()
    for doc in docs:
        if decont.filter(Document(text=doc["text"], id=doc["id"])) is not True:
            flagged.add(doc["id"])
    return flagged


def lm_eval_case(data: Path, tmp: Path) -> dict:
    """Per-task recall of both sides on lm-eval task YAMLs (see the module docstring)."""
    from lm_eval.tasks import TaskManager

    from llmflow.tasks.decontam.evalsets import _golds, lm_eval_items
    from llmflow.tasks.decontam.ngrams import Item, unindexed_items, whole_item_indexes, words
    from tests.tasks.decontam.lm_eval_sets import corpus, write_tasks

    planted = write_tasks(data / "eval", tmp / "tasks")
    docs = corpus(planted, data / "text")
    names = sorted({p.task for p in planted})
    ours_items = [i for items in lm_eval_items([], [str(tmp / "tasks")]).values() for i in items]
    indexes = [build_index(ours_items, N, "auto")] + whole_item_indexes(ours_items, N, 8)
    ours = set()
    for index in indexes:
        ours |= ours_scan(index, docs)
    manager = TaskManager(include_path=str(tmp / "tasks"), include_defaults=False)
    prompts = []
    for name, task in manager.load(names)["tasks"].items():
        for i, doc in enumerate(task.eval_docs):
            golds = _golds(task, doc, task.doc_to_target(doc), task.config.output_type)
            prompts.append(Item(name, i, str(task.doc_to_text(doc)), golds))
    theirs = datatrove_scan(datatrove_index(prompts, tmp / "dt"), docs)
    rows = {}
    for item in planted:
        if len(words(item.web_text)) < N:
            continue
        row = rows.setdefault(item.task, {"items": 0, "ours": [0, 0], "datatrove": [0, 0]})
        row["items"] += 1
        for side, flagged in (("ours", ours), ("datatrove", theirs)):
            for k, kind in enumerate(("exact", "edited")):
                row[side][k] += f"{kind}-{item.task}-{item.index}" in flagged
    clean = {d["id"] for d in docs if d["id"].startswith(("clean-", "near-", "stem-"))}
    unchecked = unindexed_items(ours_items, N, 8)
    return {
        "bench": "decontam_lm_eval",
        "recall_verbatim_edited": {
            task: {
                side: [round(v / r["items"], 3) for v in r[side]] for side in ("ours", "datatrove")
            }
            | {"items": r["items"]}
            for task, r in sorted(rows.items())
        },
        "clean_documents": len(clean),
        "clean_flagged": {"ours": len(ours & clean), "datatrove": len(theirs & clean)},
        "ours_unchecked_items": len(unchecked),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def alternate(sides: dict, rounds: int) -> dict[str, list[float]]:
    """Wall seconds per round, sides called in ABBA order."""
    names, times = list(sides), {name: [] for name in sides}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            sides[name]()
            times[name].append(round(time.perf_counter() - start, 4))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="Folder with eval/ and text/.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clean", type=int, default=600, help="Clean documents in the corpus.")
    parser.add_argument("--per-set", type=int, default=40, help="Planted items per eval set.")
    parser.add_argument(
        "--lm-eval", action="store_true", help="Also the lm-eval task YAML case (second line)."
    )
    args = parser.parse_args()
    try:
        from datatrove.utils.logging import logger
    except ImportError:
        sys.exit('datatrove is not installed: pip install "datatrove==0.10.*" spacy "xxhash<4"')
    logger.remove()  # datatrove logs each index file it loads
    docs, sets = planted_corpus(
        args.data / "eval", args.data / "text", per_set=args.per_set, num_clean=args.clean, n=N
    )
    items = [item for task_items in sets.values() for item in task_items]
    with tempfile.TemporaryDirectory() as tmp:
        built: dict = {}
        flags: dict[str, set[str]] = {}
        index_times = alternate(
            {
                "ours": lambda: built.__setitem__("ours", ours_index(items)),
                "datatrove": lambda: built.__setitem__(
                    "datatrove", datatrove_index(items, Path(tmp) / "dt")
                ),
            },
            1,  # datatrove's spaCy indexing of the eval sets alone takes a minute
        )
        scan_times = alternate(
            {
                "ours": lambda: flags.__setitem__("ours", ours_scan(built["ours"], docs)),
                "datatrove": lambda: flags.__setitem__(
                    "datatrove", datatrove_scan(built["datatrove"], docs)
                ),
            },
            args.rounds,
        )
    median = {side: statistics.median(t) for side, t in scan_times.items()}
    planted = {d["id"] for d in docs if d["id"].startswith(("exact-", "edited-"))}
    record = {
        "bench": "decontam",
        "ratio": round(median["datatrove"] / median["ours"], 3),
        "docs_per_s": {side: round(len(docs) / m, 1) for side, m in median.items()},
        "index_ratio": round(
            statistics.median(index_times["datatrove"]) / statistics.median(index_times["ours"]), 3
        ),
        "rounds": args.rounds,
        "index_rounds": 1,
        "scan_seconds": scan_times,
        "index_seconds": index_times,
        "documents": len(docs),
        "eval_items": len(items),
        "recall": {side: round(len(planted & f) / len(planted), 4) for side, f in flags.items()},
        "clean_flagged": {side: len(f - planted) for side, f in flags.items()},
        "identical_work": flags["ours"] == flags["datatrove"],
        "differences": sorted(flags["ours"] ^ flags["datatrove"])[:10],
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(record))
    if args.lm_eval:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(lm_eval_case(args.data, Path(tmp))))


if __name__ == "__main__":
    main()
