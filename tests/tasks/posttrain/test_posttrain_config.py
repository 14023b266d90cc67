"""Post-training configs fail early and clearly; quickstart data is deterministic and correct."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from llmflow.tasks.posttrain.config import DPOStepConfig, SFTStepConfig
from llmflow.tasks.posttrain.quickstart import (
    EVASIVE_ANSWER,
    make_quickstart_preferences,
    quickstart_preference_pairs,
    quickstart_sft_examples,
)


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (SFTStepConfig, "max_length", 4),
        (SFTStepConfig, "learning_rate", -1.0),
        (SFTStepConfig, "attn_implementation", "flash_attention_9"),
        (SFTStepConfig, "data", " "),
        (DPOStepConfig, "beta", 0.0),
        (DPOStepConfig, "max_steps", 0),
        (DPOStepConfig, "loss_type", "kto"),
    ],
)
def test_bad_values_fail_naming_field_and_value(cls, field, value):
    with pytest.raises(ValidationError) as error:
        cls(**{field: value})
    message = str(error.value)
    assert field in message and str(value).strip() in message


def test_unknown_fields_are_rejected():
    with pytest.raises(ValidationError, match="learning_rte"):
        SFTStepConfig(learning_rte=1e-3)


def test_execution_only_fields_are_unversioned():
    unversioned = {
        name
        for name, info in DPOStepConfig.model_fields.items()
        if (info.json_schema_extra or {}).get("versioned") is False
    }
    assert unversioned == {
        "gradient_checkpointing",
        "logging_steps",
        "dataloader_num_workers",
        "checkpoint_interval",  # a cadence: resume is exact (test_posttrain_resume.py)
    }
    assert all(info.description for info in DPOStepConfig.model_fields.values())


def test_quickstart_is_deterministic_by_seed(tmp_path):
    assert quickstart_sft_examples(50, seed=7) == quickstart_sft_examples(50, seed=7)
    assert quickstart_sft_examples(50, seed=7) != quickstart_sft_examples(50, seed=8)
    a = make_quickstart_preferences(tmp_path / "a.jsonl", 30, seed=1).read_bytes()
    b = make_quickstart_preferences(tmp_path / "b.jsonl", 30, seed=1).read_bytes()
    assert a == b


def test_quickstart_chosen_is_correct_and_rejected_is_not():
    equation = re.compile(r"^(\d+) ([+-]) (\d+) = (\d+)\.$")
    kinds = set()
    for pair in quickstart_preference_pairs(200, seed=0):
        question = pair["prompt"][-1]["content"]
        chosen, rejected = pair["chosen"][0]["content"], pair["rejected"][0]["content"]
        a, op, b, result = equation.match(chosen).groups()
        assert question == f"What is {a} {op} {b}?"
        assert int(result) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        if rejected == EVASIVE_ANSWER:
            kinds.add("evasive")
        else:
            wrong = equation.match(rejected).groups()
            assert wrong[:3] == (a, op, b) and wrong[3] != result and int(wrong[3]) >= 0
            kinds.add("wrong_result")
    assert kinds == {"evasive", "wrong_result"}
