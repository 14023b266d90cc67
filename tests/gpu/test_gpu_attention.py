"""The CUDA attention kernels for packed documents (model/kernels.py) against the dense-mask
reference (``pytest -m gpu``): which kernel is chosen, varlen's and flex's outputs and q, k, v
gradients on grouped-KV packed documents, and a whole model's forward and backward.

bf16 tolerances follow tests/gpu/test_gpu_numerics.py: each bf16 kernel within 2u (relative
norm) of the float64 result, as the dense bf16 reference is.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import GPU, U

from llmflow.model import kernels
from llmflow.model.kernels import Documents, attend, choose_kernel, use_attention_kernel

pytestmark = GPU
DEVICE = "cuda"
# B=2 rows of 256 tokens; documents: a one-token one, lengths across several 128-token blocks
# (flex's block mask), a row of one document
LENGTHS = [1, 37, 90, 128, 256]
BATCH, SEQ_LEN, HEADS, KV_HEADS, DIM = 2, 256, 8, 2, 64
FP32 = 2e-5
"""float32 kernels' relative error (IEEE float32 products, online softmax)."""


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def _documents() -> Documents:
    cu_seqlens = torch.tensor([0, *LENGTHS], device=DEVICE).cumsum(0).int()
    docs = Documents.of(BATCH, SEQ_LEN, cu_seqlens=cu_seqlens)
    assert docs is not None and docs.lengths == tuple(LENGTHS)
    return docs


def _run(kernel: str, dtype: torch.dtype, docs: Documents) -> list[torch.Tensor]:
    """The output of `kernel` on the same q, k, v (cast to `dtype`) and their gradients."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shapes = [(BATCH, SEQ_LEN, HEADS, DIM), *[(BATCH, SEQ_LEN, KV_HEADS, DIM)] * 2]
    qkv = [torch.randn(s, device=DEVICE, generator=gen).to(dtype).requires_grad_() for s in shapes]
    grad_out = torch.randn(shapes[0], device=DEVICE, generator=gen).to(dtype)
    with use_attention_kernel(kernel):
        out = attend(*qkv, docs)
    assert out.dtype == dtype and out.shape == shapes[0]
    return [out, *torch.autograd.grad(out, qkv, grad_out)]


def test_choose_kernel_picks_varlen_for_bf16_where_torch_has_it_else_flex():
    expected = "varlen" if kernels._varlen() is not None else "flex"
    assert choose_kernel(DEVICE, torch.bfloat16)[0] == expected
    assert choose_kernel(DEVICE, torch.float16)[0] == expected
    assert choose_kernel(DEVICE, torch.float32)[0] == "flex"  # varlen is flash: half types only


@pytest.mark.parametrize(
    ("kernel", "dtype"),
    [("varlen", torch.bfloat16), ("flex", torch.bfloat16), ("flex", torch.float32)],
    ids=["varlen-bf16", "flex-bf16", "flex-fp32"],
)
def test_kernel_matches_the_dense_mask_on_grouped_kv_packed_documents(kernel, dtype):
    """Outputs and q, k, v gradients: bf16 within 2u of float64 (as dense bf16 is), float32
    within FP32 of it."""
    if kernel == "varlen" and kernels._varlen() is None:
        pytest.skip("this torch has no varlen attention with grouped KV heads")
    docs = _documents()
    exact = [t.double() for t in _run("dense", torch.float64, docs)]
    got = _run(kernel, dtype, docs)
    dense = _run("dense", dtype, docs)
    bound = 2 * U if dtype == torch.bfloat16 else FP32
    for what, a, b, ref in zip(("out", "dq", "dk", "dv"), got, dense, exact, strict=True):
        assert torch.isfinite(a).all(), what
        assert _rel(a, ref) <= bound, (what, _rel(a, ref), _rel(b, ref))
        assert _rel(b, ref) <= bound, (what, "dense", _rel(b, ref))


def test_whole_model_on_packed_documents_matches_dense_under_autocast(monkeypatch):
    """The trainer's one-process path (float32 weights, bf16 autocast) on a packed batch: the
    loss and every gradient of the chosen kernel against the dense reference's."""
    from llmflow.model.config import preset
    from llmflow.model.transformer import Transformer

    calls: dict[str, int] = {}
    for name, fn in list(kernels._KERNELS.items()):

        def counted(*args, _name=name, _fn=fn):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args)

        monkeypatch.setitem(kernels._KERNELS, name, counted)
    cfg = preset("debug", vocab_size=512, nope_interval=2)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ_LEN), device=DEVICE, generator=gen)
    cu_seqlens = torch.tensor([0, *LENGTHS], device=DEVICE).cumsum(0).int()
    runs = {}
    for kernel in ("auto", "dense"):
        model = Transformer(cfg).to(DEVICE)
        model.init_weights(seed=0)
        with torch.autocast(DEVICE, dtype=torch.bfloat16), use_attention_kernel(kernel):
            loss, _ = model(ids, labels=torch.roll(ids, -1, 1), cu_seqlens=cu_seqlens)
        loss.backward()
        runs[kernel] = loss.item(), {n: p.grad.double() for n, p in model.named_parameters()}
    chosen = choose_kernel(DEVICE, torch.bfloat16)[0]
    assert calls == {chosen: cfg.num_layers, "dense": cfg.num_layers}
    (loss, grads), (expected_loss, expected) = runs["auto"], runs["dense"]
    assert abs(loss - expected_loss) <= U * expected_loss
    total = sum(g.square().sum() for g in expected.values()).sqrt()
    err = sum((grads[n] - g).square().sum() for n, g in expected.items()).sqrt()
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert (err / total).item() < 8 * U  # bf16 rounding through a few layers, as on CPU
