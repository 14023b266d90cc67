"""Normalization, the hashing normal form, and the spaCy-like word splitter."""

from __future__ import annotations

import pytest

from llmflow.tasks.curation.text import clean_whitespace, normalize_unicode, simplify_text
from llmflow.tasks.curation.words import split_words
from tests.needs import bench_module


def test_nfc_composes_accents():
    assert normalize_unicode("cafe\u0301") == "caf\u00e9"
    assert normalize_unicode("cafe\u0301", "none") == "cafe\u0301"


def test_clean_whitespace_keeps_indentation_and_paragraphs():
    text = "def f():\r\n    return  1\t \n\n\n\nnext\u00a0para\u200b\x07 end  "
    assert clean_whitespace(text) == "def f():\n    return 1\n\nnext para end"
    assert clean_whitespace("a    b", collapse_inner_spaces=False) == "a    b"


def test_simplify_text_matches_datatrove_rules():
    # lowercase, digits -> 0 (with decimal separators), punctuation -> space, no diacritics
    assert (
        simplify_text("Hello, World! 3.14 and 1,000 Café—naïve") == "hello world 0 and 0 cafe naive"
    )
    assert simplify_text("  \n ") == ""


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("Don't stop.", ["Do", "n't", "stop", "."]),
        (
            "I can't, U.S. well-known COVID-19",
            ["I", "ca", "n't", ",", "U.S.", "well", "-", "known", "COVID-19"],
        ),
        ("Smith's (yes) $5 3.5 1,000", ["Smith", "'s", "(", "yes", ")", "$", "5", "3.5", "1,000"]),
        ("Mr. Smith ends.", ["Mr.", "Smith", "ends", "."]),
        ("a @-@ b @,@ c 's", ["a", "@-@", "b", "@,@", "c", "'s"]),
        ("see http://x.org/a?b=1 or a.b@c.com", ["see", "http://x.org/a?b=1", "or", "a.b@c.com"]),
        ("wait... what", ["wait", "...", "what"]),
    ],
)
def test_split_words_like_spacy(text, words):
    assert split_words(text) == words


@pytest.mark.needs_bench
def test_split_words_agrees_with_spacy_on_real_text(shared_data):
    spacy = bench_module("spacy")
    from tests.tasks.curation.helpers import real_documents

    nlp = spacy.blank("en")
    docs = real_documents()[::15]
    same = sum([t.text for t in nlp(d) if t.text.strip()] == split_words(d) for d in docs)
    assert same / len(docs) >= 0.8
