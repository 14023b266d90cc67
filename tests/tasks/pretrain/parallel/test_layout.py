"""The trainer's parallel layout: refused before anything starts, and checkpoints that move
between layouts (tp=2 -> dp_shard=2 and -> one process) continuing the uninterrupted run."""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from llmflow.tasks.framework.errors import ConfigError

HELPERS = Path(__file__).resolve().parents[1] / "conftest.py"


def _helpers():
    spec = importlib.util.spec_from_file_location("pretrain_test_helpers", HELPERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("world_size", "parallel", "model", "named"),
    [
        (2, {"tp": 3}, {}, "pretrain.train.parallel"),  # 3 does not divide 2 processes
        (4, {"tp": 4}, {}, "num_kv_heads=2"),  # 4 ranks, but 2 KV heads
        (2, {"tp": 2}, {"intermediate_size": 66 + 1}, "intermediate_size=67"),
        (2, {"tp": 2}, {"qk_norm": True}, "qk_norm"),
        (2, {"tp": 2, "compile": True}, {}, "compile=true"),
    ],
)
def test_layout_refused_before_anything_starts(
    tmp_path, monkeypatch, world_size, parallel, model, named
):
    """Through ``train.run`` as torchrun starts it (WORLD_SIZE set): the error names the field,
    in well under a second, before the process group (which would wait for the other ranks)."""
    from llmflow.tasks.pretrain.train import run

    helpers = _helpers()
    data = helpers.make_packed(tmp_path / "data", num_docs=20)
    parallel = dict(parallel)
    optimizer = {"name": parallel.pop("optimizer", "adamw"), "lr": 3e-3}
    compile_blocks = parallel.pop("compile", False)
    cfg = helpers.tiny_config(
        model={"preset": "debug", "overrides": {**helpers.TINY_MODEL, **model}},
        parallel=parallel,
        optimizer=optimizer,
        compile=compile_blocks,
    )
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="pretrain.train.parallel") as err:
        run(cfg, data, tmp_path / "out")
    assert time.perf_counter() - started < 1.0
    assert named in str(err.value)
    assert not dist.is_initialized()
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- moving layouts
STEPS = 8


def layout_config(parallel: dict, micro_batch: int, interval: int = 4):
    """The tiny model (GQA, tied) for ``STEPS`` steps; global batch 4 sequences whatever the
    layout (``micro_batch`` x data-parallel ranks)."""
    return _helpers().tiny_config(
        parallel=parallel,
        batch={"micro_batch_size": micro_batch, "grad_accum_steps": 1},
        max_steps=STEPS,
        checkpoint={"interval": interval, "keep_last": 2},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted runs, validated at steps 6 and 8: one process (the reference) and tp=2 on
    2 processes."""
    helpers, root = _helpers(), tmp_path_factory.mktemp("layouts")
    data = helpers.make_packed(root / "data", num_docs=300, seed=0)
    val = helpers.make_packed(root / "val", num_docs=60, seed=1)
    found = {"data": data, "one": root / "one", "tp2": root / "tp2"}
    helpers.run_trainer(layout_config({}, 4), data, found["one"], val_dir=val, timeout=300)
    helpers.run_trainer(
        layout_config({"tp": 2}, 4), data, found["tp2"], val_dir=val, num_processes=2, timeout=300
    )
    return found


def assert_losses_close(got: dict[int, float], expected: dict[int, float], steps) -> float:
    worst = max(abs(got[s] - expected[s]) / abs(expected[s]) for s in steps)
    assert worst <= 1e-4, (got, expected)
    return worst


@pytest.mark.slow
def test_tp2_run_matches_one_process(runs):
    helpers = _helpers()
    expected, got = helpers.losses_by_step(runs["one"]), helpers.losses_by_step(runs["tp2"])
    assert sorted(got) == list(range(1, STEPS + 1))
    print(f"tp=2 vs one process, max loss rel diff {assert_losses_close(got, expected, got):.2e}")
    # validation reads by data-parallel rank: both TP ranks score the same sequences
    val = {}
    for name in ("one", "tp2"):
        rows = helpers.read_jsonl(runs[name] / "metrics.jsonl")
        val[name] = {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}
    assert sorted(val["tp2"]) == [6, 8]
    assert_losses_close(val["tp2"], val["one"], val["one"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("parallel", "processes", "micro_batch"),
    [({"dp_shard": 2}, 2, 2), ({}, 1, 4), ({"tp": 2}, 2, 4)],
    ids=["to-dp_shard2", "to-one-process", "to-tp2"],
)
def test_tp2_checkpoint_resumes_at_another_layout(tmp_path, runs, parallel, processes, micro_batch):
    """DCP reshards the step-4 checkpoint of the tp=2 run (weights and AdamW moments, in
    canonical row order); the resumed run continues the uninterrupted one's losses."""
    helpers = _helpers()
    out = tmp_path / "resumed"
    source = runs["tp2"] / "checkpoints" / "step-000004"
    shutil.copytree(source, out / "checkpoints" / source.name)
    proc = helpers.run_trainer(
        layout_config(parallel, micro_batch), runs["data"], out, num_processes=processes
    )
    assert "resumed from" in proc.stdout and "step 4" in proc.stdout
    got, expected = helpers.losses_by_step(out), helpers.losses_by_step(runs["one"])
    assert sorted(got) == list(range(5, STEPS + 1))
    worst = assert_losses_close(got, expected, got)
    print(f"tp=2 step 4 -> {parallel or 'one process'}: max loss rel diff {worst:.2e}")


@pytest.mark.slow
def test_tp2_killed_resumes_bitwise(tmp_path, runs):
    """kill -9 after step 5 (checkpoint at step 3): the rerun resumes from step 3 and ends on
    the uninterrupted tp=2 run's weights and losses, bit for bit."""
    helpers = _helpers()
    out, cfg = tmp_path / "killed", layout_config({"tp": 2}, 4, interval=3)
    proc = helpers.run_trainer(
        cfg, runs["data"], out, num_processes=2, check=False, faults={"sigkill_after_step": 5}
    )
    assert proc.returncode != 0 and "SIGKILL after step 5" in proc.stdout + proc.stderr
    assert not (out / "final").exists()
    proc = helpers.run_trainer(cfg, runs["data"], out, num_processes=2)
    assert "resumed from" in proc.stdout and "step 3" in proc.stdout
    got, expected = helpers.losses_by_step(out), helpers.losses_by_step(runs["tp2"])
    assert got == expected
    final = (out / "final" / "model.safetensors").read_bytes()
    assert final == (runs["tp2"] / "final" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_final_exports_the_same_from_tp2_and_one_process(tmp_path, runs):
    """final/ holds canonical weights: the HF export of the tp=2 run equals one process's
    (within the runs' float differences); q/k/v and gate/up rows in their places."""
    from safetensors.torch import load_file

    from llmflow.model.hf import export_hf
    from llmflow.tasks.pretrain.config import TrainConfig

    model_cfg = TrainConfig.load(runs["one"] / "train_config.json").model_config_obj()
    exported = {}
    for name in ("one", "tp2"):
        export_hf(load_file(runs[name] / "final" / "model.safetensors"), model_cfg, tmp_path / name)
        exported[name] = load_file(tmp_path / name / "model.safetensors")
    assert exported["one"].keys() == exported["tp2"].keys()
    worst = 0.0
    for key, expected in exported["one"].items():
        diff = (exported["tp2"][key] - expected).abs().max() / expected.abs().max()
        worst = max(worst, float(diff))
    print(f"HF export, tp=2 vs one process: max rel diff {worst:.2e}")
    assert worst <= 1e-4


def test_stage_steps_count_data_parallel_ranks():
    """A curriculum stage at 4 processes with tp=2 has the global batch, and so the steps, of 2
    data-parallel ranks; plain FSDP keeps counting every rank."""
    from llmflow.tasks.pretrain.curriculum import PretrainConfig, stage_train_config

    def steps(processes: int, parallel: dict) -> int:
        mixture = {"weights": {"p": 1.0}, "num_tokens": 128 * 12, "seq_len": 32}
        stages = [{"name": "s", "mixture": mixture}]
        train = _helpers().tiny_config(parallel=parallel)  # 4 sequences of 32 tokens a rank
        cfg = PretrainConfig(train=train, stages=stages, num_processes=processes)
        return stage_train_config(cfg, 0).max_steps

    assert steps(1, {}) == 12
    assert steps(2, {}) == steps(4, {"tp": 2}) == 6
    assert steps(4, {}) == steps(8, {"tp": 2}) == steps(8, {"tp": 2, "dp_replicate": 2}) == 3


@pytest.mark.slow
def test_weights_only_init_at_tp2(tmp_path, runs):
    """An imported model's weights (model.safetensors, canonical rows) start a tp=2 run as they
    start one process: the same losses from step 1."""
    helpers = _helpers()
    weights = tmp_path / "weights"
    weights.mkdir()
    for name in ("model.safetensors", "model_config.json", "COMPLETE"):
        shutil.copy(runs["one"] / "final" / name, weights / name)
    losses = {}
    for name, parallel, processes in (("one", {}, 1), ("tp2", {"tp": 2}, 2)):
        out = tmp_path / name
        proc = helpers.run_trainer(
            layout_config(parallel, 4),
            runs["data"],
            out,
            init_from=weights,
            num_processes=processes,
        )
        assert "initialised from the weights" in proc.stdout
        losses[name] = helpers.losses_by_step(out)
    assert losses["one"][1] < helpers.losses_by_step(runs["one"])[1] - 0.1  # trained weights
    worst = assert_losses_close(losses["tp2"], losses["one"], losses["one"])
    print(f"weights-only init, tp=2 vs one process: max loss rel diff {worst:.2e}")
