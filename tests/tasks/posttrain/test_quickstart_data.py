"""The quickstart's post-training data never holds an evaluated arithmetic question."""

from __future__ import annotations

from llmflow.tasks.evaluation.synthetic import arithmetic_items
from llmflow.tasks.posttrain.quickstart import (
    all_questions,
    quickstart_grpo_prompts,
    quickstart_preference_pairs,
    quickstart_sft_examples,
)


def _user_turn(messages: list[dict]) -> str:
    return next(m["content"] for m in messages if m["role"] == "user")


def test_no_evaluated_arithmetic_question_is_in_sft_dpo_or_grpo_data():
    evaluated = {item["question"] for seed in range(5) for item in arithmetic_items(400, seed)}
    assert len(evaluated) > 300  # the eval set is not trivially small
    trained = {_user_turn(r["messages"]) for r in quickstart_sft_examples(500, 0)}
    trained |= {_user_turn(r["prompt"]) for r in quickstart_preference_pairs(500, 0)}
    train, heldout = quickstart_grpo_prompts(500, 16, 0)
    trained |= {_user_turn(r["prompt"]) for r in train + heldout}
    assert trained <= {q for q, _, _ in all_questions()}
    assert not trained & evaluated
