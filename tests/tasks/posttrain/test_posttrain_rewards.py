"""Verifiable rewards: the built-ins by hand, user functions by name, failures contained."""

from __future__ import annotations

import logging

import pytest

from llmflow.tasks.framework.errors import ConfigError
from llmflow.tasks.posttrain.config import GRPOStepConfig
from llmflow.tasks.posttrain.rewards import (
    GuardedReward,
    RewardFailureError,
    RewardSpec,
    exact_answer,
    extract_answer,
    format_reward,
    gsm8k_answer,
    length_penalty,
    resolve_reward,
)


def test_exact_answer_reads_the_final_answer():
    assert exact_answer("7 + 5 = 12.", "12") == 1.0
    assert exact_answer("7 + 5 = 13.", "12") == 0.0
    assert exact_answer("I am not sure.", "12") == 0.0
    assert exact_answer("3 + 4 = 7 so\n#### 1,234", "1234", "gsm8k") == 1.0
    assert exact_answer("#### 12\nbut 7 later", "12", "gsm8k") == 1.0  # #### wins over last number
    assert extract_answer("-3 and 2.50") == 2.5
    assert gsm8k_answer("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18") == "18"
    assert gsm8k_answer("no marker") is None


def test_format_and_length_rewards():
    assert format_reward("7 + 5 = 12.", "12") == 1.0
    assert format_reward("The answer is 12.", "12") == 0.0
    assert format_reward("7 + 5 = 12. And more", "12") == 0.0
    assert format_reward("a = 12\nso\n#### 12", "12", "gsm8k") == 1.0
    assert format_reward("#### 12\nthen more text", "12", "gsm8k") == 0.0
    assert length_penalty("one two three", "1", target_words=4) == 0.0
    assert length_penalty(" ".join(["w"] * 6), "1", target_words=4) == -0.5
    assert length_penalty(" ".join(["w"] * 40), "1", target_words=4) == -1.0


def user_reward(completion: str, answer: str, answer_format: str, bonus: float = 0.0) -> float:
    return len(completion) % 3 + bonus


def test_user_reward_by_module_and_function():
    name = f"{__name__}:user_reward"
    assert resolve_reward(name) is user_reward
    guarded = GuardedReward(RewardSpec(name=name, params={"bonus": 0.5}), 0.1)
    assert guarded(["p", "p"], ["ab", "abcd"], ["1", "1"], ["equation"] * 2) == [2.5, 1.5]
    assert guarded.__name__ == f"{__name__}.user_reward"


@pytest.mark.parametrize("name", ["nope", "no_such_module_xyz:f", "math:no_such_fn", "math:pi"])
def test_unknown_reward_fails_at_config_time(name):
    with pytest.raises(ConfigError, match="reward"):
        resolve_reward(name)
    with pytest.raises(ValueError, match=name.split(":")[0]):
        GRPOStepConfig(rewards=[{"name": name}])


def flaky(completion: str, answer: str, answer_format: str) -> float:
    if completion == "boom":
        raise RuntimeError("cannot parse")
    return 1.0


def test_a_raising_reward_scores_zero_and_is_logged_with_its_prompt(caplog):
    guarded = GuardedReward(RewardSpec(name=f"{__name__}:flaky"), max_failure_rate=0.1)
    prompts = [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(30)]
    completions = ["boom" if i == 7 else "ok" for i in range(30)]
    with caplog.at_level(logging.WARNING, logger="llmflow.posttrain.rewards"):
        rewards = guarded(prompts, completions, ["1"] * 30, ["equation"] * 30)
    assert rewards[7] == 0.0 and sum(rewards) == 29.0
    assert guarded.failed == 1 and "What is 7 + 1?" in caplog.text
    assert guarded.failures[0]["prompt"] == "user: What is 7 + 1?"


def test_more_than_the_allowed_failures_stops_naming_the_function():
    guarded = GuardedReward(RewardSpec(name=f"{__name__}:flaky"), max_failure_rate=0.1)
    completions = ["boom" if i % 4 == 0 else "ok" for i in range(24)]  # 25% fail
    with pytest.raises(RewardFailureError, match=r"flaky.*6 of 24"):
        guarded(["p"] * 24, completions, ["1"] * 24, ["equation"] * 24)
