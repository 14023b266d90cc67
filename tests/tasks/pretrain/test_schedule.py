"""LR schedules and batch-size warmup against hand-computed values."""

from __future__ import annotations

import math

import pytest

from llmflow.tasks.pretrain.config import BatchConfig, ScheduleConfig
from llmflow.tasks.pretrain.schedule import lr_multiplier, micro_batch_size, steps_for_tokens


def test_warmup_is_linear_from_one_over_warmup():
    cfg = ScheduleConfig(name="constant", warmup_steps=4)
    assert [lr_multiplier(s, cfg, 100) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_hand_computed():
    cfg = ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(10, cfg, 110) == pytest.approx(1.0)
    # halfway through the 100 decay steps: 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert lr_multiplier(60, cfg, 110) == pytest.approx(0.55)
    # a quarter: 0.1 + 0.9 * 0.5 * (1 + cos(pi/4))
    assert lr_multiplier(35, cfg, 110) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr_multiplier(110, cfg, 110) == pytest.approx(0.1)
    assert lr_multiplier(500, cfg, 110) == pytest.approx(0.1)  # stays at the floor


def test_wsd_stable_then_decays_over_the_last_share():
    cfg = ScheduleConfig(name="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.0)
    total = 100  # decay over steps 80..100
    assert lr_multiplier(5, cfg, total) == pytest.approx(0.6)
    assert lr_multiplier(10, cfg, total) == 1.0
    assert lr_multiplier(79, cfg, total) == 1.0
    assert lr_multiplier(80, cfg, total) == 1.0
    assert lr_multiplier(90, cfg, total) == pytest.approx(0.5)
    assert lr_multiplier(95, cfg, total) == pytest.approx(0.25)
    sqrt = cfg.model_copy(update={"decay_shape": "sqrt"})
    assert lr_multiplier(85, sqrt, total) == pytest.approx(1 - math.sqrt(0.25))


def test_multistep_drops_at_fractions():
    cfg = ScheduleConfig(name="multistep", warmup_steps=0, milestones=[0.5, 0.75], gamma=0.1)
    assert lr_multiplier(49, cfg, 100) == 1.0
    assert lr_multiplier(50, cfg, 100) == pytest.approx(0.1)
    assert lr_multiplier(74, cfg, 100) == pytest.approx(0.1)
    assert lr_multiplier(75, cfg, 100) == pytest.approx(0.01)


def test_linear_to_floor():
    cfg = ScheduleConfig(name="linear", warmup_steps=0, min_lr_ratio=0.2)
    assert lr_multiplier(0, cfg, 100) == 1.0
    assert lr_multiplier(50, cfg, 100) == pytest.approx(0.6)
    assert lr_multiplier(100, cfg, 100) == pytest.approx(0.2)


def test_schedule_over_the_total_run_continues_across_stages():
    """Three stages of 40 steps under one WSD over 120: stages 1-2 stable, stage 3 decays."""
    cfg = ScheduleConfig(
        name="wsd", warmup_steps=5, total_steps=120, decay_fraction=1 / 3, min_lr_ratio=0.0
    )
    whole = [lr_multiplier(s, cfg, cfg.total_steps) for s in range(120)]
    stages = [lr_multiplier(s, cfg, cfg.total_steps) for start in (0, 40, 80)
              for s in range(start, start + 40)]  # fmt: skip
    assert stages == whole
    assert all(m == 1.0 for m in whole[5:80])
    assert whole[80] == 1.0 and whole[100] == pytest.approx(0.5) and whole[119] < 0.03


def test_batch_size_warmup_ramps_linearly():
    cfg = BatchConfig(micro_batch_size=8, warmup_start_micro_batch=2, warmup_steps=6)
    assert [micro_batch_size(s, cfg) for s in range(8)] == [2, 3, 4, 5, 6, 7, 8, 8]
    assert micro_batch_size(3, BatchConfig(micro_batch_size=8)) == 8


def test_steps_for_tokens_counts_the_ramp():
    cfg = BatchConfig(micro_batch_size=4, grad_accum_steps=2, warmup_start_micro_batch=2,
                      warmup_steps=2)  # fmt: skip
    # step tokens (seq 10, 1 rank): step0 2*2*10=40, step1 3*2*10=60, then 80 per step
    assert steps_for_tokens(100, cfg, seq_len=10, world_size=1) == 2
    assert steps_for_tokens(101, cfg, seq_len=10, world_size=1) == 3
    assert steps_for_tokens(260, cfg, seq_len=10, world_size=1) == 4
    assert steps_for_tokens(160, BatchConfig(micro_batch_size=4), 10, world_size=2) == 2
