"""bf16 numerics on CUDA: the fused loss, the model under autocast, logits parity with
transformers' SmolLM3, and SDPA's flash backend at our shapes (``pytest -m gpu``).

Tolerances are the CPU suite's (tests/model/test_loss_bf16.py, test_hf_bf16.py), argued there
from bf16's unit roundoff u = 2**-8: CUDA's bf16 matmuls accumulate in float32 as the CPU's do,
so the same bounds hold; only the order of the float32 sums differs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import GPU, U
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmflow.model.config import preset
from llmflow.model.kernels import attend
from llmflow.model.loss import linear_cross_entropy
from llmflow.model.transformer import Transformer

pytestmark = GPU
DEVICE = "cuda"


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize(("rows", "vocab", "width"), [(128, 500, 64), (512, 49152, 2048)])
def test_fused_loss_in_bf16_on_cuda_matches_float64(rows, vocab, width):
    """Small shapes and the 1.7B preset's vocabulary and width (several chunks of rows)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(rows, width, device=DEVICE, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, device=DEVICE, generator=gen) / width**0.5).bfloat16()
    weight.requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device=DEVICE, generator=gen)
    labels[:5] = -100
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref = F.cross_entropy(F.linear(h64, w64), labels, ignore_index=-100)
    ref.backward()
    loss, _ = linear_cross_entropy(hidden[None], weight, labels[None], 0.0, chunk_rows=64)
    loss.backward()
    assert loss.dtype == torch.float32
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    assert abs(loss.item() - ref.item()) / ref.item() < U / 4
    assert rel_err(hidden.grad, h64.grad) < 2 * U
    assert rel_err(weight.grad, w64.grad) < 2 * U


@pytest.mark.parametrize("packed", [False, True])
def test_cuda_autocast_gives_float32_gradients_close_to_float32(packed):
    """The trainer's one-process path: float32 weights, bf16 compute, float32 gradients; with
    packed documents (the trainer's batches) and without."""
    torch.manual_seed(0)
    cfg = preset("debug")
    model = Transformer(cfg).to(DEVICE)
    model.init_weights(seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), device=DEVICE)
    kwargs = {}
    if packed:
        kwargs["cu_seqlens"] = torch.tensor([0, 20, 64, 100, 128], dtype=torch.int32, device=DEVICE)
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in true float32
    model(ids, labels=ids, **kwargs)[0].backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss, _ = model(ids, labels=ids, **kwargs)
    loss.backward()
    total = sum(ref[n].double().square().sum() for n in ref).sqrt()
    err = sum((p.grad.double() - ref[n]).square().sum() for n, p in model.named_parameters())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert torch.isfinite(loss)
    assert (err.sqrt() / total).item() < 8 * U  # as on CPU: ~u per op through a few layers


def test_logits_parity_with_transformers_smollm3_in_bf16_on_cuda(tmp_path):
    """Our model exported, loaded by transformers' SmolLM3ForCausalLM (SDPA), both in bf16 on
    the GPU: max |ours - theirs| <= 16 u max |logits| (the bound of tests/model/test_hf_bf16.py)."""
    from transformers import AutoModelForCausalLM, SmolLM3ForCausalLM

    from llmflow.model.hf import export_hf

    cfg = preset("debug", vocab_size=512, nope_interval=4, init_std=0.1)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    export_hf(model.state_dict(), cfg, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    assert isinstance(theirs, SmolLM3ForCausalLM)
    theirs = theirs.to(DEVICE).eval()
    ours = model.to(DEVICE, torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 128), device=DEVICE)
    with torch.no_grad():
        got, want = ours(ids).float(), theirs(ids).logits.float()
        exact = model.float()(ids)
    scale = exact.abs().max().item()
    assert exact.std() > 0.5  # logits spread well past the tolerance
    assert (got - want).abs().max().item() <= 16 * U * scale
    assert (got - exact).abs().max() <= 1.5 * (want - exact).abs().max()


def _qkv(cfg, batch: int, seq: int):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shape = (batch, cfg.num_heads, seq, cfg.head_dim)
    kv = (batch, cfg.num_kv_heads, seq, cfg.head_dim)
    q = torch.randn(shape, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(kv, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(kv, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    return q, k, v


@pytest.mark.parametrize("name", ["1.7b", "3b"])
def test_sdpa_selects_flash_attention_at_our_shapes(name):
    """Under ``sdpa_kernel(FLASH_ATTENTION)`` alone, SDPA raises if flash cannot take the call:
    our attention (plain causal, grouped k/v where the preset has them) runs there, forward and
    backward, and agrees with the math kernel within bf16's rounding."""
    cfg = preset(name)
    q, k, v = _qkv(cfg, 1, cfg.max_seq_len)
    q.requires_grad_()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = attend(*(t.transpose(1, 2) for t in (q, k, v)), None)  # (B, T, H, D) in and out
        out.sum().backward()
    with sdpa_kernel(SDPBackend.MATH):
        ref = attend(*(t.float().transpose(1, 2) for t in (q.detach(), k, v)), None)
    assert out.dtype == torch.bfloat16 and torch.isfinite(q.grad).all()
    assert rel_err(out, ref.double()) < 2 * U


def test_the_models_attention_runs_under_flash_only():
    """A whole forward and backward of the model in bf16, one document per row (no mask: the
    flash kernel's case), with SDPA restricted to flash."""
    cfg = preset("debug", vocab_size=512)
    model = Transformer(cfg).to(DEVICE)
    model.init_weights(seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device=DEVICE)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss, _ = model(ids, labels=ids)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_packed_documents_never_reach_sdpas_masked_kernels():
    """Packed documents go to a document kernel (varlen or flex), not to SDPA under a mask: with
    SDPA restricted to flash (which takes no mask) the packed forward and backward still run,
    and agree with SDPA's math kernel under the dense mask (the reference)."""
    from llmflow.model.kernels import chosen_kernels, use_attention_kernel

    cfg = preset("debug", vocab_size=512)
    model = Transformer(cfg).to(DEVICE)
    model.init_weights(seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device=DEVICE)
    cu = torch.tensor([0, 100, 256, 300, 512], dtype=torch.int32, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            loss, _ = model(ids, labels=ids, cu_seqlens=cu)
        with sdpa_kernel(SDPBackend.MATH), use_attention_kernel("dense"):
            ref, _ = model(ids, labels=ids, cu_seqlens=cu)
    loss.backward()
    assert {"varlen", "flex"} & set(chosen_kernels())
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < U * ref.item()
