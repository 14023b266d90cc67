"""The planner's parameters per rank against the trainer's own parallelize code at the 3B
shapes: the model built on the meta device, split (``pp.build_stage``), tensor-parallelised
(``tp.apply_tp``) and sharded (``distributed.shard_model``) exactly as
``Parallelism.parallelize`` does, on a fake process group of the layout's world size (no
memory, no communication).

Rank 0 of each layout is measured (FSDP2 gives the first ranks the padded, fuller shards) and,
under PP, the first and the last stage (the planner counts the fuller one). The planner leaves
the norm weights' replication over TP out (a few thousand parameters in 100 million): within 1%.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmflow.model.config import preset
from llmflow.tasks.pretrain.memory_model import parameters_per_rank
from llmflow.tasks.pretrain.parallel.config import Layout
from llmflow.tasks.pretrain.parallel.support import check_layout

REPO = Path(__file__).resolve().parents[3]
LAYOUTS = {
    "fsdp8": Layout(dp_shard=8),
    "tp2-fsdp4": Layout(dp_shard=4, tp=2),
    "tp4-cp2-fsdp2": Layout(dp_shard=2, tp=4, cp=2),
    "hsdp2x4-tp2": Layout(dp_replicate=2, dp_shard=4, tp=2),
    "pp2-fsdp4": Layout(dp_shard=4, pp=2),
    "pp4-fsdp2": Layout(dp_shard=2, pp=4),
}
MOE_LAYOUTS = {
    # Qwen3-30B-A3B's shapes: the experts FSDP2-sharded alone, then split over EP ranks
    # (``ep.apply_ep``) and FSDP2-sharded over the rest of dp_shard
    "moe-fsdp8": Layout(dp_shard=8),
    "moe-ep2-fsdp2": Layout(dp_shard=4, ep=2),
    "moe-ep8-fsdp8": Layout(dp_shard=64, ep=8),
}
ALL_LAYOUTS = {**LAYOUTS, **MOE_LAYOUTS}


def _preset(name: str) -> str:
    return "30b-a3b" if name in MOE_LAYOUTS else "3b"


def measure(layout: Layout, stage: int, model: str = "3b") -> int:
    """In this process (a fresh one): rank 0's parameters of ``stage`` after the trainer's
    parallelize steps, on a fake process group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from llmflow.model.transformer import Transformer
    from llmflow.tasks.pretrain.distributed import shard_model
    from llmflow.tasks.pretrain.parallel import ep, pp, tp
    from llmflow.tasks.pretrain.parallel.mesh import build_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world_size)
    mesh = build_mesh("cpu", layout)
    with torch.device("meta"):
        model = Transformer(preset(model))
    if layout.pp > 1:
        model = pp.build_stage(model, stage, layout.pp)
    if layout.tp > 1:
        tp.apply_tp(model, mesh["tp"])
    if layout.ep > 1:
        ep.apply_ep(model, mesh["ep"])
    if layout.dp_replicate > 1:
        fsdp_mesh = mesh.world[("dp_replicate", "dp_shard_cp")]
    else:
        fsdp_mesh = mesh["dp_shard_cp"]
    experts = mesh["dp_shard_mod_ep"] if layout.ep > 1 else None
    shard_model(model, None, torch.bfloat16, fsdp_mesh, experts, layout.dp * layout.cp)
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    dist.destroy_process_group()
    return sum(t.numel() for t in local)


@pytest.fixture(scope="module")
def measured() -> dict[str, int]:
    """Each layout's fuller measured stage, from one fresh process (the fake group is its own)."""
    argv = [sys.executable, __file__]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", list(ALL_LAYOUTS))
def test_parameters_per_rank_match_the_trainers_parallelize_code_at_3b(name, measured):
    layout, cfg = ALL_LAYOUTS[name], preset(_preset(name))
    optimizer = "adamw" if layout.ep > 1 else "muon"  # muon with EP is refused
    check_layout(layout, cfg, optimizer=optimizer)  # a layout the trainer accepts
    planned = parameters_per_rank(cfg, layout)
    assert planned == pytest.approx(measured[name], rel=0.01), (planned, measured[name])
    assert planned > 10e6  # a 3B model: tens of millions of parameters per rank


if __name__ == "__main__":
    print(json.dumps({
        name: max(measure(layout, s, _preset(name)) for s in ({0, layout.pp - 1}))
        for name, layout in ALL_LAYOUTS.items()
    }))  # fmt: skip
