"""Tokenize-and-pack wall time: `tokenize_corpus` + `build_mixture` vs `datasets.map`.

Both sides start from the same Parquet corpus on disk and end with the same packed dataset on
disk (documents + eos, rows of T+1, rows shuffled, written by the same `write_packed`):

- ours: the tokenize step (no held-out documents) and one mixture taking every document once;
- peer: what a competent `datasets` user writes: ``Dataset.from_parquet``, then
  ``.map(batched=True, num_proc=N)`` calling the same tokenizer through ``AutoTokenizer`` with
  ``return_attention_mask=False`` and appending eos, then numpy packing straight from the Arrow
  column (flattened ids and list offsets, no Python lists).

The sides run once untimed (imports, page cache), then in alternating wall-time rounds
(A B B A ...). ``identical_work`` is true only
when every document's ids are the same on both sides and both packed datasets hold the same
tokens; the ratio is printed only then. Prints ONE JSON line.

    python benchmarks/bench_pack.py [--repeat 4] [--rounds 4] [--num-proc 2] [--text-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from benchmarks.common import alternate, emit, ratio  # noqa: E402
from llmflow.tasks.dataprep.config import StageMixture, TokenizeConfig  # noqa: E402
from llmflow.tasks.dataprep.mixture import build_mixture  # noqa: E402
from llmflow.tasks.dataprep.pack import write_packed  # noqa: E402
from llmflow.tasks.dataprep.tokenize import tokenize_corpus  # noqa: E402
from llmflow.tasks.tokenizer.config import TokenizerConfig  # noqa: E402
from llmflow.tasks.tokenizer.train import train_tokenizer  # noqa: E402
from tests.tasks.dataprep.packed_rows import read_all_rows  # noqa: E402
from tests.tasks.tokenizer.corpus_helpers import (  # noqa: E402
    real_docs,
    synthetic_docs,
    write_corpus,
)

SEQ_LEN = 256


def make_corpus(root: Path, repeat: int, text_dir: Path | None) -> str:
    """Real text from ``text_dir`` when given (else synthetic), repeated with fresh ids."""
    if text_dir is not None:
        docs, name = real_docs(text_dir), "real"
    else:
        docs, name = synthetic_docs(4000), "synthetic"
    docs = [dict(d, id=f"{d['id']}-{r}") for r in range(repeat) for d in docs]
    write_corpus(docs, root / "corpus", num_files=4)
    return name


def _fresh(root: Path, *names: str) -> None:
    for name in names:
        shutil.rmtree(root / name, ignore_errors=True)
        (root / name).mkdir()


def run_ours(root: Path) -> None:
    """Tokenize step, then a mixture taking each training document exactly once."""
    _fresh(root, "tokenized", "ours")
    tokenize_corpus(
        TokenizeConfig(validation_fraction=0.0), root / "corpus", root / "tok", root / "tokenized"
    )
    meta = json.loads((root / "tokenized" / "meta.json").read_text())
    weights = {d: i["num_tokens"] + i["num_docs"] for d, i in meta["train"].items()}
    stage = StageMixture(
        weights=weights, num_tokens=sum(weights.values()), max_epochs=1, seq_len=SEQ_LEN
    )
    build_mixture(stage, root / "tokenized", root / "ours")


def _peer_tokenize(root: Path, num_proc: int):
    """`datasets.map` (batched, num_proc) to an Arrow dataset of id, input_ids (eos appended)."""
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "tok")
    eos = tok.eos_token_id

    def encode(batch):
        ids = tok(batch["text"], return_attention_mask=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    files = sorted(str(p) for p in (root / "corpus" / "shards").glob("*.parquet"))
    ds = datasets.Dataset.from_parquet(files, cache_dir=str(root / "hf_cache"))
    ds = ds.map(encode, batched=True, num_proc=num_proc, remove_columns=["text", "domain"])
    return ds, tok


def run_peer(root: Path, num_proc: int) -> None:
    """The peer: tokenize with datasets.map, pack with numpy from the Arrow column."""
    _fresh(root, "peer", "hf_cache")
    ds, tok = _peer_tokenize(root, num_proc)
    column = pa.chunked_array(ds.data.column("input_ids")).combine_chunks()
    tokens = column.flatten().to_numpy()
    lengths = np.diff(column.offsets.to_numpy())
    write_packed(
        [(tokens, lengths)],
        root / "peer",
        seq_len=SEQ_LEN,
        vocab_size=len(tok),
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        seed=0,
        rows_per_shard=65536,
    )
    pq.write_table(
        pa.table({"id": ds.data.column("id"), "input_ids": ds.data.column("input_ids")}),
        root / "peer_docs.parquet",
    )


def _ours_docs(root: Path) -> dict[str, np.ndarray]:
    """Document id -> ids (eos appended) from our tokenize output."""
    meta = json.loads((root / "tokenized" / "meta.json").read_text())
    docs = {}
    for info in meta["train"].values():
        folder = root / "tokenized" / info["dir"]
        tokens = np.fromfile(folder / "tokens.bin", dtype=meta["dtype"])
        offsets = np.load(folder / "offsets.npy")
        ids = pq.read_table(folder / "docs.parquet").column("id").to_pylist()
        for k, doc_id in enumerate(ids):
            docs[doc_id] = np.append(tokens[offsets[k] : offsets[k + 1]], meta["eos_id"])
    return docs


def same_tokens(root: Path) -> bool:
    """Every document's ids equal on both sides, and both packed datasets hold equal tokens."""
    ours = _ours_docs(root)
    peer = pq.read_table(root / "peer_docs.parquet").to_pydict()
    same_docs = len(ours) == len(peer["id"]) and all(
        doc_id in ours and np.array_equal(ours[doc_id], ids)
        for doc_id, ids in zip(peer["id"], peer["input_ids"], strict=True)
    )
    rows = [read_all_rows(root / name) for name in ("ours", "peer")]
    return bool(
        same_docs
        and rows[0].shape == rows[1].shape
        and np.array_equal(*(np.bincount(r.ravel()) for r in rows))
    )


def headline(times: dict[str, list[float]], identical: bool) -> dict:
    """The ratio fields: present only when both sides did identical work."""
    if not identical:
        return {"ratio": None, "note": "no ratio: the two sides produced different tokens"}
    return {"ratio": ratio(times, "peer", "ours")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=4, help="copies of the corpus")
    parser.add_argument("--num-proc", type=int, default=2, help="datasets.map processes")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per side")
    parser.add_argument(
        "--text-dir", type=Path, help="Folder with wikitext2_valid.txt and tinyshakespeare.txt."
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
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
        times = alternate(
            {"peer": lambda: run_peer(root, args.num_proc), "ours": lambda: run_ours(root)},
            args.rounds,
            warmup=True,
        )
        identical = same_tokens(root)
        num_tokens = json.loads((root / "ours" / "meta.json").read_text())["num_tokens"]
    emit(
        "tokenize_and_pack",
        **headline(times, identical),
        ratio_means="peer median wall s / ours median wall s (above 1: ours faster)",
        rounds=args.rounds,
        identical_work=identical,
        same_tokens=identical,
        corpus=corpus,
        num_tokens=num_tokens,
        num_proc=args.num_proc,
        seconds=times,
    )


if __name__ == "__main__":
    main()
