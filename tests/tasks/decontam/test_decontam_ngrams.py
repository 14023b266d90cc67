"""The n-gram method against datatrove's own code: normalization and the windows indexed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from llmflow.tasks.decontam.ngrams import (
    Item,
    build_index,
    normalize,
    scan_texts,
    window_hashes,
    words,
)
from tests.needs import bench_module

TEXTS = [
    "Janet’s ducks lay 16 eggs per day. She sells the remainder at $2 per egg!",
    "It takes 2/2=<<2/2=1>>1 bolt of white fiber; 3.5 or 3,5 — “quoted” (parens) [x] {y}",
    "Café naïve résumé Ångström — déjà vu; coöperate",
    "Tabs\tand\nnewlines  and\x0bvertical\x0cfeeds\r\n end",
    "ÉCOLE 12:30 ٣٤ numbers ٫ arabic 1٫5 and １２ fullwidth",
    "don't can't won't it's O'Neil well-known e-mail @user #tag 50% a+b=c",
]


@pytest.mark.needs_bench
def test_normalization_is_datatrove_simplify_text():
    text_utils = bench_module("datatrove.utils.text")
    for text in TEXTS:
        assert " ".join(words(text)) == text_utils.simplify_text(text), text


def datatrove_ngrams(query: str | None, gold: str, n: int) -> set[str]:
    """The n-gram strings datatrove's indexer hashes (its ``compute_hashes`` on an identity
    hash), with a whitespace word splitter in place of spaCy."""
    decont = bench_module("datatrove.pipeline.decont.n_grams")
    fake = SimpleNamespace(
        tokenizer=SimpleNamespace(word_tokenize=str.split),
        config=decont.NGramsDecontConfig(n_grams=n),
        hash_func=lambda s: s,
    )
    return set(decont.NGramsDecontIndexer.compute_hashes(fake, gold, query))


def index_ngrams(items: list[Item], n: int) -> set[str]:
    index = build_index(items, n)
    vocabulary = index.words
    return {" ".join(vocabulary[i] for i in row) for row in index.grams.tolist()}


@pytest.mark.needs_bench
@pytest.mark.parametrize("n", [4, 5, 13])
def test_indexed_windows_are_datatrove_windows(n):
    query = "How many bolts in total does it take to make a robe of blue and white fiber?"
    gold = "It takes 2/2=<<2/2=1>>1 bolt of white fiber so the total is 2+1=<<2+1=3>>3 #### 3"
    item = Item("t", 0, query, (gold,))
    assert index_ngrams([item], n) == datatrove_ngrams(query, gold, n)
    short = Item("t", 1, "Why?", ("Because it is.",))
    assert index_ngrams([short], n) == datatrove_ngrams("Why?", "Because it is.", n)


def distinct_words(prefix: str, count: int) -> str:
    """Words that stay distinct after normalization (digits would all become 0)."""
    return " ".join(prefix + chr(97 + i) for i in range(count))


def test_query_only_and_answer_only_items():
    page = Item("wiki", 0, None, (distinct_words("w", 20),))
    assert len(build_index([page], 13).hashes) == 8
    with_query = build_index([Item("q", 0, distinct_words("q", 20), ("a",))], 13, True)
    # 8 windows of the question alone, 1 window spanning into the one-word answer
    assert len(with_query.hashes) == 9


def test_scan_attributes_each_hit_to_every_item_that_owns_the_ngram():
    shared = "the quick brown fox jumps over the lazy dog near the river bank today"
    items = [Item("a", 0, None, (shared,)), Item("b", 3, None, (shared + " again",))]
    index = build_index(items, 13)
    hits = scan_texts(index, ["nothing here", "Prefix. " + shared.upper() + "!"])
    assert {h.row for h in hits} == {1}
    owners = {index.items[o] for h in hits for o in index.owners[slice(*h.owner_slice)]}
    assert owners == {("a", 0), ("b", 3)}
    assert hits[0].ngram in shared and len(hits[0].ngram.split()) == 13


def test_a_hash_collision_is_not_a_match():
    text = distinct_words("w", 13)
    index = build_index([Item("a", 0, None, (text,))], 13)
    other = " ".join(reversed(text.split()))  # same words, another order
    assert len(scan_texts(index, [text])) == 1
    # force the reversed window's hash to equal the indexed one: only the word check stops it
    reversed_ids = np.array([index.vocab[w] for w in other.split()], dtype=np.int32)
    index.hashes[0] = window_hashes(reversed_ids, index.codes, 13)[0]
    assert scan_texts(index, [other]) == []


def test_words_drop_diacritics_and_numbers():
    assert normalize("Café 42.5").split() == ["cafe", "0"]


def test_short_items_match_whole_and_tiny_ones_are_reported():
    from llmflow.tasks.decontam.ngrams import unindexed_items, whole_item_indexes

    nine = Item("t", 0, "Which planet is the largest", ("Jupiter is largest",))  # 8 words
    tiny = Item("t", 1, "Why?", ("Because.",))
    (index,) = whole_item_indexes([nine, tiny], 13, min_words=8)
    assert index.n == 8 and len(index.hashes) == 1
    text = "Notes. WHICH planet is the largest? Jupiter, is largest! More."
    assert [index.items[o] for h in scan_texts(index, [text]) for o in index.owners] == [("t", 0)]
    assert scan_texts(index, ["which planet is the largest jupiter is big"]) == []
    assert unindexed_items([nine, tiny], 13, 8) == {("t", 1): "2 words < min_item_words=8"}


def test_auto_query_ngrams_index_the_question_only_when_the_answer_is_short():
    question = distinct_words("q", 20)
    short = build_index([Item("q", 0, question, ("a",))], 13, "auto")
    assert len(short.hashes) == 9  # 8 of the question alone, 1 spanning into the answer
    long = build_index([Item("q", 0, question, (distinct_words("a", 13),))], 13, "auto")
    assert len(long.hashes) == 1 + 12  # the answer's own window and the 12 spanning ones
