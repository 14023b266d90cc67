"""Deterministic quickstart data: small arithmetic instructions and preference pairs.

The quickstart must show SFT and DPO working on a tiny model in a few dozen CPU steps, with no
download. Questions are ``"What is 7 + 5?"``; the answer is ``"7 + 5 = 12."``.

The SFT data is deliberately noisy, like real instruction data: a share of the answers are the
evasive ``"I am not sure."``, a habit the SFT model imitates. A preference pair prefers the
correct answer over either that evasion or a wrong result that differs by 1 to 3. DPO can
unlearn the evasion within a few dozen steps on a tiny model (a measurable rise in held-out
preference accuracy); wrong results it can only fix by memorizing the small addition table.
"""

from __future__ import annotations

import random
from pathlib import Path

from llmflow.tasks.evaluation.synthetic import POSTTRAIN_MAX_OPERAND
from llmflow.tasks.posttrain.formats import Record, write_jsonl

SYSTEM_PROMPT = "You are a careful assistant who answers arithmetic questions."
EVASIVE_ANSWER = "I am not sure."
MAX_OPERAND = POSTTRAIN_MAX_OPERAND  # the evaluated arithmetic never adds or subtracts two digits
SFT_EVASIVE_SHARE = 0.25
PREFERENCE_EVASIVE_SHARE = 0.5


def _question(rng: random.Random) -> tuple[str, int, str]:
    """A random question, its correct result and the answer's equation prefix."""
    a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b, f"{a} + {b} ="
    a, b = max(a, b), min(a, b)  # no negative results
    return f"What is {a} - {b}?", a - b, f"{a} - {b} ="


def _wrong(rng: random.Random, correct: int) -> int:
    """A plausible wrong result: off by 1 to 3, never negative."""
    delta = rng.choice([-3, -2, -1, 1, 2, 3])
    return correct + delta if correct + delta >= 0 else correct + abs(delta)


def _prompt(rng: random.Random, question: str) -> list[dict[str, str]]:
    # NOTE: a third of the prompts carry a system turn, so loss masking is exercised on system
    # tokens too, not only on user tokens.
    prompt = [{"role": "user", "content": question}]
    if rng.random() < 1 / 3:
        prompt.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return prompt


def quickstart_sft_examples(n: int, seed: int) -> list[Record]:
    """``n`` arithmetic conversations ``{"messages": [...]}``, the same for the same seed."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        question, result, equation = _question(rng)
        content = f"{equation} {result}."
        if rng.random() < SFT_EVASIVE_SHARE:
            content = EVASIVE_ANSWER
        answer = {"role": "assistant", "content": content}
        examples.append({"messages": _prompt(rng, question) + [answer]})
    return examples


def quickstart_preference_pairs(n: int, seed: int) -> list[Record]:
    """``n`` preference pairs: the correct answer chosen; a wrong result or an evasion rejected."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        question, result, equation = _question(rng)
        wrong = f"{equation} {_wrong(rng, result)}."
        if rng.random() < PREFERENCE_EVASIVE_SHARE:
            wrong = EVASIVE_ANSWER
        pairs.append(
            {
                "prompt": _prompt(rng, question),
                "chosen": [{"role": "assistant", "content": f"{equation} {result}."}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
        )
    return pairs


def make_quickstart_sft(out_path: Path, n: int, seed: int) -> Path:
    """Write ``n`` quickstart SFT conversations to a JSON Lines file and return its path."""
    write_jsonl(Path(out_path), quickstart_sft_examples(n, seed))
    return Path(out_path)


def make_quickstart_preferences(out_path: Path, n: int, seed: int) -> Path:
    """Write ``n`` quickstart preference pairs to a JSON Lines file and return its path."""
    write_jsonl(Path(out_path), quickstart_preference_pairs(n, seed))
    return Path(out_path)


def all_questions() -> list[tuple[str, int, str]]:
    """Every distinct quickstart question: ``(question, result, equation prefix)``."""
    questions = []
    for a in range(MAX_OPERAND + 1):
        for b in range(MAX_OPERAND + 1):
            questions.append((f"What is {a} + {b}?", a + b, f"{a} + {b} ="))
            if a >= b:
                questions.append((f"What is {a} - {b}?", a - b, f"{a} - {b} ="))
    return questions


def quickstart_grpo_prompts(n: int, num_heldout: int, seed: int) -> tuple[list, list]:
    """``(train, heldout)`` arithmetic prompts with answers, disjoint by question.

    The distinct questions are shuffled by ``seed``; the first ``num_heldout`` are held out and
    ``n`` training prompts are drawn (with repetition) from the rest, so no held-out question is
    ever trained on. Records: ``{"prompt": [messages], "answer": "12", "answer_format":
    "equation"}``.
    """
    rng = random.Random(seed)
    questions = all_questions()
    rng.shuffle(questions)
    num_heldout = min(num_heldout, len(questions) - 1)
    heldout, pool = questions[:num_heldout], questions[num_heldout:]
    train = [rng.choice(pool) for _ in range(n)]
    return [_grpo_record(rng, q) for q in train], [_grpo_record(rng, q) for q in heldout]


def _grpo_record(rng: random.Random, question: tuple[str, int, str]) -> Record:
    text, result, _ = question
    return {"prompt": _prompt(rng, text), "answer": str(result), "answer_format": "equation"}
