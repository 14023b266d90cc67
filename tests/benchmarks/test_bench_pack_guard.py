"""bench_pack prints a ratio only when both sides wrote the same tokens for every document."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.bench_pack import headline, run_ours, run_peer, same_tokens
from benchmarks.common import alternate, order
from llmflow.tasks.tokenizer.config import TokenizerConfig
from llmflow.tasks.tokenizer.train import train_tokenizer
from tests.tasks.tokenizer.corpus_helpers import synthetic_docs, write_corpus


def test_alternating_order_and_rounds():
    assert order(["a", "b"], 3) == ["a", "b", "b", "a", "a", "b"]
    assert order(["a", "b", "c"], 2) == ["a", "b", "c", "b", "c", "a"]
    calls = []
    times = alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2)
    assert calls == ["a", "b", "b", "a"] and [len(t) for t in times.values()] == [2, 2]


def test_same_tokens_guard_detects_one_changed_document(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    write_corpus(synthetic_docs(60), tmp_path / "corpus", num_files=2)
    (tmp_path / "tok").mkdir()
    train_tokenizer(TokenizerConfig(vocab_size=400), tmp_path / "corpus", tmp_path / "tok")
    run_ours(tmp_path)
    run_peer(tmp_path, num_proc=1)
    assert same_tokens(tmp_path)
    assert headline({"peer": [2.0], "ours": [1.0]}, True) == {"ratio": 2.0}

    docs = pq.read_table(tmp_path / "peer_docs.parquet").to_pydict()
    first = docs["input_ids"][0]
    docs["input_ids"][0] = [first[1], first[0], *first[2:]]  # same tokens, another order
    pq.write_table(pa.table(docs), tmp_path / "peer_docs.parquet")
    assert not same_tokens(tmp_path)
    assert headline({"peer": [2.0], "ours": [1.0]}, False)["ratio"] is None
