"""The mask-free attention kernels (model/kernels.py) against the dense-mask reference.

`sdpa-buckets` (the CPU's kernel for packed documents) must give the outputs and the q, k, v
gradients of SDPA under the (B, 1, T, T) block-diagonal causal mask: to float64 rounding in
float64, to float32 rounding in float32, to bf16 rounding under CPU autocast.
"""

from __future__ import annotations

import pytest
import torch

from llmflow.model import kernels
from llmflow.model.kernels import (
    MIN_BUCKET,
    Documents,
    attend,
    choose_kernel,
    chosen_kernels,
    padded_length,
    use_attention_kernel,
)

U_BF16 = 2.0**-8
"""bf16's unit roundoff."""
TOLERANCE = {torch.float64: 1e-12, torch.float32: 32 * torch.finfo(torch.float32).eps}
"""Largest difference relative to the reference's largest magnitude, per dtype."""


def _qkv(batch, seq_len, heads, kv_heads, dtype, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, seq_len, heads, dim), *[(batch, seq_len, kv_heads, dim)] * 2]
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def _run(name: str, q, k, v, docs, grad_out) -> list[torch.Tensor]:
    """The output of kernel `name` and the gradients of q, k, v for `grad_out`."""
    with use_attention_kernel(name):
        out = attend(q, k, v, docs)
    return [out, *torch.autograd.grad(out, (q, k, v), grad_out)]


def _max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def _check_buckets_against_dense(lengths, batch, seq_len, heads, kv_heads, dtype) -> None:
    assert sum(lengths) == batch * seq_len
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    docs = Documents.of(batch, seq_len, cu_seqlens=cu_seqlens)
    assert docs is not None and docs.lengths == tuple(lengths)
    q, k, v = _qkv(batch, seq_len, heads, kv_heads, dtype)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    expected = _run("dense", q, k, v, docs, grad_out)
    got = _run("sdpa-buckets", q, k, v, docs, grad_out)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        assert a.dtype == b.dtype == dtype
        assert _max_rel(a, b) <= TOLERANCE[dtype], (what, _max_rel(a, b))


CASES = {
    # name: (document lengths over the flattened rows, B, T, heads, KV heads)
    "gqa-8q-2kv": ([5, 27, 32, 10, 22], 3, 32, 8, 2),
    "mha": ([5, 27, 32, 10, 22], 3, 32, 4, 4),
    "one-token-documents": ([1, 1, 1, 5, 1, 7, 1, 16, 1], 2, 17, 4, 2),
    "a-document-spans-the-row": ([48, 3, 30, 15], 2, 48, 4, 2),
    # buckets: 1..16 -> 16, 17 -> 20, 27 -> 28, 33 and 40 -> 40, 50 -> 56, 60 -> 64, 65 -> 80,
    # 100 -> 112
    "mixed-lengths-many-buckets": (
        [1, 2, 9, 16, 17, 65, 33, 40, 27, 10, 60, 50, 100, 10],
        4,
        110,
        4,
        2,
    ),
    "rows-with-different-documents": ([20, 20, 24, 64, 1, 63, 8, 8, 8, 40], 4, 64, 8, 2),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sdpa_buckets_matches_the_dense_mask(case, dtype):
    """Outputs and q, k, v gradients within float64 1e-12 / float32 32 eps of the max."""
    _check_buckets_against_dense(*CASES[case], dtype)


def test_mixed_lengths_fall_into_several_buckets():
    lengths, batch, seq_len, _, _ = CASES["mixed-lengths-many-buckets"]
    docs = Documents.of(batch, seq_len, cu_seqlens=torch.tensor([0, *lengths]).cumsum(0))
    plan = docs.plan("sdpa-buckets", kernels._plan_buckets)
    assert [size for _, size in plan.sizes] == [16, 20, 28, 40, 56, 64, 80, 112]
    assert [count for count, _ in plan.sizes] == [6, 1, 1, 2, 1, 1, 1, 1]
    # every token is read back from its own slot: the plan's scatter covers each token once
    assert sorted(plan.where.tolist()) == sorted(set(plan.where.tolist()))
    assert plan.where.numel() == batch * seq_len


def test_padded_length_pads_at_most_a_quarter_and_at_least_to_the_minimum():
    assert MIN_BUCKET == 16
    for length in range(1, 5000):
        padded = padded_length(length)
        assert padded >= max(length, MIN_BUCKET), length
        if length > MIN_BUCKET:
            assert padded - length <= length / 4, (length, padded)
        else:
            assert padded == MIN_BUCKET
    assert [padded_length(n) for n in (16, 17, 31, 32, 33, 100, 1000)] == [
        16, 20, 32, 32, 40, 112, 1024,
    ]  # fmt: skip
    buckets = {padded_length(n) for n in range(1, 8193)}
    assert len(buckets) < 4 * 10  # a quarter octave each: few distinct SDPA shapes


def test_sdpa_buckets_matches_dense_in_bf16_under_cpu_autocast():
    """q, k, v from a projection under autocast (bf16, as in the model); both kernels under the
    same autocast, and both within bf16 rounding of the float64 reference."""
    batch, seq_len, heads, kv_heads, dim, width = 2, 64, 8, 2, 16, 32
    lengths = [1, 2, 17, 30, 14, 36, 28]
    docs = Documents.of(batch, seq_len, cu_seqlens=torch.tensor([0, *lengths]).cumsum(0))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq_len, width, generator=gen)
    weight = torch.randn((heads + 2 * kv_heads) * dim, width, generator=gen) / width**0.5

    def run(name: str, dtype: torch.dtype, autocast: bool) -> list[torch.Tensor]:
        xs = x.to(dtype, copy=True).requires_grad_()
        ws = weight.to(dtype, copy=True).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with use_attention_kernel(name):
                qkv = (xs @ ws.t()).view(batch, seq_len, -1, dim)
                q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=2)
                out = attend(q, k, v, docs)
        assert out.dtype == (torch.bfloat16 if autocast else dtype)
        out.double().square().sum().backward()
        return [out.double(), xs.grad.double(), ws.grad.double()]

    got = run("sdpa-buckets", torch.float32, True)
    dense = run("dense", torch.float32, True)
    exact = run("dense", torch.float64, False)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    for what, a, b, ref in zip(("out", "dx", "dw"), got, dense, exact, strict=True):
        assert rel(a, b) <= 2 * U_BF16, (what, rel(a, b))
        assert rel(a, ref) <= 2 * U_BF16, (what, rel(a, ref))
        assert rel(b, ref) <= 2 * U_BF16, (what, rel(b, ref))


# --------------------------------------------------------------------------- documents
def test_documents_from_position_ids_equal_those_from_cu_seqlens():
    # B=2, T=8: documents [3, 5 | 2, 6]
    cu_seqlens = torch.tensor([0, 3, 8, 10, 16], dtype=torch.int32)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]])
    from_cu = Documents.of(2, 8, cu_seqlens=cu_seqlens)
    from_positions = Documents.of(2, 8, position_ids=position_ids)
    for docs in (from_cu, from_positions):
        assert docs.lengths == (3, 5, 2, 6)
        assert docs.cu_seqlens.dtype == torch.int32
        assert docs.cu_seqlens.tolist() == cu_seqlens.tolist()
        assert docs.ids().tolist() == [[1, 1, 1, 2, 2, 2, 2, 2], [3, 3, 4, 4, 4, 4, 4, 4]]
        assert torch.equal(docs.positions(), position_ids)
        assert docs.max_seqlen == 6
    # cu_seqlens takes precedence over position_ids when both are given
    both = Documents.of(2, 8, position_ids=torch.arange(8).expand(2, 8), cu_seqlens=cu_seqlens)
    assert both.lengths == (3, 5, 2, 6)


def test_cu_seqlens_without_row_boundaries_gets_them_added():
    # documents [3, 7, 6] over the flattened 2 x 8 tokens: the 7 crosses the row boundary at 8
    docs = Documents.of(2, 8, cu_seqlens=torch.tensor([0, 3, 10, 16], dtype=torch.int32))
    assert docs.cu_seqlens.tolist() == [0, 3, 8, 10, 16]
    assert docs.lengths == (3, 5, 2, 6)
    # a repeated boundary (padded cu_seqlens) makes no empty document
    docs = Documents.of(2, 8, cu_seqlens=torch.tensor([0, 3, 3, 16, 16], dtype=torch.int32))
    assert docs.lengths == (3, 5, 8)


def test_position_ids_of_one_row_apply_to_every_row():
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    docs = Documents.of(3, 8, position_ids=positions)
    assert docs.lengths == (4, 4) * 3
    assert torch.equal(docs.positions(), positions.expand(3, 8))


def test_documents_are_none_for_one_document_per_row():
    assert Documents.of(2, 8, cu_seqlens=torch.tensor([0, 8, 16], dtype=torch.int32)) is None
    assert Documents.of(2, 8, cu_seqlens=torch.tensor([0, 16], dtype=torch.int32)) is None
    assert Documents.of(2, 8, position_ids=torch.arange(8).expand(2, 8)) is None
    assert Documents.of(2, 8, position_ids=torch.arange(8)[None]) is None
    assert Documents.of(2, 8) is None


# ---------------------------------------------------------------------- kernel selection
def test_choose_kernel_picks_sdpa_buckets_on_cpu():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        name, why = choose_kernel("cpu", dtype)
        assert name == "sdpa-buckets" and why


def test_chosen_kernels_lists_the_kernels_that_ran(monkeypatch):
    monkeypatch.setattr(kernels, "_chosen", {})
    monkeypatch.delenv("LLMFLOW_ATTENTION", raising=False)
    q, k, v = (t.detach() for t in _qkv(2, 8, 4, 2, torch.float32))
    docs = Documents.of(2, 8, cu_seqlens=torch.tensor([0, 3, 8, 16]))
    assert chosen_kernels() == []
    attend(q, k, v, None)
    attend(q, k, v, docs)
    attend(q, k, v, docs)
    with use_attention_kernel("dense"):
        attend(q, k, v, docs)
        attend(q, k, v, None)  # one document per row: plain causal even when forced
    assert chosen_kernels() == ["sdpa-causal", "sdpa-buckets", "dense"]


def test_the_environment_forces_a_kernel_at_each_call(monkeypatch):
    monkeypatch.setattr(kernels, "_chosen", {})
    q, k, v = (t.detach() for t in _qkv(2, 8, 4, 2, torch.float32))
    docs = Documents.of(2, 8, cu_seqlens=torch.tensor([0, 3, 8, 16]))
    monkeypatch.setenv("LLMFLOW_ATTENTION", "dense")
    attend(q, k, v, docs)
    assert chosen_kernels() == ["dense"]
    with use_attention_kernel("auto"):  # the context manager wins over the environment
        attend(q, k, v, docs)
    assert chosen_kernels() == ["dense", "sdpa-buckets"]


def test_a_bad_kernel_name_raises_naming_it(monkeypatch):
    q, k, v = (t.detach() for t in _qkv(2, 8, 4, 2, torch.float32))
    docs = Documents.of(2, 8, cu_seqlens=torch.tensor([0, 3, 8, 16]))
    monkeypatch.setenv("LLMFLOW_ATTENTION", "flash3")
    with pytest.raises(ValueError, match=r"LLMFLOW_ATTENTION='flash3': expected one of auto, "):
        attend(q, k, v, docs)
    monkeypatch.delenv("LLMFLOW_ATTENTION")
    with pytest.raises(ValueError, match=r"attention kernel 'Dense': expected one of auto, "):
        with use_attention_kernel("Dense"):
            pass


# --------------------------------------------------------------------------- whole model
WHOLE = dict(
    vocab_size=128, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=2,
    intermediate_size=128, max_seq_len=128,
)  # fmt: skip
NOPE = {"interval": {"nope_interval": 2}, "layers": {"nope_layers": [0, 3]}}
ROW_DOCUMENTS = [[5, 20, 1, 38], [64], [13, 17, 16, 18]]
"""Documents per row of 64 tokens: a one-token document, a row of one document, mixed lengths."""


def _packed_batch(seed: int) -> dict[str, torch.Tensor]:
    """Three rows of 64 tokens packed with ROW_DOCUMENTS: ids, labels, positions, cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = sum(ROW_DOCUMENTS[0])
    ids = torch.randint(0, WHOLE["vocab_size"], (len(ROW_DOCUMENTS), seq_len), generator=gen)
    labels = torch.randint(0, WHOLE["vocab_size"], ids.shape, generator=gen)
    labels[torch.rand(ids.shape, generator=gen) < 0.2] = -100
    lengths = torch.tensor([n for row in ROW_DOCUMENTS for n in row])
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).view(ids.shape)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return {"ids": ids, "labels": labels, "positions": positions, "cu": cu_seqlens.int()}


def _documents_of(batch: dict, packing: str) -> dict[str, torch.Tensor]:
    """The model's keyword arguments that carry the documents, one way or the other."""
    if packing == "position_ids":
        return {"position_ids": batch["positions"]}
    return {"cu_seqlens": batch["cu"]}


def _counting_kernels(monkeypatch) -> dict[str, int]:
    """Count the calls of each packed-document kernel (which one really ran, per layer)."""
    calls: dict[str, int] = {}
    for name, kernel in list(kernels._KERNELS.items()):

        def counted(*args, _name=name, _kernel=kernel):
            calls[_name] = calls.get(_name, 0) + 1
            return _kernel(*args)

        monkeypatch.setitem(kernels._KERNELS, name, counted)
    return calls


def _float64_norms(monkeypatch) -> None:
    """RMSNorm in float64 for float64 inputs (it normalizes in float32 on purpose, which would
    round a float64 run to float32 and hide or fake a difference between two kernels)."""
    from llmflow.model.norm import RMSNorm

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    monkeypatch.setattr(RMSNorm, "forward", forward)


def _model(nope: str, dtype: torch.dtype):
    from llmflow.model.config import ModelConfig
    from llmflow.model.transformer import Transformer

    model = Transformer(ModelConfig(**WHOLE, **NOPE[nope]))
    model.init_weights(seed=0)
    assert not all(model.cfg.uses_rope(i) for i in range(model.cfg.num_layers))
    return model.to(dtype)


@pytest.mark.parametrize("nope", sorted(NOPE))
@pytest.mark.parametrize("packing", ["position_ids", "cu_seqlens"])
def test_ten_adamw_steps_in_float64_match_the_dense_reference(monkeypatch, packing, nope):
    """Losses and final weights of 10 AdamW steps (two packed batches in turn) within 1e-9
    relative: the kernel's float64 rounding (1e-16) amplified by training stays far below."""
    import torch.nn.functional as F

    _float64_norms(monkeypatch)
    calls = _counting_kernels(monkeypatch)
    steps, runs = 10, {}
    for kernel in ("auto", "dense"):
        model = _model(nope, torch.float64)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        losses = []
        with use_attention_kernel(kernel):
            for step in range(steps):
                batch = _packed_batch(seed=step % 2)
                logits = model(batch["ids"], **_documents_of(batch, packing))
                loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
        runs[kernel] = losses, {n: p.detach() for n, p in model.named_parameters()}
    layers = WHOLE["num_layers"]
    assert calls == {"sdpa-buckets": steps * layers, "dense": steps * layers}
    (losses, weights), (expected_losses, expected) = runs["auto"], runs["dense"]
    assert expected_losses[-2] < expected_losses[0]  # it learns the batches
    for step, (got, ref) in enumerate(zip(losses, expected_losses, strict=True)):
        assert abs(got - ref) <= 1e-9 * abs(ref), (step, got, ref)
    for name, ref in expected.items():
        assert ref.dtype == torch.float64
        assert _max_rel(weights[name], ref) <= 1e-9, (name, _max_rel(weights[name], ref))


@pytest.mark.parametrize("packing", ["position_ids", "cu_seqlens"])
def test_first_step_in_float32_matches_the_dense_reference(monkeypatch, packing):
    """The trainer's loss (fused, tied embedding) and every gradient within float32 rounding."""
    calls = _counting_kernels(monkeypatch)
    batch, runs = _packed_batch(seed=0), {}
    for kernel in ("auto", "dense"):
        model = _model("interval", torch.float32)
        with use_attention_kernel(kernel):
            loss, _ = model(batch["ids"], labels=batch["labels"], **_documents_of(batch, packing))
        loss.backward()
        runs[kernel] = loss.item(), {n: p.grad for n, p in model.named_parameters()}
    assert calls == {"sdpa-buckets": WHOLE["num_layers"], "dense": WHOLE["num_layers"]}
    (loss, grads), (expected_loss, expected) = runs["auto"], runs["dense"]
    assert abs(loss - expected_loss) <= TOLERANCE[torch.float32] * expected_loss
    for name, ref in expected.items():
        assert _max_rel(grads[name], ref) <= TOLERANCE[torch.float32], name
