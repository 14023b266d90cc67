"""Tokenizer training: transformers loading, exact round trips, chat template, bad input."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.tokenizer.config import TokenizerConfig
from llmflow.tasks.tokenizer.train import train_tokenizer
from tests.tasks.tokenizer.corpus_helpers import real_docs, synthetic_docs, write_corpus

ROUND_TRIP = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nand  double  spaces",
    "naïve café, 東京の数据, Ελλάδα, emoji 🙂👍🏽, zero\u200bwidth, combining e\u0301",
    "def f(x):\n    return {'a': [x ** 2, 0x1F]}  # comment\n",
    "text with a literal <|endoftext|> and <|im_start|> inside",
    " 12345 3.14159 -0.5e10 ",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    write_corpus(synthetic_docs(600), root / "corpus")
    (root / "out").mkdir()
    cfg = TokenizerConfig(vocab_size=600, sweep_vocab_sizes=[300, 1000], eval_fraction=0.1)
    metrics = train_tokenizer(cfg, root / "corpus", root / "out")
    return root / "out", metrics


@pytest.fixture
def hf_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def test_loads_in_transformers_with_special_tokens(trained, hf_offline):
    from transformers import AutoTokenizer

    out, metrics = trained
    tok = AutoTokenizer.from_pretrained(out)
    assert metrics["vocab_size"] == 600 == len(tok)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|endoftext|>", "<|pad|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, *ids.values()}) == 5
    for special, token_id in ids.items():
        assert tok.encode(special, add_special_tokens=False) == [token_id]
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_is_exact(trained, hf_offline, text):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    out, _ = trained
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    raw.encode_special_tokens = True  # how tokenize_corpus reads documents
    ids = raw.encode(text).ids
    assert raw.decode(ids, skip_special_tokens=False) == text
    assert raw.token_to_id("<|endoftext|>") not in ids


def test_chat_template_marks_assistant_tokens(trained, hf_offline):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained[0])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    out = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    assistant = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(assistant) == "Hello!<|im_end|>"


def test_report_rows_and_plot(trained):
    out, metrics = trained
    report = json.loads((out / "tokenizer_eval.json").read_text())
    sizes = {r["vocab_size"] for r in report["rows"]}
    assert sizes == {300, 600, 1000}
    assert {r["domain"] for r in report["rows"]} == {"web", "code", "books", "all"}
    by_size = {r["vocab_size"]: r for r in report["rows"] if r["domain"] == "all"}
    # a bigger vocabulary compresses better on the same text
    assert by_size[300]["bytes_per_token"] < by_size[600]["bytes_per_token"]
    assert by_size[300]["fertility"] > by_size[1000]["fertility"]
    assert 0 <= metrics["continued_word_rate"] <= 1 and metrics["fertility"] >= 1
    assert (out / "tokenizer_eval.png").stat().st_size > 1000


def test_fertility_by_hand(trained):
    from tokenizers import Tokenizer

    from llmflow.tasks.tokenizer.evaluate import domain_stats

    tok = Tokenizer.from_file(str(trained[0] / "tokenizer.json"))
    texts = ["the the zqxjv", "the"]
    stats = domain_stats(tok, texts)
    the, odd = (len(tok.encode(" " + w).ids) for w in ("the", "zqxjv"))
    assert odd > 1
    assert stats["num_words"] == 4
    assert stats["fertility"] == round((3 * the + odd) / 4, 4)
    assert stats["continued_word_rate"] == (3 * (the > 1) + 1) / 4
    num_tokens = sum(len(tok.encode(t).ids) for t in texts)
    assert stats["bytes_per_token"] == round(16 / num_tokens, 4)


def test_bad_input_fails_before_work(tmp_path):
    with pytest.raises(ValidationError, match="vocab_size=200.*at least 261"):
        TokenizerConfig(vocab_size=200)
    with pytest.raises(ValidationError, match="sweep_vocab_sizes"):
        TokenizerConfig(sweep_vocab_sizes=[100])
    (tmp_path / "out").mkdir()
    with pytest.raises(BadInputError, match="empty corpus"):
        train_tokenizer(TokenizerConfig(), tmp_path / "nothing", tmp_path / "out")
    write_corpus([], tmp_path / "empty", num_files=1)
    with pytest.raises(BadInputError, match="empty corpus"):
        train_tokenizer(TokenizerConfig(), tmp_path / "empty", tmp_path / "out")
    blank = [{"id": "a", "text": "", "domain": "web", "source": "s"}]
    write_corpus(blank, tmp_path / "blank", num_files=1)
    with pytest.raises(BadInputError, match="no usable training text"):
        train_tokenizer(TokenizerConfig(eval_fraction=0), tmp_path / "blank", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "rejects.jsonl").read_text())["reason"]


def test_real_corpus_round_trip(tmp_path, hf_offline):
    from transformers import AutoTokenizer

    docs = real_docs()
    write_corpus(docs, tmp_path / "corpus")
    (tmp_path / "out").mkdir()
    cfg = TokenizerConfig(vocab_size=2048, max_sample_bytes=500_000)
    metrics = train_tokenizer(cfg, tmp_path / "corpus", tmp_path / "out")
    assert metrics["num_sample_bytes"] >= 500_000 > metrics["num_sample_bytes"] - 20_000
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    for doc in docs[::25]:
        assert tok.decode(tok.encode(doc["text"], add_special_tokens=False)) == doc["text"]
