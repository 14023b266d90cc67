"""Validation under CP, TP and PP takes the train step's loss path and gives one process's loss.

Each layout builds the trainer (same seeded weights at any layout) on spawned gloo ranks and
runs ``Validator.evaluate`` once. The reference is the dense path on one process: full logits
and ``causal_lm_loss`` over the same held-out batches. Every matrix is scaled up first so
attention is sharp and the logits are far from uniform (at init both are nearly uniform, and a
wrong mask or shard would move the loss by little). Each rank also records what the model was called with: under CP its shard
of each row, and always with labels (the fused or vocabulary-parallel loss, never full logits).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from tests.tasks.pretrain.parallel.ranks import join_ranks

SHARPEN = 8.0
"""Factor on every matrix (embedding, projections): scores x 64, logits x 8."""


def _worker(rank: int, world: int, cfg_json: str, data: str, val: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from llmflow.model import transformer
    from llmflow.model.loss import IGNORE_INDEX, causal_lm_loss
    from llmflow.tasks.dataprep.loader import PackedLoader
    from llmflow.tasks.pretrain.callbacks import Validator
    from llmflow.tasks.pretrain.config import TrainConfig
    from llmflow.tasks.pretrain.train import Trainer

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank,
                                world_size=world)  # fmt: skip
    cfg = TrainConfig.model_validate_json(cfg_json)
    trainer = Trainer(cfg, Path(data), Path(out), val_dir=Path(val))
    with torch.no_grad():
        for param in trainer.model.parameters():
            if param.ndim == 2:
                (param.to_local() if isinstance(param, DTensor) else param).mul_(SHARPEN)

    def no_full_logits(*args, **kwargs):
        raise AssertionError("validation gathered the full vocabulary-parallel logits")

    transformer.vocab_parallel_logits = no_full_logits
    calls = []
    trainer.model.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(
            (args[0].shape[-1], kwargs.get("labels") is not None or len(args) > 3)
        ),
        with_kwargs=True,
    )
    record = {"val_loss": Validator(Path(val), 1).evaluate(trainer), "calls": calls}
    if world == 1:  # the dense reference: full logits, causal_lm_loss, on the same batches
        loader = PackedLoader(Path(val), cfg.batch.micro_batch_size, 0, 1, seed=cfg.seed)
        total = count = 0.0
        with torch.no_grad():
            for _ in range(cfg.eval_batches):
                batch = loader.next_batch()
                logits = trainer.model(
                    batch["input_ids"], batch["position_ids"], batch["cu_seqlens"]
                )
                loss, _ = causal_lm_loss(logits, batch["labels"])
                n = int((batch["labels"] != IGNORE_INDEX).sum())
                total, count = total + loss.item() * n, count + n
        loader.close()
        record["dense"] = total / count
    if world > 1:
        dist.destroy_process_group()
    torch.save(record, f"{out}/rank{rank}.pt")


def _evaluate(tmp_path: Path, name: str, cfg, world: int, data: Path, val: Path) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    ctx = mp.get_context("spawn")
    args = (world, cfg.model_dump_json(), str(data), str(val), str(out))
    join_ranks([ctx.Process(target=_worker, args=(r, *args)) for r in range(world)], 240)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.mark.slow  # four spawned trainers: about 60 s on 2 cores
def test_validation_loss_at_cp2_tp2_pp2_equals_one_process(tmp_path, train_data, val_data):
    from conftest import SEQ_LEN, tiny_config

    common = dict(max_steps=1, z_loss=1e-3, checkpoint={"interval": 100, "keep_last": 1},
                  batch={"micro_batch_size": 4, "grad_accum_steps": 2})  # fmt: skip
    [one] = _evaluate(tmp_path, "one", tiny_config(**common), 1, train_data, val_data)
    # the new path against the dense full-logits loss of the same weights
    assert abs(one["val_loss"] - one["dense"]) <= 1e-5 * one["dense"], one
    for layout in ({"cp": 2}, {"tp": 2}, {"pp": 2}):
        name = "-".join(f"{k}{v}" for k, v in layout.items())
        cfg = tiny_config(parallel=layout, **common)
        ranks = _evaluate(tmp_path, name, cfg, 2, train_data, val_data)
        for rank in ranks:
            print(name, rank["val_loss"], one["dense"])
            assert abs(rank["val_loss"] - one["dense"]) <= 1e-5 * one["dense"], (name, rank)
            if "pp" in layout:
                continue  # the stages take the schedule's micro-batches (pp.py: fused loss)
            length = SEQ_LEN // layout.get("cp", 1)  # CP: each rank its half of every row
            assert rank["calls"] and all(c == (length, True) for c in rank["calls"]), rank
