"""Verifiable rewards for GRPO: a registry of per-completion functions, and their guard.

A reward function scores one completion: ``fn(completion: str, answer: str, answer_format: str,
**params) -> float``. ``completion`` is the generated text, ``answer`` the reference answer (a
number as text), ``answer_format`` where the answer belongs: ``"equation"`` (``7 + 5 = 12.``, the
quickstart's arithmetic) or ``"gsm8k"`` (a final line ``#### 12``). The built-ins:

- ``exact_answer``: 1 when the extracted final answer equals the reference numerically, else 0;
- ``format``: 1 when the answer sits where ``answer_format`` puts it, else 0;
- ``length_penalty``: 0 up to ``target_words`` words, then down to -1 at twice that length.

A user adds a reward by naming ``"package.module:function"`` in the config; it follows the same
signature (extra keyword arguments come from the spec's ``params``).

``GuardedReward`` adapts one function to TRL's batch signature, and never lets one bad
completion kill a run: a raise is logged with its prompt and scored 0; more than
``max_failure_rate`` of the completions failing stops the step, naming the function.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmflow.tasks.framework.errors import BadInputError, ConfigError

logger = logging.getLogger("llmflow.posttrain.rewards")

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
EQUATION = re.compile(r"^\s*-?\d+\s*[-+*/]\s*-?\d+\s*=\s*(-?\d+)\s*\.?\s*$")
ANSWER_FORMATS = ("equation", "gsm8k")
MIN_JUDGED = 20  # completions scored before the failure rate can stop a run
MAX_LOGGED = 5  # failures logged in full per function; the rest are counted

RewardFn = Callable[..., float]


def parse_number(text: str) -> float | None:
    """``"1,234"`` -> 1234.0; None when ``text`` holds no number."""
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def extract_answer(completion: str) -> float | None:
    """The completion's final answer: after the last ``####`` if any, else its last number."""
    marked = GSM8K_ANSWER.findall(completion)
    if marked:
        return parse_number(marked[-1])
    numbers = NUMBER.findall(completion)
    return parse_number(numbers[-1]) if numbers else None


def gsm8k_answer(solution: str) -> str | None:
    """The reference answer of a GSM8K solution (the number after ``####``), or None."""
    marked = GSM8K_ANSWER.findall(solution)
    if not marked:
        return None
    value = parse_number(marked[-1])
    return None if value is None else f"{value:g}"


def exact_answer(completion: str, answer: str, answer_format: str = "equation") -> float:
    """1.0 when the completion's final answer equals ``answer`` numerically, else 0.0."""
    got, want = extract_answer(completion), parse_number(answer)
    return float(got is not None and want is not None and math.isclose(got, want))


def format_reward(completion: str, answer: str, answer_format: str = "equation") -> float:
    """1.0 when the answer is in the expected place: ``a + b = N.`` alone, or a ``#### N`` line."""
    if answer_format == "gsm8k":
        lines = [line for line in completion.strip().splitlines() if line.strip()]
        return float(bool(lines) and GSM8K_ANSWER.fullmatch(lines[-1].strip()) is not None)
    return float(EQUATION.match(completion) is not None)


def length_penalty(
    completion: str, answer: str, answer_format: str = "equation", target_words: int = 8
) -> float:
    """0 up to ``target_words`` words, falling linearly to -1 at twice that many (then -1)."""
    excess = len(completion.split()) - target_words
    return -min(1.0, max(0, excess) / target_words)


REGISTRY: dict[str, RewardFn] = {
    "exact_answer": exact_answer,
    "format": format_reward,
    "length_penalty": length_penalty,
}


class RewardSpec(BaseModel):
    """One reward: a registry name or ``module:function``, its weight and keyword params."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description=f"One of {sorted(REGISTRY)} or 'package.module:function'.")
    weight: float = Field(1.0, description="Weight in the summed reward (TRL reward_weights).")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the function."
    )

    @field_validator("name")
    @classmethod
    def _resolvable(cls, value: str) -> str:
        resolve_reward(value)
        return value


def resolve_reward(name: str) -> RewardFn:
    """A registry name or ``module:function`` as a callable.

    Raises:
        ConfigError: unknown name, unimportable module, missing or non-callable attribute.
    """
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" not in name:
        raise ConfigError(
            f"reward {name!r} is neither built in ({', '.join(sorted(REGISTRY))}) "
            "nor 'package.module:function'"
        )
    module_name, attr = name.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"reward {name!r} cannot be imported: {err}") from None
    if not callable(fn):
        raise ConfigError(f"reward {name!r} is a {type(fn).__name__}, not a function")
    return fn


class RewardFailureError(BadInputError):
    """A reward function failed on more than the allowed share of completions."""


class GuardedReward:
    """One per-completion reward function in TRL's batch signature, failures contained.

    TRL calls ``reward(prompts=..., completions=..., answer=[...], answer_format=[...], ...)``
    with one entry per completion; conversational completions are lists of messages.
    """

    def __init__(self, spec: RewardSpec, max_failure_rate: float) -> None:
        self.fn, self.params = resolve_reward(spec.name), dict(spec.params)
        self.name = spec.name.replace(":", ".")
        self.__name__ = self.name  # TRL names the logged metric after the function
        self.max_failure_rate = max_failure_rate
        self.scored = self.failed = 0
        self.failures: list[dict[str, Any]] = []

    def __call__(self, prompts, completions, answer, answer_format, **_: Any) -> list[float]:
        rewards = [
            self.score(prompt, completion_text(completion), ans, fmt)
            for prompt, completion, ans, fmt in zip(
                prompts, completions, answer, answer_format, strict=True
            )
        ]
        self.check()
        return rewards

    def score(self, prompt: Any, completion: str, answer: str, answer_format: str) -> float:
        """The function's reward for one completion; 0.0 (logged, counted) if it raises."""
        self.scored += 1
        try:
            return float(self.fn(completion, answer, answer_format, **self.params))
        except Exception as err:  # noqa: BLE001 - a user's reward may raise anything
            self.failed += 1
            self.record_failure(prompt, completion, err)
            return 0.0

    def record_failure(self, prompt: Any, completion: str, err: Exception) -> None:
        text = prompt_text(prompt)
        self.failures.append(
            {"reward": self.name, "prompt": text, "completion": completion, "error": repr(err)}
        )
        if self.failed <= MAX_LOGGED:
            logger.warning("reward %s raised %r on prompt %r; scored 0", self.name, err, text[:200])

    def check(self, final: bool = False) -> None:
        """Stop the step once more than ``max_failure_rate`` of the completions failed.

        Raises:
            RewardFailureError: naming the function, its failure count and the first error.
        """
        if self.scored < MIN_JUDGED and not final:
            return
        if self.scored and self.failed / self.scored > self.max_failure_rate:
            raise RewardFailureError(
                f"reward function {self.name!r} failed on {self.failed} of {self.scored} "
                f"completions (more than {self.max_failure_rate:.0%}); first error: "
                f"{self.failures[0]['error']} on prompt {self.failures[0]['prompt'][:200]!r}"
            )


def completion_text(completion: Any) -> str:
    """A TRL completion (text, or a list of assistant messages) as text."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") for m in completion)


def prompt_text(prompt: Any) -> str:
    """A prompt (text or messages) as one line of text for logs."""
    if isinstance(prompt, str):
        return prompt
    return " | ".join(f"{m['role']}: {m['content']}" for m in prompt)


def guarded_rewards(specs: list[RewardSpec], max_failure_rate: float) -> list[GuardedReward]:
    """The configured rewards, each guarded."""
    return [GuardedReward(spec, max_failure_rate) for spec in specs]
