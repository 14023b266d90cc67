"""End to end on real public text: tokenizer, tokenize, stage mixture, validation, loader."""

from __future__ import annotations

import numpy as np
import pytest

from llmflow.tasks.dataprep.config import StageMixture, TokenizeConfig, ValidationConfig
from llmflow.tasks.dataprep.loader import PackedLoader
from llmflow.tasks.dataprep.mixture import build_mixture, build_validation
from llmflow.tasks.tokenizer.config import TokenizerConfig
from llmflow.tasks.tokenizer.train import train_tokenizer
from tests.tasks.tokenizer.corpus_helpers import real_docs, write_corpus


@pytest.mark.slow
def test_real_corpus_end_to_end(tmp_path):
    from llmflow.tasks.dataprep.tokenize import tokenize_corpus

    write_corpus(real_docs(), tmp_path / "corpus", num_files=2)
    for name in ("tok", "tokenized", "stage1", "stage3", "val"):
        (tmp_path / name).mkdir()
    train_tokenizer(TokenizerConfig(vocab_size=4096), tmp_path / "corpus", tmp_path / "tok")
    metrics = tokenize_corpus(
        TokenizeConfig(validation_fraction=0.05), tmp_path / "corpus", tmp_path / "tok",
        tmp_path / "tokenized",
    )  # fmt: skip
    assert metrics["num_rejected"] == 0 and metrics["num_validation_docs"] > 0
    total = metrics["num_train_tokens"] + metrics["num_train_docs"]
    broad = StageMixture(weights={"books": 1, "wiki": 1}, num_tokens=total, seq_len=128)
    anneal = StageMixture(weights={"wiki": 1}, num_tokens=total // 4, seq_len=128, seed=1)
    one = build_mixture(broad, tmp_path / "tokenized", tmp_path / "stage1", max_seq_len=128)
    three = build_mixture(anneal, tmp_path / "tokenized", tmp_path / "stage3", max_seq_len=128)
    assert one["share/books"] == pytest.approx(0.5, abs=0.01)
    assert three["share/wiki"] == 1.0
    val = build_validation(ValidationConfig(seq_len=128), tmp_path / "tokenized", tmp_path / "val")
    assert val["num_tokens"] == metrics["num_validation_tokens"] + metrics["num_validation_docs"]
    loader = PackedLoader(tmp_path / "stage1", batch_size=4, world_size=2, rank=1)
    batch = loader.next_batch()
    assert batch["input_ids"].shape == (4, 128) and batch["input_ids"].max() < 4096
    assert np.all(np.diff(batch["cu_seqlens"].numpy()) > 0)
