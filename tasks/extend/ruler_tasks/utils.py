"""RULER's prompts from lm-eval's own generators, offline, at any length, and their scorer.

lm-eval's RULER tasks size prompts with a Hub tokenizer, take the essay haystack from the Hub and
define metrics for 4,096-131,072 tokens only. Here the run's tokenizer sizes the prompts, the
run's held-out text is the essay haystack, and the lengths are the caller's. The needles, the
templates, the word lists, the chains and the scoring are lm-eval's (``prepare_niah``,
``vt_utils``, ``cwe_utils``, ``fwe_utils``, ``common_utils``); the loops that fit a prompt to a
length are ours for the NIAH tasks, vt and cwe: below 4k tokens lm-eval's leave the essay out
(NIAH) or retry one size forever when it does not fit (vt, cwe).
"""

from __future__ import annotations

import contextlib
import functools
import random
import tempfile
import zlib
from collections.abc import Callable, Iterator
from importlib import import_module
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from llmflow.tasks.framework.errors import BadInputError

_WORD_NUMBER = {"type_needle_k": "words", "type_needle_v": "numbers"}
NIAH = {
    "niah_single_1": {"type_haystack": "repeat", **_WORD_NUMBER},
    "niah_single_2": {"type_haystack": "essay", **_WORD_NUMBER},
    "niah_single_3": {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "uuids"},
    "niah_multikey_1": {"type_haystack": "essay", **_WORD_NUMBER, "num_needle_k": 4},
    "niah_multikey_2": {"type_haystack": "needle", **_WORD_NUMBER},
    "niah_multikey_3": {
        "type_haystack": "needle",
        "type_needle_k": "uuids",
        "type_needle_v": "uuids",
    },
    "niah_multivalue": {"type_haystack": "essay", **_WORD_NUMBER, "num_needle_v": 4},
    "niah_multiquery": {"type_haystack": "essay", **_WORD_NUMBER, "num_needle_q": 4},
}
"""lm-eval's ``niah_utils`` settings of each needle-in-a-haystack task."""
TOKENS_TO_GENERATE = {**dict.fromkeys(NIAH, 128), "vt": 30, "cwe": 120, "fwe": 50}
"""lm-eval's generation budget of each task (its YAMLs' ``max_gen_toks``)."""
VT_ICL_TOKENS = 500  # lm-eval's variable-tracking example before a prompt of 4k tokens or more


# ------------------------------------------------------------------------------ scoring
def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval's RULER score (share of the answers found in the generation), keyed by the
    prompt's length so that each length is its own metric."""
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all

    score = string_match_all(postprocess_pred(results), [doc["outputs"]])
    return {str(doc["max_length"]): score}


# ------------------------------------------------------------------------------ generators
def samples(
    task: str, tokens: Callable, length: int, num_samples: int, haystack: str, seed: int
) -> list[dict[str, Any]]:
    """Rows (``input``, ``outputs``, ``gen_prefix``, ``length``, ``max_length``) of one task at
    one length, in lm-eval's format.

    Args:
        task: A RULER task (``niah_single_1``, ``vt``, ``cwe``, ``fwe``, ...).
        tokens: ``tokens(text).input_ids``: the tokenizer that sizes the prompts.
        length: Tokens of a prompt and its generation budget together, at most.
        num_samples: Prompts.
        haystack: Text of the essay haystack (the run's held-out documents).
        seed: Seeds every random choice, with the task and the length.

    Raises:
        BadInputError: not one prompt of the task fits ``length``.
    """
    # NOTE: imported before seeding: importing lm-eval's generators draws from ``random``.
    niah_modules() if task in NIAH else import_module(f"lm_eval.tasks.ruler.{task}_utils")
    with seeded(seed, task, length):
        return _samples(task, tokens, length, num_samples, haystack)


def _samples(
    task: str, tokens: Callable, length: int, num_samples: int, haystack: str
) -> list[dict[str, Any]]:
    if task in NIAH:
        return _niah(task, tokens, length, num_samples, haystack)
    return {"vt": _vt, "cwe": _cwe, "fwe": _fwe}[task](tokens, length, num_samples)


def _niah(
    task: str, tokens: Callable, length: int, num_samples: int, haystack: str
) -> list[dict[str, Any]]:
    """lm-eval's ``generate_samples`` with ``niah_utils``' settings of ``task``.

    NOTE: lm-eval grows an essay haystack 500 words at a time at every length, so below ~1.5k
    tokens its prompts hold the needles and no essay at all; here it grows by a word per 40
    tokens below 4k (lm-eval's own steps from 4k on).
    """
    prepare_niah, template = niah_modules()
    spec = {"num_needle_k": 1, "num_needle_v": 1, "num_needle_q": 1, **NIAH[task]}
    spec["num_needle_k"] = max(spec["num_needle_k"], spec["num_needle_q"])
    kind, budget = spec["type_haystack"], TOKENS_TO_GENERATE[task]
    text = essay_words(haystack, length) if kind == "essay" else prepare_niah.get_haystack(kind)
    seed = random.randrange(2**31)

    def make(n: int) -> tuple[str, list[str], str]:
        return prepare_niah.generate_input_output(
            n, text, template=template, random_seed=seed, **spec
        )

    def fits(generated: tuple[str, list[str], str]) -> bool:
        return _count(tokens, generated[0]) + budget <= length

    least = spec["num_needle_k"] * spec["num_needle_v"]
    if length >= 4096:
        step = 500 if kind == "essay" else 25
    else:
        step = max(1, length // 40) if kind == "essay" else 5
    largest = _largest(make, fits, step, least)
    single = spec["num_needle_q"] * spec["num_needle_v"] == 1
    kind_v = spec["type_needle_v"][:-1] if single else spec["type_needle_v"]
    rows = []
    for index in range(num_samples):
        generated = _fitted(make, fits, step, start=largest, least=least)
        if generated is None:
            raise BadInputError(f"RULER {task} at {length} tokens: its needles alone do not fit")
        prompt, answer, query = generated
        verb = "is" if single else "are"
        prefix = f"The special magic {kind_v} for {query} mentioned in the provided text {verb}"
        rows.append(_row(index, prompt, answer, prefix, _count(tokens, prompt) + budget, length))
    return rows


def _vt(tokens: Callable, length: int, num_samples: int) -> list[dict[str, Any]]:
    """lm-eval's ``sys_vartrack_w_noise_random`` (one chain of 4 hops after one example)."""
    from lm_eval.tasks.ruler import vt_utils

    budget = TOKENS_TO_GENERATE["vt"]
    icl_tokens = min(VT_ICL_TOKENS, length // 2)  # at most half of a short prompt

    def example(n: int) -> tuple[str, list[str]]:
        return vt_utils.generate_input_output(n, 1, 4, is_icl=True)

    def prompt(n: int) -> tuple[str, list[str]]:
        return vt_utils.generate_input_output(n, 1, 4, is_icl=False)

    icl_fits = lambda g: _count(tokens, g[0]) + budget <= icl_tokens  # noqa: E731
    generated = _fitted(example, icl_fits, max(1, icl_tokens // 100))
    if generated is None:
        raise BadInputError(f"RULER vt at {length} tokens: its example does not fit {icl_tokens}")
    icl = generated[0] + " " + " ".join(generated[1]) + "\n\n"
    icl_count = _count(tokens, icl)
    fits = lambda g: _count(tokens, g[0]) + budget + icl_count <= length  # noqa: E731
    step = _step(length)
    largest = _largest(prompt, fits, step)
    rows = []
    for index in range(num_samples):
        generated = _fitted(prompt, fits, step, start=largest)
        if generated is None:
            raise BadInputError(f"RULER vt at {length} tokens: no chain fits beside its example")
        text, answer = generated
        used = _count(tokens, text) + budget + icl_count
        text = vt_utils.randomize_icl(icl) + "\n\n" + text
        cut = text.rfind(" Answer: According to the chain(s) of variable assignment")
        rows.append(_row(index, text[:cut], answer, text[cut:].strip(), used, length))
    return rows


def _cwe_whole(generated: tuple[str, str, list[str]]) -> str:  # lm-eval sizes with the example
    example, text, answer = generated
    return f"{example}\n{text} " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(answer))


def _cwe(tokens: Callable, length: int, num_samples: int) -> list[dict[str, Any]]:
    """lm-eval's ``sys_word_pair_random``: the 10 most common words of a numbered list."""
    from lm_eval.tasks.ruler import cwe_utils

    budget, prefix = TOKENS_TO_GENERATE["cwe"], cwe_utils.CONFIG["answer_prefix"]

    def make(n: int) -> tuple[str, str, list[str]]:
        return cwe_utils.generate_input_output(n, length)

    num_words = _largest(make, lambda g: _count(tokens, _cwe_whole(g)) + budget <= length, 10, 10)
    num_words = min(num_words, len(cwe_utils.WORDS))
    fits = lambda g: _count(tokens, g[1]) + budget <= length  # noqa: E731
    rows = []
    for index in range(num_samples):
        generated = _fitted(make, fits, 10, start=num_words, least=10)
        if generated is None:
            raise BadInputError(f"RULER cwe at {length} tokens: 10 words do not fit")
        example, text, answer = generated
        used = _count(tokens, text) + budget
        text = text[: text.rfind(prefix)].strip()
        rows.append(_row(index, text, answer, prefix.strip(), used, length, input_example=example))
    return rows


def _fwe(tokens: Callable, length: int, num_samples: int) -> list[dict[str, Any]]:
    """lm-eval's ``sys_kwext`` as it is (its sizing loop ends at any length)."""
    from lm_eval.tasks.ruler import fwe_utils

    budget = TOKENS_TO_GENERATE["fwe"]
    return fwe_utils.sys_kwext(
        tokenizer=tokens, max_seq_length=length, num_samples=num_samples, tokens_to_generate=budget
    )


def _row(
    index: int, text: str, answer: list[str], prefix: str, used: int, length: int, **extra: Any
) -> dict[str, Any]:
    """One prompt in the row format of lm-eval's RULER generators."""
    return {
        "index": index,
        "input": text,
        "outputs": answer,
        "length": used,
        "max_length": length,
        "gen_prefix": prefix,
        **extra,
    }


# ------------------------------------------------------------------------------ sizing
def _step(length: int) -> int:
    """lm-eval grows vt's and cwe's prompts 10 units at a time from 4k tokens; shorter prompts
    grow by fewer so that a few hundred tokens still fit several units."""
    return min(10, max(1, length // 400))


def _largest(
    make: Callable[[int], Any], fits: Callable[[Any], bool], step: int, least: int = 1
) -> int:
    """The largest ``n`` of ``least``, ``least + step``, ... whose ``make(n)`` fits; 0 when
    none does. Each unit costs a token at least, so ``n`` stays below 100k."""
    best, n = 0, least
    while n < 100_000 and fits(make(n)):
        best, n = n, n + step
    return best


def _fitted(
    make: Callable[[int], Any],
    fits: Callable[[Any], bool],
    step: int,
    start: int | None = None,
    least: int = 1,
) -> Any:
    """``make(n)`` for the largest ``n`` from ``start`` (``_largest``'s when None) down to
    ``least`` whose prompt fits; None when none does (where lm-eval retried forever)."""
    n = _largest(make, fits, step, least) if start is None else start
    while n >= least:
        generated = make(n)
        if fits(generated):
            return generated
        if n == least:
            break
        n = max(least, n - step)
    return None


def _count(tokens: Callable, text: str) -> int:
    return len(tokens(text).input_ids)


# ------------------------------------------------------------------------------ inputs
class TextTokens:
    """What lm-eval's generators call: ``tokenizer(text).input_ids``, over the run's tokenizer
    (no special tokens, as the prompts are fed to the model)."""

    def __init__(self, tokenizer_dir: Path):
        from llmflow.tasks.dataprep.tokenize import load_tokenizer

        self.tok = load_tokenizer(tokenizer_dir)

    def __call__(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=self.tok.encode(text, add_special_tokens=False).ids)


def essay_words(haystack: str, length: int) -> list[str]:
    """The haystack's words, repeated until they outnumber ``length`` tokens (lm-eval's essay
    haystack is Paul Graham's essays split at spaces; a word is a token at least)."""
    words = haystack.split()
    if not words:
        raise BadInputError("RULER: the haystack (the held-out documents) holds no text")
    return words * (length // len(words) + 1)


@contextlib.contextmanager
def seeded(seed: int, task: str, length: int) -> Iterator[None]:
    """lm-eval's generators draw from the global ``random`` and ``numpy`` states (and cwe from
    its module's own): seed them for this task and length, then put them back."""
    key = f"{seed}-{task}-{length}"
    states = random.getstate(), np.random.get_state()
    cwe_rng = _cwe_rng() if task == "cwe" else None
    cwe_state = cwe_rng.getstate() if cwe_rng else None
    random.seed(key)
    np.random.seed(zlib.crc32(key.encode()))
    if cwe_rng:
        cwe_rng.seed(key)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        if cwe_rng:
            cwe_rng.setstate(cwe_state)


def _cwe_rng() -> random.Random:
    from lm_eval.tasks.ruler import cwe_utils

    return cwe_utils.RNG


@functools.cache
def niah_modules() -> tuple[Any, str]:
    """lm-eval's ``prepare_niah`` and the NIAH template, imported without the network.

    NOTE: ``prepare_niah`` downloads NLTK's ``punkt_tab`` at import when it is missing, and
    splits the essay haystack into sentences with it. Offline, NLTK finds here Punkt's empty
    parameters: the untrained Punkt splits at every sentence-final mark (an abbreviation's dot
    too). They come first on NLTK's path so that prompts do not depend on what a machine has
    installed. The import takes ~10 s and ~1 GB: it builds every adjective-noun key (6M).
    """
    import nltk

    folder = Path(tempfile.gettempdir()) / "llmflow-nltk-untrained-punkt"
    english = folder / "tokenizers" / "punkt_tab" / "english"
    english.mkdir(parents=True, exist_ok=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (english / name).touch()
    if str(folder) not in nltk.data.path:
        nltk.data.path.insert(0, str(folder))
    from lm_eval.tasks.ruler import niah_utils, prepare_niah

    return prepare_niah, niah_utils.TEMPLATE
