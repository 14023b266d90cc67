"""Peak RSS per rank of one forward/backward under context parallelism (CPU, gloo), against one
process on the same rows: the measurement a memory planner's CP estimate is checked against.

The debug preset (hidden 128, 4 layers, 4 heads / 2 KV heads of width 32, vocab 8192, fp32),
B rows of T tokens with a document boundary every ``--doc-len`` tokens, the trainer's loss
(``model(..., labels=...)``). Every process starts under preflight's ``MEASURE_ENV`` (glibc
returns each freed tensor over 64 KiB to the system, so peak RSS follows the live tensors),
builds the model and batch (and, under CP, its gloo group), resets its peak RSS
(``/proc/self/clear_refs``), and reports its RSS then (``before_mib``) and its peak after the
backward pass (``peak_mib``, ``VmHWM``); ``step_mib`` is their difference: what one
forward/backward added. cp=1 is the one-process path (no shard), cp=2 two spawned ranks. Each
layout runs ``--rounds`` times (fresh processes); a rank's figures are their medians.
``ratio``: the largest cp=2 rank's ``step_mib`` over one process's (about 0.5 when a rank
holds half the activations; what does not shrink with T, gradients and the loss's blocks,
keeps it above). Prints ONE JSON line.

    python benchmarks/bench_cp_memory.py [--seq-len 8192] [--doc-len 512] [--batch 1]
        [--cp 1 2] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import tempfile
from pathlib import Path

import torch

from llmflow.model.config import preset
from llmflow.model.transformer import Transformer
from llmflow.tasks.preflight.memory import MEASURE_ENV, environment


def _rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def _peak_mib() -> float:
    """This process's peak RSS since the last reset (VmHWM; not ru_maxrss, which a spawned
    process inherits from its parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _batch(batch: int, seq_len: int, doc_len: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 8192, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    starts = sorted({*range(0, batch * seq_len, doc_len), *range(0, batch * seq_len, seq_len)})
    cu_seqlens = torch.tensor([*starts, batch * seq_len], dtype=torch.int32)
    return {"input_ids": ids, "labels": ids, "cu_seqlens": cu_seqlens}


def _measure(rank: int, cp: int, args: argparse.Namespace, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    model = Transformer(preset("debug"))
    model.init_weights(seed=0)
    batch = _batch(args.batch, args.seq_len, args.doc_len)
    context = None
    if cp > 1:
        import torch.distributed as dist

        from llmflow.tasks.pretrain.parallel.cp import shard_batch

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=cp)
        dist.all_reduce(torch.ones(1))  # gloo's buffers before the baseline
        batch = shard_batch(batch, dist.group.WORLD)
        context = batch["context"]
    Path("/proc/self/clear_refs").write_text("5")  # NOTE: resets VmHWM to the RSS now
    before = _rss_mib()
    ids, labels = batch["input_ids"], batch["labels"]
    positions = batch.get("position_ids")
    loss, _ = model(ids, positions, batch["cu_seqlens"], labels=labels, context=context)
    loss.backward()
    peak = _peak_mib()
    row = {"cp": cp, "rank": rank, "tokens": ids.numel(), "before_mib": round(before, 1)}
    row |= {"peak_mib": round(peak, 1), "step_mib": round(peak - before, 1)}
    Path(f"{out}.{rank}").write_text(json.dumps(row))
    if cp > 1:
        dist.destroy_process_group()


def run(cp: int, args: argparse.Namespace) -> list[dict]:
    """One round: each rank's figures, from fresh processes under ``MEASURE_ENV``."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, environment(MEASURE_ENV):
        out = f"{tmp}/rank"
        procs = [
            ctx.Process(target=_measure, args=(r, cp, args, f"{tmp}/pg", out)) for r in range(cp)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        if any(p.exitcode != 0 for p in procs):
            for p in procs:
                p.kill()
            raise RuntimeError(f"cp={cp}: exit codes {[p.exitcode for p in procs]}")
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(cp)]


def medians(rounds: list[list[dict]]) -> list[dict]:
    """Per rank, the median of each figure over the rounds."""
    ranks = []
    for per_round in zip(*rounds, strict=True):
        row = dict(per_round[0])
        for key in ("before_mib", "peak_mib", "step_mib"):
            row[key] = round(statistics.median(r[key] for r in per_round), 1)
        ranks.append(row)
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="seconds: 1,024 tokens, one round (not a result)"
    )
    args = parser.parse_args()
    if args.quick:
        args.seq_len, args.doc_len, args.rounds = 1024, 128, 1
    rows = {f"cp{cp}": medians([run(cp, args) for _ in range(args.rounds)]) for cp in args.cp}
    record = {"seq_len": args.seq_len, "batch": args.batch, "doc_len": args.doc_len}
    record |= {"rounds": args.rounds, "quick": args.quick, **rows}
    if "cp1" in rows and "cp2" in rows:
        one = rows["cp1"][0]["step_mib"]
        record["ratio"] = round(max(r["step_mib"] for r in rows["cp2"]) / one, 3)
    record["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(record))


if __name__ == "__main__":
    main()
