"""The trainer on CUDA: bf16 against fp32, FSDP2 over NCCL under torchrun, the quickstart's
pretraining stages end to end, and the plan's memory against the measured peak at the 1.7B
preset's shapes (``pytest -m gpu``).

Tolerances. Training losses: u / 4 relative per step, argued in tests/tasks/pretrain/
test_bf16.py (bf16's rounding errors average out over the tokens of a loss; the drift of 20
steps of float32 master weights stays far below one bf16 rounding of the loss). FSDP2 against
one process under autocast: u / 2, as the two round in different places (FSDP2 gathers every
parameter in bf16, norms and embeddings included; autocast casts only the matmuls' operands):
measured over gloo on a CPU with tests/gpu/fsdp_worker.py, 4.3e-4 relative at world size 1
and 3.6e-4 at 2, under u / 2 = 2e-3 and 20 times under a loss computed in bf16.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from gpu_helpers import (
    GPU,
    REPO,
    TINY_MODEL,
    U,
    losses_by_step,
    make_packed,
    run_trainer,
    tiny_config,
)

pytestmark = GPU


@pytest.fixture(scope="module")
def gpu_train_data(tmp_path_factory):
    return make_packed(tmp_path_factory.mktemp("data") / "train", num_docs=300, seed=0)


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def _rank(out, rank: int = 0) -> dict:
    return json.loads((out / "ranks" / f"rank-{rank:05d}.json").read_text())


@pytest.mark.parametrize(("tie", "optimizer"), [(True, "muon"), (False, "adamw")])
def test_bf16_tracks_fp32_for_20_steps_on_cuda(tmp_path, gpu_train_data, tie, optimizer):
    losses = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        cfg = tiny_config(
            precision=precision,
            model={"preset": "debug", "overrides": {**TINY_MODEL, "tie_embeddings": tie}},
            optimizer={"name": optimizer, "lr": 3e-3},
            max_steps=20,
            activation_checkpointing="full",
            batch={"micro_batch_size": 2, "grad_accum_steps": 2},
            checkpoint={"interval": 20, "keep_last": 1},
        )
        run_trainer(cfg, gpu_train_data, out)
        losses[precision] = losses_by_step(out)
        assert _summary(out)["precision"] == precision
        assert _rank(out)["matmul_dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[precision]
    fp32, bf16 = losses["fp32"], losses["bf16"]
    assert sorted(bf16) == list(range(1, 21)) and all(math.isfinite(v) for v in bf16.values())
    assert fp32[1] != bf16[1], "bf16 gave fp32's loss to the last bit: it did not run in bf16"
    for step in fp32:
        assert abs(bf16[step] - fp32[step]) <= U / 4 * fp32[step], (step, fp32[step], bf16[step])
    assert bf16[20] < bf16[1] - 0.3


def test_auto_precision_is_bf16_on_cuda(tmp_path, gpu_train_data):
    out = tmp_path / "auto"
    run_trainer(tiny_config(max_steps=2, checkpoint={"interval": 2}), gpu_train_data, out)
    assert _summary(out)["precision"] == "bf16"
    assert _rank(out)["matmul_dtype"] == "bfloat16"


def _worker(tmp_path, name: str, launcher: list[str], *options: str) -> dict:
    out = tmp_path / f"{name}.json"
    script = REPO / "tests" / "gpu" / "fsdp_worker.py"
    proc = subprocess.run(
        [*launcher, str(script), str(out), *options],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "world_size",
    [
        1,
        pytest.param(
            2,
            marks=pytest.mark.skipif(
                torch.cuda.device_count() < 2, reason="world size 2 needs two GPUs"
            ),
        ),
    ],
)
def test_fsdp2_over_nccl_under_torchrun_matches_one_process_under_autocast(tmp_path, world_size):
    reference = _worker(tmp_path, "reference", [sys.executable], "--reference")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc_per_node", str(world_size)]
    sharded = _worker(tmp_path, "sharded", torchrun, "--backend", "nccl")
    assert sharded["world_size"] == world_size
    assert sharded["num_sharded"] == sharded["num_params"]  # every parameter a DTensor
    assert reference["num_sharded"] == 0
    for step, (got, want) in enumerate(zip(sharded["losses"], reference["losses"], strict=True)):
        assert math.isfinite(got) and abs(got - want) <= U / 2 * want, (step, got, want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_trainer_on_two_gpus_matches_one(tmp_path, gpu_train_data):
    """The production path: torchrun, NCCL, FSDP2 in bf16, against one GPU under autocast."""
    common = dict(max_steps=20, precision="bf16", checkpoint={"interval": 10, "keep_last": 1})
    single, double = tmp_path / "single", tmp_path / "double"
    run_trainer(tiny_config(batch={"micro_batch_size": 4}, **common), gpu_train_data, single)
    run_trainer(tiny_config(batch={"micro_batch_size": 2}, **common), gpu_train_data, double,
                num_processes=2)  # fmt: skip
    expected, got = losses_by_step(single), losses_by_step(double)
    assert sorted(got) == list(range(1, 21))
    for step in expected:
        assert abs(got[step] - expected[step]) <= U / 2 * expected[step], step
    for rank in (0, 1):
        info = _rank(double, rank)
        assert info["matmul_dtype"] == "bfloat16" and info["num_sharded"] == info["num_params"]


def test_the_quickstarts_pretraining_stages_run_on_the_gpu(tmp_path):
    """``llmflow run --until pretrain`` on the quickstart, shrunk as in
    tests/flows/test_quickstart_e2e.py: every stage trains on the GPU in bf16 (auto), its losses
    finite and falling from ln(vocab)."""
    sys.path.insert(0, str(REPO / "tests" / "flows"))
    from test_quickstart_e2e import SMALL

    root = tmp_path / "runs"
    args = [sys.executable, "-m", "llmflow.flows.cli", "run", "--root", str(root)]
    args += ["--until", "pretrain"]
    for override in SMALL:
        args += ["--set", override]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summaries = sorted((root / "pretrain").rglob("summary.json"))
    assert len(summaries) == 3, summaries  # the three stages, nothing of the extension
    for path in summaries:
        summary = json.loads(path.read_text())
        assert summary["precision"] == "bf16", path
        ranks = list(path.parent.rglob("rank-00000.json"))
        assert ranks and json.loads(ranks[0].read_text())["matmul_dtype"] == "bfloat16"
        losses = losses_by_step(path.parent)
        assert all(math.isfinite(v) for v in losses.values())
    first = losses_by_step(summaries[0].parent)
    # NOTE: metrics.jsonl holds every log_interval-th step; the shrunk stage logs few of them, so
    # the last loss is compared with the untrained model's ln(vocab), not with the first logged.
    assert first[max(first)] < math.log(1024) - 0.5  # it learns
    assert not (root / "longctx").exists() and not (root / "sft").exists()


def test_plan_predicts_the_measured_peak_at_the_1_7b_shapes_within_10_percent(tmp_path):
    """The 1.7B recipe at full width and depth, micro-batch 1 on one GPU (bf16 under autocast):
    the plan's memory per GPU against ``torch.cuda.max_memory_allocated`` after two steps (the
    second has the optimizer states), the trainer's ``memory_gib``, as preflight measures it."""
    from llmflow.tasks.config import CONFIGS, load_config
    from llmflow.tasks.preflight.rehearsal import (
        RehearsalLauncher,
        peak_memory_gb,
        random_packed,
        steps_train_config,
    )
    from llmflow.tasks.preflight.shape import rehearsal_plan_gb

    config = load_config(str(CONFIGS / "smollm3-1.7b.yaml"))  # launched here on one GPU
    seq = max(s.mixture.seq_len for s in config.pretrain.stages)
    vocab = config.pretrain.train.model_config_obj().vocab_size
    data = random_packed(tmp_path / "data", vocab=vocab, seq_len=seq, rows=8, seed=0)
    train = steps_train_config(config, seq, 1, 2).replaced(deterministic=False)
    assert train.compute_dtype("cuda") == torch.bfloat16
    RehearsalLauncher(1, 1200, print)(train, data, tmp_path / "run")
    measured = peak_memory_gb(tmp_path / "run")
    planned = rehearsal_plan_gb(config, seq, 1, 1)
    error = (planned - measured) / measured
    print(f"1.7B seq {seq} micro 1: plan {planned:.2f} GB, measured {measured:.2f} GB "
          f"({error:+.1%})")  # fmt: skip
    assert abs(error) <= 0.10
