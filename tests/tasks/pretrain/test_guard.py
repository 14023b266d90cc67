"""Stability guards: an injected loss spike or NaN triggers the configured policy."""

from __future__ import annotations

import json
import math

import pytest
from conftest import losses_by_step, read_jsonl, run_trainer, tiny_config

from llmflow.tasks.pretrain.config import GuardConfig
from llmflow.tasks.pretrain.guard import StabilityGuard


def test_zscore_hand_computed():
    guard = StabilityGuard(GuardConfig(window=4, min_history=3, zscore=3.0))
    for loss in (1.0, 2.0, 3.0):
        assert guard.check(loss, 1.0) == ("ok", 0.0)
        guard.accept(loss)
    # mean 2, sample std 1 -> z = (5 - 2) / 1
    assert guard.zscore(5.0) == pytest.approx(3.0)
    assert guard.check(5.5, 1.0)[0] == "spike"
    assert guard.check(4.9, 1.0)[0] == "ok"
    assert guard.check(float("nan"), 1.0)[0] == "nonfinite"
    assert guard.check(2.0, float("inf"))[0] == "nonfinite"
    for loss in (10.0, 11.0):  # the window keeps the last 4 accepted losses
        guard.accept(loss)
    assert list(guard.history) == [2.0, 3.0, 10.0, 11.0]
    restored = StabilityGuard(guard.cfg)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert restored.state_dict() == guard.state_dict()


def _guarded(policy):
    return tiny_config(
        max_steps=10,
        guard={"policy": policy, "window": 8, "min_history": 4, "zscore": 5.0},
        checkpoint={"interval": 4, "keep_last": 2},
    )


def _faults(scale, steps=(8,)):
    """Multiply the loss of ``steps`` by ``scale`` (the fault-injection component)."""
    return {"scale_loss_at_steps": list(steps), "loss_scale": scale}


@pytest.fixture(scope="module")
def clean_losses(tmp_path_factory, train_data):
    clean = tmp_path_factory.mktemp("clean")
    cfg = tiny_config(max_steps=10, checkpoint={"interval": 4, "keep_last": 2})
    run_trainer(cfg, train_data, clean)
    return losses_by_step(clean)


@pytest.mark.parametrize(("scale", "kind"), [(100.0, "spike"), (math.nan, "nonfinite")])
def test_skip_policy_drops_the_batch(tmp_path, train_data, clean_losses, scale, kind):
    out = tmp_path / "skip"
    run_trainer(_guarded("skip"), train_data, out, faults=_faults(scale))

    events = read_jsonl(out / "events.jsonl")
    assert [(e["step"], e["kind"], e["policy"]) for e in events] == [(8, kind, "skip")]
    assert events[0]["batch_ids"] == [8, 9]  # the ninth micro-batch drawn
    expected, got = clean_losses, losses_by_step(out)
    if kind == "spike":
        assert events[0]["loss"] == pytest.approx(100 * expected[9], rel=1e-6)
    # Nothing of the bad batch reached the weights: steps 1-8 are untouched, and the run
    # still makes 10 updates (the skipped batch does not count as one).
    assert [got[s] for s in range(1, 9)] == [expected[s] for s in range(1, 9)]
    assert sorted(got) == list(range(1, 11)) and all(math.isfinite(v) for v in got.values())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_batches"] == 1 and summary["steps"] == 10


def test_rewind_policy_reloads_the_checkpoint_with_lower_lr(tmp_path, train_data):
    out = tmp_path / "rewind"
    run_trainer(_guarded("rewind"), train_data, out, faults=_faults(100.0, steps=(6,)))

    events = read_jsonl(out / "events.jsonl")
    assert len(events) == 1
    assert events[0]["kind"] == "spike" and events[0]["rewound_to"] == 4
    assert events[0]["lr_scale"] == 0.5
    rows = read_jsonl(out / "metrics.jsonl")
    step5 = [r for r in rows if r["step"] == 5]
    assert len(step5) == 2, "step 5 runs before the spike and again after the rewind"
    assert step5[1]["lr"] == pytest.approx(0.5 * step5[0]["lr"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rewinds"] == 1 and summary["steps"] == 10


def test_stop_policy_fails_the_run(tmp_path, train_data):
    stop = tmp_path / "stop"
    proc = run_trainer(_guarded("stop"), train_data, stop, check=False, faults=_faults(100.0))
    assert proc.returncode != 0
    assert "stability guard: spike at step 8" in proc.stderr
