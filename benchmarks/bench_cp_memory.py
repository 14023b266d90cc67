"""Peak RSS per rank of one forward/backward under context parallelism (CPU, gloo), against one
process on the same rows: the measurement a memory planner's CP estimate is checked against.

The debug preset (hidden 128, 4 layers, 4 heads / 2 KV heads of width 32, vocab 8192, fp32),
B rows of T tokens with a document boundary every ``--doc-len`` tokens, the trainer's loss
(``model(..., labels=...)``). Each process reports its RSS after building the model and batch
(``before_mib``) and its peak RSS after the backward pass (``peak_mib``, ``ru_maxrss``);
``step_mib`` is their difference: what one forward/backward added. cp=1 is the one-process path
(no shard), cp=2 two spawned ranks. Prints ONE JSON line.

    python benchmarks/bench_cp_memory.py [--seq-len 8192] [--batch 1] [--cp 1 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import tempfile
from pathlib import Path

import torch

from llmflow.model.config import preset
from llmflow.model.transformer import Transformer


def _rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


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
        batch = shard_batch(batch, dist.group.WORLD)
        context = batch["context"]
    before = _rss_mib()
    ids, labels = batch["input_ids"], batch["labels"]
    positions = batch.get("position_ids")
    loss, _ = model(ids, positions, batch["cu_seqlens"], labels=labels, context=context)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row = {"cp": cp, "rank": rank, "tokens": ids.numel(), "before_mib": round(before, 1)}
    row |= {"peak_mib": round(peak, 1), "step_mib": round(peak - before, 1)}
    Path(f"{out}.{rank}").write_text(json.dumps(row))
    if cp > 1:
        dist.destroy_process_group()


def run(cp: int, args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rank"
        procs = [
            ctx.Process(target=_measure, args=(r, cp, args, f"{tmp}/pg", out)) for r in range(cp)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"cp={cp}: exit codes {[p.exitcode for p in procs]}")
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(cp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--doc-len", type=int, default=1000)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    rows = {f"cp{cp}": run(cp, args) for cp in args.cp}
    print(json.dumps({"seq_len": args.seq_len, "batch": args.batch, **rows}))


if __name__ == "__main__":
    main()
