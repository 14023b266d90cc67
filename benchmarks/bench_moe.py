"""Mixture of experts on CPU: our MoE block against transformers' Qwen3-MoE block, our MoE train
step against our dense one, and the floor of any block at these shapes.

Parts (one JSON line each, the block's first):

- ``moe_block`` (a): our ``MoE`` forward+backward against transformers'
  ``Qwen3MoeSparseMoeBlock`` taken from a ``Qwen3MoeForCausalLM`` (so its config carries the
  experts implementation transformers picks by default: ``grouped_mm``; the record says which
  one ran and which kernel it calls), the same router and expert weights copied across, the same
  input and output gradient, at each shape of ``--shapes``. Per shape and dtype the two sides run
  back to back in every round (which goes first swaps each round); the figure is the median of
  the per-round ratios (transformers' time / ours: above 1, ours faster) with their range.
  ``identical_work``: both outputs agree within 1e-4 (float32; bf16 within 2e-2 of the scale).
  ``floor_ms``: the block's matmuls alone (forward, input and weight gradients of every
  expert, tokens spread evenly, into preallocated buffers: no routing, no elementwise work),
  so ``max_ratio`` (transformers' time / floor) is the most any block of these matmuls can
  reach with torch's GEMM; ``gemm_gflops`` is their FLOPs over that time.
- ``moe_loop_vs_grouped_mm`` (d): our block with one ``mm`` per expert against
  ``torch._grouped_mm`` (``GroupedExperts.use_loop``), the same rounds; the ratio is the
  grouped_mm time / the loop time (above 1: the loop is faster, our CPU default).
- ``moe_train_step`` (b): the ``moe-debug`` preset's train step (forward and backward with
  labels, AdamW) against ``debug``'s, equal active parameters, batch 8 x 256; ratio is the MoE
  step's time / the dense step's.

    python benchmarks/bench_moe.py [--rounds 7] [--quick] [--results FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script or imported

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    alternate,
    append_results,
    emit,
    paired_order,
    per_round_ratios,
)
from llmflow.model.config import ModelConfig, preset  # noqa: E402
from llmflow.model.loss import IGNORE_INDEX  # noqa: E402
from llmflow.model.moe import MoE  # noqa: E402
from llmflow.model.transformer import Transformer  # noqa: E402
from llmflow.tasks.pretrain.config import OptimizerConfig  # noqa: E402
from llmflow.tasks.pretrain.optim import build_optimizers  # noqa: E402

SHAPES = ["512,8,256,2,8192", "512,16,512,2,4096"]
"""hidden, experts, expert width, top-k, tokens."""
QUICK_SHAPES = ["64,4,32,2,256"]


def parse_shape(text: str) -> dict:
    hidden, experts, width, top_k, tokens = (int(v) for v in text.split(","))
    return dict(hidden=hidden, experts=experts, width=width, top_k=top_k, tokens=tokens)


def pair(shape: dict, dtype: torch.dtype):
    """Our block and transformers' with the same weights (drawn once, seeded)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf_cfg = Qwen3MoeConfig(
        hidden_size=shape["hidden"], moe_intermediate_size=shape["width"],
        num_experts=shape["experts"], num_experts_per_tok=shape["top_k"], norm_topk_prob=True,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
        intermediate_size=shape["width"],
    )  # fmt: skip
    peer = Qwen3MoeForCausalLM(hf_cfg).model.layers[0].mlp.train()
    cfg = ModelConfig(
        vocab_size=64, hidden_size=shape["hidden"], num_layers=1, num_heads=4, num_kv_heads=2,
        intermediate_size=shape["width"], num_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"], moe_intermediate_size=shape["width"],
        hf_model_type="mixtral",
    )  # fmt: skip
    ours = MoE(cfg).train()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
        peer.gate.weight.copy_(ours.router.weight)
        peer.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
        peer.experts.down_proj.copy_(ours.experts.down_proj)
    return ours.to(dtype), peer.to(dtype)


def peer_implementation(peer, x: torch.Tensor) -> dict:
    """The experts implementation transformers' block runs, and the kernel it calls."""
    from transformers.integrations import moe as hf_moe

    name = peer.experts.config._experts_implementation
    kernel = "per-expert loop (eager)"
    if name == "grouped_mm":
        weight = peer.experts.gate_up_proj
        offsets = torch.zeros(weight.shape[0], dtype=torch.int32)
        if not hf_moe._can_use_grouped_mm(x, weight, offsets):
            kernel = "transformers::grouped_mm_fallback"
        elif hasattr(torch.nn.functional, "grouped_mm"):
            kernel = "torch.nn.functional.grouped_mm"
        else:
            kernel = "torch._grouped_mm"
    return {"experts_implementation": name, "kernel": kernel}


def step_of(module, x: torch.Tensor, grad: torch.Tensor):
    """A forward+backward of `module` on a fresh leaf copy of `x`."""
    leaf = x.clone().requires_grad_()

    def run():
        module(leaf).backward(grad)
        leaf.grad = None

    return run


def agree(ours, peer, x: torch.Tensor) -> float:
    """Max |ours - transformers'| over the block's output, relative to the output's scale in
    bf16 (absolute in float32)."""
    with torch.no_grad():
        a, b = ours(x).float(), peer(x).float()
    diff = (a - b).abs().max().item()
    return diff if x.dtype == torch.float32 else diff / b.abs().max().item()


def block_flops(shape: dict) -> int:
    """Matmul FLOPs of one forward+backward of the routed experts (the router's are ~E/3I of
    them and left out): 3 passes (forward, input and weight gradients) of
    rows x (C x 2I + I x C)."""
    rows = shape["tokens"] * shape["top_k"]
    return 3 * 2 * rows * 3 * shape["hidden"] * shape["width"]


def matmul_floor(shape: dict, dtype: torch.dtype, repeat: int) -> float:
    """Seconds of the block's matmuls alone at its shapes, tokens spread evenly over the
    experts: per expert, the forward's gate, up and down products, the backward's input and
    weight gradients, each written into a preallocated buffer (no allocation, no elementwise
    work, no routing): what any block doing these matmuls with torch's GEMM needs at least."""
    rows, hidden, width = shape["tokens"] * shape["top_k"], shape["hidden"], shape["width"]
    experts = shape["experts"]
    per = rows // experts
    x, out = torch.randn(per, hidden, dtype=dtype), torch.empty(per, hidden, dtype=dtype)
    gate, up = torch.randn(per, width, dtype=dtype), torch.randn(per, width, dtype=dtype)
    gate_up = torch.randn(experts, 2 * width, hidden, dtype=dtype)
    down = torch.randn(experts, hidden, width, dtype=dtype)
    grad_gate_up, grad_down = torch.empty_like(gate_up), torch.empty_like(down)

    def matmuls():
        for e in range(experts):
            g_w, u_w = gate_up[e, :width], gate_up[e, width:]
            torch.mm(x, g_w.t(), out=gate)  # forward
            torch.mm(x, u_w.t(), out=up)
            torch.mm(gate, down[e].t(), out=out)
            torch.mm(out, down[e], out=gate)  # backward: the down projection's input
            torch.mm(out.t(), up, out=grad_down[e])  # and its weight
            torch.mm(gate, g_w, out=out).addmm_(up, u_w)  # the gate/up input
            torch.mm(gate.t(), x, out=grad_gate_up[e, :width])  # and their weights
            torch.mm(up.t(), x, out=grad_gate_up[e, width:])

    matmuls()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        matmuls()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_blocks(shapes: list[str], dtypes: list[torch.dtype], rounds: int) -> tuple[dict, dict]:
    """(a) and (d): every (shape, dtype) pair's sides back to back in each round."""
    fns, facts = {}, {}
    for text in shapes:
        shape = parse_shape(text)
        for dtype in dtypes:
            key = f"{text}/{str(dtype).removeprefix('torch.')}"
            ours, peer = pair(shape, dtype)
            generator = torch.Generator().manual_seed(1)
            x = torch.randn(4, shape["tokens"] // 4, shape["hidden"], generator=generator)
            grad = torch.randn(x.shape, generator=generator).to(dtype)
            x = x.to(dtype)
            grouped = MoE(ours.cfg).train().to(dtype)
            grouped.load_state_dict(ours.state_dict())
            grouped.experts.use_loop = False
            fns[f"ours|{key}"] = step_of(ours, x, grad)
            fns[f"peer|{key}"] = step_of(peer, x, grad)
            fns[f"grouped|{key}"] = step_of(grouped, x, grad)
            fns[f"loop|{key}"] = fns[f"ours|{key}"]  # the same block, paired with grouped_mm
            facts[key] = dict(shape=shape, dtype=str(dtype), diff=agree(ours, peer, x),
                              loop_vs_grouped_diff=agree(ours, grouped, x),
                              peer=peer_implementation(peer, x),
                              floor=matmul_floor(shape, dtype, 5))  # fmt: skip
    for fn in fns.values():  # warm up: first calls allocate and pick kernels
        fn()
    pairs = [(f"ours|{k}", f"peer|{k}") for k in facts]
    pairs += [(f"loop|{k}", f"grouped|{k}") for k in facts]
    seconds = alternate(fns, rounds, calls=paired_order(pairs, rounds))
    block, loop = {}, {}
    for k, fact in facts.items():
        vs_peer, vs_grouped = seconds[f"ours|{k}"], seconds[f"loop|{k}"]
        times = {"peer": seconds[f"peer|{k}"], "ours": vs_peer}
        ratios = per_round_ratios(times, "peer", "ours")
        flops, floor_ms = block_flops(fact["shape"]), 1000 * fact["floor"]
        rate = flops / fact["floor"]
        tolerance = 1e-4 if fact["dtype"] == "torch.float32" else 2e-2
        block[k] = dict(
            ratio=ratios["median"], ratio_range=ratios["range"], round_ratios=ratios["rounds"],
            ms={"ours": round(1000 * statistics.median(vs_peer), 1),
                "transformers": round(1000 * statistics.median(times["peer"]), 1)},
            max_abs_diff=fact["diff"], identical_work=fact["diff"] < tolerance,
            transformers=fact["peer"], gemm_gflops=round(rate / 1e9, 1),
            matmul_gflop=round(flops / 1e9, 2), floor_ms=round(floor_ms, 1),
            max_ratio=round(statistics.median(times["peer"]) * 1000 / floor_ms, 3),
        )  # fmt: skip
        grouped = per_round_ratios({"g": seconds[f"grouped|{k}"], "l": vs_grouped}, "g", "l")
        loop[k] = dict(
            ratio=grouped["median"], ratio_range=grouped["range"],
            ms={"loop": round(1000 * statistics.median(vs_grouped), 1),
                "grouped_mm": round(1000 * statistics.median(seconds[f"grouped|{k}"]), 1)},
            max_abs_diff=fact["loop_vs_grouped_diff"],
        )  # fmt: skip
    return block, loop


def bench_train_step(rounds: int, batch: int, seq: int, steps: int) -> dict:
    """(b) the moe-debug step against the debug step (equal active parameters)."""
    generator = torch.Generator().manual_seed(2)
    runs, first = {}, {}
    for name in ("moe-debug", "debug"):
        cfg = preset(name, max_seq_len=seq)
        torch.manual_seed(0)
        model = Transformer(cfg)
        model.init_weights(seed=0)
        (optimizer,) = build_optimizers(model, OptimizerConfig(lr=1e-3))
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator)
        labels = torch.cat([ids[:, 1:], torch.full((batch, 1), IGNORE_INDEX)], dim=1)

        def step(model=model, optimizer=optimizer, ids=ids, labels=labels):
            loss = model(ids, labels=labels)[0]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        first[name] = step()
        runs[name] = lambda step=step: [step() for _ in range(steps)]
        runs[name]()
        first[f"{name}_active_parameters"] = cfg.active_parameters()
    seconds = alternate(runs, rounds, calls=paired_order([("moe-debug", "debug")], rounds))
    ratios = per_round_ratios(seconds, "moe-debug", "debug")
    tokens = steps * batch * seq
    return dict(
        ratio=ratios["median"], ratio_range=ratios["range"], round_ratios=ratios["rounds"],
        ratio_means="moe-debug step time / debug step time (1: no cost for routing)",
        tokens_per_s={k: round(tokens / statistics.median(v), 1) for k, v in seconds.items()},
        active_parameters={k: first[f"{k}_active_parameters"] for k in runs},
        first_step_loss={k: round(first[k], 4) for k in runs},
        shape=f"batch {batch}x{seq}, fp32, AdamW, {steps} steps per round",
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", nargs="+", default=None,
                        help="hidden,experts,width,top_k,tokens (default: " + " ".join(SHAPES) + ")")  # fmt: skip
    parser.add_argument("--no-bf16", action="store_true", help="float32 blocks only")
    parser.add_argument("--steps", type=int, default=2, help="train steps per timed call (b)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, seconds: a smoke run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results", type=Path, help="append the JSON lines to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    dtypes = [torch.float32] if args.no_bf16 else [torch.float32, torch.bfloat16]
    block, loop = bench_blocks(shapes, dtypes, args.rounds)
    headline = f"{shapes[0]}/float32"
    records = [
        emit(
            "moe_block",
            shapes="hidden,experts,width,top_k,tokens/dtype; forward+backward, "
            f"{args.threads} threads",
            ratio=block[headline]["ratio"],
            ratio_range=block[headline]["ratio_range"],
            identical_work=all(b["identical_work"] for b in block.values()),
            blocks=block,
            rounds=args.rounds,
            quick=args.quick,
        ),
        emit(
            "moe_loop_vs_grouped_mm",
            ratio=loop[headline]["ratio"],
            ratio_means="grouped_mm time / per-expert loop time (above 1: the loop is faster)",
            blocks=loop,
            threads=args.threads,
            rounds=args.rounds,
            quick=args.quick,
        ),
    ]
    batch, seq = (2, 64) if args.quick else (8, 256)
    step = bench_train_step(args.rounds, batch, seq, 1 if args.quick else args.steps)
    records.append(
        emit("moe_train_step", **step, threads=args.threads, rounds=args.rounds, quick=args.quick)
    )
    append_results(args.results, records)


if __name__ == "__main__":
    main()
