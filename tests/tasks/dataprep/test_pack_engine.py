"""Packing (the mixture and validation steps) as units on the data engine, against the
single-process path.

The reference is the chunk stream of `write_packed` (`_chunks`, one process, one
``stream.tmp`` written front to back): every file of the mixture and validation folders must
have the same sha256 when `write_packed_units` runs its units here, on ``LLMFLOW_DATA_WORKERS=2``
spawned processes and on a local Ray cluster. `UNIT_TOKENS` is lowered so that the small corpus
is cut into many stream units and shard runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from llmflow.tasks.dataprep import mixture as mixture_module
from llmflow.tasks.dataprep import pack as pack_module
from llmflow.tasks.dataprep.config import StageMixture, ValidationConfig
from llmflow.tasks.dataprep.mixture import build_mixture, build_validation
from llmflow.tasks.dataprep.pack import token_dtype, write_packed
from llmflow.tasks.framework.backend import ProcessBackend, RayBackend, active
from tests.tasks.dataprep.packed_rows import read_all_rows

MIX = StageMixture(
    weights={"prose": 2.0, "code": 1.0, "math": 1.0},
    num_tokens=600_000,
    max_epochs=4,
    seq_len=128,
    rows_per_shard=200,
    seed=7,
)
VAL = ValidationConfig(seq_len=64, rows_per_shard=50, seed=3)
UNIT = 20_000  # tokens: ~30 stream units for the mixture, the cap of 8 per worker decides


def sha256s(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def make_tokenized(root: Path, vocab_size: int, tokens_per_domain: int, seed: int = 0) -> Path:
    """A tokenized folder in `tokenize_corpus`'s layout (meta.json, {split}/{domain}/tokens.bin
    and offsets.npy) of random documents, some of them empty (eos only once packed)."""
    rng = np.random.default_rng(seed)
    dtype = token_dtype(vocab_size)
    meta = {"vocab_size": vocab_size, "dtype": dtype.name, "eos_id": 1, "pad_id": 0}
    for split, scale in (("train", 1.0), ("validation", 0.1)):
        meta[split] = {}
        for domain, mean in (("prose", 300), ("code", 900), ("math", 60)):
            lengths = rng.integers(0, 2 * mean, int(tokens_per_domain * scale) // mean + 1)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            folder = root / split / domain
            folder.mkdir(parents=True)
            rng.integers(2, vocab_size, int(offsets[-1])).astype(dtype).tofile(
                folder / "tokens.bin"
            )
            np.save(folder / "offsets.npy", offsets)
            info = {"dir": f"{split}/{domain}", "num_docs": len(lengths)}
            meta[split][domain] = {**info, "num_tokens": int(offsets[-1])}
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def _build(tokenized: Path, out: Path) -> tuple[dict, dict]:
    """The mixture and the validation set of ``tokenized``: both folders' sha256s."""
    (out / "mix").mkdir(parents=True)
    (out / "val").mkdir()
    build_mixture(MIX, tokenized, out / "mix")
    build_validation(VAL, tokenized, out / "val")
    return sha256s(out / "mix"), sha256s(out / "val")


def _single_process(source, docs, lengths, out_dir, **kwargs) -> dict:
    """`write_packed` on the chunk stream of the same documents: the path before units."""
    domains = [
        mixture_module._DomainTokens(Path(source.tokenized_dir), info, source.dtype)
        for info in source.infos
    ]
    chunks = _chunks(domains, docs, source.eos_id, np.dtype(source.dtype))
    return write_packed(chunks, out_dir, **kwargs)


REFERENCE_CHUNK_DOCS = 4096


def _chunks(domains: list, order: np.ndarray, eos_id: int, dtype):
    """(tokens, doc_lengths) for documents ``order`` (rows of (domain, doc)), eos appended: the
    single-process stream of `write_packed`, which the units must reproduce byte for byte."""
    eos = np.array([eos_id], dtype)
    for begin in range(0, len(order), REFERENCE_CHUNK_DOCS):
        docs = order[begin : begin + REFERENCE_CHUNK_DOCS]
        lengths = [domains[d].offsets[i + 1] - domains[d].offsets[i] + 1 for d, i in docs]
        yield mixture_module._read_docs(domains, docs, eos), np.asarray(lengths, np.int64)


@pytest.fixture(scope="module", params=[1000, 100_000], ids=["uint16", "uint32"])
def corpus(request, tmp_path_factory):
    """A tokenized corpus (~2.3M train tokens) and its single-process mixture and validation."""
    root = tmp_path_factory.mktemp(f"pack_engine_{request.param}")
    tokenized = make_tokenized(root / "tokenized", request.param, 800_000)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mixture_module, "write_packed_units", _single_process)
        reference = _build(tokenized, root / "reference")
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    return tokenized, reference


@pytest.fixture
def small_units(monkeypatch) -> list[int]:
    """Lower `UNIT_TOKENS`; the list receives the number of units of every cut."""
    monkeypatch.setattr(pack_module, "UNIT_TOKENS", UNIT)
    cuts, counts = pack_module._cuts, []

    def counting(*args):
        boundaries = cuts(*args)
        counts.append(len(boundaries) - 1)
        return boundaries

    monkeypatch.setattr(pack_module, "_cuts", counting)
    return counts


def test_in_process_units_are_byte_identical(corpus, small_units, tmp_path, monkeypatch):
    tokenized, reference = corpus
    assert _build(tokenized, tmp_path) == reference
    # stream and shard runs of the mixture, then of the validation set: one worker, 8 units
    assert small_units[:2] == [8, 8] and len(small_units) == 4, small_units
    assert len(reference[0]) > 20 and "meta.json" in reference[0]


def test_process_pool_units_are_byte_identical(corpus, small_units, tmp_path, on_backend):
    tokenized, reference = corpus
    on_backend(ProcessBackend(2))
    start = time.perf_counter()
    assert _build(tokenized, tmp_path) == reference
    assert small_units[:2] == [16, 16], small_units
    print(f"2 processes: {time.perf_counter() - start:.2f} s, load {os.getloadavg()[0]:.1f}")


def test_ray_units_are_byte_identical(corpus, small_units, tmp_path, monkeypatch):
    """On a local Ray cluster (127.0.0.1, 2 CPUs): the units are Ray tasks.

    NOTE: not marked slow: 7-8 s per dtype with Ray's start, on 2 shared cores (load 2)."""
    pytest.importorskip("ray")
    import ray

    from llmflow.tasks.framework.ray_cluster import init_ray

    tokenized, reference = corpus
    init_ray("local", num_cpus=2, log_to_driver=False)
    try:
        start = time.perf_counter()
        with RayBackend() as backend, active(backend):
            assert _build(tokenized, tmp_path) == reference
        seconds = time.perf_counter() - start
    finally:
        ray.shutdown()
    assert small_units[:2] == [16, 16], small_units
    print(f"ray: {seconds:.2f} s, load {os.getloadavg()[0]:.1f}")


@dataclass(frozen=True)
class _Arrays:
    """A `DocumentSource` of in-memory documents (``docs`` are their indices)."""

    arrays: tuple[np.ndarray, ...]

    def open(self):
        return lambda docs: np.concatenate([self.arrays[i] for i in docs] or [np.zeros(0)])


@pytest.mark.parametrize("vocab_size", [1000, 100_000])
def test_stream_units_put_every_document_at_its_prefix_sum(vocab_size, tmp_path, monkeypatch):
    dtype = token_dtype(vocab_size)
    rng = np.random.default_rng(vocab_size)
    lengths = rng.integers(0, 50, 3000)
    lengths[rng.choice(3000, 300, replace=False)] = 0  # documents with no token
    lengths[:5] = 0  # the first unit starts with empty documents
    arrays = tuple(rng.integers(0, vocab_size, n).astype(dtype) for n in lengths)
    docs = rng.permutation(len(arrays))
    doc_lengths = lengths[docs]
    row_len = 33
    monkeypatch.setattr(pack_module, "UNIT_TOKENS", 997)
    monkeypatch.setattr(pack_module, "CHUNK_DOCS", 37)

    chunks = [
        (np.concatenate([arrays[i] for i in docs[b : b + 50]]), doc_lengths[b : b + 50])
        for b in range(0, len(docs), 50)
    ]
    returned = pack_module._write_stream(chunks, tmp_path / "sequential.bin", dtype)
    np.testing.assert_array_equal(returned, doc_lengths)
    sequential = np.fromfile(tmp_path / "sequential.bin", dtype)

    pack = pack_module._Pack(tmp_path, tmp_path / "units.bin", dtype, row_len, 10)
    units = []

    def local_map(fn, items):
        units.extend(items)
        return [fn(item) for item in items]

    pack_module._write_stream_units(_Arrays(arrays), docs, doc_lengths, pack, 7, local_map, 4)
    stream = np.fromfile(tmp_path / "units.bin", dtype)
    num_tokens = int(lengths.sum())
    assert len(units) == 4 * pack_module.UNITS_PER_WORKER
    assert len(stream) == -(-num_tokens // row_len) * row_len
    np.testing.assert_array_equal(stream[:num_tokens], sequential)
    assert (stream[num_tokens:] == 7).all()
    offsets = np.concatenate([[0], np.cumsum(doc_lengths)])
    for k, i in enumerate(docs):
        np.testing.assert_array_equal(stream[offsets[k] : offsets[k + 1]], arrays[i])
    first = 0
    for unit_docs, offset in units:  # each unit starts at its first document's prefix sum
        np.testing.assert_array_equal(unit_docs, docs[first : first + len(unit_docs)])
        assert offset == offsets[first]
        first += len(unit_docs)
    assert first == len(docs)


def test_units_pack_the_same_rows_as_write_packed(tmp_path, monkeypatch):
    """`write_packed_units` and `write_packed` on the same documents (empty ones included):
    the same files, and the rows hold the documents in order."""
    monkeypatch.setattr(pack_module, "UNIT_TOKENS", 500)
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 40, 400)
    arrays = tuple(rng.integers(2, 1000, n).astype(np.uint16) for n in lengths)
    kwargs = dict(seq_len=31, vocab_size=1000, eos_id=1, pad_id=0, seed=2, rows_per_shard=9)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    chunks = [(np.concatenate(arrays[b : b + 7]), lengths[b : b + 7]) for b in range(0, 400, 7)]
    write_packed(chunks, tmp_path / "a", **kwargs)
    meta = pack_module.write_packed_units(
        _Arrays(arrays), np.arange(400), lengths, tmp_path / "b", **kwargs
    )
    assert sha256s(tmp_path / "a") == sha256s(tmp_path / "b")
    assert len(meta["shards"]) > 8
    rows = read_all_rows(tmp_path / "b")
    perm = np.random.default_rng(2).permutation(len(rows))
    unshuffled = np.empty_like(rows)
    unshuffled[perm] = rows
    np.testing.assert_array_equal(unshuffled.reshape(-1)[: lengths.sum()], np.concatenate(arrays))


def test_lengths_that_disagree_with_the_source_fail(tmp_path, monkeypatch):
    arrays = tuple(np.full(n, 5, np.uint16) for n in (3, 4, 5))
    kwargs = dict(seq_len=3, vocab_size=1000, eos_id=1, pad_id=0, seed=0, rows_per_shard=2)
    with pytest.raises(ValueError, match="the stream units wrote"):
        pack_module.write_packed_units(_Arrays(arrays), np.arange(3), [3, 4, 6], tmp_path, **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cuts_cover_every_item_in_nonempty_units(monkeypatch):
    monkeypatch.setattr(pack_module, "UNIT_TOKENS", 100)
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(0, 60, rng.integers(1, 300))
        starts = np.cumsum(lengths) - lengths
        total, workers = int(lengths.sum()), int(rng.integers(1, 4))
        cuts = pack_module._cuts(starts, total, workers)
        assert cuts[0] == 0 and cuts[-1] == len(lengths)
        assert all(a < b for a, b in zip(cuts, cuts[1:], strict=False))
        assert len(cuts) - 1 <= max(1, min(-(-total // 100), 8 * workers))


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_failed_unit_leaves_no_meta(workers, tmp_path, monkeypatch, on_backend):
    """A unit that raises (a domain's tokens gone: the driver reads only the offsets, the units
    the tokens) fails the step and leaves no meta.json nor stream.tmp."""
    tokenized = make_tokenized(tmp_path / "tokenized", 1000, 100_000)
    (tokenized / "train" / "code" / "tokens.bin").unlink()
    if workers == "2":
        on_backend(ProcessBackend(2))
    monkeypatch.setattr(pack_module, "UNIT_TOKENS", UNIT)
    (tmp_path / "mix").mkdir()
    with pytest.raises(FileNotFoundError, match="tokens.bin"):
        build_mixture(MIX.model_copy(update={"num_tokens": 200_000}), tokenized, tmp_path / "mix")
    left = {p.name for p in (tmp_path / "mix").iterdir()}
    assert "meta.json" not in left and "stream.tmp" not in left, left
