"""Expert parallelism (parallel/ep.py) against one process on the same global batch.

Each case runs this file as a worker (``python -m torch.distributed.run ... test_ep.py``): the
trainer takes ``STEPS`` steps of the tiny mixture-of-experts model; the worker records the
initial weights, the step-1 gradients and the final weights (whole, by state-dict name), every
step's loss and every step's tokens per expert (summed over the data-parallel ranks). One
process is the reference. Checkpoints (DCP) are resharded between ep=2 and one process, and a
run killed mid-stage at ep=2 resumes to the uninterrupted run's weights.
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
GLOBAL_ROWS = 4


def _helpers():
    """tests/tasks/pretrain/conftest.py (make_packed, tiny_config, TINY_MODEL) by path."""
    spec = importlib.util.spec_from_file_location("pretrain_test_helpers", HELPERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "router_aux_loss_coef": 0.0, "router_bias_update_rate": 0.001}  # fmt: skip
"""moe-debug at the tiny model's width: 8 experts of width 32, 2 per token, every layer sparse,
balanced by the aux-free bias (the auxiliary loss is a function of each rank's micro-batch, so
a layout that splits the rows differently would not compute one process's loss)."""


def ep_config(parallel: dict, processes: int, **changes):
    """The tiny MoE (moe-debug at the tiny width) at a layout, ``GLOBAL_ROWS`` rows a step."""
    helpers = _helpers()
    dp = processes // parallel.get("ep", 1) * parallel.get("ep", 1)
    base = dict(
        model={"preset": "moe-debug", "overrides": {**helpers.TINY_MODEL, **MOE}},
        optimizer={"name": "adamw", "lr": 3e-3},
        parallel=parallel,
        batch={"micro_batch_size": GLOBAL_ROWS // dp, "grad_accum_steps": 1},
        max_steps=STEPS,
        checkpoint={"interval": 100, "keep_last": 1},
        eval_interval=100,
    )
    return helpers.tiny_config(**{**base, **changes})


def run_worker(cfg, data_dir: Path, out_dir: Path, processes: int, timeout: float = 240) -> dict:
    """Train in ``processes`` ranks; rank 0's record."""
    from tests.tasks.pretrain.parallel.ranks import run_record_worker

    return run_record_worker(__file__, cfg, data_dir, out_dir, processes, timeout)


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    from tests.tasks.pretrain.parallel.ranks import max_rel as relative

    return relative(a, b)


def compare(got: dict, expected: dict) -> dict[str, float]:
    """Max differences: loss (relative, any step), weights at init, step-1 gradients, final
    weights; whether the expert loads were the same at every step."""
    assert got["weights"].keys() == expected["weights"].keys()
    pairs = zip(got["losses"], expected["losses"], strict=True)
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in pairs),
        "init_abs": max(
            (got["weights"][k] - v).abs().max().item() for k, v in expected["weights"].items()
        ),  # fmt: skip
        "grad_rel": max(max_rel(got["grads"][k], v) for k, v in expected["grads"].items()),
        "final_rel": max(max_rel(got["final"][k], v) for k, v in expected["final"].items()),
        "same_loads": float(torch.equal(got["loads"], expected["loads"])),
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return _helpers().make_packed(tmp_path_factory.mktemp("ep") / "train", 300, seed=0)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data) -> dict:
    return run_worker(ep_config({}, 1), data, tmp_path_factory.mktemp("one"), 1)


def assert_matches(got: dict, expected: dict, name: str) -> None:
    diffs = compare(got, expected)
    print(f"{name}: {diffs}")
    assert diffs["init_abs"] == 0.0  # each EP rank draws its experts' rows of the seeded init
    assert diffs["same_loads"] == 1.0  # identical routing: every expert got the same tokens
    assert diffs["loss_rel"] <= 1e-5
    assert diffs["grad_rel"] <= 1e-5
    assert diffs["final_rel"] <= 1e-4


# ----------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    ("parallel", "world", "model", "support", "needles"),
    [
        ({"ep": 2}, 2, "debug", {}, ["parallel.ep=2 needs a mixture-of-experts", "num_experts=0"]),
        ({"ep": 3}, 3, "moe-debug", {}, ["parallel.ep=3 does not divide", "num_experts=8"]),
        ({"ep": 4}, 2, "moe-debug", {}, ["parallel.ep=4 does not divide dp_shard=2"]),
        ({"ep": 2, "tp": 2}, 4, "moe-debug", {}, ["parallel.ep=2 with tp=2"]),
        ({"ep": 2, "cp": 2}, 4, "moe-debug", {}, ["parallel.ep=2 with cp=2"]),
        ({"ep": 2, "pp": 2}, 4, "moe-debug", {}, ["parallel.ep=2 with pp=2"]),
        ({"ep": 2, "dp_replicate": 2}, 4, "moe-debug", {}, ["parallel.ep=2 with dp_replicate=2"]),
        ({"ep": 2}, 2, "moe-debug", {"compile": True}, ["parallel.ep=2", "compile=true"]),
    ],
)  # fmt: skip
def test_check_layout_refuses_what_ep_does_not_run(parallel, world, model, support, needles):
    from llmflow.model.config import preset
    from llmflow.tasks.framework.errors import ConfigError
    from llmflow.tasks.pretrain.parallel.config import ParallelConfig

    with pytest.raises(ConfigError) as err:
        ParallelConfig(**parallel).resolve(world, preset(model), **support)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_ep_layout_keeps_the_dense_mesh_unless_set():
    from llmflow.model.config import preset
    from llmflow.tasks.pretrain.parallel.config import MESH_DIMS, Layout, ParallelConfig

    dense = Layout(dp_shard=4)
    assert dense.ep == 1 and dense.shape == (1, 1, 4, 1, 1) and dense.mesh_dims == MESH_DIMS
    layout = ParallelConfig(ep=2).resolve(4, preset("moe-debug"), optimizer="adamw")
    assert (layout.dp_shard, layout.ep, layout.dp_shard_mod_ep, layout.dp) == (4, 2, 2, 4)
    assert layout.shape == (1, 1, 2, 2, 1, 1) and "ep" in layout.mesh_dims
    assert not layout.is_plain and layout.world_size == 4


# ----------------------------------------------------------------------------- the trainer
def test_ep2_matches_one_process(tmp_path, data, one_process):
    """ep=2 on 2 ranks (dp_shard 2 = ep: no expert FSDP2 shards, the rest FSDP2 over 2)."""
    started = time.perf_counter()
    got = run_worker(ep_config({"ep": 2}, 2), data, tmp_path / "ep2", 2)
    assert_matches(got, one_process, f"ep2 ({time.perf_counter() - started:.1f}s)")
    assert got["expert_shape"] == [4, 64, 32]  # 8 experts / 2 ranks, local (E/ep, 2I, C)


@pytest.mark.slow
def test_ep2_fsdp2_matches_one_process(tmp_path, data, one_process):
    """ep=2 x dp_shard 4 on 4 ranks: the experts also FSDP2-sharded over dp_shard_mod_ep=2."""
    started = time.perf_counter()
    got = run_worker(ep_config({"ep": 2}, 4), data, tmp_path / "ep2-fsdp2", 4, timeout=360)
    assert_matches(got, one_process, f"ep2 x fsdp2 ({time.perf_counter() - started:.1f}s)")
    assert got["expert_shape"] == [2, 64, 32]  # 4 experts per EP rank, halved by FSDP2


@pytest.mark.slow
def test_ep2_with_muon_matches_one_process_as_fsdp_does(tmp_path, data):
    """Muon (the quickstart's optimizer) at ep=2: each expert's gate, up and down matrices
    orthogonalized whole though EP splits the experts over the ranks. Newton-Schulz runs in bf16
    and amplifies FSDP's ~1e-7 gradient rounding (a near-tie token may then pick another expert),
    so the tolerance is the dense Muon FSDP test's 1e-4, and ep=2 is no further from one process
    than plain FSDP2 on 2 ranks (measured: losses 3.2e-5 vs 4.4e-5, final weights 8.3% vs 9.7%)."""
    muon = {"name": "muon", "lr": 3e-3, "muon_lr": 0.02}
    one = run_worker(ep_config({}, 1, optimizer=muon), data, tmp_path / "one", 1)
    fsdp = run_worker(ep_config({}, 2, optimizer=muon), data, tmp_path / "fsdp", 2)
    ep = run_worker(ep_config({"ep": 2}, 2, optimizer=muon), data, tmp_path / "ep2", 2)
    diffs, baseline = compare(ep, one), compare(fsdp, one)
    print(f"ep2 muon: {diffs}; fsdp2 muon: {baseline}")
    assert diffs["init_abs"] == 0.0 and diffs["grad_rel"] <= 1e-5
    assert diffs["loss_rel"] <= 1e-4
    assert diffs["final_rel"] <= 1.5 * baseline["final_rel"] + 1e-3
    assert torch.equal(ep["loads"][:1], one["loads"][:1])  # the first step routes the same


# ----------------------------------------------------------------------------- checkpoints
def _run(cfg, data, out, processes, **kwargs):
    return _helpers().run_trainer(cfg, data, out, num_processes=processes, timeout=300, **kwargs)


@pytest.mark.slow  # 5 trainer launches, about 60 s on 2 cores
def test_checkpoint_reshards_between_ep2_and_one_process(tmp_path, data):
    """A stage trained at ep=2 continues at one process (its DCP checkpoint resharded: each
    rank's experts and their AdamW moments) and the reverse; the next step's loss is the one
    the one-process curriculum takes."""
    helpers = _helpers()
    data2 = helpers.make_packed(tmp_path / "data2", num_docs=120, seed=1)
    layouts = {"one": ({}, 1), "ep2": ({"ep": 2}, 2)}
    for name, (parallel, processes) in layouts.items():
        _run(ep_config(parallel, processes, max_steps=4), data, tmp_path / name / "s1", processes)
    losses = {}
    for first, second in (("one", "one"), ("ep2", "one"), ("one", "ep2")):
        parallel, processes = layouts[second]
        cfg = ep_config(parallel, processes, max_steps=2)
        out = tmp_path / f"{first}-then-{second}"
        proc = _run(cfg, data2, out, processes, init_from=tmp_path / first / "s1")
        assert "initialised from" in proc.stdout
        losses[(first, second)] = helpers.losses_by_step(out)
    expected = losses[("one", "one")]
    assert sorted(expected) == [5, 6]
    print(losses)
    for key, got in losses.items():
        for step, value in expected.items():
            assert abs(got[step] - value) <= 1e-5 * value, (key, step, losses)


@pytest.mark.slow  # 3 trainer launches at ep=2, about 40 s on 2 cores
def test_ep2_killed_resumes_bitwise(tmp_path, data):
    """kill -9 after step 5 (checkpoint at step 3) at ep=2: the rerun resumes from step 3 and
    ends on the uninterrupted run's weights, bit for bit."""
    from safetensors.torch import load_file

    cfg = ep_config({"ep": 2}, 2, max_steps=7, checkpoint={"interval": 3, "keep_last": 2})
    full, killed = tmp_path / "full", tmp_path / "killed"
    _run(cfg, data, full, 2)
    proc = _run(cfg, data, killed, 2, check=False, faults={"sigkill_after_step": 5})
    assert proc.returncode != 0 and "SIGKILL after step 5" in proc.stdout + proc.stderr
    assert not (killed / "final").exists()
    proc = _run(cfg, data, killed, 2)
    assert "resumed from" in proc.stdout and "step 3" in proc.stdout
    helpers = _helpers()
    assert helpers.losses_by_step(killed) == helpers.losses_by_step(full)
    expected = load_file(full / "final" / "model.safetensors")
    got = load_file(killed / "final" / "model.safetensors")
    assert got.keys() == expected.keys() and any("experts" in k for k in got)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


# ----------------------------------------------------------------------------- the worker
def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().float().cpu().clone()


def _tensors(model, pick) -> dict[str, torch.Tensor]:
    from llmflow.model.transformer import _canonical

    return {_canonical(n): _full(pick(p)) for n, p in model.named_parameters()}


def worker(config_path: str, data_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from llmflow.model.moe import Router
    from llmflow.tasks.pretrain.config import TrainConfig
    from llmflow.tasks.pretrain.distributed import teardown_runtime
    from llmflow.tasks.pretrain.train import Trainer

    cfg = TrainConfig.load(Path(config_path))
    trainer = Trainer(cfg, Path(data_dir), Path.cwd())
    model = trainer.model
    experts = next(m for n, m in model.named_modules() if n.endswith("experts"))
    local = experts.gate_up_proj
    local = local.to_local() if isinstance(local, DTensor) else local
    record = {"weights": _tensors(model, lambda p: p), "losses": [], "loads": []}
    record["expert_shape"] = list(local.shape)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    step_loads = torch.zeros(len(routers), routers[0].num_experts, dtype=torch.int64)

    def count(index):
        def hook(module, args, output) -> None:
            if torch.is_grad_enabled():  # training forwards only
                step_loads[index] += torch.bincount(output[2].reshape(-1), minlength=8)

        return hook

    for index, router in enumerate(routers):
        router.register_forward_hook(count(index))
    clip = trainer.clip_gradients

    def clip_recording() -> float:
        if "grads" not in record:
            record["grads"] = _tensors(model, lambda p: p.grad)
        return clip()

    trainer.clip_gradients = clip_recording
    model.train()
    while trainer.state.step < trainer.state.end_step:
        out = trainer.train_step()
        record["losses"].append(out.loss)
        loads = step_loads.clone()
        if dist.is_initialized():  # every rank is a data-parallel rank here
            dist.all_reduce(loads)
        record["loads"].append(loads)
        step_loads.zero_()
    record["loads"] = torch.stack(record["loads"])
    record["final"] = _tensors(model, lambda p: p)
    if trainer.runtime.is_main:
        torch.save(record, Path.cwd() / "record.pt")
    teardown_runtime()


if __name__ == "__main__":
    worker(*sys.argv[1:3])


def test_ep_at_one_moves_no_address_and_any_other_degree_is_hashed():
    """``ep`` came after recipes were embedded in cards: at 1 it is in neither the pretrain
    config's hash nor a card's recipe (test_graph_addresses checks every quickstart address);
    ep=2 enters both."""
    from llmflow.tasks.config import load_config
    from llmflow.tasks.framework.hashing import digest, recipe_dump, versioned_fields

    plain = load_config(None, [])
    ep2 = load_config(None, ["pretrain.train.model.preset=moe-debug", "pretrain.parallel.ep=2",
                             "pretrain.num_processes=2"])  # fmt: skip
    assert "ep" not in recipe_dump(plain)["pretrain"]["train"]["parallel"]
    assert recipe_dump(ep2)["pretrain"]["train"]["parallel"]["ep"] == 2
    parallel = ep2.pretrain.train.parallel
    assert digest(versioned_fields(parallel)) != digest(
        versioned_fields(parallel.model_copy(update={"ep": 1}))
    )
