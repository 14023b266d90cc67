"""Tokenize-and-pack throughput: `tokenize_corpus` + `build_mixture` vs `datasets.map`.

Both sides read the same parquet corpus, tokenize every document with the same tokenizer and
write the same packed shards (eos between documents, rows of T+1, shuffled). The baseline is
``Dataset.from_parquet`` + ``.map(tokenizer, batched=True, num_proc=N)`` followed by the same
packing writer. Prints one JSON line with both throughputs and their ratio.

    python benchmarks/bench_pack.py [--repeat 4] [--num-proc 2] [--text-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from llmflow.tasks.dataprep.config import StageMixture, TokenizeConfig  # noqa: E402
from llmflow.tasks.dataprep.mixture import build_mixture  # noqa: E402
from llmflow.tasks.dataprep.pack import read_all_rows, write_packed  # noqa: E402
from llmflow.tasks.dataprep.tokenize import tokenize_corpus  # noqa: E402
from llmflow.tasks.tokenizer.config import TokenizerConfig  # noqa: E402
from llmflow.tasks.tokenizer.train import train_tokenizer  # noqa: E402
from tests.tasks.tokenizer.corpus_helpers import (  # noqa: E402
    real_docs,
    synthetic_docs,
    write_corpus,
)

SEQ_LEN = 256


def cpu_seconds() -> float:
    """User+system CPU time of this process and its reaped children (datasets' workers)."""
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn, *args):
    """(wall seconds, CPU seconds, result) of one call."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    result = fn(*args)
    return time.perf_counter() - wall, cpu_seconds() - cpu, result


def make_corpus(root: Path, repeat: int, text_dir: Path | None) -> str:
    """Real text from ``text_dir`` when given (else synthetic), repeated with fresh ids."""
    docs, name = (
        (real_docs(text_dir), "real")
        if text_dir is not None
        else (synthetic_docs(4000), "synthetic")
    )
    docs = [dict(d, id=f"{d['id']}-{r}") for r in range(repeat) for d in docs]
    write_corpus(docs, root / "corpus", num_files=4)
    return name


def run_ours(root: Path) -> int:
    for name in ("tokenized", "ours"):
        shutil.rmtree(root / name, ignore_errors=True)
        (root / name).mkdir()
    tokenize_corpus(
        TokenizeConfig(validation_fraction=0.0), root / "corpus", root / "tok", root / "tokenized"
    )
    meta = json.loads((root / "tokenized" / "meta.json").read_text())
    weights = {d: i["num_tokens"] + i["num_docs"] for d, i in meta["train"].items()}
    stage = StageMixture(
        weights=weights, num_tokens=sum(weights.values()), max_epochs=1, seq_len=SEQ_LEN
    )
    return build_mixture(stage, root / "tokenized", root / "ours")["num_tokens"]


def run_baseline(root: Path, num_proc: int) -> int:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    for name in ("baseline", "hf_cache"):
        shutil.rmtree(root / name, ignore_errors=True)
    (root / "baseline").mkdir()
    tok = AutoTokenizer.from_pretrained(root / "tok")
    files = sorted(str(p) for p in (root / "corpus" / "shards").glob("*.parquet"))
    ds = datasets.Dataset.from_parquet(files, cache_dir=str(root / "hf_cache"))
    ds = ds.map(
        lambda b: tok(b["text"]), batched=True, num_proc=num_proc, remove_columns=ds.column_names
    )
    eos, dtype = tok.eos_token_id, np.uint16

    def chunks():
        for batch in ds.iter(batch_size=4096):
            docs = [np.array(ids + [eos], dtype) for ids in batch["input_ids"]]
            yield np.concatenate(docs), [len(d) for d in docs]

    meta = write_packed(
        chunks(),
        root / "baseline",
        seq_len=SEQ_LEN,
        vocab_size=len(tok),
        eos_id=eos,
        pad_id=tok.pad_token_id,
        seed=0,
        rows_per_shard=65536,
    )
    return meta["num_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=4, help="copies of the corpus")
    parser.add_argument("--num-proc", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs; best is kept")
    parser.add_argument(
        "--text-dir", type=Path, help="Folder with wikitext2_valid.txt and tinyshakespeare.txt."
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ.setdefault("HF_HOME", str(root / "hf"))
        corpus = make_corpus(root, args.repeat, args.text_dir)
        (root / "tok").mkdir()
        train_tokenizer(
            TokenizerConfig(vocab_size=8192, max_sample_bytes=5_000_000),
            root / "corpus",
            root / "tok",
        )
        base, ours = [], []
        for _ in range(args.rounds):  # alternate, so load changes hit both sides alike
            base.append(timed(run_baseline, root, args.num_proc))
            ours.append(timed(run_ours, root))
        base_rows, ours_rows = (read_all_rows(root / n) for n in ("baseline", "ours"))
    ours_n, base_n = ours[0][2], base[0][2]
    same = base_n == ours_n and np.array_equal(
        np.bincount(base_rows.ravel()), np.bincount(ours_rows.ravel())
    )
    ours_s, base_s = min(r[0] for r in ours), min(r[0] for r in base)
    ours_cpu, base_cpu = min(r[1] for r in ours), min(r[1] for r in base)
    print(
        json.dumps(
            {
                "bench": "tokenize_and_pack",
                "corpus": corpus,
                "num_tokens": ours_n,
                "ours_tokens_per_s": round(ours_n / ours_s),
                "baseline_datasets_map_tokens_per_s": round(base_n / base_s),
                "num_proc": args.num_proc,
                "speedup": round(base_s / ours_s * ours_n / base_n, 3),
                "ours_cpu_s": round(ours_cpu, 2),
                "baseline_cpu_s": round(base_cpu, 2),
                "cpu_speedup": round(base_cpu / ours_cpu * ours_n / base_n, 3),
                "load_avg_1m": os.getloadavg()[0],
                "same_tokens": bool(same),
            }
        )
    )


if __name__ == "__main__":
    main()
