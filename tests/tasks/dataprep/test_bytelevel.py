"""ByteLevelEncoder gives `tokenizers`' own ids, on every kind of character and on real text."""

from __future__ import annotations

import numpy as np
import pytest

from llmflow.tasks.dataprep.bytelevel import ByteLevelEncoder
from llmflow.tasks.dataprep.tokenize import load_tokenizer
from llmflow.tasks.tokenizer.config import TokenizerConfig
from llmflow.tasks.tokenizer.train import train_tokenizer
from tests.tasks.tokenizer.corpus_helpers import real_docs, synthetic_docs, write_corpus


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytelevel")
    write_corpus(synthetic_docs(300), root / "corpus")
    (root / "tok").mkdir()
    train_tokenizer(TokenizerConfig(vocab_size=600), root / "corpus", root / "tok")
    return load_tokenizer(root / "tok")


def _assert_same_ids(tokenizer, texts: list[str]) -> None:
    encoder = ByteLevelEncoder.for_tokenizer(tokenizer)
    assert encoder is not None
    ours = encoder.encode_batch(texts, np.dtype(np.uint16))
    theirs = tokenizer.encode_batch_fast(texts)
    bad = [t for t, a, b in zip(texts, ours, theirs, strict=True) if a.tolist() != b.ids]
    assert not bad, f"{len(bad)} texts differ, e.g. {bad[:3]!r}"


def test_every_unicode_block_in_context_matches_tokenizers(tokenizer):
    """Code points (every one below U+3100, then every 61st) as letters, spaces and marks."""
    points = [*range(0x3100), *range(0x3100, 0x110000, 61)]
    chars = [chr(c) for c in points if not 0xD800 <= c <= 0xDFFF]
    texts = [f"x{c}y {c} {c}{c}9 '{c}s {c}  \n{c}\t's 've" for c in chars]
    _assert_same_ids(tokenizer, texts)


def test_special_token_text_and_edge_cases_match_tokenizers(tokenizer):
    texts = ["", " ", "\n\n\n", "a<|endoftext|>b <|pad|>", "don't I'll we've", "  x  ", "🙂🙂 🙂"]
    _assert_same_ids(tokenizer, texts * 3)


def test_real_text_matches_tokenizers(tokenizer, shared_data):
    texts = [d["text"] for d in real_docs(shared_data / "text")]
    _assert_same_ids(tokenizer, texts)


def test_other_layouts_fall_back(tokenizer):
    from tokenizers import Tokenizer, normalizers

    changed = Tokenizer.from_str(tokenizer.to_str())
    changed.encode_special_tokens = True
    changed.normalizer = normalizers.NFKC()
    assert ByteLevelEncoder.for_tokenizer(changed) is None
    changed.normalizer = None
    assert ByteLevelEncoder.for_tokenizer(changed) is not None
    changed.encode_special_tokens = False
    assert ByteLevelEncoder.for_tokenizer(changed) is None


def test_cache_stays_bounded_and_ids_do_not_depend_on_it(tokenizer, monkeypatch):
    from llmflow.tasks.dataprep import bytelevel

    monkeypatch.setattr(bytelevel, "CACHE_LIMIT", 3)
    encoder = ByteLevelEncoder.for_tokenizer(tokenizer)
    texts = [d["text"] for d in synthetic_docs(40, seed=1)]
    ours = encoder.encode_batch(texts, np.dtype(np.uint16))
    assert len(encoder.cache) == 3
    assert [a.tolist() for a in ours] == [e.ids for e in tokenizer.encode_batch_fast(texts)]


def test_a_large_batch_shared_with_a_worker_process_gives_the_same_ids(tokenizer, monkeypatch):
    from llmflow.tasks.dataprep import bytelevel

    monkeypatch.setattr(bytelevel, "PROCESS_MIN_CHARS", 100)
    encoder = ByteLevelEncoder.for_tokenizer(tokenizer)
    texts = [d["text"] for d in synthetic_docs(60, seed=2)] + ["", "é ü 9", "\x1c\x1d x \x1f"]
    ours = encoder.encode_batch(texts, np.dtype(np.uint16))
    assert encoder._pool is not None  # the worker took part of the batch
    assert [a.tolist() for a in ours] == [e.ids for e in tokenizer.encode_batch_fast(texts)]
    # half of the documents' pre-tokens were seen by the worker only, not by this cache
    assert len(encoder.cache) < len({w for t in texts for w in bytelevel.split(t)})
