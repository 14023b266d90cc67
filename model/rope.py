"""Rotary position embeddings: the default RoPE, ABF (a larger base), YaRN, linear and llama3.

The frequencies are computed op for op as transformers' `modeling_rope_utils` does, so an exported
model gives the same cos/sin tables under `AutoModelForCausalLM`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from llmflow.model.config import ModelConfig


def default_inv_freq(head_dim: int, theta: float) -> Tensor:
    """Inverse frequencies `1 / theta^(2i / head_dim)` of the original RoPE, shape (head_dim/2,)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def yarn_inv_freq(
    head_dim: int,
    theta: float,
    factor: float | None,
    original_max_position_embeddings: int,
    beta_fast: float | None = 32,
    beta_slow: float | None = 1,
    attention_factor: float | None = None,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    truncate: bool = True,
    max_position_embeddings: int | None = None,
) -> tuple[Tensor, float]:
    """YaRN inverse frequencies and attention factor (arXiv 2309.00071).

    Dimensions that rotate more than `beta_fast` times over the original context keep their
    frequency (extrapolation); those rotating fewer than `beta_slow` times are divided by `factor`
    (interpolation); a linear ramp blends the band in between. cos and sin are then multiplied by
    the attention factor `0.1 ln(factor) + 1` unless it is given.

    Returns:
        (inv_freq of shape (head_dim/2,), attention_factor).
    """
    if factor is None:  # NOTE: transformers infers it from the context lengths (DeepSeek-V3)
        factor = max_position_embeddings / original_max_position_embeddings
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    beta_fast, beta_slow = beta_fast or 32, beta_slow or 1
    low, high = _correction_range(
        beta_fast, beta_slow, head_dim, theta, original_max_position_embeddings, truncate
    )
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation = 1 - _linear_ramp(low, high, head_dim // 2)
    inv_freq = inv_freq_interpolation * (1 - extrapolation) + inv_freq_extrapolation * extrapolation
    return inv_freq, attention_factor


def _mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, max_positions: int) -> float:
    """Dimension index whose wavelength fits `num_rotations` times into `max_positions`."""
    return (dim * math.log(max_positions / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _correction_range(
    low_rot: float, high_rot: float, dim: int, base: float, max_positions: int, truncate: bool
) -> tuple[float, float]:
    low = _correction_dim(low_rot, dim, base, max_positions)
    high = _correction_dim(high_rot, dim, base, max_positions)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, dim: int) -> Tensor:
    if low == high:
        high += 0.001  # prevent a division by zero, as transformers does
    return torch.clamp((torch.arange(dim, dtype=torch.float32) - low) / (high - low), 0, 1)


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The `rope_scaling` entries a "llama3" RoPE reads."""


def llama3_inv_freq(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> Tensor:
    """Llama 3.1's inverse frequencies: long wavelengths divided by `factor`, short ones kept.

    Wavelengths above `original / low_freq_factor` are interpolated, those below
    `original / high_freq_factor` kept, and the band between blended linearly in
    `original / wavelength`.
    """
    inv_freq = default_inv_freq(head_dim, theta)
    original = original_max_position_embeddings
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_parameters(cfg: ModelConfig) -> tuple[Tensor, float]:
    """Inverse frequencies and cos/sin scaling for a config (default, YaRN, linear, llama3)."""
    scaling = cfg.rope_scaling or {"rope_type": "default"}
    if scaling["rope_type"] == "default":
        return default_inv_freq(cfg.head_dim, cfg.rope_theta), 1.0
    if scaling["rope_type"] == "linear":
        return default_inv_freq(cfg.head_dim, cfg.rope_theta) / scaling["factor"], 1.0
    if scaling["rope_type"] == "llama3":
        params = {name: scaling[name] for name in LLAMA3_KEYS}
        return llama3_inv_freq(cfg.head_dim, cfg.rope_theta, **params), 1.0
    return yarn_inv_freq(
        cfg.head_dim,
        cfg.rope_theta,
        factor=scaling.get("factor"),
        original_max_position_embeddings=scaling["original_max_position_embeddings"],
        beta_fast=scaling.get("beta_fast"),
        beta_slow=scaling.get("beta_slow"),
        attention_factor=scaling.get("attention_factor"),
        mscale=scaling.get("mscale"),
        mscale_all_dim=scaling.get("mscale_all_dim"),
        truncate=scaling.get("truncate", True),
        max_position_embeddings=cfg.max_seq_len,
    )


class RotaryEmbedding(nn.Module):
    """Turns positions into the (cos, sin) tables every RoPE layer shares."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        inv_freq, self.attention_scaling = rope_parameters(cfg)
        # NOTE: not persistent, so checkpoints stay free of derived tensors; a model built on the
        # meta device must call `reset_parameters()` after `to_empty()`.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the frequencies in place (after `to_empty()` from the meta device)."""
        inv_freq, self.attention_scaling = rope_parameters(self.cfg)
        self.inv_freq = inv_freq.to(self.inv_freq.device)  # replaces the buffer, float32

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # NOTE: `model.to(torch.bfloat16)` would round the frequencies, which shifts the angles
        # of far positions; keep them float32 as transformers computes them.
        if self.inv_freq.dtype != torch.float32 and self.inv_freq.device.type != "meta":
            self.reset_parameters()
        return self

    @torch.no_grad()
    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Cos and sin for `position_ids` (B, T), each (B, T, head_dim), in float32 then `dtype`."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension (the non-interleaved Llama layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate heads `x` (B, T, H, D) by the angles in `cos`, `sin` (B, T, D)."""
    # NOTE: under autocast q and k come out of the projection in bf16 while the tables are
    # float32; matching them keeps the rotated heads in bf16 instead of promoting them.
    cos, sin = cos.to(x.dtype).unsqueeze(2), sin.to(x.dtype).unsqueeze(2)  # (B, T, 1, D)
    return x * cos + rotate_half(x) * sin


def split_rotary_qkv(
    qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Split a fused (B, T, H + 2KV, D) projection into rotated q, rotated k and v.

    The same numbers as `apply_rotary` on each of q and k, in fewer passes over memory: the
    rotation is written as two half-width multiply-adds (no `rotate_half` copy, no negation), and
    the backward pass writes the gradients of q, k and v straight into one buffer shaped like
    `qkv` (autograd would rotate, negate and concatenate them, then concatenate the three).

    Args:
        qkv: (B, T, H + 2KV, D) fused projection output.
        cos, sin: (B or 1, T, D) tables from `RotaryEmbedding` (both halves equal).
    """
    return _RotaryQKV.apply(qkv, cos, sin, num_heads, num_kv_heads)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, sign: int) -> Tensor:
    """out = x rotated by +angle (sign 1) or -angle (sign -1); cos, sin are half-width."""
    half = x.shape[-1] // 2
    x1, x2, o1, o2 = x[..., :half], x[..., half:], out[..., :half], out[..., half:]
    if torch.compiler.is_compiling():  # inductor cannot lower `out=`; it fuses these itself
        o1.copy_(x1 * cos - sign * (x2 * sin))
        o2.copy_(x2 * cos + sign * (x1 * sin))
        return out
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-sign)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin, value=sign)
    return out


class _RotaryQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int):
        half = qkv.shape[-1] // 2
        cos = cos[..., :half].to(qkv.dtype).unsqueeze(2)  # (B, T, 1, D/2)
        sin = sin[..., :half].to(qkv.dtype).unsqueeze(2)
        q_in, k_in, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=2)
        q = _rotate(
            q_in, cos, sin, torch.empty_like(q_in, memory_format=torch.contiguous_format), 1
        )
        k = _rotate(
            k_in, cos, sin, torch.empty_like(k_in, memory_format=torch.contiguous_format), 1
        )
        ctx.save_for_backward(cos, sin)
        ctx.heads = (num_heads, num_kv_heads)
        return q, k, v.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_q: Tensor, grad_k: Tensor, grad_v: Tensor):
        cos, sin = ctx.saved_tensors
        num_heads, num_kv_heads = ctx.heads
        batch, seq_len = grad_v.shape[:2]
        shape = (batch, seq_len, num_heads + 2 * num_kv_heads, grad_v.shape[-1])
        grad = grad_v.new_empty(shape)
        gq, gk, gv = grad.split([num_heads, num_kv_heads, num_kv_heads], dim=2)
        _rotate(grad_q, cos, sin, gq, -1)  # the transpose of a rotation is the inverse one
        _rotate(grad_k, cos, sin, gk, -1)
        gv.copy_(grad_v)
        return grad, None, None, None, None
