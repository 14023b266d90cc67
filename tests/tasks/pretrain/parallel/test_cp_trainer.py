"""The trainer under context parallelism: cp=2 on 2 gloo ranks against one process.

Both read the same packed rows (documents of 8 to 60 tokens in rows of 32: boundaries inside
rows and across the ranks' chunks); each CP rank must see half of every row's tokens, and the
step-1 gradients and the 10 steps' losses must equal the one-process run's.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

STEPS = 10


def _worker(rank: int, world_size: int, cfg_json: str, data: str, out: str, pg: str) -> None:
    """Train STEPS steps; record step 1's full gradients and the token counts each forward saw."""
    import torch.distributed as dist

    from llmflow.tasks.pretrain.config import TrainConfig
    from llmflow.tasks.pretrain.train import Trainer

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{pg}", rank=rank, world_size=2)
    trainer = Trainer(TrainConfig.model_validate_json(cfg_json), Path(data), Path(out))
    seen, grads = [], {}
    trainer.model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    clip = trainer.clip_gradients

    def clip_and_record() -> float:
        if not grads:  # step 1: the gradients before clipping, gathered from their shards
            for name, param in trainer.model.named_parameters():
                grad = param.grad
                grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        return clip()

    trainer.clip_gradients = clip_and_record
    try:
        trainer.fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save({"grads": grads, "seen": sorted(set(seen))}, f"{out}/rank{rank}.pt")


def _train(tmp_path: Path, cfg, data: Path, world_size: int, name: str, timeout: float = 240):
    ctx = mp.get_context("spawn")
    out = tmp_path / name
    out.mkdir()
    args = (world_size, cfg.model_dump_json(), str(data), str(out), str(tmp_path / f"{name}.pg"))
    procs = [ctx.Process(target=_worker, args=(r, *args)) for r in range(world_size)]
    from tests.tasks.pretrain.parallel.ranks import join_ranks

    join_ranks(procs, timeout)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    return losses, [torch.load(out / f"rank{r}.pt") for r in range(world_size)]


@pytest.mark.slow  # three spawned trainers: about 40 s idle
def test_cp2_trainer_matches_one_process(tmp_path, train_data):
    """10 steps: losses within 1e-4 relative, step-1 gradients within 1e-5 of each tensor's max."""
    from conftest import SEQ_LEN, tiny_config

    common = dict(max_steps=STEPS, checkpoint={"interval": 100, "keep_last": 1})
    single = tiny_config(**common)
    expected_losses, [expected] = _train(tmp_path, single, train_data, 1, "single")
    cp = tiny_config(parallel={"cp": 2}, **common)
    losses, ranks = _train(tmp_path, cp, train_data, 2, "cp2")

    assert expected["seen"] == [SEQ_LEN]
    assert [r["seen"] for r in ranks] == [[SEQ_LEN // 2], [SEQ_LEN // 2]]  # half of each row
    assert sorted(losses) == sorted(expected_losses) == list(range(1, STEPS + 1))
    for step, loss in expected_losses.items():
        assert abs(losses[step] - loss) <= 1e-4 * abs(loss), (step, losses[step], loss)
    for name, grad in expected["grads"].items():
        scale = grad.abs().max().item()
        for rank in ranks:
            worst = (rank["grads"][name] - grad).abs().max().item()
            assert worst <= 1e-5 * scale, (name, worst, scale)
