"""A faster encoder for the byte-level BPE that `train_tokenizer` writes, with the same ids.

`tokenizers` spends most of its time per token building `Encoding` objects (token strings,
offsets, masks) that tokenize_corpus throws away. This encoder splits text with the same
pre-tokenizer pattern (GPT-2's, through the `regex` module, which releases the GIL), and maps
each distinct pre-token to its ids once: a miss goes through the tokenizer's own BPE model
(`Model.tokenize`), so merges are never re-implemented. Two threads split a batch.

It applies only to the layout `train_tokenizer` writes (no normalizer, ``ByteLevel`` pre-tokenizer
with the regex and no prefix space, a plain BPE without dropout, a post-processor adding
nothing, special tokens encoded as text); `for_tokenizer` returns None for anything else and the
caller uses `tokenizers` itself. Its ids equal `Tokenizer.encode_batch_fast`'s on every Unicode
code point in context (checked in tests/tasks/dataprep/test_bytelevel.py).

Speed on prose: most time goes to the split, which creates a Python string per pre-token while
holding the GIL, so two threads barely overlap. An ASCII document is split by the standard
library's `re` with the same pattern in ASCII classes (about 1.6x faster than `regex` on English
prose, identical splits), and a batch of at least ``PROCESS_MIN_CHARS`` characters is split in
two by characters: a forked worker process encodes one part while this process encodes the other.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import re
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import regex
from tokenizers import Tokenizer

# NOTE: the pattern of tokenizers' ByteLevel pre-tokenizer (use_regex=True), i.e. GPT-2's.
PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
# NOTE: the same pattern for ASCII text, in ASCII classes: the stdlib `re` runs it faster. `\s`
# is spelled out (tokenizers' \s is Unicode White_Space, which leaves out U+001C..U+001F; the
# stdlib's \s would take them).
_WS = r" \t\n\r\x0b\x0c"
ASCII_PATTERN = re.compile(
    rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])"""
    rf"""|[{_WS}]+"""
)
THREADS = 2
# A batch of at least this many characters is shared with a worker process (see module doc).
PROCESS_MIN_CHARS = 1 << 20
PROCESS_TIMEOUT_S = 3600
# NOTE: distinct pre-tokens kept (~100 MB); later misses are encoded without being cached, so
# memory stays bounded on corpora with an open vocabulary (ids never depend on the cache).
CACHE_LIMIT = 500_000


def _byte_table() -> list[str]:
    """GPT-2's reversible byte -> printable character map (as ByteLevel applies it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return [table[b] for b in range(256)]


BYTE_TABLE = _byte_table()


def _supported(spec: dict, tokenizer: Tokenizer) -> bool:
    pre, model, post = spec.get("pre_tokenizer") or {}, spec["model"], spec.get("post_processor")
    template_adds = post is not None and (
        post.get("type") != "TemplateProcessing" or post.get("special_tokens")
    )
    return (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space")
        and model.get("type") == "BPE"
        and model.get("dropout") is None
        and not template_adds
        and all(t.get("special") for t in spec.get("added_tokens", []))
        and tokenizer.encode_special_tokens
    )


def split(text: str) -> list[str]:
    """The pre-tokens of ``text``, as the ByteLevel pre-tokenizer splits it."""
    if text.isascii():
        return ASCII_PATTERN.findall(text)
    return PATTERN.findall(text, concurrent=True)


_WORKER: ByteLevelEncoder | None = None


def _start_worker(tokenizer_json: str) -> None:
    global _WORKER
    _WORKER = ByteLevelEncoder(Tokenizer.from_str(tokenizer_json), processes=False)


def _encode_flat(texts: list[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """In the worker: every document's ids end to end, and each document's length."""
    arrays = _WORKER.encode_batch(texts, np.dtype(dtype))
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype)
    return flat, lengths


class ByteLevelEncoder:
    """Encodes documents to id arrays, caching the ids of every distinct pre-token."""

    def __init__(self, tokenizer: Tokenizer, processes: bool = True):
        self.model = tokenizer.model
        self.cache: dict[str, tuple[int, ...]] = {}
        self._tokenizer_json = tokenizer.to_str() if processes else None
        self._pool = None

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> ByteLevelEncoder | None:
        """The encoder when ``tokenizer`` has the supported layout, else None."""
        return cls(tokenizer) if _supported(json.loads(tokenizer.to_str()), tokenizer) else None

    def _miss(self, word: str) -> tuple[int, ...]:
        mapped = "".join(BYTE_TABLE[b] for b in word.encode("utf-8"))
        ids = tuple(token.id for token in self.model.tokenize(mapped))
        if len(self.cache) < CACHE_LIMIT:
            self.cache[word] = ids
        return ids

    def encode(self, text: str, dtype: np.dtype) -> np.ndarray:
        """The ids of one document."""
        get, miss = self.cache.get, self._miss
        parts = [get(w) or miss(w) for w in split(text)]
        return np.fromiter(itertools.chain.from_iterable(parts), dtype)

    def encode_batch(self, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
        """The ids of each document: a large batch shared with a worker process, else
        ``THREADS`` threads each taking a contiguous slice."""
        if self._tokenizer_json is not None and len(texts) > 1:
            sizes = np.cumsum([len(t) for t in texts])
            if sizes[-1] >= PROCESS_MIN_CHARS:
                half = int(np.searchsorted(sizes, sizes[-1] / 2)) + 1
                return self._shared(texts, min(half, len(texts) - 1), dtype)
        return self._threaded(texts, dtype)

    def _shared(self, texts: list[str], half: int, dtype: np.dtype) -> list[np.ndarray]:
        """The second part in the worker process while this one encodes the first."""
        pending = self._worker_pool().apply_async(_encode_flat, (texts[half:], dtype.str))
        first = self._threaded(texts[:half], dtype)
        flat, lengths = pending.get(PROCESS_TIMEOUT_S)
        return first + np.split(flat, np.cumsum(lengths)[:-1])

    def _worker_pool(self):
        if self._pool is None:
            # NOTE: forked (a spawned child would re-import the caller's __main__); tokenizers
            # warns in a forked child after its Rust threads ran unless parallelism is set, and
            # the child uses none, so the variable is set around the fork only.
            context = multiprocessing.get_context("fork")
            unset = "TOKENIZERS_PARALLELISM" not in os.environ
            if unset:
                os.environ["TOKENIZERS_PARALLELISM"] = "false"
            try:
                self._pool = context.Pool(1, _start_worker, (self._tokenizer_json,))
            finally:
                if unset:
                    os.environ.pop("TOKENIZERS_PARALLELISM", None)
            weakref.finalize(self, self._pool.terminate)
        return self._pool

    def _threaded(self, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
        if len(texts) < 2 * THREADS:
            return [self.encode(t, dtype) for t in texts]
        step = -(-len(texts) // THREADS)
        slices = [texts[i : i + step] for i in range(0, len(texts), step)]
        with ThreadPoolExecutor(THREADS) as pool:
            done = pool.map(lambda part: [self.encode(t, dtype) for t in part], slices)
        return [array for part in done for array in part]
