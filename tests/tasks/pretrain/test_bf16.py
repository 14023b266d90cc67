"""bf16 training on the CPU: the path GPU users take (autocast in one process, FSDP2's bf16
parameters when sharded), against fp32 and against itself.

Tolerances. bf16 keeps 8 significant bits (unit roundoff u = 2**-8 ~ 3.9e-3). A logit rounded
to bf16 is off by at most u relative, but the loss is a mean over hundreds of tokens of
log-softmaxes, whose rounding errors have random signs: they shrink by ~sqrt(tokens), and the
first step's loss agrees with fp32 to ~1e-5 (measured: 1.2e-5). Training then compounds
them through the float32 master weights for 20 steps (measured: at most 8.5e-5 relative with
AdamW and Muon, tied and untied). We allow u / 4 ~ 1e-3 relative on every step: 10x the
measured drift, and 4x below one bf16 rounding of the loss itself, so a loss computed or
reduced in bf16 (or a bf16 master copy) would fail it. fp32 and bf16 must also differ (the
bf16 path really ran), and the ranks' records name the dtype the projections computed in.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import TINY_MODEL, losses_by_step, run_trainer, tiny_config

U = 2.0**-8


def _config(precision: str, tie: bool = True, optimizer: str = "adamw", **changes):
    return tiny_config(
        precision=precision,
        model={"preset": "debug", "overrides": {**TINY_MODEL, "tie_embeddings": tie}},
        optimizer={"name": optimizer, "lr": 3e-3},
        **changes,
    )


def _rank(out, rank: int = 0) -> dict:
    return json.loads((out / "ranks" / f"rank-{rank:05d}.json").read_text())


@pytest.mark.parametrize(
    "tie,optimizer",
    [
        (True, "muon"),
        pytest.param(True, "adamw", marks=pytest.mark.slow),
        pytest.param(False, "adamw", marks=pytest.mark.slow),
        pytest.param(False, "muon", marks=pytest.mark.slow),
    ],
)
def test_bf16_training_tracks_fp32_within_a_quarter_of_a_bf16_rounding(
    tmp_path, train_data, tie, optimizer
):
    common = dict(
        max_steps=20,
        activation_checkpointing="full",
        batch={"micro_batch_size": 2, "grad_accum_steps": 2},
        checkpoint={"interval": 20, "keep_last": 1},
    )
    losses = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        run_trainer(_config(precision, tie, optimizer, **common), train_data, out)
        losses[precision] = losses_by_step(out)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["precision"] == precision
        # packed documents on the CPU: per-document SDPA, never the dense mask
        assert "sdpa-buckets" in summary["attention"] and "dense" not in summary["attention"]
        assert _rank(out)["matmul_dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[precision]
    fp32, bf16 = losses["fp32"], losses["bf16"]
    assert sorted(bf16) == list(range(1, 21))
    assert all(math.isfinite(v) for v in bf16.values())
    assert fp32[1] != bf16[1], "bf16 gave fp32's loss to the last bit: it did not run in bf16"
    for step in fp32:
        assert abs(bf16[step] - fp32[step]) <= U / 4 * fp32[step], (step, fp32[step], bf16[step])
    assert bf16[20] < bf16[1] - 0.3  # and it learns


def test_fsdp2_bf16_on_two_gloo_ranks_matches_one_process_under_autocast(tmp_path, train_data):
    """FSDP2 gathers bf16 parameters and reduces gradients in float32; one process autocasts.
    The two round at different places (a bf16 copy of each weight vs per-op casts), so they
    agree to the bf16 drift above, not bit for bit (measured: 2.2e-4 relative at most)."""
    common = dict(max_steps=20, precision="bf16", checkpoint={"interval": 10, "keep_last": 1})
    single, double = tmp_path / "single", tmp_path / "double"
    run_trainer(tiny_config(batch={"micro_batch_size": 4}, **common), train_data, single)
    run_trainer(
        tiny_config(batch={"micro_batch_size": 2}, **common), train_data, double, num_processes=2
    )
    expected, got = losses_by_step(single), losses_by_step(double)
    assert sorted(got) == list(range(1, 21))
    for step in expected:
        assert abs(got[step] - expected[step]) <= U / 4 * expected[step], step
    for rank in (0, 1):
        info = _rank(double, rank)
        assert info["matmul_dtype"] == "bfloat16" and info["num_sharded"] == info["num_params"]


def test_bf16_resume_after_a_crash_is_bitwise_exact(tmp_path, train_data):
    cfg = _config("bf16", max_steps=8, checkpoint={"interval": 4, "keep_last": 2})
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_trainer(cfg, train_data, full)
    proc = run_trainer(cfg, train_data, resumed, check=False, faults={"crash_after_step": 6})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    proc = run_trainer(cfg, train_data, resumed)
    assert "resumed from" in proc.stdout and "step 4" in proc.stdout
    assert losses_by_step(resumed) == losses_by_step(full)
    a = (full / "final" / "model.safetensors").read_bytes()
    assert a == (resumed / "final" / "model.safetensors").read_bytes()
