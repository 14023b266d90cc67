"""Muon under FSDP2: 2 gloo ranks against torch.optim.Muon in one process, and exact resume.

The reference applies ``torch.optim.Muon`` to each logical matrix (q, k, v out of ``qkv_proj``;
gate, up out of ``gate_up_proj``; the other hidden matrices whole) and ``torch.optim.AdamW`` to
the rest, with the same groups as the trainer.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from llmflow.model.config import preset
from llmflow.model.transformer import Transformer
from llmflow.tasks.pretrain.config import OptimizerConfig
from llmflow.tasks.pretrain.muon import logical_rows, newton_schulz
from llmflow.tasks.pretrain.optim import split_parameters

STEPS = 20
# Odd sizes so FSDP's row shards are uneven (ceil-sized, the last rank short). The spawned ranks
# import this module: it imports no test helpers at the top.
MODEL = dict(vocab_size=128, hidden_size=40, num_layers=2, num_heads=5, num_kv_heads=1,
             intermediate_size=72, max_seq_len=64)  # fmt: skip
OPTIM = dict(name="muon", lr=3e-3, muon_lr=0.02, muon_weight_decay=0.1, grad_clip=0.0)
ADJUST = ("original", "match_rms_adamw")


def _model() -> Transformer:
    model = Transformer(preset("debug", **MODEL))
    model.init_weights(seed=0)
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randint(
        0, MODEL["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(step)
    )


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    ids = _batch(step)
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


class _ReferenceMuon:
    """torch.optim.Muon over each logical matrix, copied in and out of the fused parameters."""

    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig) -> None:
        parts = logical_rows(model)
        self.blocks = []
        for name, param in split_parameters(model)["hidden_matrix"]:
            start = 0
            for rows in parts.get(name, (param.shape[0],)):
                leaf = torch.nn.Parameter(param.detach()[start : start + rows].clone())
                self.blocks.append((param, start, start + rows, leaf))
                start += rows
        leaves = [leaf for *_, leaf in self.blocks]
        self.muon = torch.optim.Muon(
            leaves,
            lr=cfg.muon_lr,
            weight_decay=cfg.muon_weight_decay,
            momentum=cfg.muon_momentum,
            adjust_lr_fn=cfg.muon_adjust_lr,
        )

    @torch.no_grad()
    def step(self) -> None:
        for param, lo, hi, leaf in self.blocks:
            leaf.copy_(param[lo:hi])
            leaf.grad = param.grad[lo:hi].clone()
        self.muon.step()
        for param, lo, hi, leaf in self.blocks:
            param[lo:hi] = leaf


def _reference(cfg: OptimizerConfig) -> tuple[dict[str, torch.Tensor], list[float]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the spawned ranks: the same matmul kernels, the same sums
    try:
        return _reference_run(cfg)
    finally:
        torch.set_num_threads(threads)


def reference_adamw(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """torch's AdamW on the parameters Muon leaves out, in the trainer's decay groups."""
    groups = split_parameters(model)
    return torch.optim.AdamW(
        [
            {"params": [p for _, p in groups["decay"]], "weight_decay": cfg.weight_decay},
            {"params": [p for _, p in groups["no_decay"]], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
    )


def _reference_run(cfg: OptimizerConfig) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = _model()
    adamw = reference_adamw(model, cfg)
    muon = _ReferenceMuon(model, cfg)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, step)
        loss.backward()
        muon.step()
        adamw.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _fsdp_worker(rank: int, init_file: str, cfgs: list[str], out: str) -> None:
    """One rank: for each config, FSDP2-shard the model and train it STEPS steps."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    results = [_fsdp_train(rank, cfg) for cfg in cfgs]
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _fsdp_train(rank: int, cfg_json: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from llmflow.tasks.pretrain.distributed import Runtime, shard_model
    from llmflow.tasks.pretrain.optim import build_optimizers

    model = shard_model(_model(), Runtime(rank, 2, rank, torch.device("cpu")))
    optimizers = build_optimizers(model, OptimizerConfig.model_validate_json(cfg_json))
    losses = []
    for step in range(STEPS):
        loss = _loss(model, step)  # the same batch on both ranks: FSDP's mean gradient is exact
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"state": get_model_state_dict(model, options=options), "losses": losses}


def _run_fsdp(tmp_path: Path, cfgs: list[OptimizerConfig]) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = tmp_path / "fsdp.pt"
    args = (str(tmp_path / "pg"), [c.model_dump_json() for c in cfgs], str(out))
    procs = [ctx.Process(target=_fsdp_worker, args=(r, *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return torch.load(out)


@pytest.mark.slow  # two spawned ranks: about 20 s idle, longer on a loaded machine
def test_two_ranks_match_single_process_muon(tmp_path):
    """Both adjust_lr rules, 20 steps: every weight within 1e-5 of torch.optim.Muon's."""
    cfgs = [OptimizerConfig(**OPTIM, muon_adjust_lr=adjust) for adjust in ADJUST]
    results = _run_fsdp(tmp_path, cfgs)
    start = _model().state_dict()
    for cfg, got in zip(cfgs, results, strict=True):
        expected, expected_losses = _reference(cfg)
        worst = max((got["state"][k] - v).abs().max().item() for k, v in expected.items())
        assert worst <= 1e-5, (cfg.muon_adjust_lr, worst)
        assert got["losses"] == pytest.approx(expected_losses, abs=1e-5)
        # The run moved the weights far more than the tolerance: the comparison is not vacuous.
        moved = max((expected[k] - v).abs().max().item() for k, v in start.items())
        assert moved > 1e-2


def test_one_process_matches_torch_muon():
    """Unsharded, the trainer's Muon is torch.optim.Muon on the logical matrices, bit for bit."""
    from llmflow.tasks.pretrain.optim import build_optimizers

    cfg = OptimizerConfig(**OPTIM, muon_adjust_lr="match_rms_adamw")
    expected, expected_losses = _reference_run(cfg)
    model = _model()
    optimizers = build_optimizers(model, cfg)
    for step in range(STEPS):
        loss = _loss(model, step)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert loss.item() == expected_losses[step], step
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_logical_matrices_of_fused_projections():
    model = _model()
    parts = logical_rows(model)
    head_dim = MODEL["hidden_size"] // MODEL["num_heads"]
    assert parts["layers.0.attn.qkv_proj.weight"] == (40, head_dim, head_dim)
    assert parts["layers.1.mlp.gate_up_proj.weight"] == (72, 72)
    assert "layers.0.attn.o_proj.weight" not in parts


def test_newton_schulz_orthogonalizes():
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    singular = torch.linalg.svdvals(newton_schulz(g).float())
    # The quintic's fixed point band (about 0.7..1.2), far from g's spread of singular values.
    assert singular.min() > 0.5 and singular.max() < 1.3
    assert torch.linalg.svdvals(g).max() > 5


@pytest.mark.slow
def test_two_rank_muon_trainer_matches_one_process_and_resumes_exactly(tmp_path, train_data):
    """The trainer with Muon on 2 ranks: same losses as 1 process; a crash resumes bitwise."""
    from conftest import losses_by_step, run_trainer, tiny_config

    optimizer = {"name": "muon", "lr": 3e-3, "muon_lr": 0.02}
    common = dict(max_steps=12, optimizer=optimizer, checkpoint={"interval": 4, "keep_last": 2})
    single = tmp_path / "single"
    proc = run_trainer(tiny_config(batch={"micro_batch_size": 4}, **common), train_data, single)
    assert proc.stdout.count("AdamW takes the other") == 1
    cfg = tiny_config(batch={"micro_batch_size": 2}, **common)
    full = tmp_path / "full"
    proc = run_trainer(cfg, train_data, full, num_processes=2)
    assert proc.stdout.count("AdamW takes the other") == 1  # once, on rank 0

    expected, got = losses_by_step(single), losses_by_step(full)
    assert sorted(got) == list(range(1, 13))
    for step in got:
        assert abs(got[step] - expected[step]) <= 1e-4 * abs(expected[step]), step

    resumed = tmp_path / "resumed"
    crash = run_trainer(cfg, train_data, resumed, num_processes=2, check=False,
                        faults={"crash_after_step": 6})  # fmt: skip
    assert crash.returncode != 0
    proc = run_trainer(cfg, train_data, resumed, num_processes=2)
    assert "resumed from" in proc.stdout and "step 4" in proc.stdout
    assert losses_by_step(resumed) == got
