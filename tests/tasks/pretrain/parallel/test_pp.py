"""Pipeline parallelism: the stage split, and pp=2 over two CPU processes (gloo) against one.

The two-process runs execute this file as a torchrun worker (``__main__`` below): each rank
builds its stage of the model, runs 4 micro-batches through GPipe or 1F1B, and compares its
loss and its stage's gradients with the whole model's in one process (the trainer's token-mean
accumulation), by parameter name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from llmflow.model.config import preset
from llmflow.model.loss import IGNORE_INDEX
from llmflow.model.transformer import Transformer
from llmflow.tasks.framework.errors import ConfigError
from llmflow.tasks.pretrain.parallel.pp import build_stage, split_layers

TINY = dict(
    vocab_size=128, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
    intermediate_size=64, max_seq_len=64,
)  # fmt: skip
NUM_MICRO, BATCH, SEQ = 4, 2, 16
DEADLINE_S = 120


# ------------------------------------------------------------------------------- the split
@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [
        (8, 2, [4, 4]),  # embed + 4 | 4 + head
        (6, 4, [1, 2, 2, 1]),
        (4, 4, [1, 1, 1, 1]),
        (30, 4, [7, 8, 8, 7]),
        (5, 2, [3, 2]),  # loads 4 | 3: a tie goes to the earlier stage
        (3, 1, [3]),
    ],
)
def test_split_layers_balances_embedding_and_head(layers, stages, expected):
    split = split_layers(layers, stages)
    assert [len(r) for r in split] == expected
    assert [i for r in split for i in r] == list(range(layers))  # contiguous, in order
    # No other split into non-empty stages has a smaller largest load (brute force).
    assert _largest_load([len(r) for r in split]) == min(
        _largest_load(sizes) for sizes in _compositions(layers, stages)
    )


def _largest_load(sizes: list[int]) -> int:
    loads = list(sizes)
    loads[0] += 1
    loads[-1] += 1
    return max(loads)


def _compositions(total: int, parts: int):
    if parts == 1:
        yield [total]
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield [first, *rest]


def test_split_layers_by_weights_and_refusal():
    assert [len(r) for r in split_layers(8, 2, 0, 0)] == [4, 4]
    assert [len(r) for r in split_layers(8, 2, 0, 4)] == [6, 2]
    assert [len(r) for r in split_layers(4, 3, 0, 10)] == [2, 1, 1]  # each keeps one block
    with pytest.raises(ConfigError, match=r"parallel.pp=3 exceeds the model's num_layers=2"):
        split_layers(2, 3)


@pytest.mark.parametrize("tie", [True, False])
def test_stages_keep_full_model_names_and_seeded_init(tie):
    cfg = preset("debug", **TINY, tie_embeddings=tie)
    full = Transformer(cfg)
    full.init_weights(seed=3)
    reference = full.state_dict()
    names: set[str] = set()
    for index in range(2):
        with torch.device("meta"):
            model = Transformer(cfg)
        stage = build_stage(model, index, 2)
        stage.to_empty(device="cpu")
        stage.init_weights(seed=3)
        state = stage.state_dict()
        names |= set(state)
        for name, value in state.items():
            torch.testing.assert_close(value, reference[name], rtol=0, atol=0)
    assert names == set(reference)
    assert "layers.3.mlp.down_proj.weight" in state and "layers.0.attn_norm.weight" not in state


# ---------------------------------------------------------------------- two processes
def _batches(seed: int) -> list[dict[str, torch.Tensor]]:
    """Packed micro-batches: documents restart positions; cu_seqlens as the loader makes them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(NUM_MICRO):
        ids = torch.randint(1, TINY["vocab_size"], (BATCH, SEQ), generator=g)
        labels = torch.roll(ids, -1, 1)
        labels[torch.rand(BATCH, SEQ, generator=g) < 0.2] = IGNORE_INDEX
        positions, cu = torch.empty(BATCH, SEQ, dtype=torch.long), [0]
        for row in range(BATCH):
            start = 0
            while start < SEQ:
                length = min(int(torch.randint(2, 9, (1,), generator=g)), SEQ - start)
                positions[row, start : start + length] = torch.arange(length)
                start += length
                cu.append(row * SEQ + start)
        out.append(
            {
                "input_ids": ids,
                "labels": labels,
                "position_ids": positions,
                "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
            }
        )
    return out


def _reference(cfg, batches, z_loss: float) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the trainer's accumulation: sum_i loss_i * count_i / num_valid."""
    model = Transformer(cfg)
    model.init_weights(seed=0)
    counts = [int((b["labels"] != IGNORE_INDEX).sum()) for b in batches]
    total, loss_sum = sum(counts), 0.0
    for batch, count in zip(batches, counts, strict=True):
        loss, _ = model(
            batch["input_ids"], batch["position_ids"], batch.get("cu_seqlens"),
            labels=batch["labels"], z_loss_weight=z_loss,
        )  # fmt: skip
        (loss * (count / total)).backward()
        loss_sum += float(loss.detach().double()) * count
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss_sum / total, grads


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from llmflow.tasks.pretrain.distributed import apply_activation_checkpointing
    from llmflow.tasks.pretrain.parallel.pp import PipelineRunner, tied_group

    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = preset("debug", **TINY, tie_embeddings=bool(args.tied))
    batches = _batches(seed=11)
    # batch-size warmup: a step of 1-row micro-batches (another shape, another schedule)
    rows1 = [{k: b[k][:1] for k in ("input_ids", "labels", "position_ids")} for b in batches]
    expected_loss, expected_grads = _reference(cfg, batches, args.z_loss)
    references = {
        "full": (expected_loss, expected_grads),
        "rows1": _reference(cfg, rows1, args.z_loss),
    }

    with torch.device("meta"):
        model = Transformer(cfg)
    stage = build_stage(model, rank, world, z_loss_weight=args.z_loss)
    stage.to_empty(device="cpu")
    stage.init_weights(seed=0)
    if args.ac:
        apply_activation_checkpointing(stage, "full")
    group = dist.new_group(list(range(world)))
    tied = tied_group(torch.arange(world)) if cfg.tie_embeddings else None
    runner = PipelineRunner(stage, rank, world, group, torch.device("cpu"), args.schedule, tied)
    results = []
    # a second step reuses the schedule (gradients reset in between), a third has a new shape
    for which, step_batches in [("full", batches), ("full", batches), ("rows1", rows1)]:
        num_valid = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in step_batches)
        stage.zero_grad(set_to_none=True)
        loss_sum = runner.step(step_batches, 1.0 / num_valid)  # summed over the stages
        loss = float(loss_sum) / num_valid
        grad_err = 0.0
        for name, param in stage.named_parameters():
            ref = references[which][1][name.replace("_checkpoint_wrapped_module.", "")]
            err = float((param.grad - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
            grad_err = max(grad_err, err)
        names = sorted(stage.state_dict())  # the wrapper's prefix left out
        results.append(
            {"loss": loss, "expected": references[which][0], "grad_err": grad_err, "names": names}
        )
    stage.eval()
    num_valid = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    with torch.no_grad():  # validation: the schedule's forward only, same weights
        eval_loss = float(runner.evaluate(batches)) / num_valid
    # validation reports the cross-entropy alone (no z-loss), as at every other layout
    expected_eval = _reference(cfg, batches, 0.0)[0] if args.z_loss else expected_loss
    out = {"expected_loss": expected_loss, "steps": results, "eval_loss": eval_loss,
           "expected_eval": expected_eval}  # fmt: skip
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run_two_ranks(
    tmp_path: Path, schedule: str, tied: bool, z_loss: float = 0.0, ac: bool = False
) -> list[dict]:
    """Run this file's worker on 2 gloo ranks with a deadline; return each rank's results."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--standalone", __file__, "--schedule", schedule, "--tied", str(int(tied)),
        "--z-loss", str(z_loss), "--out", str(tmp_path), *(["--ac"] if ac else []),
    ]  # fmt: skip
    from tests.tasks.pretrain.parallel.ranks import run_group

    run_group(command, env, DEADLINE_S, f"pp=2 {schedule}")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize(
    ("schedule", "tied", "z_loss", "ac"),
    [
        ("gpipe", True, 0.0, False),
        ("1f1b", False, 1e-3, True),
        pytest.param("1f1b", True, 0.0, False, marks=pytest.mark.slow),
        pytest.param("gpipe", False, 0.0, False, marks=pytest.mark.slow),
    ],
)
def test_pp2_matches_one_process(tmp_path, schedule, tied, z_loss, ac):
    """Steps 1-2: the 4 micro-batches; step 3: 1-row micro-batches (a new schedule)."""
    ranks = run_two_ranks(tmp_path, schedule, tied, z_loss, ac)
    expected = ranks[0]["expected_loss"]
    for info in ranks:
        assert abs(info["eval_loss"] - info["expected_eval"]) <= 1e-5 * abs(expected)
        assert len(info["steps"]) == 3
        for step in info["steps"]:
            assert abs(step["loss"] - step["expected"]) <= 1e-5 * abs(step["expected"])
            assert step["grad_err"] <= 1e-5, step
    first, last = ranks[0]["steps"][0]["names"], ranks[1]["steps"][0]["names"]
    assert "embed.weight" in first and "norm.weight" in last
    assert ("embed.weight" in last) == tied and ("lm_head.weight" in last) != tied
    assert not {n for n in first if n.startswith("layers.")} & set(last)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--tied", type=int, required=True)
    parser.add_argument("--z-loss", type=float, default=0.0)
    parser.add_argument("--ac", action="store_true", help="full activation checkpointing")
    parser.add_argument("--out", required=True)
    _worker(parser.parse_args())
