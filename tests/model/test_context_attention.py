"""`SequenceShard.attend` (model/context.py): one rank's queries over the whole rows' keys and
values under context parallelism, against dense-mask SDPA over the whole rows.

Ranks are simulated in one process: each rank's shard takes its zig-zag queries and the whole
rows' k/v (what `SequenceShard.gather` would return); `attend` needs no process group. The
gradients of q, k and v are summed over the ranks, as the gather's reduce-scatter sums them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from llmflow.model.attention import document_ids, document_mask
from llmflow.model.context import SequenceShard
from llmflow.tasks.pretrain.parallel.cp import gather_order, zigzag_index

SEQ_LEN = 64
# Document lengths per row (B=2, T=64). Chunks are 16 tokens at cp=2 and 8 at cp=4.
LAYOUTS = {
    # documents crossing chunk boundaries (5..18 spans chunks 0 and 1; 19..63 spans three)
    "crossing": [[5, 14, 45], [10, 22, 1, 1, 30]],
    # one-token documents, in runs and at chunk edges
    "one_token": [[1, 1, 1, 13, 1, 1, 30, 15, 1], [16, 1, 1, 1, 45]],
    # a document spanning the whole row beside a packed row
    "one_document": [[64], [20, 44]],
    # every row one document: no document ids at all (plain causal)
    "causal": [[64], [64]],
}


def _cu_seqlens(lengths: list[list[int]]) -> torch.Tensor:
    flat = [n for row in lengths for n in row]
    return torch.tensor([0, *torch.tensor(flat).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(heads: int, kv_heads: int, dtype: torch.dtype, dim: int = 16, seed: int = 0):
    """Leaves q (B, H, T, D) and k, v (B, KV, T, D) in the layouts the model hands over: q from
    (B, T, H, D) memory, k and v from the gather's (T, B, KV, D) memory."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, SEQ_LEN, heads, dim, generator=gen, dtype=dtype).transpose(1, 2)
    k, v = (
        torch.randn(SEQ_LEN, 2, kv_heads, dim, generator=gen, dtype=dtype).permute(1, 2, 0, 3)
        for _ in range(2)
    )
    grad = torch.randn(2, heads, SEQ_LEN, dim, generator=gen, dtype=dtype)
    return [t.detach().requires_grad_() for t in (q, k, v)], grad


def _reference(q, k, v, doc_ids, grad):
    """Dense-mask SDPA over the whole rows (k/v repeated per head) and its gradients."""
    if doc_ids is None:
        mask = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool, device=q.device).tril()[None, None]
    else:
        mask = document_mask(doc_ids)
    groups = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out.detach(), dq, dk, dv


def _sharded(q, k, v, doc_ids, grad, cp: int):
    """Every rank's attend, scattered back to row order; gradients summed over the ranks."""
    out = torch.zeros_like(q)
    total = 0
    for rank in range(cp):
        index = zigzag_index(SEQ_LEN, cp, rank, q.device)
        shard = SequenceShard(None, index, gather_order(SEQ_LEN, cp, q.device), doc_ids)
        local = shard.attend(q[:, :, index], k, v)
        assert local.shape == (q.shape[0], q.shape[1], index.numel(), q.shape[3])
        out[:, :, index] = local.detach().to(out.dtype)
        total = total + (local.to(grad.dtype) * grad[:, :, index]).sum()
    dq, dk, dv = torch.autograd.grad(total, (q, k, v))
    return out, dq, dk, dv


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_shard_attention_matches_dense_whole_rows(cp, layout, dtype, heads):
    """Outputs and q/k/v gradients equal dense SDPA's rows: 1e-12 in float64, rounding in fp32."""
    doc_ids = document_ids(2, SEQ_LEN, None, _cu_seqlens(LAYOUTS[layout]))
    assert (doc_ids is None) == (layout == "causal")
    (q, k, v), grad = _inputs(*heads, dtype)
    expected = _reference(q, k, v, doc_ids, grad)
    got = _sharded(q, k, v, doc_ids, grad, cp)
    tolerance = 1e-12 if dtype == torch.float64 else 2e-6
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, expected, strict=True):
        assert a.dtype == dtype, name
        worst = (a - b).abs().max().item()
        assert worst <= tolerance * max(b.abs().max().item(), 1.0), (name, worst)


@pytest.mark.parametrize("layout", ["crossing", "one_document"])
def test_shard_attention_under_bf16_autocast(layout):
    """bf16 autocast: the output is bf16 and as close to the float64 truth as dense SDPA's own
    bf16 result (both round q, k, v and the output to bf16)."""
    doc_ids = document_ids(2, SEQ_LEN, None, _cu_seqlens(LAYOUTS[layout]))
    (q, k, v), grad = _inputs(4, 2, torch.float32)
    truth = _reference(*(t.double() for t in (q, k, v)), doc_ids, grad.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense = _reference(q, k, v, doc_ids, grad)
        got = _sharded(q, k, v, doc_ids, grad, 2)
    for name, a, ref, exact in zip(["out", "dq", "dk", "dv"], got, dense, truth, strict=True):
        scale = exact.abs().max().item()
        ours = (a.double() - exact).abs().max().item()
        theirs = (ref.double() - exact).abs().max().item()
        assert ours <= max(2 * theirs, 1e-2 * scale), (name, ours, theirs, scale)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        index = zigzag_index(SEQ_LEN, 2, 0)
        shard = SequenceShard(None, index, gather_order(SEQ_LEN, 2), doc_ids)
        assert shard.attend(q[:, :, index], k, v).dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["crossing", "one_token", "causal"])
def test_flex_shard_attention_on_cuda_matches_dense(layout):
    """CUDA's path (FlexAttention, compiled block mask of the local queries over the whole
    rows): float32 within 1e-4 of dense SDPA's rows; under bf16 autocast as close to the float64
    truth as dense SDPA's own bf16 result (or 2% of the largest value)."""
    cu_seqlens = _cu_seqlens(LAYOUTS[layout])
    doc_ids = document_ids(2, SEQ_LEN, None, cu_seqlens)
    doc_ids = None if doc_ids is None else doc_ids.cuda()
    (q, k, v), grad = _inputs(4, 2, torch.float32)
    q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    grad = grad.cuda()
    expected = _reference(q, k, v, doc_ids, grad)
    got = _sharded(q, k, v, doc_ids, grad, 2)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, expected, strict=True):
        worst = (a - b).abs().max().item()
        assert worst <= 1e-4 * max(b.abs().max().item(), 1.0), (name, worst)
    truth = _reference(*(t.double() for t in (q, k, v)), doc_ids, grad.double())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        dense = _reference(q, k, v, doc_ids, grad)
        got = _sharded(q, k, v, doc_ids, grad, 2)
    for name, a, ref, exact in zip(["out", "dq", "dk", "dv"], got, dense, truth, strict=True):
        scale = exact.abs().max().item()
        ours = (a.double() - exact).abs().max().item()
        theirs = (ref.double() - exact).abs().max().item()
        assert ours <= max(2 * theirs, 2e-2 * scale), (name, ours, theirs, scale)


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), func
        return out


@pytest.mark.parametrize("layout", ["one_document", "crossing", "causal"])
def test_no_tensor_of_local_by_full_tokens(layout):
    """Forward and backward allocate nothing of T_local x T_full elements (no mask, no scores):
    at T=1024, cp=2, 2 heads of width 8, one row, every legitimate tensor is below 16k elements
    and T_local x T_full is 512k (today's mask path: a (1, 1, 512, 1024) mask)."""
    seq_len, cp = 1024, 2
    lengths = {"one_document": [1024], "crossing": [100, 600, 1, 323], "causal": [1024]}[layout]
    doc_ids = document_ids(1, seq_len, None, _cu_seqlens([lengths]))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, seq_len // cp, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 1, seq_len, 8, generator=gen, requires_grad=True) for _ in range(2))
    shard = SequenceShard(None, zigzag_index(seq_len, cp, 1), gather_order(seq_len, cp), doc_ids)
    with _LargestOutput() as mode:
        shard.attend(q, k, v).sum().backward()
    local_by_full = (seq_len // cp) * seq_len
    assert mode.largest < local_by_full // 16, (mode.largest, mode.op, local_by_full)


def test_kernel_calls_follow_length_buckets_not_documents():
    """Four rows of 2,048 tokens in 270 documents of 1 to 59 tokens, cp=2: the forward runs the
    flash kernel once per length bucket (13), and the plan is built once for all layers."""
    seq_len, cp = 2048, 2
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(4):
        lengths, left = [], seq_len
        while left:
            n = min(left, int(torch.randint(1, 60, (1,), generator=gen)))
            lengths.append(n)
            left -= n
        rows.append(lengths)
    documents = sum(len(r) for r in rows)
    doc_ids = document_ids(4, seq_len, None, _cu_seqlens(rows))
    q = torch.randn(4, 2, seq_len // cp, 8, generator=gen)
    k, v = (torch.randn(4, 1, seq_len, 8, generator=gen) for _ in range(2))
    shard = SequenceShard(None, zigzag_index(seq_len, cp, 0), gather_order(seq_len, cp), doc_ids)
    calls = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "flash_attention" in str(func):
                calls.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        shard.attend(q, k, v)
    plan = shard.plan(4, q.device)
    buckets = len(plan.diagonal) + len(plan.past)
    assert documents > 150 and len(calls) == buckets <= 16, (documents, len(calls), buckets)
    with Count():
        shard.attend(q, k, v)  # the next layer: the same plan
    assert len(calls) == 2 * buckets and shard.plan(4, q.device) is plan


def _regather_rank(rank: int, init_file: str, out: str) -> None:
    """One of two gloo ranks: gather + attend + backward on its zig-zag tokens, once on the
    gather's own outputs and once on copies of them, fp32 and under bf16 autocast; what each
    run's autograd saved (bytes, by storage), its output and its local q/k/v gradients."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    doc_ids = document_ids(2, SEQ_LEN, None, _cu_seqlens(LAYOUTS["crossing"]))
    index = zigzag_index(SEQ_LEN, 2, rank)
    (q, k, v), grad = _inputs(4, 2, torch.float32)  # the whole rows, the same on both ranks
    results = {}
    for autocast in (False, True):
        for copied in (False, True):
            shard = SequenceShard(dist.group.WORLD, index, gather_order(SEQ_LEN, 2), doc_ids)
            ql, kl, vl = (t[:, :, index].detach().requires_grad_() for t in (q, k, v))
            saved = {}

            def pack(t, saved=saved):
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with (
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
            ):
                kw, vw = shard.gather(kl), shard.gather(vl)
                if copied:  # not the gather's outputs: the attention saves the whole rows
                    kw, vw = kw.clone(), vw.clone()
                local = shard.attend(ql, kw, vw)
            (local.float() * grad[:, :, index]).sum().backward()
            results[autocast, copied] = {
                "saved": sum(saved.values()),
                "tensors": [local.detach(), ql.grad, kl.grad, vl.grad],
            }
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def test_gathered_kv_saved_as_local_tokens_and_gathered_again(tmp_path):
    """Two gloo ranks: on the gather's own outputs the attention saves each rank's local k/v
    (T/cp tokens) for its backward pass, not the whole rows', and gathers them again there:
    autograd saves 2 x (T_full - T_local) x B x KV x D elements less (16 KiB in fp32, 8 KiB
    in bf16 under autocast; 0 before: the whole rows were saved), and the output and q/k/v
    gradients are bit for bit those of the same attention on copies of the whole rows."""
    import multiprocessing as mp

    from tests.tasks.pretrain.parallel.ranks import join_ranks

    ctx = mp.get_context("spawn")
    out = str(tmp_path / "rank")
    procs = [
        ctx.Process(target=_regather_rank, args=(r, str(tmp_path / "pg"), out)) for r in (0, 1)
    ]
    join_ranks(procs, 120)
    kv_elements = 2 * 2 * (SEQ_LEN - SEQ_LEN // 2) * 2 * 16  # k and v, B=2, KV=2, D=16
    for rank in (0, 1):
        results = torch.load(f"{out}.{rank}")
        for autocast in (False, True):
            local, whole = results[autocast, False], results[autocast, True]
            size = 2 if autocast else 4
            assert whole["saved"] - local["saved"] == kv_elements * size, (rank, autocast)
            for name, a, b in zip(["out", "dq", "dk", "dv"], local["tensors"], whole["tensors"],
                                  strict=True):  # fmt: skip
                assert torch.equal(a, b), (rank, autocast, name)
