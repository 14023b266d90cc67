"""Tensor parallelism (TP + sequence parallelism) against one process on the same global batch.

Each case runs this file as a worker (``python -m torch.distributed.run ... test_tp.py``): the
trainer takes 10 steps; the worker records the initial weights, the step-1 gradients (gathered
with ``full_tensor``, in canonical row order) and every step's loss. One process is the
reference.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
import torch

HELPERS = Path(__file__).resolve().parents[1] / "conftest.py"
STEPS = 10


def _helpers():
    """tests/tasks/pretrain/conftest.py (make_packed, tiny_config, TINY_MODEL) by path."""
    spec = importlib.util.spec_from_file_location("pretrain_test_helpers", HELPERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tp_config(parallel: dict, model: dict | None = None, **changes):
    """The tiny model (GQA: 4 heads, 2 KV heads; tied embeddings) at a parallel layout."""
    helpers = _helpers()
    overrides = {**helpers.TINY_MODEL, **(model or {})}
    return helpers.tiny_config(
        model={"preset": "debug", "overrides": overrides},
        parallel=parallel,
        max_steps=STEPS,
        checkpoint={"interval": 100, "keep_last": 1},
        **changes,
    )


def run_worker(cfg, data_dir: Path, out_dir: Path, processes: int, timeout: float = 240) -> dict:
    """Train ``STEPS`` steps in ``processes`` ranks; rank 0's record (losses, weights, grads)."""
    from tests.tasks.pretrain.parallel.ranks import run_record_worker

    return run_record_worker(__file__, cfg, data_dir, out_dir, processes, timeout)


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    from tests.tasks.pretrain.parallel.ranks import max_rel as relative

    return relative(a, b)


def compare(got: dict, expected: dict) -> dict[str, float]:
    """Max differences: loss (relative, any step), weights at init, step-1 gradients."""
    assert got["weights"].keys() == expected["weights"].keys()
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], expected["losses"], strict=True))
    init = max((got["weights"][k] - v).abs().max().item() for k, v in expected["weights"].items())
    grad = max(max_rel(got["grads"][k], v) for k, v in expected["grads"].items())
    return {"loss_rel": loss, "init_abs": init, "grad_rel": grad}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return _helpers().make_packed(tmp_path_factory.mktemp("tp") / "train", 300, seed=0)


CASES = {
    # model overrides, config changes
    # GQA (KV heads split 1 per rank), tied embeddings, layer 1 without RoPE
    "tied-gqa-nope": ({"nope_layers": [1]}, {}),
    # the vocabulary-parallel loss's z-loss term
    "untied-zloss": ({"tie_embeddings": False}, {"z_loss": 1e-3}),
}


def test_row_order_gives_each_rank_its_heads():
    """Rank r's contiguous block of the tensor-parallel order: its q, k and v heads (GQA)."""
    from llmflow.tasks.pretrain.parallel.tp import row_order

    # 4 q heads, 2 kv heads, head_dim 1: canonical rows q0 q1 q2 q3 k0 k1 v0 v1
    order = row_order([4, 2, 2], 2).tolist()
    assert order[:4] == [0, 1, 4, 6]  # rank 0: q0 q1 k0 v0
    assert order[4:] == [2, 3, 5, 7]  # rank 1: q2 q3 k1 v1
    assert sorted(order) == list(range(8))


def test_seeded_init_in_row_order_equals_the_canonical_rows():
    """``init_normal_(rows=order)`` draws row i of the canonical tensor's row order[i]; a
    column-sharded slice (rowwise TP) gets the same columns one process draws."""
    from llmflow.model.transformer import init_normal_
    from llmflow.tasks.pretrain.parallel.tp import row_order

    canonical, permuted = torch.empty(2048 + 16, 8), torch.empty(2048 + 16, 8)
    init_normal_(canonical, 0.02, seed=3, key="w")
    order = row_order([2048, 8, 8], 4)  # runs crossing the 1024-row blocks of the draw
    init_normal_(permuted, 0.02, seed=3, key="w", rows=order)
    assert torch.equal(permuted, canonical[order])


@pytest.mark.slow  # about 40 s a case on 2 cores
@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_matches_one_process(tmp_path, data, case):
    model, changes = CASES[case]
    started = time.perf_counter()
    expected = run_worker(tp_config({}, model, **changes), data, tmp_path / "one", 1)
    got = run_worker(tp_config({"tp": 2}, model, **changes), data, tmp_path / "tp2", 2)
    diffs = compare(got, expected)
    print(f"{case}: {diffs} ({time.perf_counter() - started:.1f}s)")
    assert diffs["init_abs"] == 0.0  # the seeded init draws the same rows
    assert diffs["loss_rel"] <= 1e-4
    assert diffs["grad_rel"] <= 1e-5
    assert got["sharded"] and not expected["sharded"]


@pytest.mark.slow
def test_tp2_dp2_matches_one_process(tmp_path, data):
    started = time.perf_counter()
    batch = {"micro_batch_size": 2, "grad_accum_steps": 1}
    expected = run_worker(
        tp_config({}, batch={"micro_batch_size": 4, "grad_accum_steps": 1}),
        data,
        tmp_path / "one",
        1,
    )
    got = run_worker(tp_config({"tp": 2, "dp_shard": 2}, batch=batch), data, tmp_path / "2d", 4)
    diffs = compare(got, expected)
    print(f"tp2 x dp_shard2: {diffs} ({time.perf_counter() - started:.1f}s)")
    assert diffs["init_abs"] == 0.0
    assert diffs["loss_rel"] <= 1e-4
    assert diffs["grad_rel"] <= 1e-5


LAYOUTS = {
    # name: (config changes, parallel, processes, micro-batch, loss and gradient tolerances)
    "tp2-activation-ckpt": ({"activation_checkpointing": "full"}, {"tp": 2}, 2, 4, 1e-4, 1e-5),
    "hsdp-2x2": ({}, {"dp_replicate": 2, "dp_shard": 2}, 4, 1, 1e-4, 1e-5),
    "dp_replicate2-tp2": ({}, {"dp_replicate": 2, "tp": 2}, 4, 2, 1e-4, 1e-5),
    "tp2-cp2": ({}, {"tp": 2, "cp": 2}, 4, 4, 1e-4, 1e-5),  # with parallel/cp.py
    # bf16 against one process's autocast: bf16 rounding, not exactness
    "tp2-bf16": ({"precision": "bf16"}, {"tp": 2}, 2, 4, 1e-3, 3e-2),
    "tp2-dp_shard2-bf16": ({"precision": "bf16"}, {"tp": 2, "dp_shard": 2}, 4, 2, 1e-3, 3e-2),
}


@pytest.mark.slow  # 50-95 s each on 2 cores
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_more_layouts_match_one_process(tmp_path, data, name):
    changes, parallel, processes, micro_batch, loss_tol, grad_tol = LAYOUTS[name]
    one = {"micro_batch_size": 4, "grad_accum_steps": 1}
    expected = run_worker(tp_config({}, batch=one, **changes), data, tmp_path / "one", 1)
    batch = {"micro_batch_size": micro_batch, "grad_accum_steps": 1}
    cfg = tp_config(parallel, batch=batch, **changes)
    diffs = compare(run_worker(cfg, data, tmp_path / "par", processes), expected)
    print(f"{name}: {diffs}")
    assert diffs["init_abs"] == 0.0
    assert diffs["loss_rel"] <= loss_tol
    assert diffs["grad_rel"] <= grad_tol


# ----------------------------------------------------------------------------- the worker
def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().float().cpu().clone()


def _canonical_tensors(model, pick) -> dict[str, torch.Tensor]:
    """Each parameter (or its gradient) whole, in canonical row order, by state-dict name."""
    from llmflow.model.transformer import _canonical
    from llmflow.tasks.pretrain.parallel import tp

    full = {_canonical(n): _full(pick(p)) for n, p in model.named_parameters()}
    return tp.canonical_full(model, full)


def worker(config_path: str, data_dir: str) -> None:
    from torch.distributed.tensor import DTensor

    from llmflow.tasks.pretrain.config import TrainConfig
    from llmflow.tasks.pretrain.distributed import teardown_runtime
    from llmflow.tasks.pretrain.train import Trainer

    cfg = TrainConfig.load(Path(config_path))
    trainer = Trainer(cfg, Path(data_dir), Path.cwd())
    record = {
        "weights": _canonical_tensors(trainer.model, lambda p: p),
        "sharded": any(isinstance(p, DTensor) for p in trainer.model.parameters()),
        "losses": [],
    }
    clip = trainer.clip_gradients

    def clip_recording() -> float:
        if "grads" not in record:
            record["grads"] = _canonical_tensors(trainer.model, lambda p: p.grad)
        return clip()

    trainer.clip_gradients = clip_recording
    trainer.model.train()
    while trainer.state.step < trainer.state.end_step:
        out = trainer.train_step()
        record["losses"].append(out.loss)
    if trainer.runtime.is_main:
        torch.save(record, Path.cwd() / "record.pt")
    teardown_runtime()


if __name__ == "__main__":
    worker(*sys.argv[1:3])
