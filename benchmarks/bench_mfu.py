"""Tokens/s and MFU of our trainer step in bf16 against transformers' SmolLM3ForCausalLM, on one
GPU at the 1.7B preset's shapes, eager and compiled.

Like for like: the same starting weights (ours exported to the HF layout), the same batch
(``--micro-batch`` x the preset's 2048 tokens, the last position of each row taking no loss on
either side), float32 master weights under ``torch.autocast(bf16)`` on both (the trainer's one-GPU
path; HF's Trainer with ``bf16=True`` does the same), SDPA attention, gradient clipping at 1.0,
fused AdamW with the same groups (no decay on embeddings and norms). Ours steps through the
trainer's loss (``model(..., labels=...)``, the output projection fused into the loss) and its
optimizer groups; SmolLM3 through ``model(input_ids, labels=...).loss``. Two pairs, each compared
with itself only: ``eager``, and ``compiled`` (each decoder layer ``torch.compile``d, as our
trainer does, on both sides). One pair's two models are held at a time (two 1.7B models with
their optimizer states take ~55 GB); in each round its two sides run back to back and swap who
goes first (``paired_order``), and a pair's ratio is the median of its per-round ratios (SmolLM3's
time over ours: above 1, ours is faster), with their range.

MFU = model FLOPs per token x tokens/s / the device's dense bf16 peak. The FLOPs are the
planner's (``flops_per_token``): 6 x (non-embedding + output-projection parameters) for the
matmuls, forward and backward, plus 12 x layers x heads x head_dim x seq for QK^T and AV over the
full square (PaLM's convention; no recomputation counted). The peak is read from the device's name:
H100 SXM and H200 989 TFLOP/s, H100 PCIe 756; unknown devices and the CPU report no MFU.

``--packed DOC_LEN`` packs each row with documents of DOC_LEN tokens: ``position_ids`` restart at
each document (ours attends within documents without a T x T mask; SmolLM3 gets the same
``position_ids``, no attention mask and ``use_cache=False``, from which transformers builds its
document mask), and no target crosses a document. Each pair then has a third side, ours on the
same batch as causal rows (the same model and optimizer, no ``position_ids``), timed in the same
rounds: ``packed_vs_causal`` is its per-round time over the packed side's (above 1, the packed
rows are faster). The FLOPs of a packed token count attention over its document (``DOC_LEN``),
not the row. ``attention_kernels`` lists the kernels that ran (`model.kernels.chosen_kernels`).

    python benchmarks/bench_mfu.py [--rounds 5] [--steps 5] [--warmup 3] [--micro-batch 2]
        [--packed DOC_LEN]
    python benchmarks/bench_mfu.py --quick     # seconds on a CPU at tiny shapes: the script runs

Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script or imported

import torch  # noqa: E402

from benchmarks.bench_train_step import ours_loss, smollm3_loss  # noqa: E402
from benchmarks.common import (  # noqa: E402
    alternate,
    emit,
    hf_adamw,
    paired_order,
    per_round_ratios,
)
from llmflow.model.config import ModelConfig, preset  # noqa: E402
from llmflow.model.hf import to_hf_state_dict  # noqa: E402
from llmflow.model.hf_arch import hf_config  # noqa: E402
from llmflow.model.kernels import chosen_kernels  # noqa: E402
from llmflow.model.loss import IGNORE_INDEX  # noqa: E402
from llmflow.model.transformer import Transformer  # noqa: E402
from llmflow.tasks.pretrain.config import OptimizerConfig  # noqa: E402
from llmflow.tasks.pretrain.optim import build_optimizers  # noqa: E402
from llmflow.tasks.pretrain.planner import flops_per_token  # noqa: E402

PRESET = "1.7b"
QUICK = dict(vocab_size=1024, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=128, max_seq_len=64)  # fmt: skip
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12)]
"""Dense bf16 peak FLOP/s by a part of the device's name; the first that matches wins."""


def peak_for_name(name: str) -> float | None:
    """A GPU's dense bf16 peak FLOP/s from its name (None: not listed)."""
    return next((peak for part, peak in PEAK_BF16 if part in name), None)


def peak_flops(device: torch.device) -> tuple[str, float | None]:
    """The device's name and its dense bf16 peak (None: a CPU or a GPU not listed)."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, peak_for_name(name)


def ours(cfg: ModelConfig, device: torch.device, compile_blocks: bool, optim: OptimizerConfig):
    """Our model with the trainer's loss and optimizer groups; returns (model, step)."""
    with torch.device(device):
        model = Transformer(cfg)
    model.init_weights(seed=0)
    if compile_blocks:  # NOTE: per block, as the trainer does (cfg.compile)
        for block in model.layers:
            block.compile()
    (optimizer,) = build_optimizers(model, optim)

    return model, train_step(model, optimizer, lambda batch: ours_loss(model, batch), device)


def smollm3(cfg: ModelConfig, device: torch.device, compile_layers: bool, optim, weights):
    """transformers' SmolLM3ForCausalLM with the same shapes and weights; returns (model, step)."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    config = SmolLM3Config.from_dict(hf_config(cfg), attn_implementation="sdpa")
    with torch.device(device):
        model = SmolLM3ForCausalLM(config).float().train()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    optimizer = hf_adamw(model, optim, optim.fused)

    return model, train_step(model, optimizer, lambda batch: smollm3_loss(model, batch), device)


def train_step(model, optimizer, loss_of, device: torch.device):
    """One training step, the same for both models: bf16 autocast loss, backward, clip, step."""

    def step(batch: dict) -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # NOTE: waits for the GPU, so a timed call ends with its work

    return step


def batches(ids: torch.Tensor, doc_len: int | None) -> dict[str, dict[str, torch.Tensor]]:
    """The batches of the sides: ``rows`` (each row one document) and, with ``doc_len``,
    ``packed`` (documents of ``doc_len``, positions restarting) and ``causal`` (the packed
    batch's ids and targets, without positions: each row one document)."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
    if doc_len is None:
        return {"rows": {"ids": ids, "labels": labels, "hf_labels": ids}}
    positions = torch.arange(ids.shape[1], device=ids.device) % doc_len
    labels[:, positions == doc_len - 1] = IGNORE_INDEX  # the next token starts a document
    hf_labels = ids.clone()
    starts = (positions == 0) & (torch.arange(ids.shape[1], device=ids.device) > 0)
    hf_labels[:, starts] = IGNORE_INDEX  # transformers shifts its labels inside its loss
    packed = {"ids": ids, "labels": labels, "hf_labels": hf_labels,
              "position_ids": positions.expand(ids.shape[0], -1).contiguous()}  # fmt: skip
    return {"packed": packed, "causal": {"ids": ids, "labels": labels, "hf_labels": hf_labels}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="train steps per timed call")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (and compilation)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--no-compile", action="store_true", help="the eager pair only")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, CPU: the script runs")
    parser.add_argument("--packed", type=int, metavar="DOC_LEN",
                        help="rows packed with documents of DOC_LEN tokens, and the causal side")  # fmt: skip
    args = parser.parse_args()
    for name in ("rounds", "steps", "warmup", "micro_batch"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is too small")
    if args.quick:
        device, cfg = torch.device("cpu"), ModelConfig(**QUICK, nope_interval=4)
        torch.set_num_threads(2)
    else:
        if not torch.cuda.is_available():  # a record that says so, not figures
            emit("mfu", skipped="no CUDA device: the full run needs one GPU (--quick: CPU)")
            return
        device, cfg = torch.device("cuda"), preset(PRESET)
    seq = cfg.max_seq_len
    if args.packed is not None and (args.packed < 1 or seq % args.packed or args.packed == seq):
        parser.error(
            f"--packed={args.packed}: must divide the {seq}-token rows into >= 2 documents"
        )
    optim = OptimizerConfig(lr=3e-4, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, seq), generator=gen).to(device)
    feeds = batches(ids, args.packed)
    main_batch = feeds["rows" if args.packed is None else "packed"]
    pairs = ["eager"] + ([] if args.no_compile else ["compiled"])
    seconds: dict[str, list[float]] = {}
    first: dict[str, float] = {}
    for pair in pairs:
        compiled = pair == "compiled"
        model, ours_step = ours(cfg, device, compiled, optim)
        weights = to_hf_state_dict(model.state_dict(), cfg)
        peer, peer_step = smollm3(cfg, device, compiled, optim, weights)
        del weights
        steps = {f"ours_{pair}": ours_step, f"smollm3_{pair}": peer_step}
        inputs = dict.fromkeys(steps, main_batch)
        calls = paired_order([(f"ours_{pair}", f"smollm3_{pair}")], args.rounds)
        if args.packed is not None:  # our model again, the same batch as causal rows
            steps[f"ours_{pair}_causal"], inputs[f"ours_{pair}_causal"] = ours_step, feeds["causal"]
            calls = with_causal(calls, f"ours_{pair}", f"ours_{pair}_causal")
        first.update({name: step(inputs[name]) for name, step in steps.items()})
        for name, step in steps.items():
            for _ in range(max(args.warmup - 1, 0)):
                step(inputs[name])

        def run(step, batch):
            return lambda: [step(batch) for _ in range(args.steps)]

        sides = {n: run(s, inputs[n]) for n, s in steps.items()}
        seconds |= alternate(sides, args.rounds, calls=calls)
        del model, peer, steps, ours_step, peer_step, sides
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tokens = args.steps * ids.numel()
    tps = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    per_token = flops_per_token(cfg, seq if args.packed is None else args.packed)
    causal_per_token = flops_per_token(cfg, seq)
    device_name, peak = peak_flops(device)
    mfu = {k: None if peak is None else
           round((causal_per_token if k.endswith("_causal") else per_token) * v / peak, 4)
           for k, v in tps.items()}  # fmt: skip
    per_round = {p: per_round_ratios(seconds, f"smollm3_{p}", f"ours_{p}") for p in pairs}
    vs_causal = {} if args.packed is None else {
        p: per_round_ratios(seconds, f"ours_{p}_causal", f"ours_{p}") for p in pairs
    }  # fmt: skip
    # NOTE: the first step of each pair from the same weights; bf16 rounds the two differently
    same = all(abs(first[f"ours_{p}"] - first[f"smollm3_{p}"]) < 2e-2 for p in pairs)
    emit(
        "mfu_quick_cpu" if args.quick else "mfu",
        shape=(f"{PRESET if not args.quick else 'tiny'}: h{cfg.hidden_size} L{cfg.num_layers} "
               f"H{cfg.num_heads}/{cfg.num_kv_heads} I{cfg.intermediate_size} "
               f"V{cfg.vocab_size}, batch {args.micro_batch}x{seq}, bf16 autocast, sdpa"
               + ("" if args.packed is None else f", documents of {args.packed}")),
        packed_doc_len=args.packed,
        attention_kernels=chosen_kernels(),
        device=device_name,
        peak_tflops=None if peak is None else peak / 1e12,
        flops_per_token=per_token,
        tokens_per_s={k: round(v, 1) for k, v in tps.items()},
        mfu=mfu,
        mfu_compiled=mfu.get("ours_compiled"),
        compiled_vs_smollm3_eager=(
            round(tps["ours_compiled"] / tps["smollm3_eager"], 3) if "ours_compiled" in tps
            else None
        ),
        ratios={p: r["median"] for p, r in per_round.items()},
        ratio_ranges={p: r["range"] for p, r in per_round.items()},
        packed_vs_causal={p: r["median"] for p, r in vs_causal.items()} or None,
        packed_vs_causal_ranges={p: r["range"] for p, r in vs_causal.items()} or None,
        flops_per_token_causal=causal_per_token if args.packed is not None else None,
        first_step_loss={k: round(v, 5) for k, v in first.items()},
        rounds=args.rounds,
        steps_per_round=args.steps,
        identical_work=same,
    )  # fmt: skip


def with_causal(calls: list[str], ours: str, causal: str) -> list[str]:
    """A pair's paired rounds with a third side, ``causal``, next to ``ours`` in every round:
    before it when ours goes first, after it when ours goes second (so the two alternate too)."""
    out: list[str] = []
    for r in range(0, len(calls), 2):
        pair = calls[r : r + 2]
        out += [causal, *pair] if pair[0] == ours else [*pair, causal]
    return out


if __name__ == "__main__":
    main()
