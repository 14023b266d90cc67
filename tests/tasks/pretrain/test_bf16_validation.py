"""Validation and the NaN/spike guard in bf16: the held-out loss the Validator
computes under the trainer's autocast, and the guard's skip of a non-finite loss.

Tolerance. The Validator runs the forward under autocast (bf16 matmuls) and the loss in float32
(``causal_lm_loss`` upcasts the logits). As for the training loss (tests/tasks/pretrain/
test_bf16.py), a bf16 rounding of a logit is at most u = 2**-8 relative, but the held-out loss
averages hundreds of tokens' log-softmaxes whose rounding errors have random signs, and the
weights it scores drifted from fp32's for 12 steps: we allow u / 4 relative (measured: 1.8e-6
at step 6, 2.3e-5 at step 12). A validation loss computed from bf16 log-probabilities, or a bf16 sum over tokens, would
be off by about u and fail it.
"""

from __future__ import annotations

import json
import math

from conftest import losses_by_step, read_jsonl, run_trainer, tiny_config

U = 2.0**-8


def test_bf16_validation_loss_and_guard_track_fp32(tmp_path, train_data, val_data):
    cfg = dict(
        max_steps=12,
        eval_interval=6,
        guard={"policy": "skip", "window": 8, "min_history": 4, "zscore": 5.0},
        checkpoint={"interval": 6, "keep_last": 1},
    )
    faults = {"scale_loss_at_steps": [8], "loss_scale": math.nan}
    val, summary, events, losses = {}, {}, {}, {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        run_trainer(
            tiny_config(precision=precision, **cfg), train_data, out, val_dir=val_data,
            faults=faults,
        )  # fmt: skip
        rows = read_jsonl(out / "metrics.jsonl")
        val[precision] = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
        summary[precision] = json.loads((out / "summary.json").read_text())
        events[precision] = [
            (e["step"], e["kind"], e["policy"]) for e in read_jsonl(out / "events.jsonl")
        ]
        losses[precision] = losses_by_step(out)
    assert summary["bf16"]["precision"] == "bf16" and summary["fp32"]["precision"] == "fp32"
    # The guard caught the NaN in bf16 as in fp32, and nothing of it reached the weights.
    assert events["bf16"] == events["fp32"] == [(8, "nonfinite", "skip")]
    assert summary["bf16"]["skipped_batches"] == 1 and summary["bf16"]["steps"] == 12
    assert sorted(losses["bf16"]) == list(range(1, 13))
    assert all(math.isfinite(v) for v in losses["bf16"].values())
    assert sorted(val["bf16"]) == sorted(val["fp32"]) == [6, 12]
    for step, fp32 in val["fp32"].items():
        bf16 = val["bf16"][step]
        assert math.isfinite(bf16) and bf16 != fp32, (step, bf16)  # bf16 really ran
        assert abs(bf16 - fp32) <= U / 4 * fp32, (step, fp32, bf16)
    assert summary["bf16"]["val_loss"] == val["bf16"][12]
