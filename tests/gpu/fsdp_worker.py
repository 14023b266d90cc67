"""A few AdamW steps of the debug model in bf16, sharded with the trainer's ``shard_model``
(FSDP2, bf16 parameters, float32 gradient reduction) under torchrun at any world size, even 1
(the trainer shards only from 2 ranks); or, with ``--reference``, one process under autocast.

    torchrun --standalone --nproc_per_node N tests/gpu/fsdp_worker.py OUT.json [--backend nccl]
    python tests/gpu/fsdp_worker.py OUT.json --reference

Every rank draws the same global batch per step and trains on its rows ``rank::world``; the
loss written is the global batch's (the ranks' token sums all-reduced), with the sharding report.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from llmflow.model.config import preset
from llmflow.model.transformer import Transformer
from llmflow.tasks.pretrain.distributed import (
    Runtime,
    materialize_sharded,
    shard_model,
    sharding_report,
)

STEPS, GLOBAL_BATCH, SEQ = 10, 4, 65


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = preset("debug", vocab_size=512)
    if args.reference:
        rt = Runtime(0, 1, 0, device)
        model = Transformer(cfg).to(device)
        model.init_weights(seed=0)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    else:
        dist.init_process_group(args.backend)
        rt = Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device)
        with torch.device("meta"):
            model = Transformer(cfg)
        shard_model(model, rt, torch.bfloat16)
        materialize_sharded(model, rt, seed=0)
        autocast = torch.autocast(device.type, enabled=False)  # FSDP2 gathers bf16 itself
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ), generator=gen)
        mine = ids[rt.rank :: rt.world_size].to(device)
        with autocast:
            loss, _ = model(mine[:, :-1], labels=mine[:, 1:])
        # NOTE: every rank holds as many tokens, so the mean of the ranks' means is the global one
        (loss / rt.world_size).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().float().clone()
        if rt.world_size > 1 or not args.reference:
            dist.all_reduce(total)
        losses.append(total.item() / rt.world_size)
    if rt.rank == 0:
        report = {"losses": losses, "world_size": rt.world_size, **sharding_report(model)}
        with open(args.out, "w") as f:
            json.dump(report, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
