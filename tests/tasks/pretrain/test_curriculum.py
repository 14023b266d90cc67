"""Per-stage trainer configs of the curriculum: step budgets and one schedule across stages."""

from __future__ import annotations

import pytest
from conftest import tiny_config

from llmflow.tasks.framework.hashing import digest, versioned_fields
from llmflow.tasks.pretrain.curriculum import PretrainConfig, stage_steps, stage_train_config
from llmflow.tasks.pretrain.schedule import lr_multiplier


def _curriculum(**changes) -> PretrainConfig:
    stages = [
        {"name": f"s{i}", "mixture": {"weights": {"prose": 1.0}, "num_tokens": n, "seq_len": 32}}
        for i, n in enumerate((128 * 6, 128 * 3, 128 * 3))
    ]
    train = tiny_config(schedule={"name": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.0})
    return PretrainConfig(train=train, stages=stages, **changes)


def test_stages_hold_the_lr_then_the_last_anneals_over_exactly_its_steps():
    cfg = _curriculum()
    assert stage_steps(cfg) == [6, 3, 3]  # 4 sequences of 32 tokens per step
    first, second, last = (stage_train_config(cfg, i) for i in range(3))
    for stage, steps in ((first, 6), (second, 3), (last, 3)):
        assert (stage.max_steps, stage.num_tokens) == (steps, None)
    assert first.schedule.name == second.schedule.name == "constant"
    assert first.schedule.total_steps is None and first.schedule.warmup_steps == 2
    assert (last.schedule.name, last.schedule.total_steps) == ("wsd", 12)
    assert last.schedule.decay_fraction == pytest.approx(3 / 12)
    # The last stage's schedule: full LR at its first step (9), down to the floor at 12.
    assert lr_multiplier(9, last.schedule, 12) == 1.0
    assert lr_multiplier(12, last.schedule, 12) == pytest.approx(0.0)
    assert cfg.train.max_steps == 12 and cfg.train.schedule.name == "cosine"  # untouched


def test_two_processes_halve_the_steps_of_a_token_budget():
    assert stage_steps(_curriculum(num_processes=2), world_size=2) == [3, 2, 2]
    assert stage_train_config(_curriculum(num_processes=2), 0).max_steps == 3


# --- the world size (however the run is launched) is part of what a stage trains -----------------


def _stage1(overrides: list[str]):
    from llmflow.flows.recipe import recipe
    from llmflow.tasks.config import load_config

    node = recipe(load_config(None, overrides)).find(step="pretrain")[0]
    return node.config.train.max_steps, digest(versioned_fields(node.config))


def test_ray_workers_set_the_stage_steps_and_the_address():
    steps_1, hash_1 = _stage1([])
    steps_4, hash_4 = _stage1(["pretrain.launcher=ray", "pretrain.ray.workers=4"])
    # Four ranks see four micro-batches a step: a quarter of the steps for the same tokens.
    assert steps_4 == -(-steps_1 // 4) or abs(steps_4 - steps_1 / 4) <= 1
    assert hash_4 != hash_1


def test_same_world_size_same_address_however_launched():
    local = _stage1(["pretrain.num_processes=2"])
    ray = _stage1(["pretrain.launcher=ray", "pretrain.ray.workers=2"])
    assert local == ray
    assert local != _stage1([])


def test_a_single_rank_keeps_its_address():
    from llmflow.flows.recipe import recipe
    from llmflow.tasks.config import load_config

    node = recipe(load_config(None)).find(step="pretrain")[0]
    assert "world_size" not in versioned_fields(node.config)


def test_sweep_segments_hash_the_world_size():
    from llmflow.tasks.config import load_config
    from llmflow.tasks.scaling.trial import segment_runs, trial_train_config

    hashes = []
    for n in (1, 4):
        config = load_config(None, [f"pretrain.num_processes={n}"])
        runs = segment_runs(config, trial_train_config(config, {}, 40), 2)
        hashes.append([digest(versioned_fields(r)) for r in runs])
    assert hashes[0][0] != hashes[1][0] and hashes[0][1] != hashes[1][1]
