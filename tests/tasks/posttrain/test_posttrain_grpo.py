"""The grpo step: TRL's rewards and advantages against a hand computation, data splits, bad input."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import RawFiles
from llmflow.tasks.posttrain.config import GRPOStepConfig
from llmflow.tasks.posttrain.grpo import (
    build_grpo_trainer,
    grpo,
    grpo_training_args,
    prepare_prompts,
)
from llmflow.tasks.posttrain.quickstart import quickstart_grpo_prompts
from llmflow.tasks.posttrain.rewards import guarded_rewards, resolve_reward

FAST = dict(
    max_steps=1,
    per_device_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    num_heldout=4,
    num_quickstart_examples=8,
    logging_steps=1,
)


def _prompt_key(record) -> str:
    return json.dumps(record["prompt"], sort_keys=True)


def test_quickstart_heldout_questions_are_never_trained_on():
    train, heldout = quickstart_grpo_prompts(500, 40, seed=3)
    questions = lambda rs: {r["prompt"][-1]["content"] for r in rs}  # noqa: E731
    assert len(heldout) == 40 and not questions(train) & questions(heldout)
    for record in heldout:
        a, op, b = record["prompt"][-1]["content"].removeprefix("What is ").rstrip("?").split()
        assert int(record["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert quickstart_grpo_prompts(500, 40, seed=4)[1] != heldout


def test_gsm8k_split_keeps_every_test_item_out_of_training(shared_data, tokenizer):
    path = shared_data / "eval" / "gsm8k_test.jsonl"
    cfg = GRPOStepConfig(data=str(path), max_length=4096, num_heldout=100)
    train, heldout, rejects = prepare_prompts(cfg, tokenizer, path)
    assert len(heldout) == 100 and len(train) + len(heldout) + len(rejects) == 1319
    assert not {_prompt_key(r) for r in train} & {_prompt_key(r) for r in heldout}
    first = json.loads(path.read_text().splitlines()[0])
    match = [r for r in train + heldout if r["prompt"][-1]["content"] == first["question"]]
    assert match[0]["answer"] == "18" and match[0]["answer_format"] == "gsm8k"


def test_use_vllm_reaches_grpo_config_without_vllm_installed(tmp_path):
    assert importlib.util.find_spec("vllm") is None  # the wiring is tested without vLLM
    args = grpo_training_args(GRPOStepConfig(use_vllm=True, vllm_mode="server"), tmp_path)
    assert args.use_vllm is True and args.vllm_mode == "server"
    assert args.reward_weights == [1.0, 0.5, 0.5] and args.num_generations == 4
    assert grpo_training_args(GRPOStepConfig(), tmp_path).use_vllm is False


def test_data_without_answers_fails_before_compute(tiny_model_output, tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text(json.dumps({"question": "What is 2 + 2?"}) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BadInputError, match="no 'answer' field"):
        grpo(GRPOStepConfig(**FAST), tiny_model_output, out, RawFiles((str(data),)))
    assert not (out / "hf").exists()


def always_raises(completion: str, answer: str, answer_format: str) -> float:
    raise ValueError("unparseable")


def test_a_reward_failing_everywhere_stops_the_step_naming_it(tiny_model_output, tmp_path):
    name = f"{__name__}:always_raises"
    cfg = GRPOStepConfig(**FAST, rewards=[{"name": "exact_answer"}, {"name": name}])
    with pytest.raises(BadInputError, match="always_raises.*failed on 4 of 4"):
        grpo(cfg, tiny_model_output, tmp_path)
    assert not (tmp_path / "hf").exists()


def hand_advantages(rewards: list[float], group: int) -> list[float]:
    """GRPO's advantage by hand: (r - group mean) / (group sample std + 1e-4)."""
    out = []
    for start in range(0, len(rewards), group):
        chunk = rewards[start : start + group]
        mean = sum(chunk) / group
        std = math.sqrt(sum((r - mean) ** 2 for r in chunk) / (group - 1))
        out += [(r - mean) / (std + 1e-4) for r in chunk]
    return out


def characters(completion: str, answer: str, answer_format: str) -> float:
    """A user reward that varies between completions of a random model."""
    return len(completion) % 5


def test_rewards_and_advantages_equal_a_hand_computation(tiny_model_dir, tmp_path):
    """One generation batch through TRL: its per-function rewards and group-normalized
    advantages equal our rewards of the decoded completions and the GRPO formula by hand."""
    specs = [
        {"name": "exact_answer"},
        {"name": "format", "weight": 0.5},
        {"name": "length_penalty", "weight": 0.5, "params": {"target_words": 1}},
        {"name": f"{__name__}:characters", "weight": 0.25},
    ]
    cfg = GRPOStepConfig(
        **{**FAST, "per_device_batch_size": 8, "max_completion_length": 12}, rewards=specs
    )
    train, _ = quickstart_grpo_prompts(2, 0, seed=1)
    rewards = guarded_rewards(cfg.rewards, cfg.max_failure_rate)
    trainer = build_grpo_trainer(cfg, tiny_model_dir, tmp_path, train, rewards)
    inputs = [record for record in train for _ in range(cfg.num_generations)]
    batch = trainer._generate_and_score_completions(inputs)

    tokenizer = trainer.processing_class
    ids, mask = batch["completion_ids"], batch["completion_mask"]
    texts = [
        tokenizer.decode(i[m.bool()], skip_special_tokens=True)
        for i, m in zip(ids, mask, strict=True)
    ]
    by_hand = {
        spec.name: [
            resolve_reward(spec.name)(t, r["answer"], r["answer_format"], **spec.params)
            for t, r in zip(texts, inputs, strict=True)
        ]
        for spec in cfg.rewards
    }
    for spec, reward in zip(cfg.rewards, rewards, strict=True):
        assert trainer._logs["rewards"][reward.name] == pytest.approx(by_hand[spec.name])
    total = [
        sum(spec.weight * by_hand[spec.name][i] for spec in cfg.rewards) for i in range(len(texts))
    ]
    expected = hand_advantages(total, cfg.num_generations)
    assert batch["advantages"].tolist() == pytest.approx(expected, abs=1e-5)
    assert len(set(total)) > 1, "a batch whose rewards are all equal tests nothing"


@pytest.mark.slow
def test_grpo_step_writes_model_metrics_and_leaderboard_record(
    tiny_model_output, tmp_path, assert_chats
):
    varied = [{"name": "exact_answer"}, {"name": f"{__name__}:characters"}]  # random model
    cfg = GRPOStepConfig(**{**FAST, "max_steps": 2, "learning_rate": 1e-3}, rewards=varied)
    metrics = grpo(cfg, tiny_model_output, tmp_path)
    assert metrics["num_steps"] == 2 and metrics["num_heldout_prompts"] == 4
    assert metrics["heldout_kl_to_reference_before"] == 0.0
    assert metrics["heldout_kl_to_reference_after"] != 0.0  # lr 1e-3 moved the policy
    record = json.loads((tmp_path / "leaderboard_metrics.json").read_text())
    values = record["metrics"]["verifiable_rewards"]
    assert values["exact_match"] == metrics["heldout_exact_match_after"]
    assert values["exact_match_before"] == metrics["heldout_exact_match_before"]
    assert 0 < values["completion_length"] <= cfg.max_completion_length
    assert_chats(tmp_path / "hf")


def test_grpo_metrics_join_the_models_leaderboard_row(tmp_path):
    from llmflow.tasks.evaluation.leaderboard import _record, leaderboard_rows, wide_table
    from llmflow.tasks.posttrain.grpo import write_leaderboard_metrics

    evaluation, model = tmp_path / "eval", tmp_path / "model"
    evaluation.mkdir(), model.mkdir()
    results = {"suite_key": "s", "metrics": {"gen_arith": {"exact_match": 0.25}}}
    (evaluation / "results.json").write_text(json.dumps(results))
    before = {
        "exact_match": 0.1,
        "mean_reward": 0.2,
        "completion_length": 9.0,
        "kl_to_reference": 0.0,
    }
    after = {
        "exact_match": 0.5,
        "mean_reward": 0.9,
        "completion_length": 7.0,
        "kl_to_reference": 0.3,
    }
    write_leaderboard_metrics(model, before, after)
    row = wide_table(leaderboard_rows([_record("grpo", evaluation, model)]))[0]
    assert row["gen_arith/exact_match"] == 0.25
    assert row["verifiable_rewards/exact_match"] == 0.5
    assert row["verifiable_rewards/exact_match_before"] == 0.1
    assert row["verifiable_rewards/kl_to_reference"] == 0.3
