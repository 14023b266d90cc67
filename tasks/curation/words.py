"""A fast word splitter that reproduces spaCy's English tokenizer on ordinary text.

NOTE: datatrove splits words with `spacy.blank("en")`, so punctuation marks and numbers are
words of their own ("don't" -> "do", "n't"; "well-known" -> "well", "-", "known"; WikiText's
"@-@" stays one token). Gopher's word-count and alpha-word rules depend on this; `str.split`
would disagree with the FineWeb pipeline on many documents. Like spaCy, we split on whitespace,
then peel prefixes, suffixes, special cases and infixes from each chunk, and cache the result per
chunk, which makes repeated words almost free. Rare cases (emoticons, exotic symbols) differ.
"""

from __future__ import annotations

import regex

_QUOTES = "'\"”“`‘´’‚,„»«「」『』（）〔〕【】《》〈〉⟦⟧"
_PUNCT = "…,:;!?¿؟¡()[]{}<>_#*&。？！，、；：～·।،۔؛٪"
_CURRENCY = "$£€¥฿₽₹₩₪₫₱₴₦"
_PREFIX = regex.compile(
    r"^(?:US\$|C\$|A\$|\.\.+|……|\+(?![0-9])|[§%=—–"
    + regex.escape(_PUNCT + _QUOTES + _CURRENCY)
    + r"]|\p{So})"
)
_UNITS = (
    "km|km²|km³|m|m²|m³|dm|cm|mm|ha|µm|nm|yd|in|ft|kg|g|mg|µg|t|lb|oz|m/s|km/h|kmh|mph|"
    "hPa|Pa|mbar|mb|MB|kb|KB|gb|GB|tb|TB|T|G|M|K|%"
)
_SUFFIX = regex.compile(
    r"(?:\.\.+|……|'s|'S|’s|’S|[—–"
    + regex.escape(_PUNCT + _QUOTES)
    + r"]|\p{So}|(?<=[0-9])\+|(?<=°[FfCcKk])\.|(?<=[0-9])(?:"
    + "|".join(regex.escape(c) for c in _CURRENCY)
    + r")|(?<=[0-9])(?:"
    + _UNITS
    + r")|(?<=[0-9\p{Ll}%²\-\+…"
    + regex.escape(_QUOTES)
    + r"])\.|(?<=\p{Lu}\p{Lu})\.)$"
)
_INFIX = regex.compile(
    r"\.\.+|…|\p{So}|(?<=[0-9])[+\-*^](?=[0-9-])|(?<=[\p{Ll}"
    + regex.escape(_QUOTES)
    + r"])\.(?=[\p{Lu}"
    + regex.escape(_QUOTES)
    + r"])|(?<=\p{L}),(?=\p{L})|(?<=[\p{L}0-9])(?:-|–|—|--|---|——|~)(?=\p{L})"
    + r"|(?<=[\p{L}0-9])[:<>=/](?=\p{L})"
)
_URL = regex.compile(
    r"^(?:(?:https?|ftp)://|www\.)[^\s/$.?#].[^\s]*$|^[\w.+-]+@[\w-]+(?:\.[\w-]+)+$", regex.I
)
_NT_VERBS = (
    "ca do does did is are was were have has had could should would must need might wo sha ai "
    "dare ought may"
).split()


def _special_cases() -> dict[str, list[str]]:
    cases: dict[str, list[str]] = {}
    for verb in _NT_VERBS:
        for v in (verb, verb.capitalize()):
            for apostrophe in ("'", "’"):
                cases[f"{v}n{apostrophe}t"] = [v, f"n{apostrophe}t"]
            cases[f"{v}nt"] = [v, "nt"]
    for word, parts in {
        "cannot": ["can", "not"],
        "Cannot": ["Can", "not"],
        "gonna": ["gon", "na"],
        "gotta": ["got", "ta"],
        "wanna": ["wan", "na"],
    }.items():
        cases[word] = parts
    for pronoun in ("i", "you", "he", "she", "it", "we", "they", "that", "there", "what", "who"):
        for p in (pronoun, pronoun.capitalize()):
            for clitic in ("'ll", "'d", "'re", "'ve", "'m"):
                cases[p + clitic] = [p, clitic]
    return cases


_SPECIAL = _special_cases()
_KEEP = set(
    "Mr. Mrs. Ms. Dr. St. Jr. Sr. vs. etc. Inc. Ltd. Co. Corp. Jan. Feb. Mar. Apr. Jun. Jul. "
    "Aug. Sep. Sept. Oct. Nov. Dec. e.g. i.e. a.m. p.m. Mt. Bros. Gen. Gov. Sen. Rep. Rev. Prof. "
    ":) :( :-) ;) :D <3 'em 'Em 'cause 'nuff 'bout 'til 's 'S ’s 'll 'd 're 've 'm".split()
) | {f"{c}." for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"}


def _split_infixes(core: str) -> list[str]:
    tokens, start = [], 0
    for match in _INFIX.finditer(core):
        if match.start() == 0 and match.end() == len(core):
            continue
        if match.start() > start:
            tokens.append(core[start : match.start()])
        if match.end() > match.start():
            tokens.append(match.group())
        start = match.end()
    if start < len(core):
        tokens.append(core[start:])
    return tokens


def _tokenize_chunk(chunk: str) -> list[str]:
    prefixes: list[str] = []
    suffixes: list[str] = []
    while chunk:
        if chunk in _SPECIAL:
            return prefixes + _SPECIAL[chunk] + suffixes[::-1]
        if chunk in _KEEP or _URL.match(chunk):
            break
        match = _PREFIX.match(chunk)
        if match and len(chunk) > 0:
            prefixes.append(match.group())
            chunk = chunk[match.end() :]
            continue
        match = _SUFFIX.search(chunk)
        if match and match.start() > 0:
            suffixes.append(match.group())
            chunk = chunk[: match.start()]
            continue
        if match:
            prefixes.append(chunk)
            chunk = ""
        break
    return prefixes + _core_tokens(chunk) + suffixes[::-1]


def _core_tokens(chunk: str) -> list[str]:
    """The tokens of what is left of a chunk once its prefixes and suffixes are split off."""
    if not chunk:
        return []
    if chunk in _KEEP or _URL.match(chunk):
        return [chunk]
    return _split_infixes(chunk)


class WordSplitter:
    """Callable splitting text into spaCy-like words, with a bounded per-chunk cache."""

    def __init__(self, max_cache: int = 500_000):
        self._cache: dict[str, list[str]] = {}
        self._max_cache = max_cache

    def __call__(self, text: str) -> list[str]:
        cache = self._cache
        out: list[str] = []
        for chunk in text.split():
            tokens = cache.get(chunk)
            if tokens is None:
                tokens = _tokenize_chunk(chunk)
                if len(cache) >= self._max_cache:
                    cache.clear()
                cache[chunk] = tokens
            out.extend(tokens)
        return out


split_words = WordSplitter()
"""Module-level splitter shared by the filters (its cache is per process)."""
