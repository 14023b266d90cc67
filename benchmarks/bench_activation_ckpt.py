"""Activation memory and step time of activation checkpointing on CPU, beside `plan`'s prediction.

The 135m preset, fp32, one micro-batch of 1 x 1024 tokens, the trainer's loss. Each measurement
runs in a fresh process (peak RSS is a process-wide high-water mark): the model and its
gradient buffers are allocated first, then one forward+backward; the activation memory is the
peak RSS of that pass minus the RSS before it. The same process then times ``--steps``
forward+backward passes. Modes alternate over rounds (none, full, full, none, ...). Both modes
must produce the same loss and gradient norm (``identical_work``). ``predicted_gib`` is
`tasks.pretrain.planner.activation_bytes_per_token` at 4 bytes per activation, the figure
`llmflow plan` adds to its memory estimate. Prints ONE JSON line.

    python benchmarks/bench_activation_ckpt.py [--preset 135m] [--seq 1024] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from common import emit

GIB = 2**30


def _rss() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(mode: str, preset_name: str, seq: int, steps: int) -> dict:
    """One fresh process: activation memory of one pass, then the time of ``steps`` passes."""
    import torch

    from llmflow.model.config import preset
    from llmflow.model.transformer import Transformer
    from llmflow.tasks.pretrain.distributed import apply_activation_checkpointing

    torch.set_num_threads(2)
    model = Transformer(preset(preset_name))
    apply_activation_checkpointing(model, mode)
    model.init_weights(seed=0)
    for param in model.parameters():  # gradient buffers exist before the measured pass
        param.grad = torch.zeros_like(param)
    ids = torch.randint(0, model.cfg.vocab_size, (1, seq + 1), generator=torch.Generator())

    def fwd_bwd() -> float:
        # NOTE: the trainer's loss, the output projection fused into the chunked cross-entropy
        # (causal_lm_loss on the model's logits would hold the full (T, V) logits)
        loss, _ = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        return float(loss.detach())

    before, started = _rss(), time.perf_counter()
    loss = fwd_bwd()
    first = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grad_norm = float(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    )
    seconds = [] if steps else [first]  # NOTE: --steps 0 times the measured pass itself
    for _ in range(steps):
        started = time.perf_counter()
        fwd_bwd()
        seconds.append(time.perf_counter() - started)
    return {"activation_gib": (peak - before) / GIB, "loss": loss, "grad_norm": grad_norm,
            "seconds": seconds}  # fmt: skip


def launch(mode: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--worker", mode, "--preset", args.preset]
    command += ["--seq", str(args.seq), "--steps", str(args.steps)]
    proc = subprocess.run(command, check=True, timeout=900, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def predicted_gib(preset_name: str, seq: int, checkpointing: bool) -> float:
    from llmflow.model.config import preset
    from llmflow.tasks.pretrain.planner import activation_bytes_per_token

    return seq * activation_bytes_per_token(preset(preset_name), 4, checkpointing) / GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="135m")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument(
        "--steps", type=int, default=2, help="timed passes per process (0: time the measured pass)"
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--worker", choices=["none", "full"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.preset, args.seq, args.steps)))
        return
    runs: dict[str, list[dict]] = {"none": [], "full": []}
    for r in range(args.rounds):
        for mode in ("none", "full") if r % 2 == 0 else ("full", "none"):
            runs[mode].append(launch(mode, args))
    memory = {m: statistics.median(x["activation_gib"] for x in v) for m, v in runs.items()}
    step = {m: statistics.median(s for x in v for s in x["seconds"]) for m, v in runs.items()}
    same = {(x["loss"], x["grad_norm"]) for v in runs.values() for x in v}
    emit(
        "activation_checkpointing",
        preset=args.preset,
        tokens=args.seq,
        activation_gib=memory,
        predicted_gib={m: predicted_gib(args.preset, args.seq, m == "full") for m in runs},
        memory_ratio=round(memory["full"] / memory["none"], 3),
        step_seconds=step,
        time_ratio=round(step["full"] / step["none"], 3),
        rounds=args.rounds,
        steps_per_round=args.steps,
        identical_work=len(same) == 1,
    )


if __name__ == "__main__":
    main()
