"""tokenize_corpus, build_mixture, build_validation, chinchilla_report on a small corpus."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from llmflow.tasks.dataprep.config import StageMixture, TokenizeConfig, ValidationConfig
from llmflow.tasks.dataprep.loader import PackedLoader
from llmflow.tasks.dataprep.mixture import (
    build_mixture,
    build_validation,
    chinchilla_report,
    select_documents,
)
from llmflow.tasks.dataprep.pack import read_meta
from llmflow.tasks.dataprep.tokenize import tokenize_corpus
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.tokenizer.config import TokenizerConfig
from llmflow.tasks.tokenizer.train import train_tokenizer
from tests.tasks.dataprep.packed_rows import read_all_rows
from tests.tasks.tokenizer.corpus_helpers import synthetic_docs, write_corpus


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A 3-domain corpus (with two malformed rows), its tokenizer and its tokenized form."""
    root = tmp_path_factory.mktemp("dataprep")
    docs = synthetic_docs(450)
    docs += [
        {"id": "bad-1", "text": "", "domain": "web", "source": "s"},
        {"id": "bad-2", "text": None, "domain": "code", "source": "s"},
    ]
    write_corpus(docs, root / "corpus", num_files=3)
    for name in ("tok", "tokenized"):
        (root / name).mkdir()
    train_tokenizer(TokenizerConfig(vocab_size=500), root / "corpus", root / "tok")
    cfg = TokenizeConfig(validation_fraction=0.1, encode_batch_size=64, read_batch_rows=100)
    metrics = tokenize_corpus(cfg, root / "corpus", root / "tok", root / "tokenized")
    return root, docs[:450], metrics


def _domain_tokens(tokenized, split, domain):
    meta = json.loads((tokenized / "meta.json").read_text())
    folder = tokenized / meta[split][domain]["dir"]
    tokens = np.fromfile(folder / "tokens.bin", dtype=meta["dtype"])
    offsets = np.load(folder / "offsets.npy")
    ids = pq.read_table(folder / "docs.parquet").column("id").to_pylist()
    return {i: tokens[offsets[k] : offsets[k + 1]] for k, i in enumerate(ids)}, meta


def test_tokenize_matches_transformers_and_holds_out_by_id(pipeline, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    from transformers import AutoTokenizer

    root, docs, metrics = pipeline
    tok = AutoTokenizer.from_pretrained(root / "tok")
    tokenized = root / "tokenized"
    assert metrics["num_rejected"] == 2
    reasons = [json.loads(line)["reason"] for line in open(tokenized / "rejects.jsonl")]
    assert reasons == ["null or empty text", "null or empty text"]
    seen = {}
    for split in ("train", "validation"):
        for domain in ("web", "code", "books"):
            by_id, meta = _domain_tokens(tokenized, split, domain)
            for doc_id, tokens in by_id.items():
                assert doc_id.startswith(domain)
                seen[doc_id] = split
                expected = tok.encode(next(d["text"] for d in docs if d["id"] == doc_id))
                assert tokens.tolist() == expected
    assert sorted(seen) == sorted(d["id"] for d in docs)
    held = pq.read_table(tokenized / "validation_docs" / "shards" / "part-00000.parquet")
    assert held.column_names == ["id", "text", "domain", "source"]
    assert sorted(held.column("id").to_pylist()) == sorted(
        i for i, s in seen.items() if s == "validation"
    )
    assert 20 < metrics["num_validation_docs"] < 70  # ~10% of 450
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 500


def _packed_counts(out, vocab):
    rows = read_all_rows(out)
    return np.bincount(rows.ravel().astype(np.int64), minlength=vocab)


def test_every_token_appears_exactly_as_often_as_the_mixture_says(pipeline, tmp_path):
    root, _, _ = pipeline
    tokenized = root / "tokenized"
    web, meta = _domain_tokens(tokenized, "train", "web")
    code, _ = _domain_tokens(tokenized, "train", "code")
    eos, pad, vocab = meta["eos_id"], meta["pad_id"], meta["vocab_size"]
    web_tokens = sum(len(t) + 1 for t in web.values())
    code_tokens = sum(len(t) + 1 for t in code.values())
    # web twice, code once, books not at all
    cfg = StageMixture(
        weights={"web": 2 * web_tokens, "code": code_tokens, "books": 0},
        num_tokens=2 * web_tokens + code_tokens,
        max_epochs=2,
        seq_len=32,
        rows_per_shard=50,
    )
    metrics = build_mixture(cfg, tokenized, tmp_path, max_seq_len=64)
    assert metrics["epochs/web"] == 2.0 and metrics["epochs/code"] == 1.0
    expected = np.zeros(vocab, np.int64)
    for times, docs in ((2, web), (1, code)):
        for tokens in docs.values():
            expected += times * np.bincount(tokens, minlength=vocab)
            expected[eos] += times
    got = _packed_counts(tmp_path, vocab)
    packed = read_meta(tmp_path)
    expected[pad] += packed["num_sequences"] * 33 - packed["num_tokens"]
    assert packed["num_tokens"] == cfg.num_tokens
    np.testing.assert_array_equal(got, expected)
    assert len(packed["shards"]) == -(-packed["num_sequences"] // 50)


def test_fractional_epochs_follow_the_saved_doc_counts(pipeline, tmp_path):
    root, _, _ = pipeline
    tokenized = root / "tokenized"
    cfg = StageMixture(
        weights={"web": 0.5, "code": 0.3, "books": 0.2},
        num_tokens=20_000,
        max_epochs=4,
        seq_len=16,
        seed=3,
    )
    metrics = build_mixture(cfg, tokenized, tmp_path)
    packed = read_meta(tmp_path)
    expected = np.zeros(packed["vocab_size"], np.int64)
    for domain, weight in cfg.weights.items():
        docs, meta = _domain_tokens(tokenized, "train", domain)
        counts = np.load(tmp_path / packed["doc_counts"][domain])
        lengths = np.array([len(t) + 1 for t in docs.values()])
        used = int((counts * lengths).sum())
        assert weight * 20_000 <= used < weight * 20_000 + lengths.max() + 1
        assert packed["mixture"][domain]["tokens"] == used
        assert metrics[f"share/{domain}"] == pytest.approx(weight, abs=0.01)
        for c, tokens in zip(counts, docs.values(), strict=True):
            expected += c * np.bincount(tokens, minlength=len(expected))
            expected[meta["eos_id"]] += c
    expected[meta["pad_id"]] += packed["num_sequences"] * 17 - packed["num_tokens"]
    np.testing.assert_array_equal(_packed_counts(tmp_path, len(expected)), expected)


def test_packed_index_matches_eos_positions_and_is_deterministic(pipeline, tmp_path):
    root, _, _ = pipeline
    cfg = StageMixture(weights={"web": 1, "books": 1}, num_tokens=5_000, seq_len=24, seed=9)
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    build_mixture(cfg, root / "tokenized", tmp_path / "a")
    build_mixture(cfg, root / "tokenized", tmp_path / "b")
    build_mixture(cfg.model_copy(update={"seed": 10}), root / "tokenized", tmp_path / "c")
    a, b, c = (read_all_rows(tmp_path / n) for n in "abc")
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    meta = read_meta(tmp_path / "a")
    loader = PackedLoader(tmp_path / "a", batch_size=meta["num_sequences"])
    batch = loader.next_batch()
    x, pos = batch["input_ids"].numpy(), batch["position_ids"].numpy()
    after_eos = np.zeros_like(x, bool)
    after_eos[:, 1:] = x[:, :-1] == meta["eos_id"]
    np.testing.assert_array_equal(pos[:, 1:] == 0, after_eos[:, 1:])


def test_overflow_fails_naming_the_domain_or_reweights(pipeline, tmp_path):
    root, _, _ = pipeline
    web, _ = _domain_tokens(root / "tokenized", "train", "web")
    web_tokens = sum(len(t) + 1 for t in web.values())
    cfg = StageMixture(
        weights={"web": 0.9, "code": 0.1},
        num_tokens=3 * web_tokens // 2,
        max_epochs=1.0,
        seq_len=16,
    )
    with pytest.raises(BadInputError, match=r"domain 'web' would need 1\.35 epochs.*max_epochs=1"):
        build_mixture(cfg, root / "tokenized", tmp_path)
    metrics = build_mixture(
        cfg.model_copy(update={"on_overflow": "reweight"}), root / "tokenized", tmp_path
    )
    assert metrics["num_reweighted"] == 1 and metrics["epochs/web"] == 1.0
    assert metrics["num_tokens"] >= 3 * web_tokens // 2
    assert "capped" in read_meta(tmp_path)["notes"][0]
    everything = cfg.model_copy(update={"num_tokens": 100 * web_tokens, "on_overflow": "reweight"})
    with pytest.raises(BadInputError, match="every domain is capped"):
        build_mixture(everything, root / "tokenized", tmp_path)


def test_bad_mixture_configs_fail_before_work(pipeline, tmp_path):
    root, _, _ = pipeline
    with pytest.raises(ValidationError, match="negative weights.*'web': -1"):
        StageMixture(weights={"web": -1, "code": 2}, num_tokens=1000)
    with pytest.raises(ValidationError, match="all zero"):
        StageMixture(weights={"web": 0, "code": 0}, num_tokens=1000)
    with pytest.raises(ValidationError, match="num_tokens=10 is smaller than one sequence"):
        StageMixture(weights={"web": 1}, num_tokens=10, seq_len=16)
    cfg = StageMixture(weights={"web": 1, "news": 1}, num_tokens=1000, seq_len=16)
    with pytest.raises(BadInputError, match=r"\['news'\]"):
        build_mixture(cfg, root / "tokenized", tmp_path)
    with pytest.raises(BadInputError, match="seq_len=16 is above the model's max_seq_len=8"):
        build_mixture(cfg, root / "tokenized", tmp_path, max_seq_len=8)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValidationError, match="validation_fraction"):
        TokenizeConfig(validation_fraction=1.0)


def test_validation_set_holds_each_held_out_document_once(pipeline, tmp_path):
    root, _, _ = pipeline
    metrics = build_validation(ValidationConfig(seq_len=16), root / "tokenized", tmp_path)
    expected = np.zeros(500, np.int64)
    num_docs = 0
    for domain in ("web", "code", "books"):
        docs, meta = _domain_tokens(root / "tokenized", "validation", domain)
        num_docs += len(docs)
        for tokens in docs.values():
            expected += np.bincount(tokens, minlength=500)
            expected[meta["eos_id"]] += 1
    expected[meta["pad_id"]] += metrics["num_sequences"] * 17 - metrics["num_tokens"]
    assert metrics["num_documents"] == num_docs
    np.testing.assert_array_equal(_packed_counts(tmp_path, 500), expected)


def test_select_documents_by_hand():
    rng = np.random.default_rng(0)
    lengths = np.array([3, 5, 2])  # 10 tokens per epoch
    np.testing.assert_array_equal(select_documents(lengths, 20, rng), [2, 2, 2])
    counts = select_documents(lengths, 24, rng)
    assert counts.min() == 2 and 24 <= (counts * lengths).sum() < 24 + 5


def test_chinchilla_report():
    report = chinchilla_report(num_params=1_000_000, num_tokens=50_000_000)
    assert report["optimal_tokens"] == 20_000_000
    assert report["ratio_to_optimal"] == 2.5 and report["tokens_per_param"] == 50.0
    assert report["verdict"].startswith("over-trains")
    assert chinchilla_report(1_000_000, 5_000_000)["verdict"].startswith("under-trains: 0.25x")
    assert chinchilla_report(1_000_000, 20_000_000)["verdict"] == "about compute-optimal"
    with pytest.raises(BadInputError):
        chinchilla_report(0, 10)
