"""Padding is masked by position, so eos stays a target when pad = eos (Qwen2.5, Qwen3, Llama 3).

Before, the loader ignored every label equal to ``pad_id``: with pad = eos no document's end was
ever a target, and continued pretraining never learnt to stop.
"""

from __future__ import annotations

import json

import numpy as np

from llmflow.tasks.dataprep.loader import IGNORE_INDEX, PackedLoader
from llmflow.tasks.dataprep.pack import write_packed
from tests.tasks.dataprep.conftest import EOS, VOCAB, make_docs


def _expected_labels(docs: list[np.ndarray], seq_len: int) -> dict[tuple, list[int]]:
    """By hand, per unshuffled row (keyed by its input tokens): the row's next tokens, ignored
    where the target begins a document and where it is padding."""
    row_len = seq_len + 1
    stream = np.concatenate(docs)
    num_rows = -(-len(stream) // row_len)
    real = np.zeros(num_rows * row_len, bool)
    real[: len(stream)] = True
    begins = np.zeros(num_rows * row_len, bool)
    begins[np.cumsum([len(d) for d in docs])[:-1]] = True
    begins[len(stream) :] = True  # the pad region begins like a document
    tokens = np.concatenate([stream, np.full(num_rows * row_len - len(stream), EOS)])
    out = {}
    for r in range(num_rows):
        row = slice(r * row_len, (r + 1) * row_len)
        labels = tokens[row][1:].copy()
        labels[begins[row][1:] | ~real[row][1:]] = IGNORE_INDEX
        out[tuple(tokens[row][:-1].tolist())] = labels.tolist()
    return out


def _pack_pad_is_eos(docs, out_dir, seq_len):
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths = [len(d) for d in docs]
    return write_packed(
        [(np.concatenate(docs), lengths)], out_dir, seq_len=seq_len, vocab_size=VOCAB,
        eos_id=EOS, pad_id=EOS, seed=3, rows_per_shard=4,
    )  # fmt: skip


def test_pad_equal_to_eos_keeps_eos_targets_and_masks_only_the_padding(tmp_path):
    docs = make_docs([5, 9, 3, 30, 2, 11, 7], seed=4)  # 67 tokens, T=8: 8 rows, 5 pad tokens
    meta = _pack_pad_is_eos(docs, tmp_path, seq_len=8)
    assert meta["num_sequences"] == 8 and meta["num_tokens"] == 67
    batch = PackedLoader(tmp_path, batch_size=8).next_batch()
    labels = batch["labels"].numpy()
    assert (labels == EOS).any()
    expected = _expected_labels(docs, seq_len=8)
    got = {tuple(x): y for x, y in zip(batch["input_ids"].tolist(), labels.tolist(), strict=True)}
    assert got == expected
    # eos targets by hand: every document's eos except one at a row's position 0 (never a target)
    ends = np.cumsum([len(d) for d in docs]) - 1
    assert (labels == EOS).sum() == np.count_nonzero(ends % 9 != 0) == 7


def test_a_meta_written_before_the_padding_field_gives_the_same_labels(tmp_path):
    docs = make_docs([5, 9, 3, 30, 2, 11, 7], seed=4)
    _pack_pad_is_eos(docs, tmp_path, seq_len=8)
    new = PackedLoader(tmp_path, batch_size=8).next_batch()
    path = tmp_path / "meta.json"
    meta = json.loads(path.read_text())
    meta.pop("padding")
    path.write_text(json.dumps(meta))
    old = PackedLoader(tmp_path, batch_size=8).next_batch()
    for key in new:
        assert np.array_equal(new[key].numpy(), old[key].numpy()), key


def test_a_full_last_row_records_no_padding(tmp_path):
    docs = make_docs([4, 5, 9], seed=1)  # 18 tokens = 2 rows of T+1 = 9
    meta = _pack_pad_is_eos(docs, tmp_path, seq_len=8)
    assert meta["padding"] is None
    labels = PackedLoader(tmp_path, batch_size=2).next_batch()["labels"].numpy()
    assert (labels == EOS).sum() == 3  # every document's eos is a target


def test_an_imported_model_with_pad_equal_to_eos_trains_on_eos(tmp_path, monkeypatch):
    """The issue's case: a mirror Llama whose pad falls back to eos, through tokenize and the
    mixture step, into packed batches."""
    from llmflow.tasks.dataprep.config import StageMixture, TokenizeConfig
    from llmflow.tasks.dataprep.mixture import mixture
    from llmflow.tasks.dataprep.tokenize import tokenize_corpus
    from llmflow.tasks.ingest.hub import MIRROR_ENV
    from llmflow.tasks.ingest.import_model import (
        ImportModelConfig,
        ImportTokenizerConfig,
        import_model,
        import_tokenizer,
    )
    from tests.flows.tiny_llama import save_tiny_llama
    from tests.tasks.tokenizer.corpus_helpers import synthetic_docs, write_corpus

    save_tiny_llama(tmp_path / "mirror" / "test" / "tiny-llama")
    monkeypatch.setenv(MIRROR_ENV, str(tmp_path / "mirror"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok, tokenized, packed = (tmp_path / n for n in ("model", "tok", "tokenized", "mix"))
    for folder in (model, tok, tokenized, packed):
        folder.mkdir()
    import_model(ImportModelConfig(model="hf://models/test/tiny-llama"), out=model)
    special = import_tokenizer(ImportTokenizerConfig(), model=model, out=tok)
    assert special["pad_id"] == special["eos_id"]
    eos = special["eos_id"]
    write_corpus(synthetic_docs(60, domains=("web",)), tmp_path / "corpus", num_files=1)
    tokenize_corpus(
        TokenizeConfig(validation_fraction=0.0), corpus=tmp_path / "corpus", tokenizer=tok,
        out=tokenized,
    )  # fmt: skip
    cfg = StageMixture(weights={"web": 1.0}, num_tokens=3000, seq_len=64, rows_per_shard=16)
    mixture(cfg, tokenized=tokenized, out=packed)
    meta = json.loads((packed / "meta.json").read_text())
    loader = PackedLoader(packed, batch_size=meta["num_sequences"])
    labels = loader.next_batch()["labels"].numpy()  # one epoch: every row once
    assert (labels == eos).any()
    # By hand from the document index: each document's eos is a target unless it sits at a
    # row's position 0, i.e. unless the next document (or the padding) starts at position 1.
    starts = np.fromfile(packed / meta["index"]["doc_starts"], np.int32)
    assert (labels == eos).sum() == meta["num_documents"] - np.count_nonzero(starts == 1)
