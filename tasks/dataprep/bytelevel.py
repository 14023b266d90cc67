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
"""

from __future__ import annotations

import itertools
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import regex
from tokenizers import Tokenizer

# NOTE: the pattern of tokenizers' ByteLevel pre-tokenizer (use_regex=True), i.e. GPT-2's.
PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
THREADS = 2
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


class ByteLevelEncoder:
    """Encodes documents to id arrays, caching the ids of every distinct pre-token."""

    def __init__(self, tokenizer: Tokenizer):
        self.model = tokenizer.model
        self.cache: dict[str, tuple[int, ...]] = {}

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
        parts = [get(w) or miss(w) for w in PATTERN.findall(text, concurrent=True)]
        return np.fromiter(itertools.chain.from_iterable(parts), dtype)

    def encode_batch(self, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
        """The ids of each document, ``THREADS`` threads each taking a contiguous slice."""
        if len(texts) < 2 * THREADS:
            return [self.encode(t, dtype) for t in texts]
        step = -(-len(texts) // THREADS)
        slices = [texts[i : i + step] for i in range(0, len(texts), step)]
        with ThreadPoolExecutor(THREADS) as pool:
            done = pool.map(lambda part: [self.encode(t, dtype) for t in part], slices)
        return [array for part in done for array in part]
