"""Heuristic quality filters: Gopher repetition, Gopher quality, C4 and FineWeb quality.

Each `*_filter(cfg, doc)` returns None to keep the document or a reason string to remove it,
with datatrove 0.10's reason names and decision rules (same thresholds, same ratios). The speed
comes from a cached regex word splitter instead of spaCy and from hashing n-grams with numpy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import regex

from llmflow.tasks.curation.config import (
    C4Config,
    FineWebQualityConfig,
    GopherQualityConfig,
    GopherRepetitionConfig,
)
from llmflow.tasks.curation.text import PUNCTUATION_SET
from llmflow.tasks.curation.words import split_words

_PARAGRAPHS = re.compile(r"\n{2,}")
_LINES = re.compile(r"\n+")
_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_TERMINAL = regex.compile(r"[\p{Sentence_Terminal}\u17d6\u17d9\u17da]$")
_SENTENCIZER_PUNCT = regex.compile(r"^[\p{Sentence_Terminal}]+$")
_POLICY = (
    "terms of use",
    "privacy policy",
    "cookie policy",
    "uses cookies",
    "use of cookies",
    "use cookies",
)
_C4_END = (".", "?", "!", '"', "'")
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_WORD_KIND: dict[str, tuple[bool, bool]] = {}


def _word_kind(word: str) -> tuple[bool, bool]:
    """(has a non-punctuation char, has a letter), cached per word."""
    kind = _WORD_KIND.get(word)
    if kind is None:
        kind = (any(c not in PUNCTUATION_SET for c in word), any(c.isalpha() for c in word))
        if len(_WORD_KIND) > 1_000_000:
            _WORD_KIND.clear()
        _WORD_KIND[word] = kind
    return kind


@dataclass
class Doc:
    """A document under filtering; words are split once and shared by all filters."""

    text: str
    _words: list[str] | None = field(default=None, repr=False)

    @property
    def words(self) -> list[str]:
        if self._words is None:
            self._words = split_words(self.text)
        return self._words

    @cached_property
    def word_hashes(self) -> np.ndarray:
        # NOTE: str hashes are salted per process but stable within it, which is all we need.
        return np.fromiter((hash(w) for w in self.words), np.int64, len(self.words)).view(np.uint64)

    @cached_property
    def word_lengths(self) -> np.ndarray:
        return np.fromiter((len(w) for w in self.words), np.int64, len(self.words))


def _find_duplicates(items: list[str]) -> tuple[int, int]:
    """(number of repeated items, characters in repeated items), first occurrences excluded."""
    seen: set[str] = set()
    num, chars = 0, 0
    for item in items:
        if item in seen:
            num += 1
            chars += len(item)
        else:
            seen.add(item)
    return num, chars


def _ngram_hashes(doc: Doc, n: int) -> np.ndarray:
    """64-bit hashes of all word n-grams (polynomial combination of the word hashes)."""
    h = doc.word_hashes
    out = h[: len(h) - n + 1].copy()
    with np.errstate(over="ignore"):
        for k in range(1, n):
            out = out * np.uint64(0x9E3779B97F4A7C15) + h[k : len(h) - n + 1 + k]
    return out


def _ngram_char_lengths(doc: Doc, n: int) -> np.ndarray:
    """Characters of each n-gram's words (without separators)."""
    cum = np.concatenate([[0], np.cumsum(doc.word_lengths)])
    return cum[n:] - cum[:-n]


def _top_ngram_chars(doc: Doc, n: int) -> int:
    """Length of the most frequent n-gram (space-joined) times its count; ties go to the first."""
    hashes = _ngram_hashes(doc, n)
    _, first, inverse, counts = np.unique(
        hashes, return_index=True, return_inverse=True, return_counts=True
    )
    best = counts.max()
    start = int(first[counts == best].min())
    return int((_ngram_char_lengths(doc, n)[start] + n - 1) * best)


def _all_duplicate_chars(doc: Doc, n: int, limit: float) -> int:
    """datatrove's greedy count of characters in repeated n-grams (skipping n after a hit).

    Returns early with an upper bound when even every repeat together stays under `limit`.
    """
    hashes = _ngram_hashes(doc, n)
    lengths = _ngram_char_lengths(doc, n)
    _, first = np.unique(hashes, return_index=True)
    repeat = np.ones(len(hashes), bool)
    repeat[first] = False
    upper = int(lengths[repeat].sum())
    if upper <= limit:
        return upper
    seen: set[int] = set()
    total, idx, hash_list = 0, 0, hashes.tolist()
    while idx < len(hash_list):
        gram = hash_list[idx]
        if gram in seen:
            total += int(lengths[idx])
            idx += n
        else:
            seen.add(gram)
            idx += 1
    return total


def _duplicated(
    units: list[str], text: str, unit: str, frac: float, char_frac: float
) -> str | None:
    """``dup_{unit}_frac`` or ``dup_{unit}_char_frac`` when the duplicated units (paragraphs or
    lines) of ``text`` pass that limit (a limit of 0 is off); None otherwise."""
    num, chars = _find_duplicates(units)
    if frac and num / len(units) > frac:
        return f"dup_{unit}_frac"
    if char_frac and chars / len(text) > char_frac:
        return f"dup_{unit}_char_frac"
    return None


def gopher_repetition_filter(cfg: GopherRepetitionConfig, doc: Doc) -> str | None:
    """Gopher repetition rules: duplicated paragraphs/lines and repeated n-grams."""
    text = doc.text
    if not text:
        return "empty"
    paragraphs = _PARAGRAPHS.split(text.strip())
    reason = _duplicated(paragraphs, text, "para", cfg.dup_para_frac, cfg.dup_para_char_frac)
    if reason:
        return reason
    lines = _LINES.split(text)
    reason = _duplicated(lines, text, "line", cfg.dup_line_frac, cfg.dup_line_char_frac)
    if reason:
        return reason
    num_words = len(doc.words)
    for n, frac in cfg.top_n_grams:
        if num_words >= n and _top_ngram_chars(doc, n) / len(text) > frac:
            return f"top_{n}_gram"
    for n, frac in cfg.dup_n_grams:
        if num_words >= n and _all_duplicate_chars(doc, n, frac * len(text)) / len(text) > frac:
            return f"duplicated_{n}_n_grams"
    return None


def gopher_quality_filter(cfg: GopherQualityConfig, doc: Doc) -> str | None:
    """Gopher quality rules: length, word length, symbols, bullets, alpha words, stop words."""
    text, words = doc.text, doc.words
    kinds = [_word_kind(w) for w in words]
    lengths = [len(w) for w, (non_symbol, _) in zip(words, kinds, strict=True) if non_symbol]
    num_words = len(words)
    if cfg.min_doc_words and len(lengths) < cfg.min_doc_words:
        return "gopher_short_doc"
    if cfg.max_doc_words and len(lengths) > cfg.max_doc_words:
        return "gopher_long_doc"
    if not num_words:
        return "gopher_short_doc"
    avg = sum(lengths) / len(lengths) if lengths else float("nan")
    if cfg.min_avg_word_length and avg < cfg.min_avg_word_length:
        return "gopher_below_avg_threshold"
    if cfg.max_avg_word_length and avg > cfg.max_avg_word_length:
        return "gopher_above_avg_threshold"
    if cfg.max_symbol_word_ratio:
        if text.count("#") / num_words > cfg.max_symbol_word_ratio:
            return "gopher_too_many_hashes"
        if (text.count("...") + text.count("…")) / num_words > cfg.max_symbol_word_ratio:
            return "gopher_too_many_ellipsis"
    lines = text.splitlines() or [""]
    if cfg.max_bullet_lines_ratio:
        bullets = sum(line.lstrip().startswith(("•", "-")) for line in lines)
        if bullets / len(lines) > cfg.max_bullet_lines_ratio:
            return "gopher_too_many_bullets"
    if cfg.max_ellipsis_lines_ratio:
        ellipses = sum(line.rstrip().endswith(("...", "…")) for line in lines)
        if ellipses / len(lines) > cfg.max_ellipsis_lines_ratio:
            return "gopher_too_many_end_ellipsis"
    if cfg.max_non_alpha_words_ratio:
        alpha = sum(has_alpha for _, has_alpha in kinds)
        denominator = len(lengths) if cfg.alpha_ratio_skips_punctuation else num_words
        if alpha / max(1, denominator) < cfg.max_non_alpha_words_ratio:
            return "gopher_below_alpha_threshold"
    if cfg.min_stop_words and len(set(cfg.stop_words).intersection(words)) < cfg.min_stop_words:
        return "gopher_enough_stop_words"
    return None


def count_sentences(line: str) -> int:
    """Sentences in a line as spaCy's sentencizer finds them: a new one starts at the first
    non-punctuation token after a sentence-final mark."""
    num, seen_end = 0, False
    for i, token in enumerate(split_words(line)):
        is_end = len(token) == 1 and bool(_SENTENCIZER_PUNCT.match(token))
        if i == 0:
            num = 1
        elif seen_end and not is_end and any(c not in PUNCTUATION_SET for c in token):
            num += 1
            seen_end = False
        if is_end:
            seen_end = True
    return num


def c4_filter(cfg: C4Config, doc: Doc) -> tuple[str | None, str]:
    """C4 rules. Returns (reason or None, text made of the kept lines)."""
    num_sentences, kept = 0, []
    for line in doc.text.splitlines():
        line = line.strip()
        words = line.split()
        if cfg.max_word_length != -1 and any(len(w) > cfg.max_word_length for w in words):
            continue
        if cfg.remove_citations:
            line = _CITATION.sub("", line)
        if cfg.filter_no_terminal_punct and (not line.endswith(_C4_END) or line.endswith("...")):
            continue
        if len(words) < cfg.min_words_per_line:
            continue
        lower = line.lower()
        if cfg.filter_lorem_ipsum and "lorem ipsum" in lower:
            return "lorem_ipsum", doc.text
        if cfg.filter_javascript and "javascript" in lower:
            continue
        if cfg.filter_curly_bracket and "{" in line:
            return "curly_bracket", doc.text
        if cfg.filter_policy and any(p in lower for p in _POLICY):
            continue
        if cfg.min_num_sentences != -1:
            num_sentences += count_sentences(line)
        kept.append(line)
    if num_sentences < cfg.min_num_sentences:
        return "too_few_sentences", doc.text
    return None, "\n".join(kept).strip()


def fineweb_quality_filter(cfg: FineWebQualityConfig, doc: Doc) -> str | None:
    """FineWeb rules: terminal punctuation, short lines, duplicated lines, list-like text."""
    lines = [line for line in doc.text.split("\n") if line.strip() != ""]
    if not lines:
        return "empty"
    ratio = sum(1 for line in lines if _TERMINAL.search(line)) / len(lines)
    if ratio < cfg.line_punct_thr and not (ratio == 0 and cfg.line_punct_exclude_zero):
        return "line_punct_ratio"
    ratio = sum(1 for line in lines if len(line) <= cfg.short_line_length) / len(lines)
    if ratio > cfg.short_line_thr:
        return "short_line_ratio"
    if _find_duplicates(lines)[1] / len(doc.text.replace("\n", "")) > cfg.char_duplicates_ratio:
        return "char_dup_ratio"
    words = doc.words
    if not words or doc.text.count("\n") / len(words) > cfg.new_line_ratio:
        return "list_ratio"
    return None
