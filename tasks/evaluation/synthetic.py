"""Deterministic synthetic eval items: small arithmetic and simple facts.

Each item is ``{"question", "answer", "choices", "label"}``: the same item serves the cloze
format (score each answer text), the multiple-choice format (score the letters A-D) and
generation (exact match on ``answer``). Items depend only on the seed, never on the machine.
"""

from __future__ import annotations

import random
from collections.abc import Callable

NUM_CHOICES = 4
LETTERS = ["A", "B", "C", "D"]

NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
]  # fmt: skip
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
]  # fmt: skip
OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("old", "young"),
    ("happy", "sad"), ("light", "dark"), ("early", "late"), ("open", "closed"), ("wet", "dry"),
    ("high", "low"), ("hard", "soft"), ("full", "empty"), ("rich", "poor"), ("strong", "weak"),
    ("left", "right"), ("in", "out"), ("win", "lose"), ("buy", "sell"), ("push", "pull"),
]  # fmt: skip
LETTERS_AZ = [chr(c) for c in range(ord("A"), ord("Z") + 1)]


POSTTRAIN_MAX_OPERAND = 9
"""The largest operand of the quickstart's SFT, DPO and GRPO questions (tasks/posttrain)."""


def _item(question: str, answer: str, distractors: list[str], rng: random.Random) -> dict:
    """Shuffle the answer among three distractors; ``label`` is the answer's index."""
    choices = [answer, *distractors[: NUM_CHOICES - 1]]
    rng.shuffle(choices)
    return {
        "question": question,
        "answer": answer,
        "choices": choices,
        "label": choices.index(answer),
    }


def _arith_item(rng: random.Random) -> dict:
    op = rng.choice(["+", "-", "*"])
    if op == "*":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        value = a * b
    else:
        # At least one operand of 10 or more: the quickstart's post-training questions add and
        # subtract single digits, so no evaluated item is ever trained on.
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        while max(a, b) <= POSTTRAIN_MAX_OPERAND:
            a, b = rng.randint(0, 20), rng.randint(0, 20)
        if op == "-" and a < b:
            a, b = b, a
        value = a + b if op == "+" else a - b
    offsets = [-2, -1, 1, 2, 10, -10, 3]
    wrong: list[int] = []
    for delta in rng.sample(offsets, len(offsets)):
        if value + delta >= 0 and value + delta not in wrong:
            wrong.append(value + delta)
    return _item(f"What is {a} {op} {b}?", str(value), [str(w) for w in wrong], rng)


def _next_in(names: list[str], noun: str) -> Callable[[random.Random], dict]:
    def make(rng: random.Random) -> dict:
        i = rng.randrange(len(names) - 1)
        wrong = [n for n in names if n not in (names[i], names[i + 1])]
        return _item(
            f"What {noun} comes after {names[i]}?", names[i + 1], rng.sample(wrong, 3), rng
        )

    return make


def _opposite(rng: random.Random) -> dict:
    word, answer = rng.choice(OPPOSITES)
    if rng.random() < 0.5:
        word, answer = answer, word
    pool = [w for pair in OPPOSITES for w in pair if w not in (word, answer)]
    return _item(f"What is the opposite of {word}?", answer, rng.sample(pool, 3), rng)


FACT_MAKERS = [
    _next_in(NUMBER_WORDS, "number"),
    _next_in(DAYS, "day"),
    _next_in(MONTHS, "month"),
    _next_in(LETTERS_AZ, "letter"),
    _opposite,
]


def arithmetic_items(num_items: int, seed: int) -> list[dict]:
    """``num_items`` small +, -, * problems with non-negative answers."""
    rng = random.Random(f"arith-{seed}")
    return [_arith_item(rng) for _ in range(num_items)]


def fact_items(num_items: int, seed: int) -> list[dict]:
    """``num_items`` simple facts: successor of numbers, days, months, letters; opposites."""
    rng = random.Random(f"facts-{seed}")
    return [FACT_MAKERS[i % len(FACT_MAKERS)](rng) for i in range(num_items)]
