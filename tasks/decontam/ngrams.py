"""Normalized word n-grams of evaluation items, hashed into one sorted array, and a batch scan.

The method is datatrove's (``NGramsDecontIndexer`` / ``NGramsDecontFilter``): text is lowercased,
numbers become ``0``, punctuation becomes spaces, whitespace collapses and diacritics go; an item
contributes the n-grams of its gold answer and, answer-aware, the n-grams that span the end of
the question into the answer (optionally the question's own n-grams too).

What differs is how it runs. Words split on whitespace (datatrove runs spaCy on the already
simplified text; they differ only where spaCy splits a word, such as "cannot"). Each word
becomes an id in the eval sets' vocabulary (a word the eval sets never use cannot be part of a
match, so a window holding one is skipped); a window's hash is a polynomial of random 64-bit word
codes, computed for a whole batch of documents at once with numpy and looked up by binary search
in the sorted index. A hash hit is then checked word by word, so a hash collision never flags a
document.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np
import regex

# The characters datatrove's simplify_text turns into spaces (its PUNCTUATION string).
PUNCTUATION = (
    "!/—”:％１〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»"
    + "".join(
        map(chr, (x for a, b in ((0, 9), (11, 13), (13, 32), (127, 160)) for x in range(a, b)))
    )
)
PUNCTUATION_CLASS = re.compile("[" + re.escape(PUNCTUATION) + "]")
ASCII_PUNCTUATION = bytes(32 if chr(b) in PUNCTUATION else b for b in range(256))
NUMBERS = regex.compile(r"\p{Nd}+([.,،٫⎖⎗⎘]{1}\p{Nd}+)?", regex.UNICODE)
ASCII_NUMBERS = re.compile(rb"[0-9]+([.,][0-9]+)?")
MARKS = regex.compile(r"\p{Mn}+")
MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd: the polynomial's base, mod 2**64
CODE_SEED = 20240613


def normalize(text: str) -> str:
    """datatrove's ``simplify_text`` with its default settings (without the final whitespace
    collapse: callers split on whitespace).

    NOTE: ASCII text (most of a corpus) takes a bytes path: ``bytes.translate`` with a 256-byte
    table is ~10x faster than ``str.translate`` with a dict, and NFD changes nothing in ASCII.
    """
    text = text.lower()
    if text.isascii():
        return ASCII_NUMBERS.sub(b"0", text.encode()).translate(ASCII_PUNCTUATION).decode()
    text = PUNCTUATION_CLASS.sub(" ", NUMBERS.sub("0", text))
    return MARKS.sub("", unicodedata.normalize("NFD", text))


def words(text: str) -> list[str]:
    """The normalized words of a text."""
    return normalize(text).split()


@dataclass(frozen=True)
class Item:
    """One evaluation item: its task, its index in the eval set, question and gold answers."""

    task: str
    index: int
    query: str | None
    golds: tuple[str, ...]


@dataclass
class Hit:
    """A training document's match: the document's row in its batch, the owners' entries in
    ``NGramIndex.owners`` and the matched n-gram's words."""

    row: int
    owner_slice: tuple[int, int]
    ngram: str


@dataclass
class NGramIndex:
    """Sorted unique n-gram hashes of every item, with their words and owning items."""

    n: int
    vocab: dict[str, int]
    hashes: np.ndarray  # uint64, sorted, unique
    grams: np.ndarray  # int32 (len(hashes), n): the words of each n-gram, to verify hits
    owner_starts: np.ndarray  # int64 (len(hashes) + 1): CSR offsets into owners
    owners: np.ndarray  # int32: indices into items
    items: list[tuple[str, int]]  # (task, item index) per owner id
    codes: np.ndarray = field(repr=False, default=None)  # uint64 code per word id (0: unknown)

    @property
    def words(self) -> list[str]:
        inverse = [""] * (len(self.vocab) + 1)
        for word, index in self.vocab.items():
            inverse[index] = word
        return inverse


def word_codes(vocab_size: int) -> np.ndarray:
    """A fixed random 64-bit code per word id; id 0 (a word outside the eval sets) too."""
    rng = np.random.default_rng(CODE_SEED)
    return rng.integers(0, np.iinfo(np.uint64).max, size=vocab_size + 1, dtype=np.uint64)


def window_hashes(ids: np.ndarray, codes: np.ndarray, n: int) -> np.ndarray:
    """Hash of every window of ``n`` ids (``len(ids) - n + 1`` values), one numpy pass per word."""
    count = len(ids) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    values = codes[ids]
    out = values[:count].copy()
    for j in range(1, n):
        out *= MULTIPLIER
        out += values[j : j + count]
    return out


def _ranges(begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Concatenated ``range(b, e)`` for each pair (empty where ``e <= b``), in one numpy pass."""
    lengths = np.maximum(end - begin, 0)
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    shift = np.repeat(begin - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return np.arange(total, dtype=np.int64) + shift


def item_starts(
    offset: np.ndarray,
    query_len: np.ndarray,
    total: np.ndarray,
    n: int,
    query: bool | np.ndarray,
    overlap: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Window starts in each ``question + answer`` segment, as datatrove's indexer takes them,
    and the segment each belongs to.

    The answer's own windows always; windows of the question alone if ``query`` (a bool, or one
    per segment); windows that hold at least one word of each if ``overlap`` (and there is a
    question).
    """
    spans = [(query_len, total - n + 1)]
    query = np.broadcast_to(np.asarray(query, dtype=bool), query_len.shape)
    if query.any():
        spans.append((np.zeros_like(query_len), np.where(query, query_len - n + 1, 0)))
    if overlap:
        spans.append((np.maximum(0, query_len - n + 1), np.minimum(query_len, total - n + 1)))
    segment = np.arange(len(offset))
    starts, owners = [], []
    for begin, end in spans:
        starts.append(_ranges(offset + begin, offset + end))
        owners.append(np.repeat(segment, np.maximum(end - begin, 0)))
    return np.concatenate(starts), np.concatenate(owners)


QueryNgrams = bool | str
"""``True``: every question's own n-grams too; ``False``: never (datatrove's default);
``"auto"``: the question's n-grams of an item whose gold answer is shorter than n words (a short
answer has no n-gram of its own, and a templated question shares none with the web)."""


def _segments(items: list[Item]) -> tuple[list[list[str]], list[int], list[int]]:
    """Each ``question + gold`` as normalized words, its item, and its question's length."""
    segments, owner_of, query_lens = [], [], []
    for key, item in enumerate(items):
        q_words = words(item.query) if item.query else []
        for gold in item.golds:
            segments.append(q_words + words(gold))
            owner_of.append(key)
            query_lens.append(len(q_words))
    return segments, owner_of, query_lens


def build_index(items: list[Item], n: int, query: QueryNgrams = False, overlap: bool = True):
    """The index of every item's n-grams (see ``item_starts``; ``query`` as ``QueryNgrams``)."""
    segments, owner_of, query_lens = _segments(items)
    if query == "auto":
        query = np.array([len(s) - q < n for s, q in zip(segments, query_lens, strict=True)])
    flat = [w for seg in segments for w in seg]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(flat), start=1)}
    all_ids = np.fromiter(map(vocab.__getitem__, flat), dtype=np.int32, count=len(flat))
    total = np.fromiter(map(len, segments), dtype=np.int64, count=len(segments))
    offset = np.concatenate(([0], np.cumsum(total)[:-1])).astype(np.int64)
    q_len = np.asarray(query_lens, dtype=np.int64)
    starts, segment = item_starts(offset, q_len, total, n, query, overlap)
    owners = np.asarray(owner_of, dtype=np.int32)[segment]
    keys = [(item.task, item.index) for item in items]
    return _sorted_index(n, vocab, all_ids, starts, owners.astype(np.int32), keys)


def whole_item_indexes(items: list[Item], n: int, min_words: int) -> list[NGramIndex]:
    """For items too short for one n-gram (``min_words`` <= words < ``n``): one index per length
    whose only window is the whole normalized ``question + answer``, matched exactly."""
    segments, owner_of, _ = _segments(items)
    keys = [(item.task, item.index) for item in items]
    by_length: dict[int, list[int]] = {}
    for i, seg in enumerate(segments):
        if min_words <= len(seg) < n:
            by_length.setdefault(len(seg), []).append(i)
    indexes = []
    for length, chosen in sorted(by_length.items()):
        flat = [w for i in chosen for w in segments[i]]
        vocab = {w: k for k, w in enumerate(dict.fromkeys(flat), start=1)}
        all_ids = np.fromiter(map(vocab.__getitem__, flat), dtype=np.int32, count=len(flat))
        starts = np.arange(len(chosen), dtype=np.int64) * length
        owners = np.asarray([owner_of[i] for i in chosen], dtype=np.int32)
        indexes.append(_sorted_index(length, vocab, all_ids, starts, owners, keys))
    return indexes


def unindexed_items(items: list[Item], n: int, min_words: int) -> dict[tuple[str, int], str]:
    """Items no index can find, with the reason: no segment of ``min_words`` words or more."""
    segments, owner_of, _ = _segments(items)
    longest: dict[int, int] = {}
    for seg, owner in zip(segments, owner_of, strict=True):
        longest[owner] = max(longest.get(owner, 0), len(seg))
    out = {}
    for key, item in enumerate(items):
        size = longest.get(key, 0)
        if size < min_words:
            out[(item.task, item.index)] = (
                f"{size} words < min_item_words={min_words}" if size else "no text"
            )
    return out


def _sorted_index(n, vocab, all_ids, starts, owners, keys) -> NGramIndex:
    codes = word_codes(len(vocab))
    hashes = window_hashes(all_ids, codes, n)[starts] if len(starts) else np.zeros(0, np.uint64)
    order = np.lexsort((owners, hashes))
    hashes, starts, owners = hashes[order], starts[order], owners[order]
    first = np.ones(len(hashes), dtype=bool)
    first[1:] = hashes[1:] != hashes[:-1]
    # one owner per (n-gram, item): an item repeating an n-gram owns it once
    keep = first.copy()
    keep[1:] |= owners[1:] != owners[:-1]
    unique_at = np.flatnonzero(first)
    grams = all_ids[starts[unique_at, None] + np.arange(n)] if len(unique_at) else None
    group = np.cumsum(first) - 1
    owner_starts = np.searchsorted(group[keep], np.arange(len(unique_at) + 1))
    return NGramIndex(
        n=n,
        vocab=vocab,
        hashes=hashes[unique_at],
        grams=grams if grams is not None else np.zeros((0, n), dtype=np.int32),
        owner_starts=owner_starts.astype(np.int64),
        owners=owners[keep],
        items=keys,
        codes=codes,
    )


def scan_texts(index: NGramIndex, texts: list[str]) -> list[Hit]:
    """Every verified match in a batch of documents, at most one per (document, n-gram)."""
    flat: list[str] = []
    ends = []
    for text in texts:
        flat += words(text)
        flat.append("")  # not a word: id 0, so no window spans two documents
        ends.append(len(flat))
    ids = np.fromiter(map(index.vocab.get, flat, repeat(0)), dtype=np.int32, count=len(flat))
    positions = _candidate_positions(ids, index.n)
    if not len(positions) or not len(index.hashes):
        return []
    hashes = window_hashes(ids, index.codes, index.n)[positions]
    loc = np.minimum(np.searchsorted(index.hashes, hashes), len(index.hashes) - 1)
    found = index.hashes[loc] == hashes
    positions, loc = positions[found], loc[found]
    windows = ids[positions[:, None] + np.arange(index.n)]
    exact = (windows == index.grams[loc]).all(axis=1)
    positions, loc, windows = positions[exact], loc[exact], windows[exact]
    rows = np.searchsorted(np.asarray(ends), positions, side="right")
    return _hits(index, rows, loc, windows)


def _candidate_positions(ids: np.ndarray, n: int) -> np.ndarray:
    """Starts of the windows made only of eval words (others cannot match)."""
    if len(ids) < n:
        return np.zeros(0, dtype=np.int64)
    unknown = np.concatenate(([0], np.cumsum(ids == 0)))
    return np.flatnonzero(unknown[n:] == unknown[: len(ids) - n + 1])


def _hits(index: NGramIndex, rows, loc, windows) -> list[Hit]:
    vocabulary = index.words if len(rows) else []
    out, seen = [], set()
    for row, where, window in zip(rows.tolist(), loc.tolist(), windows, strict=True):
        if (row, where) in seen:
            continue
        seen.add((row, where))
        span = (int(index.owner_starts[where]), int(index.owner_starts[where + 1]))
        out.append(Hit(row, span, " ".join(vocabulary[i] for i in window.tolist())))
    return out
