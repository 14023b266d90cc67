"""Context parallelism (``parallel/cp.py``): 2 gloo ranks against the same model in one process.

Each rank holds the zig-zag half of every row; the token-weighted sum of the ranks' losses and
the sum of their parameter gradients must equal one process's loss and gradients on the whole
rows, with documents that start inside rows and cross the ranks' chunk boundaries.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from llmflow.model.config import preset
from llmflow.model.loss import IGNORE_INDEX
from llmflow.model.transformer import Transformer
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.pretrain.parallel.cp import gather_order, whole_row_positions, zigzag_index

SEQ_LEN, VOCAB = 32, 256
# Row 0: documents [5, 14, 13] (tokens 5..18 lie in chunks 0, 1, 2: on both ranks; 19..31 in
# chunks 2 and 3: rank 1 then rank 0); row 1: [10, 22]. "one_token": row 0 [1, 1, 1, 5, 1, 23]
# (one-token documents in chunk 0, the last from chunk 1 to the row's end), row 1 one document.
# "rows": one document per row.
DOCS = {
    "packed": [0, 5, 19, 32, 42, 64],
    "one_token": [0, 1, 2, 3, 8, 9, 32, 64],
    "rows": [0, 32, 64],
}
CASES = {
    "default": dict(),
    # ABF base, YaRN scaling and NoPE in layers 1 and 3.
    "yarn_nope": dict(
        rope_theta=500000.0,
        max_seq_len=256,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        nope_interval=2,
    ),
    # Every block recomputed in the backward pass (the all-gather runs again) on the CP ranks.
    "checkpointed": dict(),
}


def _model(case: str) -> Transformer:
    model = Transformer(preset("debug", vocab_size=VOCAB, **CASES[case]))
    model.init_weights(seed=0)
    return model


def _batch(docs: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=generator)
    labels[torch.rand(2, SEQ_LEN, generator=generator) < 0.2] = IGNORE_INDEX
    return {
        "input_ids": ids,
        "labels": labels,
        "cu_seqlens": torch.tensor(DOCS[docs], dtype=torch.int32),
    }


def _reference(case: str, docs: str) -> tuple[float, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)  # as the spawned ranks
    model, batch = _model(case), _batch(docs)
    loss, _ = model(batch["input_ids"], cu_seqlens=batch["cu_seqlens"], labels=batch["labels"])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cp_step(case: str, docs: str) -> dict:
    """One rank: the loss of its shard, weighted by its share of the tokens; summed over ranks."""
    import torch.distributed as dist

    from llmflow.tasks.pretrain.distributed import apply_activation_checkpointing
    from llmflow.tasks.pretrain.parallel.cp import shard_batch

    model, group = _model(case), dist.group.WORLD
    if case == "checkpointed":
        apply_activation_checkpointing(model, "full")
    shard = shard_batch(_batch(docs), group)
    count = int((shard["labels"] != IGNORE_INDEX).sum())
    total = torch.tensor(float(count))
    dist.all_reduce(total, group=group)
    loss, _ = model(
        shard["input_ids"],
        shard["position_ids"],
        shard["cu_seqlens"],
        labels=shard["labels"],
        context=shard["context"],
    )
    (loss * count / total).backward()
    weighted = (loss.detach() * count / total).reshape(1)
    dist.all_reduce(weighted, group=group)
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad, group=group)
        grads[name.replace("_checkpoint_wrapped_module.", "")] = param.grad
    return {"loss": weighted.item(), "grads": grads, "count": count}


def _worker(rank: int, init_file: str, runs: list[tuple[str, str]], out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    results = {run: _cp_step(*run) for run in runs}
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def _run_cp(tmp_path: Path, runs: list[tuple[str, str]], timeout: float = 120) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = tmp_path / "cp.pt"
    args = (str(tmp_path / "pg"), runs, str(out))
    procs = [ctx.Process(target=_worker, args=(r, *args)) for r in (0, 1)]
    from tests.tasks.pretrain.parallel.ranks import join_ranks

    join_ranks(procs, timeout)
    return [torch.load(f"{out}.{r}") for r in (0, 1)]


RUNS = [
    ("default", "packed"),
    ("yarn_nope", "packed"),
    ("default", "rows"),
    ("checkpointed", "packed"),
]


def _check_runs(tmp_path: Path, runs: list[tuple[str, str]]) -> None:
    """Loss within 1e-5 relative and every summed gradient within 1e-5 of its largest entry."""
    results = _run_cp(tmp_path, runs)
    for run in runs:
        expected_loss, expected = _reference(*run)
        per_rank = [r[run] for r in results]
        assert per_rank[0]["count"] > 0 and per_rank[1]["count"] > 0
        assert per_rank[0]["loss"] == per_rank[1]["loss"]  # the same all-reduced value
        got = per_rank[0]
        assert abs(got["loss"] - expected_loss) <= 1e-5 * abs(expected_loss), run
        for name, grad in expected.items():
            scale = grad.abs().max().item()
            assert scale > 0, (run, name)
            worst = (got["grads"][name] - grad).abs().max().item()
            assert worst <= 1e-5 * scale, (run, name, worst, scale)


def test_two_cp_ranks_match_one_process_yarn_nope(tmp_path):
    """Documents across the ranks' chunks, ABF + YaRN, NoPE layers, GQA: about 12 s idle."""
    _check_runs(tmp_path, [("yarn_nope", "packed")])


def test_two_cp_ranks_match_one_process_one_token_documents(tmp_path):
    """A packed row of one-token documents beside a row of one document, default model."""
    _check_runs(tmp_path, [("default", "one_token")])


@pytest.mark.slow  # four models on two spawned ranks: about 20 s idle, 50 s on a loaded machine
def test_two_cp_ranks_match_one_process_all_cases(tmp_path):
    """Default RoPE, one document per row (plain causal) and activation checkpointing too."""
    _check_runs(tmp_path, RUNS)


def test_zigzag_split_covers_each_position_once_and_balances_causal_work():
    for seq_len, cp in [(8, 1), (32, 2), (48, 4)]:
        parts = [zigzag_index(seq_len, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(seq_len))
        work = [int((p + 1).sum()) for p in parts]  # keys each rank's queries see (causal)
        assert len(set(work)) == 1, work
        order = gather_order(seq_len, cp)
        assert torch.equal(torch.cat(parts)[order], torch.arange(seq_len))
    assert zigzag_index(32, 2, 0).tolist() == [*range(8), *range(24, 32)]
    with pytest.raises(BadInputError, match="seq_len=30 must be divisible by 2 x cp = 4"):
        zigzag_index(30, 2, 0)


def test_whole_row_positions_restart_at_each_document_across_chunks():
    """Positions are the whole rows' (computed before the cut): they restart at each document,
    across the ranks' chunk boundaries. (Each rank's attention against the whole rows' dense
    mask: tests/model/test_context_attention.py.)"""
    positions, doc_ids = whole_row_positions(2, SEQ_LEN, None, _batch("packed")["cu_seqlens"])
    assert doc_ids is not None
    assert positions[0, 19].item() == 0 and positions[0, 31].item() == 12
    assert positions[1, 10].item() == 0 and positions[1, 9].item() == 9
    _, doc_ids = whole_row_positions(2, SEQ_LEN, None, _batch("rows")["cu_seqlens"])
    assert doc_ids is None


def test_cp_with_pipeline_stages_is_refused_naming_both():
    from llmflow.tasks.framework.errors import ConfigError
    from llmflow.tasks.pretrain.parallel.config import ParallelConfig

    ParallelConfig(cp=2).resolve(4)
    ParallelConfig(pp=2).resolve(4)
    with pytest.raises(ConfigError, match=r"parallel.cp=2 with pp=2"):
        ParallelConfig(cp=2, pp=2).resolve(4)
