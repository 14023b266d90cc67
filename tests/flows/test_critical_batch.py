"""Critical batch size: branch configs (batch, LR rule, same tokens), the graph, the verdict."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from llmflow.flows.critical_batch import (
    CriticalBatchConfig,
    branch_train,
    critical_batch_graph,
    critical_rows,
)
from llmflow.tasks.config import load_config
from llmflow.tasks.pretrain.schedule import steps_for_tokens


def test_branches_scale_batch_and_lr_for_the_same_tokens(tmp_path):
    cfg = load_config(None, [f"root={tmp_path}"])
    base = cfg.pretrain.train
    cb = CriticalBatchConfig(base_batch=4, factors=[1, 4], branch_tokens=65_536)
    one, four = branch_train(base, cb, 1), branch_train(base, cb, 4)
    assert four.batch.micro_batch_size == 16 and one.batch.micro_batch_size == 4
    assert four.optimizer.lr == pytest.approx(base.optimizer.lr * 2)  # sqrt(4)
    linear = CriticalBatchConfig(base_batch=4, factors=[1, 4], lr_scaling="linear")
    assert branch_train(base, linear, 4).optimizer.lr == pytest.approx(base.optimizer.lr * 4)
    steps = [steps_for_tokens(65_536, t.batch, 256, 1, 0) for t in (one, four)]
    assert steps == [64, 16]  # same tokens: 4x the batch, a quarter of the steps
    assert four.schedule.name == "constant" and four.schedule.per_stage


def test_graph_branches_from_the_trunk_at_each_point(tmp_path):
    cfg = load_config(None, [f"root={tmp_path}"])
    cb = CriticalBatchConfig(points=[10_000, 30_000], factors=[1, 2])
    planned = critical_batch_graph(cfg, cb)
    first, second = (planned.branches[(p, 1)].inputs["init"] for p in cb.points)
    assert second.inputs["init"] is first  # the trunk continues from the first point
    assert first.config.train.num_tokens == 10_000 and second.config.train.num_tokens == 20_000
    assert planned.branches[(30_000, 2)].inputs["init"] is second


def test_critical_batch_is_the_largest_batch_within_tolerance():
    cb = CriticalBatchConfig(base_batch=4, factors=[1, 2, 4, 8], points=[1, 2], tolerance=0.01)
    losses = {(1, 1): 4.0, (1, 2): 4.03, (1, 4): 4.2, (1, 8): 4.02}  # 8 fits only by luck
    losses |= {(2, 1): 3.0, (2, 2): 2.99, (2, 4): 3.02, (2, 8): 3.2}
    rows, critical = critical_rows(cb, losses)
    assert critical == {1: 8, 2: 16}
    assert [r["within_tolerance"] for r in rows[:4]] == [True, True, False, True]
    assert rows[1]["vs_base"] == pytest.approx(0.0075)
    assert rows[2]["lr_factor"] == pytest.approx(math.sqrt(4))


def test_bad_factors_and_points_are_rejected():
    with pytest.raises(ValidationError, match="include 1"):
        CriticalBatchConfig(factors=[2, 4])
    with pytest.raises(ValidationError, match="increasing"):
        CriticalBatchConfig(points=[100, 50])


def test_branches_validate_on_one_held_out_set_and_continue_the_data(tmp_path):
    cfg = load_config(None, [f"root={tmp_path}"])
    base = cfg.pretrain.train
    cb = CriticalBatchConfig(base_batch=4, factors=[1, 2, 4], branch_tokens=65_536)
    branches = [branch_train(base, cb, k) for k in cb.factors]
    sequences = {t.eval_batches * t.batch.micro_batch_size for t in branches}
    assert sequences == {base.eval_batches * 4 * 4}  # the same held-out sequences for every k
    assert [t.optimizer.muon_lr for t in branches] == pytest.approx(
        [base.optimizer.muon_lr * cb.lr_factor(k) for k in cb.factors]
    )
    assert branches[2].optimizer.muon_lr == pytest.approx(base.optimizer.muon_lr * 2)
    assert all(t.continue_data for t in branches)  # not the trunk's tokens again
    planned = critical_batch_graph(cfg, CriticalBatchConfig(points=[10_000], factors=[1, 2]))
    assert planned.branches[(10_000, 2)].inputs["init"].config.train.continue_data
