"""Forward+backward of one packed row of documents against the same row as one causal document,
on one CPU thread: what attention without a T x T mask buys.

The model is h256 L4 H8/2 I512 V4096 (fp32) and the row 8,192 tokens: packed, it holds 16
documents of 512 tokens (``position_ids`` restarting at 0 at each, so `model.kernels` picks its
per-document kernel); causal, the same tokens are one document. A third side, ``dense``, is the
packed row through the reference kernel (``LLMFLOW_ATTENTION=dense``: SDPA under the T x T
block-diagonal mask), the figures before per-document attention. Every side steps through
``Transformer.forward(ids, position_ids, None, labels)``, the trainer's fused loss, with the same
ids and labels (no target across a document boundary).

Each measurement is a fresh process with ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``:
the model and its gradient buffers are allocated, then the first forward+backward gives the
memory of a step (the peak RSS of that step minus the RSS before it), then ``--steps`` more
steps are timed. Sides alternate over ``--rounds`` (packed, causal, dense; then rotated); a
side's figures are the medians over its rounds. ``identical_work``: the packed and dense sides'
loss and gradient norm agree (the same documents, two kernels).

    python benchmarks/bench_attention.py [--rounds 3] [--tokens 8192] [--doc-len 512]
    python benchmarks/bench_attention.py --quick      # seconds: 1,024 tokens, 1 round

Prints ONE JSON line: ``time_ratio`` and ``memory_ratio`` (packed / causal: below 1, the packed
row is cheaper), the dense figures and the kernel that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script or imported

from benchmarks.common import emit, order  # noqa: E402

SHAPES = dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
              intermediate_size=512)  # fmt: skip
SIDES = ("packed", "causal", "dense")
MIB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _high_water() -> int:
    """This process's peak RSS in bytes (VmHWM).

    NOTE: not ``ru_maxrss``: exec copies the parent's high-water mark into the child's
    ``ru_maxrss``, so a worker started by a large parent (pytest with torch loaded) would report
    the parent's peak instead of its own.
    """
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _reset_high_water() -> None:
    """Start VmHWM again from the RSS now, so setup's temporaries do not count (Linux >= 4.0;
    where /proc/self/clear_refs is not writable the mark keeps setup's peak, an overestimate)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def worker(side: str, tokens: int, doc_len: int, steps: int) -> dict:
    """One fresh process: the memory of the first step, then the time of ``steps`` more."""
    import torch

    from llmflow.model.config import ModelConfig
    from llmflow.model.kernels import chosen_kernels
    from llmflow.model.loss import IGNORE_INDEX
    from llmflow.model.transformer import Transformer

    torch.set_num_threads(1)
    model = Transformer(ModelConfig(**SHAPES, max_seq_len=tokens))
    model.init_weights(seed=0)
    for param in model.parameters():  # gradient buffers exist before the measured step
        param.grad = torch.zeros_like(param)
    ids = torch.randint(0, SHAPES["vocab_size"], (1, tokens + 1),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    labels[:, doc_len - 1 :: doc_len] = IGNORE_INDEX  # a document's last token has no target
    positions = None if side == "causal" else (torch.arange(tokens) % doc_len)[None]

    def step() -> float:
        loss, _ = model(inputs, positions, None, labels)
        loss.backward()
        return float(loss.detach())

    _reset_high_water()
    before = _rss()
    loss = step()
    step_bytes = _high_water() - before
    grad_norm = float(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    )
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return {"step_mib": step_bytes / MIB, "seconds": seconds, "loss": loss,
            "grad_norm": grad_norm, "kernels": chosen_kernels()}  # fmt: skip


def launch(side: str, args: argparse.Namespace) -> dict:
    """One measurement of ``side`` in a fresh single-threaded process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("LLMFLOW_ATTENTION", None)
    if side == "dense":
        env["LLMFLOW_ATTENTION"] = "dense"
    command = [sys.executable, __file__, "--worker", side, "--tokens", str(args.tokens),
               "--doc-len", str(args.doc_len), "--steps", str(args.steps)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def close(a: float, b: float, rel: float = 1e-4) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens in the row")
    parser.add_argument("--doc-len", type=int, default=512, help="tokens per packed document")
    parser.add_argument("--steps", type=int, default=1, help="timed steps after the first")
    parser.add_argument("--quick", action="store_true", help="1,024 tokens, 1 round: it runs")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.doc_len, args.rounds, args.steps = 1024, 128, 1, 1
    for name in ("rounds", "tokens", "doc_len", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.tokens % args.doc_len or args.tokens == args.doc_len:
        parser.error(f"--tokens={args.tokens} must be a multiple (>= 2x) of "
                     f"--doc-len={args.doc_len}")  # fmt: skip
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens, args.doc_len, args.steps)))
        return
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for side in order(list(SIDES), args.rounds):
        runs[side].append(launch(side, args))
    seconds = {s: statistics.median(t for r in v for t in r["seconds"]) for s, v in runs.items()}
    mib = {s: statistics.median(r["step_mib"] for r in v) for s, v in runs.items()}
    per_round = [statistics.median(p["seconds"]) / statistics.median(c["seconds"])
                 for p, c in zip(runs["packed"], runs["causal"], strict=True)]  # fmt: skip
    packed, dense = runs["packed"][0], runs["dense"][0]
    same = close(packed["loss"], dense["loss"]) and close(packed["grad_norm"], dense["grad_norm"])
    emit(
        "attention_packed",
        shape=(f"h256 L4 H8/2 I512 V4096, 1 x {args.tokens} tokens, documents of "
               f"{args.doc_len}, fp32, 1 thread, forward+backward with the fused loss"),
        kernel=", ".join(packed["kernels"]),
        kernels={s: v[0]["kernels"] for s, v in runs.items()},
        time_ratio=round(seconds["packed"] / seconds["causal"], 3),
        time_ratio_rounds=[round(x, 3) for x in per_round],
        memory_ratio=round(mib["packed"] / mib["causal"], 3),
        step_seconds=seconds,
        step_mib={s: round(m, 1) for s, m in mib.items()},
        dense={"step_seconds": seconds["dense"], "step_mib": round(mib["dense"], 1),
               "time_ratio": round(seconds["packed"] / seconds["dense"], 3),
               "memory_ratio": round(mib["packed"] / mib["dense"], 3)},
        loss={s: round(v[0]["loss"], 6) for s, v in runs.items()},
        rounds=args.rounds,
        steps_per_round=args.steps,
        identical_work=same,
    )  # fmt: skip


if __name__ == "__main__":
    main()
