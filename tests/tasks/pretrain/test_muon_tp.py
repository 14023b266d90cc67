"""Muon under tensor parallelism and HSDP: gloo ranks against torch.optim.Muon in one process.

Each layout runs twice: given the same gradients (drawn whole, in canonical row order, and
placed on each rank's piece), the updated hidden matrices equal one process's bit for bit (the
owner orthogonalizes the same bf16 blocks); trained on the same batch through the sharded model,
they differ only by the float rounding of the gradients' sums and the bf16 Newton–Schulz it
feeds (see ``TRAIN_TOLERANCE``).
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from test_muon_fsdp import _ReferenceMuon, reference_adamw

from llmflow.model.config import preset
from llmflow.model.transformer import Transformer
from llmflow.tasks.pretrain.config import OptimizerConfig
from llmflow.tasks.pretrain.optim import split_parameters

GIVEN_STEPS, TRAIN_STEPS = 3, 2
# GQA; an odd hidden size (explicit head_dim) so FSDP's row shards of o_proj and down_proj are
# uneven; heads, KV heads, intermediate and vocabulary sizes divisible by tp=2.
MODEL = dict(vocab_size=128, hidden_size=21, num_layers=2, num_heads=4, num_kv_heads=2,
             explicit_head_dim=6, intermediate_size=36, max_seq_len=64)  # fmt: skip
OPTIM = dict(name="muon", lr=3e-3, muon_lr=0.02, muon_weight_decay=0.1, grad_clip=0.0)
# NOTE: Newton–Schulz in bf16 amplifies a flipped rounding of its input (its quintic pushes the
# small singular values up ~3.4x an iteration), and the next step's gradient feeds on it:
# gradients that differ in float32's last bits (TP's partial sums, FSDP's reduce-scatter) move
# the trained weights apart as much as one process moves against itself when its own gradients
# are perturbed by 1e-6 relative (measured: ~3% of the weights' change after 2 steps, ~10%
# after 5). That self-spread under NOISE is the tolerance's unit.
NOISE = 1e-6
LAYOUTS = {
    # name: (dp_replicate, dp_shard, tp)
    "tp2": (1, 1, 2),
    "dp_shard2-tp2": (1, 2, 2),
    "dp_replicate2": (2, 1, 1),
    "hsdp-2x2": (2, 2, 1),
    "dp_replicate2-tp2": (2, 1, 2),
}


def _plain_model() -> Transformer:
    model = Transformer(preset("debug", **MODEL))
    model.init_weights(seed=0)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels of 16 tokens (sequence parallelism splits them over tp ranks)."""
    ids = torch.randint(
        0, MODEL["vocab_size"], (4, 17), generator=torch.Generator().manual_seed(step)
    )
    return ids[:, :-1], ids[:, 1:]


def _grads(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """A whole gradient for each hidden matrix (canonical order), drawn from the step's seed."""
    from llmflow.model.transformer import _canonical

    generator = torch.Generator().manual_seed(1000 + step)
    return {
        _canonical(name): torch.randn(param.shape, generator=generator)
        for name, param in split_parameters(model)["hidden_matrix"]
    }


# ------------------------------------------------------------------------------ one process
def _reference(cfg: OptimizerConfig) -> dict:
    """One process: given gradients, trained, and the trained run's spread under NOISE."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the spawned ranks: the same matmul kernels, the same sums
    try:
        trained = _reference_trained(cfg)
        spread = max(_worst(_reference_trained(cfg, NOISE, seed), trained) for seed in (1, 2))
        return {"given": _reference_given(cfg), "trained": trained, "spread": spread}
    finally:
        torch.set_num_threads(threads)


def _worst(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((got[k] - v).abs().max().item() for k, v in expected.items())


def _reference_given(cfg: OptimizerConfig) -> dict[str, torch.Tensor]:
    model = _plain_model()
    muon = _ReferenceMuon(model, cfg)
    hidden = dict(split_parameters(model)["hidden_matrix"])
    for step in range(GIVEN_STEPS):
        for name, grad in _grads(model, step).items():
            hidden[name].grad = grad
        muon.step()
    return {name: p.detach().clone() for name, p in hidden.items()}


def _reference_trained(
    cfg: OptimizerConfig, noise: float = 0.0, seed: int = 0
) -> dict[str, torch.Tensor]:
    """``noise``: every gradient scaled by 1 + noise x a standard normal draw (``seed``)."""
    model = _plain_model()
    generator = torch.Generator().manual_seed(seed)
    adamw = reference_adamw(model, cfg)
    muon = _ReferenceMuon(model, cfg)
    for step in range(TRAIN_STEPS):
        inputs, labels = _batch(step)
        model(inputs, labels=labels)[0].backward()
        for param in model.parameters() if noise else ():
            param.grad.mul_(1 + noise * torch.randn(param.shape, generator=generator))
        muon.step()
        adamw.step()
        model.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------ the ranks
def _worker(rank: int, world: int, shape: tuple, init_file: str, cfg_json: str, out: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = OptimizerConfig.model_validate_json(cfg_json)
    results = {"given": _given(rank, shape, cfg), "trained": _trained(rank, shape, cfg)}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _sharded_model(rank: int, shape: tuple) -> torch.nn.Module:
    """The trainer's way: on the meta device, TP then FSDP2/HSDP, then the seeded init."""
    from llmflow.tasks.pretrain.distributed import Runtime, shard_model
    from llmflow.tasks.pretrain.parallel import tp
    from llmflow.tasks.pretrain.parallel.config import Layout
    from llmflow.tasks.pretrain.parallel.mesh import build_mesh

    replicate, dp_shard, tp_size = shape
    layout = Layout(dp_replicate=replicate, dp_shard=dp_shard, tp=tp_size)
    mesh = build_mesh("cpu", layout)
    with torch.device("meta"):
        model = Transformer(preset("debug", **MODEL))
    if tp_size > 1:
        tp.apply_tp(model, mesh["tp"])
    if layout.dp > 1:
        dp_mesh = (
            mesh.world[("dp_replicate", "dp_shard_cp")] if replicate > 1 else mesh["dp_shard_cp"]
        )
        runtime = Runtime(rank, layout.world_size, rank, torch.device("cpu"))
        shard_model(model, runtime, torch.float32, dp_mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def _given(rank: int, shape: tuple, cfg: OptimizerConfig) -> dict[str, torch.Tensor]:
    """Muon alone, each step's whole gradients placed on the parameters' pieces."""
    from torch.distributed.tensor import distribute_tensor

    from llmflow.model.transformer import _canonical
    from llmflow.tasks.pretrain.muon import row_orders
    from llmflow.tasks.pretrain.optim import build_optimizers

    model = _sharded_model(rank, shape)
    muon, _ = build_optimizers(model, cfg)
    hidden = split_parameters(model)["hidden_matrix"]
    orders = row_orders(model)
    for step in range(GIVEN_STEPS):
        grads = _grads(model, step)
        for name, param in hidden:
            grad = grads[_canonical(name)]
            if name in orders:  # held in tensor-parallel row order
                grad = grad[orders[name]]
            param.grad = distribute_tensor(grad, param.device_mesh, param.placements)
        muon.step()
    return {k: v for k, v in _whole(model).items() if k in grads}


def _trained(rank: int, shape: tuple, cfg: OptimizerConfig) -> dict[str, torch.Tensor]:
    """Muon and AdamW on the sharded model, the same batch on every rank (the mean gradient of
    the data-parallel ranks is the one process's)."""
    from llmflow.tasks.pretrain.optim import build_optimizers

    model = _sharded_model(rank, shape)
    optimizers = build_optimizers(model, cfg)
    for step in range(TRAIN_STEPS):
        inputs, labels = _batch(step)
        model(inputs, labels=labels)[0].backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return _whole(model)


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole, in canonical row order, by state-dict name."""
    from torch.distributed.tensor import DTensor

    from llmflow.model.transformer import _canonical
    from llmflow.tasks.pretrain.parallel import tp

    full = {
        _canonical(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return tp.canonical_full(model, full)


def run_layout(tmp_path: Path, shape: tuple, cfg: OptimizerConfig) -> dict:
    world = shape[0] * shape[1] * shape[2]
    out = tmp_path / "ranks.pt"
    args = (world, shape, str(tmp_path / "pg"), cfg.model_dump_json(), str(out))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, *args)) for r in range(world)]
    from tests.tasks.pretrain.parallel.ranks import join_ranks

    join_ranks(procs, 300)
    return torch.load(out)


@pytest.mark.slow  # 2 or 4 spawned gloo ranks: 20-60 s each on 2 cores
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_muon_matches_one_process(tmp_path, name):
    cfg = OptimizerConfig(**OPTIM, muon_adjust_lr="match_rms_adamw")
    got = run_layout(tmp_path, LAYOUTS[name], cfg)
    expected = _reference(cfg)
    start = _plain_model().state_dict()

    for key, value in expected["given"].items():
        assert torch.equal(got["given"][key], value), (name, key)
    trained, spread = expected["trained"], expected["spread"]
    worst = _worst(got["trained"], trained)
    moved = _worst(trained, start)
    print(f"{name}: weights differ by {worst:.2e}; one process's spread under {NOISE} relative "
          f"gradient noise {spread:.2e}; the run moved them by {moved:.2e}")  # fmt: skip
    assert worst <= 3 * spread, (name, worst, spread)
    assert moved > 10 * spread  # far beyond the rounding: the comparison is not vacuous


def test_logical_rows_of_a_tensor_parallel_model():
    """apply_tp leaves each attention module its share of the heads: the logical matrices are
    still cut from the whole fused weight."""
    from llmflow.tasks.pretrain.muon import logical_rows

    with torch.device("meta"):
        model = Transformer(preset("debug", **MODEL))
    whole = logical_rows(model)
    for block in model.layers:  # what apply_tp does to the modules at tp=2
        block.attn.num_heads, block.attn.num_kv_heads = 2, 1
    assert logical_rows(model) == whole
    assert whole["layers.0.attn.qkv_proj.weight"] == (24, 12, 12)


def test_runs_of_rows_in_tensor_parallel_order():
    """A tp rank's rows of a fused qkv weight, [its q heads, its k heads, its v heads], fall in
    three runs, each stepped with its own logical matrix's LR adjustment."""
    from llmflow.tasks.pretrain.muon import Spread, _runs
    from llmflow.tasks.pretrain.parallel.tp import row_order

    order = row_order([4, 2, 2], 2)  # canonical rows q0 q1 q2 q3 k0 k1 v0 v1, head_dim 1
    pieces = [order[:4], order[4:]]
    cols = [torch.arange(3)] * 2
    assert _runs(Spread(None, 1, pieces, cols), (4, 2, 2)) == [(0, 2, 4), (2, 3, 2), (3, 4, 2)]
    whole = torch.arange(24.0).view(8, 3)
    spread = Spread(None, 0, pieces, cols)
    back = spread.assemble([spread.piece(whole, r) for r in (0, 1)], whole.shape)
    assert torch.equal(back, whole)
    assert torch.equal(spread.piece(whole, 1).view(4, 3), whole[[2, 3, 5, 7]])
