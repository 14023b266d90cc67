"""Tokenize every curated document once, per domain, holding out validation documents.

Output directory (read by `tasks.dataprep.mixture`):

- ``meta.json``: ``vocab_size``, ``dtype``, ``eos_id``, ``pad_id``, ``bos_id`` and per split
  (``train``, ``validation``) per domain: ``dir``, ``num_docs``, ``num_tokens`` (eos excluded).
- ``{split}/{domain}/tokens.bin``: the domain's documents' tokens back to back (no eos),
  ``offsets.npy``: int64 document boundaries (num_docs+1), ``docs.parquet``: id, source,
  num_tokens in the same order.
- ``validation_docs/shards/part-00000.parquet``: the held-out documents with the input's
  columns (id, text, domain, source), itself a corpus directory for per-domain perplexity.
- ``rejects.jsonl``: malformed records with a ``reason``.

Parallel encoding (execution only: the output is the same bytes, the address unchanged): on
the run's backend (`backend.current`) each corpus file is encoded by a Ray task
(``runner.kind: ray``) or a spawned process (``runner.kind: processes``); else this process
encodes batch by batch (the rule ingest and the mixture follow too). A worker returns each of its file's record
batches encoded (ids, domains, sources, tokens end to end with each document's length, the
hold-out mask, the held-out rows, the rejects) and this process writes them in file and batch
order, exactly the writes of the sequential path (the held-out Parquet gets the same row
groups). At most ``2 x workers`` files are in flight, so this process holds a bounded number of
encoded files, never the corpus.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer
from tqdm import tqdm

from llmflow.tasks.dataprep.bytelevel import ByteLevelEncoder
from llmflow.tasks.dataprep.config import TokenizeConfig
from llmflow.tasks.dataprep.pack import token_dtype
from llmflow.tasks.framework import backend
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.tokenizer.config import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
from llmflow.tasks.tokenizer.corpus import (
    CORPUS_COLUMNS,
    RejectLog,
    corpus_files,
    holdout_mask,
    iter_batches,
    valid_rows,
)

SPLITS = ("train", "validation")
VOCAB_META = "vocab_meta.json"
"""An imported model's vocabulary size and special ids, beside its tokenizer (``import_model``)."""


def load_tokenizer(tokenizer_dir: Path) -> Tokenizer:
    """The raw `tokenizers` object, set to treat special-token text in documents as text."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise BadInputError(f"no tokenizer.json in {tokenizer_dir}; run train_tokenizer first")
    tokenizer = Tokenizer.from_file(str(path))
    # NOTE: a document containing the literal text "<|endoftext|>" must not yield an eos id.
    tokenizer.encode_special_tokens = True
    return tokenizer


def domain_dir_name(domain: str) -> str:
    """A file-system-safe folder name for a domain (the real name stays in meta.json)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", domain) or "_"


class _DomainWriter:
    """Appends one domain's documents to its token file; keeps lengths, ids and sources."""

    def __init__(self, folder: Path, dtype: np.dtype):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.dtype = folder, dtype
        self.file = open(folder / "tokens.bin", "wb")
        self.lengths: list[np.ndarray] = []
        self.ids: list[str] = []
        self.sources: list[str | None] = []

    def write(self, arrays: list[np.ndarray], ids: list[str], sources: list) -> None:
        np.concatenate(arrays).astype(self.dtype, copy=False).tofile(self.file)
        self.lengths.append(np.fromiter((len(a) for a in arrays), np.int64, len(arrays)))
        self.ids += ids
        self.sources += sources

    def close(self) -> dict:
        self.file.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        np.save(self.folder / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]))
        table = pa.table({"id": self.ids, "source": self.sources, "num_tokens": lengths})
        pq.write_table(table, self.folder / "docs.parquet")
        return {"num_docs": len(self.ids), "num_tokens": int(lengths.sum())}


class _CorpusWriter:
    """Routes encoded documents to per-(split, domain) writers."""

    def __init__(self, out_dir: Path, dtype: np.dtype):
        self.out_dir, self.dtype = out_dir, dtype
        self.writers: dict[tuple[str, str], _DomainWriter] = {}
        self.dirs: dict[str, str] = {}

    def write(self, split: str, cols: dict, arrays: list[np.ndarray], rows: np.ndarray) -> None:
        domains = [cols["domain"][i] for i in rows]
        for domain in sorted(set(domains)):
            picked = [i for i, d in zip(rows, domains, strict=True) if d == domain]
            self._writer(split, domain).write(
                [arrays[i] for i in picked],
                [cols["id"][i] for i in picked],
                [cols["source"][i] for i in picked],
            )

    def _writer(self, split: str, domain: str) -> _DomainWriter:
        if (split, domain) not in self.writers:
            if domain not in self.dirs:
                name = domain_dir_name(domain)
                if name in self.dirs.values():
                    name = f"{name}-{len(self.dirs)}"
                self.dirs[domain] = name
            folder = self.out_dir / split / self.dirs[domain]
            self.writers[split, domain] = _DomainWriter(folder, self.dtype)
        return self.writers[split, domain]

    def close(self) -> dict:
        summary: dict = {split: {} for split in SPLITS}
        for (split, domain), writer in sorted(self.writers.items()):
            summary[split][domain] = {"dir": f"{split}/{self.dirs[domain]}", **writer.close()}
        return summary


def _special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    ids = {
        name: tokenizer.token_to_id(tok)
        for name, tok in (("eos_id", EOS_TOKEN), ("pad_id", PAD_TOKEN), ("bos_id", BOS_TOKEN))
    }
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise BadInputError(
            f"tokenizer lacks special tokens {missing}; retrain it with train_tokenizer"
        )
    return ids


def _vocabulary(tokenizer: Tokenizer, folder: Path) -> tuple[int, dict[str, int | None]]:
    """The vocabulary size and special ids: an imported model's (``vocab_meta.json``, written by
    ``import-tokenizer``: the embedding's rows, the model's eos), else our trained tokenizer's."""
    path = Path(folder) / VOCAB_META
    if path.is_file():
        meta = json.loads(path.read_text())
        return meta["vocab_size"], {k: meta[k] for k in ("eos_id", "pad_id", "bos_id")}
    return tokenizer.get_vocab_size(), _special_ids(tokenizer)


@step("tokenize", execution=("encode_batch_size", "read_batch_rows"), data_engine=True)
def tokenize_corpus(cfg: TokenizeConfig, corpus: Path, tokenizer: Path, out: Path) -> Metrics:
    """Tokenize every curated document once, split into train and held-out validation.

    Args:
        cfg: The step's config.
        corpus: Curated corpus (``shards/**/*.parquet`` with id, text, domain, source).
        tokenizer: Output of `train_tokenizer` or `import_tokenizer` (holds ``tokenizer.json``).
        out: Existing directory for the layout described in this module's docstring.

    Returns:
        Headline metrics: documents and tokens per split, rejects, tokens per second.
    """
    out_dir, files = Path(out), corpus_files(corpus)
    bpe = load_tokenizer(tokenizer)
    encoder = _Encoder(bpe)
    vocab_size, special = _vocabulary(bpe, tokenizer)
    dtype = token_dtype(vocab_size)
    rejects = RejectLog(out_dir / "rejects.jsonl")
    writer = _CorpusWriter(out_dir, dtype)
    holdout_path = out_dir / "validation_docs" / "shards" / "part-00000.parquet"
    holdout_path.parent.mkdir(parents=True)
    start = time.perf_counter()
    pieces = _encoded_batches(cfg, encoder, bpe, files, dtype)
    with pq.ParquetWriter(holdout_path, _corpus_schema()) as holdout:
        for piece in tqdm(pieces, desc="tokenize", unit="batch"):
            rejects.write(piece.rejected)
            _write_batch(piece, writer, holdout)
    seconds = time.perf_counter() - start
    summary = writer.close()
    if not summary["train"]:
        raise BadInputError(
            f"empty corpus: no usable documents in {corpus} ({rejects.count} rejected, see "
            f"{rejects.path}); fix the corpus or lower validation_fraction"
        )
    meta = {
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        **special,
        **summary,
        "validation_docs": "validation_docs",
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    num_tokens = {s: sum(d["num_tokens"] for d in summary[s].values()) for s in SPLITS}
    return {
        "num_train_docs": sum(d["num_docs"] for d in summary["train"].values()),
        "num_validation_docs": sum(d["num_docs"] for d in summary["validation"].values()),
        "num_train_tokens": num_tokens["train"],
        "num_validation_tokens": num_tokens["validation"],
        "num_domains": len(summary["train"]),
        "num_rejected": rejects.count,
        "tokens_per_second": round(sum(num_tokens.values()) / max(seconds, 1e-9), 1),
    }


def _corpus_schema() -> pa.Schema:
    return pa.schema([(c, pa.string()) for c in CORPUS_COLUMNS])


class _Encoder:
    """`ByteLevelEncoder` for the layout `train_tokenizer` writes, else `tokenizers` itself
    (an imported model's tokenizer: Llama 3's or Qwen's split pattern, a normalizer, ...)."""

    def __init__(self, tokenizer: Tokenizer, processes: bool = True):
        self.tokenizer = tokenizer
        self.fast = ByteLevelEncoder.for_tokenizer(tokenizer)
        if self.fast is not None and not processes:
            # NOTE: a file's worker (a Ray task, a pool process) is one of several: its encoder
            # does not fork a helper process of its own.
            self.fast = ByteLevelEncoder(tokenizer, processes=False)

    def encode_batch(self, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
        if self.fast is not None:
            return self.fast.encode_batch(texts, dtype)
        # NOTE: documents are packed as tokens + eos; an imported tokenizer's post-processor
        # (a bos per text, as Llama's adds) is left out, as the fast encoder leaves it out.
        encoded = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [np.array(e.ids, dtype) for e in encoded]


@dataclass
class _Batch:
    """One record batch encoded: what the writers need of it, and nothing more (no texts but
    the held-out rows'), so a worker sends little more than the tokens."""

    ids: list[str]
    domains: list[str]
    sources: list
    tokens: np.ndarray
    lengths: np.ndarray
    held: np.ndarray
    held_rows: dict[str, list]
    rejected: list[dict]


def _encode_batch(cfg: TokenizeConfig, encoder: _Encoder, batch, dtype: np.dtype) -> _Batch:
    """Encode one record batch in large calls; hold out documents by id."""
    cols, rejected = valid_rows(batch)
    texts = cols["text"]
    arrays = []
    for begin in range(0, len(texts), cfg.encode_batch_size):
        arrays += encoder.encode_batch(texts[begin : begin + cfg.encode_batch_size], dtype)
    held = holdout_mask(cols["id"], cfg.validation_fraction)
    rows = np.flatnonzero(held)
    return _Batch(
        ids=cols["id"],
        domains=cols["domain"],
        sources=cols["source"],
        tokens=np.concatenate(arrays) if arrays else np.zeros(0, dtype),
        lengths=np.fromiter((len(a) for a in arrays), np.int64, len(arrays)),
        held=held,
        held_rows={c: [cols[c][i] for i in rows] for c in CORPUS_COLUMNS},
        rejected=rejected,
    )


def _write_batch(piece: _Batch, writer: _CorpusWriter, holdout: pq.ParquetWriter) -> None:
    """Route one encoded batch's documents to the writers (the same calls on every path)."""
    arrays = np.split(piece.tokens, np.cumsum(piece.lengths)[:-1]) if len(piece.lengths) else []
    cols = {"id": piece.ids, "domain": piece.domains, "source": piece.sources}
    writer.write("train", cols, arrays, np.flatnonzero(~piece.held))
    if piece.held.any():
        writer.write("validation", cols, arrays, np.flatnonzero(piece.held))
        holdout.write_table(pa.Table.from_pydict(piece.held_rows, schema=_corpus_schema()))


# --- parallel encoding ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """What a worker needs to encode a file: the tokenizer (as JSON) and the batch settings."""

    tokenizer_json: str
    key: str
    cfg: TokenizeConfig
    dtype: str


_WORKER_ENCODERS: dict[str, _Encoder] = {}


def _encode_file(job: _Job, path: str) -> list[_Batch]:
    """In a worker: every record batch of one file, encoded as the sequential path does."""
    encoder = _WORKER_ENCODERS.get(job.key)
    if encoder is None:
        tokenizer = Tokenizer.from_str(job.tokenizer_json)
        tokenizer.encode_special_tokens = True
        _WORKER_ENCODERS.clear()
        encoder = _WORKER_ENCODERS[job.key] = _Encoder(tokenizer, processes=False)
    dtype = np.dtype(job.dtype)
    return [
        _encode_batch(job.cfg, encoder, batch, dtype)
        for batch in iter_batches([Path(path)], job.cfg.read_batch_rows)
    ]


def _encoded_batches(
    cfg: TokenizeConfig, encoder: _Encoder, bpe: Tokenizer, files: list[Path], dtype: np.dtype
) -> Iterator[_Batch]:
    """Every record batch of every file encoded, in file and batch order: a file per unit on
    the run's backend (`backend.current`: Ray, or processes), else batch by batch here."""
    units = backend.current()
    if not units.parallel or (units.kind == "processes" and len(files) < 2):
        for batch in iter_batches(files, cfg.read_batch_rows):
            yield _encode_batch(cfg, encoder, batch, dtype)
        return
    text = bpe.to_str()
    job = _Job(text, hashlib.sha256(text.encode()).hexdigest(), cfg, dtype.str)
    for encoded in units.stream(_encode_file, job, [str(f) for f in files]):
        yield from encoded
