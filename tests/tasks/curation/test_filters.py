"""Heuristic filters: hand-computed decisions, and agreement with datatrove where installed."""

from __future__ import annotations

import random

import pytest

from llmflow.tasks.config import load_config
from llmflow.tasks.curation.config import (
    C4Config,
    CurateConfig,
    FiltersConfig,
    FineWebQualityConfig,
    GopherQualityConfig,
    GopherRepetitionConfig,
)
from llmflow.tasks.curation.filters import (
    Doc,
    c4_filter,
    count_sentences,
    fineweb_quality_filter,
    gopher_quality_filter,
    gopher_repetition_filter,
)
from llmflow.tasks.curation.heuristics import apply_filters
from tests.needs import bench_module
from tests.tasks.curation.helpers import prose, real_documents

GOOD = prose(random.Random(0), 12)


def test_good_prose_passes_every_filter():
    assert apply_filters(FiltersConfig(), GOOD, "web")[0] is None


def test_gopher_quality_rules():
    cfg = GopherQualityConfig()
    assert (
        gopher_quality_filter(cfg, Doc("the cat and the dog " * 9)) == "gopher_short_doc"
    )  # 45 words
    # 60 words, none a stop word
    assert (
        gopher_quality_filter(cfg, Doc("cats like fish here " * 15)) == "gopher_enough_stop_words"
    )
    # 50 words that are all numbers: average length 1 < 3
    assert gopher_quality_filter(cfg, Doc("1 " * 50)) == "gopher_below_avg_threshold"
    hashes = "the of and cats " * 15 + "#tag " * 10  # 10 '#' in 80 words > 0.1
    assert gopher_quality_filter(cfg, Doc(hashes)) == "gopher_too_many_hashes"
    # each "x, y." is 4 tokens of which 2 have letters: alpha ratio 0.5 < 0.8
    punct = "the, of. and, with. " * 15
    assert gopher_quality_filter(cfg, Doc(punct)) == "gopher_below_alpha_threshold"
    skip = cfg.model_copy(update={"alpha_ratio_skips_punctuation": True})
    assert gopher_quality_filter(skip, Doc(punct)) is None


def test_gopher_repetition_rules():
    cfg = GopherRepetitionConfig()
    assert gopher_repetition_filter(cfg, Doc("")) == "empty"
    paras = "\n\n".join(["same paragraph here"] * 3 + ["other text"])  # 2 of 4 repeated
    assert gopher_repetition_filter(cfg, Doc(paras)) == "dup_para_frac"
    lines = "\n".join(
        ["line one is here", "line one is here", "a", "b", "c"]
    )  # 1 of 5, 16/45 chars
    assert gopher_repetition_filter(cfg, Doc(lines)) == "dup_line_char_frac"
    top2 = " ".join(["good day"] * 10 + [f"w{i}" for i in range(20)])
    assert gopher_repetition_filter(cfg, Doc(top2)) == "top_2_gram"
    assert gopher_repetition_filter(cfg, Doc(GOOD)) is None


def test_c4_rules():
    cfg = C4Config()
    assert c4_filter(cfg, Doc(GOOD + "\nlorem ipsum dolor sit"))[0] == "lorem_ipsum"
    assert c4_filter(cfg, Doc(GOOD + "\nint main() { return 0; }"))[0] == "curly_bracket"
    assert c4_filter(cfg, Doc("One. Two three four.\nShort."))[0] == "too_few_sentences"
    reason, kept = c4_filter(cfg, Doc(GOOD + "\nEnable JavaScript to view this page.\nok"))
    assert reason is None and "JavaScript" not in kept and not kept.endswith("ok")


def test_count_sentences_like_the_sentencizer():
    assert count_sentences("One. Two! Three? Four") == 4
    assert count_sentences("Mr. Smith went home.") == 1
    assert count_sentences('He said "stop." Then left.') == 2


def test_fineweb_rules():
    cfg = FineWebQualityConfig()
    no_punct = "\n".join(
        ["a line without an end mark at all here"] * 1
        + [f"row {i} of items and more words" for i in range(9)]
    )
    assert fineweb_quality_filter(cfg, Doc(no_punct)) == "line_punct_ratio"
    short = "\n".join(["Short line."] * 1 + [f"Item {i}." for i in range(5)])
    assert fineweb_quality_filter(cfg, Doc(short)) == "short_line_ratio"
    listy = "\n".join(f"This is line {i} of a list of things that ends." for i in range(4))
    listy += "\n" + "\n".join(["Repeated line of the text that ends here."] * 2)
    assert fineweb_quality_filter(cfg, Doc(listy)) == "char_dup_ratio"
    assert fineweb_quality_filter(cfg, Doc(GOOD)) is None


def test_code_is_not_filtered_as_prose():
    code = "def f(x):\n    return {x: 1}\n\n\nclass A:\n    pass\n"
    filters = CurateConfig(skip_domains=["code", "math"]).filters
    assert apply_filters(filters, code, "code")[0] is None
    assert apply_filters(filters, code, "web")[0] is not None
    # No domain name is built in: without the recipe's setting, code is prose like any text.
    assert apply_filters(FiltersConfig(), code, "code")[0] is not None


def test_recipe_skip_domains_reach_every_prose_filter_and_the_quality_model():
    cfg = CurateConfig.model_validate(
        {"skip_domains": ["code"], "filters": {"c4": {"skip_domains": ["math"]}}}
    )
    sections = ["gopher_repetition", "gopher_quality", "fineweb"]
    assert all(getattr(cfg.filters, s).skip_domains == ["code"] for s in sections)
    assert cfg.filters.c4.skip_domains == ["math"]  # its own setting wins
    assert cfg.quality_model.skip_domains == ["code"]
    assert cfg.filter_config().filters == cfg.filters  # what the filter step hashes
    default = CurateConfig()
    assert default.skip_domains == [] and default.filters.gopher_quality.skip_domains == []
    quickstart = load_config(None, []).curate
    assert quickstart.filters.gopher_quality.skip_domains == ["code", "math"]
    assert quickstart.quality_model.skip_domains == ["code", "math"]


def test_disabled_filter_is_skipped():
    cfg = FiltersConfig.model_validate({"c4": {"enabled": False}})
    assert apply_filters(cfg, GOOD + "\nlorem ipsum dolor sit amet", "web")[0] is None


@pytest.mark.slow
def test_decisions_match_datatrove(shared_data):
    """Same keep/remove decision as datatrove's FineWeb chain on real documents."""
    filters = bench_module("datatrove.pipeline.filters")
    bench_module("spacy")
    from datatrove.data import Document

    chain = [
        filters.GopherRepetitionFilter(),
        filters.GopherQualityFilter(),
        filters.C4QualityFilter(filter_no_terminal_punct=False),
        filters.FineWebQualityFilter(),
    ]
    cfg = FiltersConfig.model_validate({"c4": {"rewrite_lines": True}})
    docs = real_documents()[::4]
    same = 0
    for text in docs:
        doc, kept = Document(text=text, id="x"), True
        for f in chain:
            if f.filter(doc) is not True:
                kept = False
                break
        same += kept == (apply_filters(cfg, text, "web")[0] is None)
    assert same / len(docs) >= 0.95
