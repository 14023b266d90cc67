"""pp=2 against one process in float64, where rounding drift nearly vanishes and a defect does not.

In float32 the quickstart's stage 1 (debug preset, Muon, tied embeddings, warmup 20, 2
micro-batches) at pp=2 drifts from one process by about 1e-5 after 20 steps on these CPUs (and
by 5e-3 in one report), as cp=2 does: Muon's bf16 Newton–Schulz amplifies every last-bit
difference. In float64 (Newton–Schulz too) the same 20 steps must agree to rounding: the tied
embedding's two copies, the norm over both stages, the micro-batch loss scaling and the schedule
leave no room for a difference of more than 1e-12.

The trainer has no float64 mode; the worker makes one (``float64_everywhere``): float64 default
dtype, so the meta-built model's parameters are float64, and float64 where the model's code
computes in float32 on purpose (RMSNorm's and the loss's ``.float()``, the loss's float32
accumulators, Muon's bf16 Newton–Schulz).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tasks/pretrain/conftest.py

STEPS = 20
# The quickstart's stage 1 (configs/quickstart.yaml) on the tests' tiny data: vocabulary 128,
# rows of 32 tokens; the debug preset's shape (4 blocks: 2 per stage).
QUICKSTART = dict(
    model={"preset": "debug", "overrides": {"vocab_size": 128, "max_seq_len": 64}},
    optimizer={"name": "muon", "lr": 0.003, "weight_decay": 0.1},
    schedule={"warmup_steps": 20, "min_lr_ratio": 0.1},
    batch={"micro_batch_size": 8, "grad_accum_steps": 2},
    max_steps=STEPS,
    checkpoint={"interval": 50, "keep_last": 2},
    eval_interval=50,
    log_interval=1,
)
DEADLINE_S = 300


def float64_everywhere() -> None:
    """Make this process's trainer compute in float64 (test only; see the module docstring)."""
    import llmflow.model.loss as loss_module
    from llmflow.tasks.pretrain import muon

    torch.set_default_dtype(torch.float64)
    to_float = torch.Tensor.float

    def at_least_float32(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else to_float(self, *args, **kwargs)

    torch.Tensor.float = at_least_float32

    class Float64Torch(types.ModuleType):
        float32 = torch.float64

        def __getattr__(self, name: str):
            return getattr(torch, name)

    # NOTE: the loss accumulates in ``torch.float32`` by name; this module's ``torch`` only
    loss_module.torch = Float64Torch("torch")

    def newton_schulz(update, steps=muon.NS_STEPS, eps=muon.EPS):
        a, b, c = muon.NS_COEFFICIENTS
        x = update.double()
        tall = update.size(0) > update.size(1)
        if tall:
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x

    muon.newton_schulz = newton_schulz  # the same quintic as muon.newton_schulz, in float64


def _worker(rank: int, world_size: int, cfg_json: str, data: str, out: str, pg: str) -> None:
    """Train STEPS steps in float64; save this rank's parameters and their dtypes."""
    from llmflow.tasks.pretrain.config import TrainConfig
    from llmflow.tasks.pretrain.train import Trainer

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    float64_everywhere()
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{pg}", rank=rank, world_size=2)
    try:
        trainer = Trainer(TrainConfig.model_validate_json(cfg_json), Path(data), Path(out))
        trainer.fit()
        params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(params, f"{out}/params{rank}.pt")


def _train(tmp_path: Path, cfg, data: Path, world_size: int, name: str):
    """(step -> (loss, grad_norm), each rank's parameters) of a float64 run."""
    ctx = mp.get_context("spawn")
    out = tmp_path / name
    out.mkdir()
    args = (world_size, cfg.model_dump_json(), str(data), str(out), str(tmp_path / f"{name}.pg"))
    procs = [ctx.Process(target=_worker, args=(r, *args)) for r in range(world_size)]
    from tests.tasks.pretrain.parallel.ranks import join_ranks

    join_ranks(procs, DEADLINE_S)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    metrics = {row["step"]: (row["loss"], row["grad_norm"]) for row in rows if "loss" in row}
    return metrics, [torch.load(out / f"params{r}.pt") for r in range(world_size)]


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


@pytest.mark.slow  # two float64 trainers, three processes: about a minute
def test_pp2_quickstart_20_steps_match_one_process_in_float64(tmp_path, train_data):
    from conftest import tiny_config

    expected, [reference] = _train(tmp_path, tiny_config(**QUICKSTART), train_data, 1, "single")
    cfg = tiny_config(**QUICKSTART, parallel={"pp": 2})
    got, stages = _train(tmp_path, cfg, train_data, 2, "pp2")

    assert all(p.dtype == torch.float64 for p in reference.values())
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    assert expected[STEPS][0] < 0.9 * expected[1][0]  # it trained
    for step, (loss, norm) in expected.items():
        assert _relative(got[step][0], loss) <= 1e-12, (step, got[step][0], loss)
        # the norm over both stages, the tied embedding once, in the gradients' dtype
        assert _relative(got[step][1], norm) <= 1e-12, (step, got[step][1], norm)
    first, last = stages
    assert torch.equal(first["embed.weight"], last["embed.weight"])  # one tied weight
    assert set(first) | set(last) == set(reference)
    for params in stages:
        for name, value in params.items():
            scale = reference[name].abs().max().item()
            worst = (value - reference[name]).abs().max().item()
            assert worst <= 1e-12 * scale, (name, worst, scale)


def test_pipeline_norm_keeps_the_gradients_dtype(tmp_path):
    """The pipeline's clip (one stage, a one-rank group) equals torch's clip in float64: the
    norm and the clipped gradients are not rounded through float32."""
    from llmflow.model.config import preset
    from llmflow.model.transformer import Transformer
    from llmflow.tasks.pretrain.parallel.pp import build_stage, clip_grad_norm_

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Transformer(preset("debug", vocab_size=64, num_layers=2)).double()
        stage = build_stage(model, 0, 1)
        grads = {n: torch.randn_like(p) for n, p in stage.named_parameters()}
        for name, param in stage.named_parameters():
            param.grad = grads[name].clone()
        norm = clip_grad_norm_(stage, 1.0, dist.group.WORLD)
        clipped = {n: p.grad.clone() for n, p in stage.named_parameters()}
        for name, param in stage.named_parameters():
            param.grad = grads[name].clone()
        expected = torch.nn.utils.clip_grad_norm_(stage.parameters(), 1.0, foreach=True)
    finally:
        dist.destroy_process_group()
    assert norm > 1.0  # it clipped
    assert _relative(norm, float(expected)) <= 1e-15, (norm, float(expected))
    for name, param in stage.named_parameters():
        assert clipped[name].dtype == torch.float64
        worst = (clipped[name] - param.grad).abs().max().item()
        assert worst <= 1e-15 * param.grad.abs().max().item(), (name, worst)
