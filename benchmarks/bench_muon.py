"""Distributed Muon on 2 gloo ranks (FSDP2, CPU): step time against AdamW, and parity with
``torch.optim.Muon`` in one process.

Step time: one FSDP2 model per optimizer (same init, same batches: 4 x 128 tokens per rank),
alternating rounds (ABBA); each round times ``--steps`` whole train steps (forward, backward,
optimizer) and, separately, the optimizer step alone, on rank 0 between barriers. The headline
``ratio`` is AdamW's median step time over Muon's (below 1: Muon is slower); ``optimizer_ratio``
is the same for the optimizer step alone (Muon adds two all_to_all and Newton-Schulz on each
owner's matrices).

Parity: 20 steps of a small model on both ranks against the single-process reference
(``torch.optim.Muon`` on each logical matrix, AdamW for the rest), as the max absolute
difference over all weights: ``parity_same_batch`` (every rank sees the whole batch, so the
gradients are bitwise those of one process) and ``parity_split_batch`` (each rank half the batch,
as the trainer does: the gradients differ by float rounding, which bf16 Newton-Schulz amplifies),
beside ``split_batch_noise_one_process``: the same reference in one process with the loss taken
as the mean of the two half-batch losses, i.e. what that rounding alone does without any
distribution.
``identical_work`` is measured, not assumed: both sides drew the same batches in the same order
and their first step (same initial weights, same batch) gave the same loss. Prints ONE JSON line.

    python benchmarks/bench_muon.py [--rounds 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import emit, order

from llmflow.model.config import ModelConfig
from llmflow.model.transformer import Transformer
from llmflow.tasks.pretrain.config import OptimizerConfig
from llmflow.tasks.pretrain.muon import logical_rows
from llmflow.tasks.pretrain.optim import build_optimizers, split_parameters

WORLD = 2
SHAPES = dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
              intermediate_size=768, max_seq_len=128)  # fmt: skip
PARITY_SHAPES = dict(vocab_size=128, hidden_size=40, num_layers=2, num_heads=5, num_kv_heads=1,
                     intermediate_size=72, max_seq_len=64)  # fmt: skip
BATCH, SEQ = 4, 128
PARITY_STEPS = 20
MUON = OptimizerConfig(name="muon", lr=3e-3, muon_lr=0.02, muon_weight_decay=0.1, grad_clip=0.0)
ADAMW = OptimizerConfig(name="adamw", lr=3e-3, grad_clip=0.0)


def _model(shapes: dict) -> Transformer:
    model = Transformer(ModelConfig(**shapes))
    model.init_weights(seed=0)
    return model


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _ids(step: int, rows: int, vocab: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(step))


def _sharded(shapes: dict, cfg: OptimizerConfig, rank: int):
    from llmflow.tasks.pretrain.distributed import Runtime, shard_model

    model = shard_model(_model(shapes), Runtime(rank, WORLD, rank, torch.device("cpu")))
    return model, build_optimizers(model, cfg)


# ----------------------------------------------------------------------------- step time
def _train_step(model, optimizers, ids) -> tuple[float, float, float]:
    """Seconds of the whole step and of the optimizer step alone (between barriers); the loss."""
    dist.barrier()
    start = time.perf_counter()
    loss = _loss(model, ids)
    loss.backward()
    dist.barrier()
    mid = time.perf_counter()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    end = time.perf_counter()
    return end - start, end - mid, loss.item()


def _timing(rank: int, rounds: int, steps: int) -> dict:
    sides = {"adamw": _sharded(SHAPES, ADAMW, rank), "muon": _sharded(SHAPES, MUON, rank)}
    times = {name: {"step": [], "optimizer": [], "batches": [], "losses": []} for name in sides}
    for i, name in enumerate(order(list(sides), rounds + 1)):
        for s in range(steps):
            seed = 1000 * (i // 2) + 10 * s + rank
            ids = _ids(seed, BATCH, SHAPES["vocab_size"], SEQ + 1)
            step_s, opt_s, loss = _train_step(*sides[name], ids)
            times[name]["batches"].append(seed)
            times[name]["losses"].append(loss)
            if i >= 2:  # the first round of each side warms up
                times[name]["step"].append(step_s)
                times[name]["optimizer"].append(opt_s)
    return times


# ----------------------------------------------------------------------------- parity
def _parity_run(rank: int, split: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model, optimizers = _sharded(PARITY_SHAPES, MUON, rank)
    for step in range(PARITY_STEPS):
        ids = _ids(step, 4, PARITY_SHAPES["vocab_size"], 17)
        _loss(model, ids.chunk(WORLD)[rank] if split else ids).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def _reference(halves: bool = False) -> dict[str, torch.Tensor]:
    """torch.optim.Muon on each logical matrix (copied in and out), AdamW on the rest.

    ``halves``: the loss as the mean of the two half-batches' losses (the same value up to float
    rounding): how far rounding alone moves one process's run (the split-batch noise floor).
    """
    model = _model(PARITY_SHAPES)
    groups, parts = split_parameters(model), logical_rows(model)
    blocks = []
    for name, param in groups["hidden_matrix"]:
        start = 0
        for rows in parts.get(name, (param.shape[0],)):
            leaf = torch.nn.Parameter(param.detach()[start : start + rows].clone())
            blocks.append((param, start, start + rows, leaf))
            start += rows
    muon = torch.optim.Muon([b[3] for b in blocks], lr=MUON.muon_lr,
                            weight_decay=MUON.muon_weight_decay, momentum=MUON.muon_momentum,
                            adjust_lr_fn=MUON.muon_adjust_lr)  # fmt: skip
    adamw = torch.optim.AdamW(
        [
            {"params": [p for _, p in groups["decay"]], "weight_decay": MUON.weight_decay},
            {"params": [p for _, p in groups["no_decay"]], "weight_decay": 0.0},
        ],
        lr=MUON.lr,
        betas=MUON.betas,
        eps=MUON.eps,
    )
    for step in range(PARITY_STEPS):
        ids = _ids(step, 4, PARITY_SHAPES["vocab_size"], 17)
        if halves:
            sum(_loss(model, part) for part in ids.chunk(WORLD)).div(WORLD).backward()
        else:
            _loss(model, ids).backward()
        with torch.no_grad():
            for param, lo, hi, leaf in blocks:
                leaf.copy_(param[lo:hi])
                leaf.grad = param.grad[lo:hi].clone()
            muon.step()
            for param, lo, hi, leaf in blocks:
                param[lo:hi] = leaf
        adamw.step()
        model.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- driver
def _worker(rank: int, init_file: str, rounds: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    result = {
        "same": _parity_run(rank, split=False),
        "split": _parity_run(rank, split=True),
        "times": _timing(rank, rounds, steps),
    }
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


def _max_diff(got: dict, expected: dict) -> float:
    return max((got[k] - v).abs().max().item() for k, v in expected.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per optimizer")
    parser.add_argument("--steps", type=int, default=3, help="train steps per round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.pt"
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_worker, args=(r, f"{tmp}/pg", args.rounds, args.steps, str(out)))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        result = torch.load(out)
    torch.set_num_threads(1)
    expected = _reference()
    noise = _max_diff(_reference(halves=True), expected)
    times = result["times"]
    identical = (
        times["adamw"]["batches"] == times["muon"]["batches"]
        and times["adamw"]["losses"][0] == times["muon"]["losses"][0]
    )
    median = {
        k: {s: statistics.median(v[s]) for s in ("step", "optimizer")} for k, v in times.items()
    }
    emit(
        "muon_fsdp",
        world_size=WORLD,
        ratio=round(median["adamw"]["step"] / median["muon"]["step"], 3),
        optimizer_ratio=round(median["adamw"]["optimizer"] / median["muon"]["optimizer"], 3),
        muon_step_s=median["muon"]["step"],
        adamw_step_s=median["adamw"]["step"],
        muon_optimizer_s=median["muon"]["optimizer"],
        adamw_optimizer_s=median["adamw"]["optimizer"],
        parity_steps=PARITY_STEPS,
        parity_same_batch=f"{_max_diff(result['same'], expected):.2e}",
        parity_split_batch=f"{_max_diff(result['split'], expected):.2e}",
        split_batch_noise_one_process=f"{noise:.2e}",
        rounds=args.rounds,
        steps_per_round=args.steps,
        identical_work=identical,
        seconds={k: v["step"] for k, v in times.items()},
    )


if __name__ == "__main__":
    main()
