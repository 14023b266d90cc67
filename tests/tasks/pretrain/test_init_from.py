"""init_from: a new curriculum stage continues weights, optimizer state, step and schedule."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_MODEL, losses_by_step, read_jsonl, run_trainer, tiny_config

from llmflow.model.hf import load_model
from llmflow.model.transformer import Transformer
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.pretrain.checkpoint import load_checkpoint
from llmflow.tasks.pretrain.optim import build_optimizers
from llmflow.tasks.pretrain.schedule import lr_multiplier
from llmflow.tasks.pretrain.validate import validate_run


def _optimizer_steps(checkpoint_dir, cfg) -> set[float]:
    model = Transformer(cfg.model_config_obj())
    optimizers = build_optimizers(model, cfg.optimizer)
    load_checkpoint(checkpoint_dir, model, optimizers)
    return {float(s["step"]) for o in optimizers for s in o.state.values()}


def test_second_stage_continues_step_optimizer_and_schedule(tmp_path, train_data, val_data):
    schedule = {"name": "wsd", "warmup_steps": 2, "total_steps": 12, "decay_fraction": 0.5,
                "min_lr_ratio": 0.0}  # fmt: skip
    stage1 = tiny_config(max_steps=6, schedule=schedule, checkpoint={"interval": 3, "keep_last": 1})
    run_trainer(stage1, train_data, tmp_path / "s1")
    stage2 = stage1.model_copy(update={"max_steps": 6})
    # stage 2 trains on other data (the held-out set stands in for the next mixture)
    run_trainer(stage2, val_data, tmp_path / "s2", init_from=tmp_path / "s1")

    summary = json.loads((tmp_path / "s2" / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["stage_steps"] == 6
    rows = read_jsonl(tmp_path / "s2" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(7, 13))
    for row in rows:  # the LR follows the schedule over the whole 12-step run
        expected = 3e-3 * lr_multiplier(row["step"] - 1, stage2.schedule, 12)
        assert row["lr"] == pytest.approx(expected)
    assert rows[0]["lr"] == pytest.approx(3e-3)  # stage 1 never decayed; stage 2 does
    assert rows[-1]["lr"] == pytest.approx(3e-3 / 6)

    # Adam's per-parameter step counters went on from 6 to 12 (a fresh optimizer says 6).
    assert _optimizer_steps(tmp_path / "s1" / "final", stage1) == {6.0}
    assert _optimizer_steps(tmp_path / "s2" / "final", stage2) == {12.0}
    # the first stage-2 loss comes from trained weights (well below ln(128) = 4.85)
    first_stage2 = losses_by_step(tmp_path / "s2")[7]
    assert first_stage2 < losses_by_step(tmp_path / "s1")[1] - 0.2
    # A per-stage schedule (context extension) restarts warmup + decay over the stage's steps,
    # while the global step still continues.
    per_stage = {"name": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.0, "per_stage": True}
    stage3 = tiny_config(max_steps=4, schedule=per_stage)
    run_trainer(stage3, val_data, tmp_path / "s3", init_from=tmp_path / "s2")
    rows3 = read_jsonl(tmp_path / "s3" / "metrics.jsonl")
    assert [r["step"] for r in rows3] == [13, 14, 15, 16]
    # local steps 0-3: warmup 1/2, 2/2, then cosine over the 2 remaining steps: 1, cos(pi/2)
    assert [r["lr"] for r in rows3] == pytest.approx([1.5e-3, 3e-3, 3e-3, 1.5e-3], abs=1e-12)
    # final/ is also a plain model folder
    model = load_model(tmp_path / "s2" / "final")
    assert isinstance(model, Transformer) and model.cfg.hidden_size == TINY_MODEL["hidden_size"]
    assert torch.isfinite(model.embed.weight).all()


def test_init_from_another_architecture_fails(tmp_path, train_data):
    run_trainer(tiny_config(max_steps=1), train_data, tmp_path / "s1")
    wider = tiny_config(model={"preset": "debug", "overrides": {**TINY_MODEL, "hidden_size": 64}})
    with pytest.raises(
        BadInputError, match="another architecture .*hidden_size: checkpoint=32 vs config=64"
    ):
        validate_run(wider, train_data, None, tmp_path / "s1", world_size=1)
    proc = run_trainer(wider, train_data, tmp_path / "s2", init_from=tmp_path / "s1", check=False)
    assert proc.returncode != 0 and "another architecture" in proc.stderr
    muon = tiny_config(optimizer={"name": "muon"})
    with pytest.raises(BadInputError, match="used optimizer.name='adamw'"):
        validate_run(muon, train_data, None, tmp_path / "s1", world_size=1)


def test_continue_data_trains_on_the_sequences_after_the_init_checkpoint(tmp_path, train_data):
    """A critical-batch branch (continue_data) goes on with the data where its trunk stopped:
    3 + 3 steps give the losses of one 6-step run; without it, stage 2 replays the start."""
    constant = {"name": "constant", "warmup_steps": 0}
    common = {"schedule": constant, "checkpoint": {"interval": 3, "keep_last": 1}}
    run_trainer(tiny_config(max_steps=6, **common), train_data, tmp_path / "whole")
    run_trainer(tiny_config(max_steps=3, **common), train_data, tmp_path / "s1")
    cont = tiny_config(max_steps=3, continue_data=True, **common)
    proc = run_trainer(cont, train_data, tmp_path / "s2", init_from=tmp_path / "s1")
    assert "data continues at sequence 12" in proc.stdout
    replay = tiny_config(max_steps=3, **common)
    run_trainer(replay, train_data, tmp_path / "s2-replay", init_from=tmp_path / "s1")
    whole, after = losses_by_step(tmp_path / "whole"), losses_by_step(tmp_path / "s2")
    assert [after[s] for s in (4, 5, 6)] == [whole[s] for s in (4, 5, 6)]
    assert losses_by_step(tmp_path / "s2-replay")[4] != whole[4]
