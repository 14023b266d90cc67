"""The chosen attention kernel against the dense-mask reference at every layout.

One process holds a pipeline stage pair (stage 0 then stage 1 by hand). Two gloo ranks run the
trainer's first step at tp=2, cp=2 and pp=2, once with the chosen kernel (``auto``) and once
with the dense-mask reference, in the same ranks on the same batches: the losses and the
gradients must agree to float32 rounding, and equal one process's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tasks/pretrain/conftest.py

from conftest import TINY_MODEL, tiny_config  # noqa: E402

from llmflow.model.kernels import chosen_kernels, use_attention_kernel  # noqa: E402

KERNELS = ("auto", "dense")
SEQ_LEN = 64
CP_CHUNK = SEQ_LEN // 4
"""cp=2 cuts each row into 4 chunks (zig-zag: rank 0 holds chunks 0 and 3, rank 1 chunks 1, 2)."""
FP32 = 1e-5
"""float32 rounding through a step: a loss's relative difference, a gradient's relative to its
largest entry (the bound of the other layout tests)."""
LAYOUTS = {"tp2": {"tp": 2}, "cp2": {"cp": 2}, "pp2": {"pp": 2}}
DEADLINE_S = 180


def _max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-12))


# ------------------------------------------------------------ pipeline stages in one process
def test_stage_pair_in_one_process_matches_dense_and_the_whole_model():
    """Stage 0 then stage 1 of a GQA model with NoPE layers, forward and backward by hand on
    packed documents (position_ids, as the schedule passes them)."""
    from llmflow.model.config import ModelConfig
    from llmflow.model.transformer import Transformer
    from llmflow.tasks.pretrain.parallel.pp import build_stage

    cfg = ModelConfig(**{**TINY_MODEL, "num_layers": 4, "nope_interval": 2})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ_LEN), generator=gen)
    labels = torch.roll(ids, -1, 1)
    lengths = [[7, 1, 30, 26], [40, 24]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])

    def run(kernel: str, staged: bool) -> tuple[float, dict[str, torch.Tensor]]:
        model = Transformer(cfg)
        model.init_weights(seed=0)
        with use_attention_kernel(kernel):
            if staged:
                first, last = build_stage(model, 0, 2), build_stage(model, 1, 2)
                loss = last(first(ids, positions), positions, labels)
            else:
                loss, _ = model(ids, positions, labels=labels)
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    expected_loss, expected = run("dense", staged=False)
    for kernel in KERNELS:
        loss, grads = run(kernel, staged=True)
        assert abs(loss - expected_loss) <= FP32 * expected_loss, kernel
        assert grads.keys() == expected.keys()
        for name, ref in expected.items():
            assert _max_rel(grads[name], ref) <= FP32, (kernel, name)
    assert {"sdpa-buckets", "dense"} <= set(chosen_kernels())


# ------------------------------------------------------------------------- two gloo ranks
def _packed_data(out_dir: Path) -> Path:
    """Rows of 64 tokens packed from documents of 3 to 40 tokens: several per row, crossing the
    cp chunks' boundaries."""
    from llmflow.tasks.dataprep.pack import write_packed

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 41, size=40)
    tokens = rng.integers(1, TINY_MODEL["vocab_size"], size=int(lengths.sum()))
    tokens[np.cumsum(lengths) - 1] = 0  # each document ends with eos
    out_dir.mkdir(parents=True)
    write_packed(
        [(tokens, lengths)], out_dir, seq_len=SEQ_LEN, vocab_size=TINY_MODEL["vocab_size"],
        eos_id=0, pad_id=0, seed=0, rows_per_shard=64,
    )  # fmt: skip
    return out_dir


def _config(parallel: dict):
    """The tiny model (GQA, layer 1 without RoPE) on 2 micro-batches of 2 rows: the same global
    batch at every layout of 2 ranks (one data-parallel rank) and in one process."""
    model = {"preset": "debug", "overrides": {**TINY_MODEL, "nope_layers": [1]}}
    batch = {"micro_batch_size": 2, "grad_accum_steps": 2}
    return tiny_config(model=model, batch=batch, parallel=parallel, max_steps=1)


def _worker(rank: int, world_size: int, cfg_json: str, data: str, out: str, pg: str) -> None:
    """The first step's forward/backward with each kernel on the same batches; this rank's
    loss, its gradients (whole, canonical row order) and the kernels that ran."""
    import torch.distributed as dist

    from llmflow.tasks.pretrain.config import TrainConfig
    from llmflow.tasks.pretrain.train import Trainer
    from tests.tasks.pretrain.parallel.test_tp import _canonical_tensors

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{pg}", rank=rank, world_size=2)
    try:
        trainer = Trainer(TrainConfig.model_validate_json(cfg_json), Path(data), Path(out))
        batches = trainer.next_batches(0)
        record = {"cu_seqlens": [b["cu_seqlens"] for b in batches]}
        for kernel in KERNELS:
            with use_attention_kernel(kernel):
                loss, _ = trainer.forward_backward(batches)
            grads = _canonical_tensors(trainer.model, lambda p: p.grad)
            record[kernel] = {"loss": loss, "grads": grads}
            trainer.zero_grad()
        record["kernels"] = chosen_kernels()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(record, f"{out}/rank{rank}.pt")


def _step_one(tmp_path: Path, data: Path, parallel: dict, world_size: int) -> list[dict]:
    from tests.tasks.pretrain.parallel.ranks import join_ranks

    name = "-".join(f"{k}{v}" for k, v in parallel.items()) or "one"
    out = tmp_path / name
    out.mkdir()
    args = (world_size, _config(parallel).model_dump_json(), str(data), str(out))
    args += (str(tmp_path / f"{name}.pg"),)
    ctx = mp.get_context("spawn")
    join_ranks([ctx.Process(target=_worker, args=(r, *args)) for r in range(world_size)],
               DEADLINE_S)  # fmt: skip
    return [torch.load(out / f"rank{r}.pt") for r in range(world_size)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return _packed_data(tmp_path_factory.mktemp("attention_layouts") / "train")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data) -> dict:
    (record,) = _step_one(tmp_path_factory.mktemp("one"), data, {}, 1)
    return record


def _crosses_a_chunk(cu_seqlens: torch.Tensor) -> bool:
    """Whether a document of these rows spans a cp chunk boundary inside a row."""
    starts, ends = cu_seqlens[:-1] % SEQ_LEN, (cu_seqlens[1:] - 1) % SEQ_LEN
    return bool((starts // CP_CHUNK != ends // CP_CHUNK).any())


@pytest.mark.slow  # two spawned gloo ranks, both kernels: 8-11 s each (20 s loaded), + 4 s once
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_chosen_kernel_matches_dense_and_one_process(tmp_path, data, one_process, layout):
    ranks = _step_one(tmp_path, data, LAYOUTS[layout], 2)
    reference = one_process["dense"]
    # the one process's two kernels agree, on documents that cross the cp chunks
    assert all(_crosses_a_chunk(cu) for cu in one_process["cu_seqlens"])
    assert {"sdpa-buckets", "dense"} <= set(one_process["kernels"])
    assert abs(one_process["auto"]["loss"] - reference["loss"]) <= FP32 * reference["loss"]
    for name, ref in reference["grads"].items():
        assert _max_rel(one_process["auto"]["grads"][name], ref) <= FP32, name

    names: set[str] = set()
    worst = {"loss": 0.0, "grad": 0.0, "grad_vs_dense": 0.0}
    for rank, record in enumerate(ranks):
        for a, b in zip(record["cu_seqlens"], one_process["cu_seqlens"], strict=True):
            assert torch.equal(a, b)  # the same rows as one process
        if layout != "cp2":  # context parallelism attends through model/context.py
            assert {"sdpa-buckets", "dense"} <= set(record["kernels"]), (rank, record["kernels"])
        for kernel in KERNELS:
            got = record[kernel]
            loss_rel = abs(got["loss"] - reference["loss"]) / reference["loss"]
            assert loss_rel <= FP32, (rank, kernel, loss_rel)
            worst["loss"] = max(worst["loss"], loss_rel)
            for name, grad in got["grads"].items():
                to_one, to_dense = (
                    _max_rel(grad, r["grads"][name]) for r in (reference, record["dense"])
                )
                assert to_one <= FP32, (rank, kernel, name, to_one)
                assert to_dense <= FP32, (rank, name, to_dense)
                worst["grad"] = max(worst["grad"], to_one)
                worst["grad_vs_dense"] = max(worst["grad_vs_dense"], to_dense)
            names |= set(got["grads"])
    print(f"{layout}: {worst}, kernels {[r['kernels'] for r in ranks]}")
    assert names == set(reference["grads"])  # every parameter compared (both stages at pp=2)
