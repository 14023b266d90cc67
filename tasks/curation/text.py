"""Text utilities shared by the curation stages: normalization, the hashing normal form, and a
fast regex word and sentence splitter that approximates spaCy's English tokenizer.

NOTE: datatrove splits words with spaCy (`spacy.blank("en")`), so punctuation marks and numbers
are words of their own ("don't" -> "do", "n't"; "well-known" -> "well", "-", "known"). Gopher's
word-count and alpha-word rules depend on this, so a plain `str.split` would disagree with the
FineWeb pipeline on many documents. The regex below reproduces spaCy's splits for ordinary
English at a fraction of the cost; rare cases (emoticons, some URLs) still differ.
"""

from __future__ import annotations

import re
import unicodedata

import regex

# Characters datatrove treats as punctuation (`datatrove.utils.text.PUNCTUATION`, plus the C0/C1
# controls it appends). Terminal punctuation of other scripts is added below.
_ASCII_PUNCT = (
    "!/—”:％１〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»"
)
_CONTROLS = "".join(
    chr(x) for a, b in ((0, 9), (11, 13), (13, 32), (127, 160)) for x in range(a, b)
)
TERMINAL_PUNCTUATION = frozenset(".!?。！？．｡։؟۔।॥၊။።፧፨᙮᠃᠉‼‽⁇⁈⁉⸮⸼꓿꘎꘏꛳꛷꡶꡷꣎꣏꤯꧈꧉꩝꩞꩟꫰꫱꯫﹒﹖﹗")
PUNCTUATION_SET = frozenset(_ASCII_PUNCT + _CONTROLS) | TERMINAL_PUNCTUATION
_PUNCT_TRANS = str.maketrans({c: " " for c in _ASCII_PUNCT + _CONTROLS})

_NUMBERS = regex.compile(r"\p{Nd}+(?:[.,،٫⎖⎗⎘]\p{Nd}+)?")
_WHITESPACE = re.compile(r"\s+")
_COMBINING = regex.compile(r"\p{Mn}+")
_INNER_SPACES = re.compile(r"(?<=\S)[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]{2,}")
_EXOTIC_SPACES = re.compile(r"[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_ZERO_WIDTH = re.compile(r"[\u200b\u200c\u200d\u2060\ufeff]")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_TRAILING = re.compile(r"[ \t]+$", re.MULTILINE)
_MANY_NEWLINES = re.compile(r"\n{3,}")

_SENTENCE_END = regex.compile(r"[.!?。！？…]+[\"'”’)\]]*(?=\s+\S|$)")


def normalize_unicode(text: str, form: str = "NFC") -> str:
    """Returns `text` in the given Unicode normal form ("none" leaves it unchanged)."""
    return text if form == "none" else unicodedata.normalize(form, text)


def clean_whitespace(text: str, collapse_inner_spaces: bool = True) -> str:
    """Normalizes line ends, control and zero-width characters and spacing.

    Keeps leading indentation and single blank lines (paragraph breaks); tabs inside a line and
    exotic Unicode spaces become plain spaces.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _ZERO_WIDTH.sub("", text)
    text = _CONTROL.sub("", text.replace("\t", "    ") if collapse_inner_spaces else text)
    text = _EXOTIC_SPACES.sub(" ", text)
    if collapse_inner_spaces:
        text = _INNER_SPACES.sub(" ", text)
    text = _TRAILING.sub("", text)
    return _MANY_NEWLINES.sub("\n\n", text).strip("\n")


def simplify_text(text: str) -> str:
    """The text-normal form used for hashing, as datatrove's `simplify_text` defaults.

    Lowercase, digit runs -> "0", punctuation -> space, whitespace collapsed, diacritics removed.
    """
    text = _NUMBERS.sub("0", text.lower())
    text = " ".join(text.translate(_PUNCT_TRANS).split())
    if not text.isascii():
        text = _COMBINING.sub("", unicodedata.normalize("NFD", text))
    return text.strip()


def count_sentences(line: str) -> int:
    """Counts sentences in one line the way spaCy's sentencizer would, approximately."""
    if not line.strip():
        return 0
    ends = _SENTENCE_END.findall(line.rstrip())
    tail = _SENTENCE_END.sub("", line.rstrip()).strip()
    # A trailing fragment without end punctuation is one more sentence.
    return (
        len(ends) + (0 if not ends or not tail or line.rstrip()[-1] in ".!?。！？…\"'”’)]" else 1)
        or 1
    )


def count_tokens(text: str) -> int:
    """Whitespace word count: the token unit of the curation report (no tokenizer exists yet)."""
    return len(text.split())
