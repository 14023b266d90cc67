"""The trainer at pp=2 (two gloo ranks) against one process on the same global batch.

pp=2 over 2 processes leaves one data-parallel rank, so both runs read the same micro-batches:
the debug preset's tiny model, micro_batch_size 2 x grad_accum_steps 4 (one schedule
micro-batch per accumulation step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tasks/pretrain/conftest.py

from conftest import (  # noqa: E402
    losses_by_step,
    make_packed,
    read_jsonl,
    run_trainer,
    tiny_config,
)

STEPS = 10
COMMON = dict(
    max_steps=STEPS,
    batch={"micro_batch_size": 2, "grad_accum_steps": 4},
    checkpoint={"interval": 5, "keep_last": 2},
)
DEADLINE_S = 240


def _pp(schedule: str) -> dict:
    return {"pp": 2, "pp_schedule": schedule}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


# ------------------------------------------------------------- step-1 gradients (in process)
def _worker(args: argparse.Namespace) -> None:
    """Build the trainer, run step 1's forward/backward and clip; save gradients by name."""
    from llmflow.tasks.pretrain.config import TrainConfig
    from llmflow.tasks.pretrain.distributed import teardown_runtime
    from llmflow.tasks.pretrain.train import Trainer

    trainer = Trainer(TrainConfig.load(Path(args.config)), Path(args.data), Path(args.out))
    loss, _ = trainer.forward_backward(trainer.next_batches(0))
    grads = {}
    for name, param in trainer.model.named_parameters():
        grad = param.grad
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.detach()
    norm = trainer.clip_gradients()
    rank = trainer.runtime.rank
    torch.save({"loss": loss, "norm": norm, "grads": grads}, Path(args.out) / f"grads{rank}.pt")
    teardown_runtime()


def _step_one(cfg, data: Path, out: Path, processes: int) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cfg.save(out / "train_config.json")
    worker = [__file__, "--config", str(out / "train_config.json"), "--data", str(data)]
    worker += ["--out", str(out)]
    if processes == 1:
        command = [sys.executable, *worker]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc_per_node", str(processes), *worker]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    from tests.tasks.pretrain.parallel.ranks import run_group

    run_group(command, env, DEADLINE_S, f"step 1 on {processes} processes")
    return [torch.load(out / f"grads{r}.pt") for r in range(processes)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_packed(tmp_path_factory.mktemp("pp_data") / "train", num_docs=300, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_step_one_gradients_match_one_process(tmp_path, data, schedule):
    (expected,) = _step_one(tiny_config(**COMMON), data, tmp_path / "single", 1)
    ranks = _step_one(tiny_config(**COMMON, parallel=_pp(schedule)), data, tmp_path / "pp", 2)
    names: set[str] = set()
    for got in ranks:
        assert abs(got["loss"] - expected["loss"]) <= 1e-5 * expected["loss"]
        # the norm over both stages (the tied embedding once) before clipping
        assert abs(got["norm"] - expected["norm"]) <= 1e-5 * expected["norm"]
        for name, grad in got["grads"].items():
            assert _relative(grad, expected["grads"][name]) <= 1e-5, name
        names |= set(got["grads"])
    assert names == set(expected["grads"])  # the stages together hold every parameter
    first, last = (set(r["grads"]) for r in ranks)
    assert "layers.0.attn.qkv_proj.weight" in first - last
    assert {"layers.1.attn.qkv_proj.weight", "norm.weight"} <= last - first


# ------------------------------------------------------------ 10 steps, export and resume
def _val_losses(out: Path) -> dict[int, float]:
    rows = read_jsonl(out / "metrics.jsonl")
    return {row["step"]: row["val_loss"] for row in rows if row.get("val_loss") is not None}


@pytest.fixture(scope="module")
def val_data(tmp_path_factory) -> Path:
    return make_packed(tmp_path_factory.mktemp("pp_data") / "val", num_docs=60, seed=1)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, data, val_data) -> Path:
    out = tmp_path_factory.mktemp("pp_single") / "run"
    run_trainer(tiny_config(**COMMON), data, out, val_dir=val_data, timeout=DEADLINE_S)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_trainer_matches_one_process_and_resumes_at_pp1(
    tmp_path, data, val_data, single_run, schedule
):
    from safetensors.torch import load_file

    out = tmp_path / "pp"
    cfg = tiny_config(**COMMON, parallel=_pp(schedule))
    run_trainer(cfg, data, out, val_dir=val_data, num_processes=2, timeout=DEADLINE_S)
    expected, got = losses_by_step(single_run), losses_by_step(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert abs(got[step] - expected[step]) <= 1e-4 * expected[step], step
    # validation (steps 6 and 10) runs the schedule's forward on every stage
    expected_val, got_val = _val_losses(single_run), _val_losses(out)
    assert sorted(got_val) == [6, STEPS]
    for step, value in got_val.items():
        assert abs(value - expected_val[step]) <= 1e-4 * expected_val[step], step
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2

    # The final export holds every stage's tensors (gathered on rank 0).
    reference = load_file(single_run / "final" / "model.safetensors")
    exported = load_file(out / "final" / "model.safetensors")
    assert set(exported) == set(reference)
    for name, value in exported.items():
        assert _relative(value, reference[name]) <= 1e-4, name

    # The pp=2 checkpoint of step 5 (each stage's parameters and optimizer state under their
    # own names) resumes in one process and trains steps 6-10 as the one-process run did.
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "final")
    kept = [row for row in read_jsonl(resumed / "metrics.jsonl") if row["step"] <= 5]
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in kept))
    proc = run_trainer(tiny_config(**COMMON), data, resumed, timeout=DEADLINE_S)
    assert "resumed from" in proc.stdout and "step-000005" in proc.stdout
    got = losses_by_step(resumed)
    assert sorted(got) == list(range(1, STEPS + 1))  # steps 6-10 trained again
    for step in range(6, STEPS + 1):
        assert abs(got[step] - expected[step]) <= 1e-4 * expected[step], step


@pytest.mark.slow
def test_pp2_with_fsdp_over_two_data_parallel_ranks(tmp_path, data):
    """4 gloo ranks: pp=2 x dp_shard=2 (FSDP2 inside each stage) against one process reading
    the same global batch (2 data-parallel ranks x 2 rows = 4 rows per micro-batch)."""
    steps = dict(max_steps=6, checkpoint={"interval": 5, "keep_last": 1})
    single, double = tmp_path / "single", tmp_path / "pp_fsdp"
    batch = {"micro_batch_size": 4, "grad_accum_steps": 2}
    run_trainer(tiny_config(**steps, batch=batch), data, single, timeout=DEADLINE_S)
    batch = {"micro_batch_size": 2, "grad_accum_steps": 2}
    cfg = tiny_config(**steps, batch=batch, parallel=_pp("1f1b"))
    run_trainer(cfg, data, double, num_processes=4, timeout=2 * DEADLINE_S)
    expected, got = losses_by_step(single), losses_by_step(double)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert abs(got[step] - expected[step]) <= 1e-4 * expected[step], step
    ranks = [json.loads((double / "ranks" / f"rank-{r:05d}.json").read_text()) for r in range(4)]
    assert all(info["num_sharded"] == info["num_params"] for info in ranks)  # FSDP2 in stages


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp4_middle_stages_match_one_process(tmp_path, data, schedule):
    """4 gloo ranks, 4 stages of a 6-block model (1 | 2 | 2 | 1 blocks), the tied embedding on
    the first and last: 6 steps within 1e-4, the export gathered from all four."""
    from conftest import TINY_MODEL
    from safetensors.torch import load_file

    model = {"preset": "debug", "overrides": {**TINY_MODEL, "num_layers": 6}}
    steps = dict(COMMON, model=model, max_steps=6)
    single, piped = tmp_path / "single", tmp_path / "pp4"
    run_trainer(tiny_config(**steps), data, single, timeout=DEADLINE_S)
    cfg = tiny_config(**steps, parallel={"pp": 4, "pp_schedule": schedule})
    run_trainer(cfg, data, piped, num_processes=4, timeout=2 * DEADLINE_S)
    expected, got = losses_by_step(single), losses_by_step(piped)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert abs(got[step] - expected[step]) <= 1e-4 * expected[step], step
    reference = load_file(single / "final" / "model.safetensors")
    exported = load_file(piped / "final" / "model.safetensors")
    assert set(exported) == set(reference)
    for name, value in exported.items():
        assert _relative(value, reference[name]) <= 1e-4, name


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--config", "--data", "--out"):
        parser.add_argument(flag, required=True)
    _worker(parser.parse_args())
