"""Grouped-query attention with optional RoPE, QK-norm and intra-document masking."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmflow.model.config import ModelConfig
from llmflow.model.norm import RMSNorm
from llmflow.model.rope import apply_rotary, split_rotary_qkv


def document_ids(
    batch_size: int,
    seq_len: int,
    position_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor | None:
    """Which document each token belongs to, (B, T), or None when every row is one document.

    Args:
        batch_size: B.
        seq_len: T.
        position_ids: (B, T) positions that restart at 0 at each document start; used only when
            `cu_seqlens` is absent (a position that is not the previous one plus 1 starts a
            document, as transformers' `find_packed_sequence_indices` decides).
        cu_seqlens: cumulative document lengths over the flattened B*T tokens (flash-attn varlen
            convention: every multiple of T is also a boundary).
    """
    if cu_seqlens is not None:
        if cu_seqlens.numel() == batch_size + 1:  # only the row boundaries: one doc per row
            return None
        tokens = torch.arange(batch_size * seq_len, device=cu_seqlens.device)
        ids = torch.searchsorted(cu_seqlens.to(tokens.dtype), tokens, right=True)
        return ids.view(batch_size, seq_len)  # (B, T)
    if position_ids is None:
        return None
    position_ids = position_ids.expand(batch_size, -1)
    diff = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    ids = (diff != 1).cumsum(-1)  # (B, T)
    # NOTE: a host sync, as in transformers; pass cu_seqlens to avoid it.
    return ids if bool((ids[:, -1] != 0).any()) else None


def positions_from_cu_seqlens(batch_size: int, seq_len: int, cu_seqlens: Tensor) -> Tensor:
    """Position of each token inside its document, (B, T), restarting at 0 at each start."""
    tokens = torch.arange(batch_size * seq_len, device=cu_seqlens.device)
    starts = cu_seqlens.to(tokens.dtype)
    doc = torch.searchsorted(starts, tokens, right=True) - 1  # index of the doc's start
    return (tokens - starts[doc]).view(batch_size, seq_len)


def document_mask(doc_ids: Tensor) -> Tensor:
    """Block-diagonal causal mask (B, 1, T, T), True where a query may attend to a key."""
    seq_len = doc_ids.shape[-1]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=doc_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


class Attention(nn.Module):
    """Causal self-attention with `num_kv_heads` key/value heads shared by groups of query heads.

    One fused projection makes q, k and v (the export splits it into q_proj, k_proj, v_proj), with
    a bias when `cfg.attention_bias` (Qwen2). With `cfg.qk_norm`, each q and k head is RMS-normed
    over its own width before RoPE, as Qwen3 does.
    """

    def __init__(self, cfg: ModelConfig, use_rope: bool = True):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim, self.use_rope = cfg.head_dim, use_rope
        qkv_heads = cfg.num_heads + 2 * cfg.num_kv_heads
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, qkv_heads * cfg.head_dim, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None, doc_mask: Tensor | None
    ) -> Tensor:
        """Attend over `x` (B, T, C).

        Args:
            x: normalized residual stream (B, T, C).
            rope: (cos, sin), each (B or 1, T, head_dim); ignored by a NoPE layer.
            doc_mask: (B, 1, T, T) boolean block-diagonal causal mask, or None for plain causal.
        """
        batch, seq_len, _ = x.shape
        qkv = self.qkv_proj(x).view(batch, seq_len, -1, self.head_dim)  # (B, T, H + 2KV, D)
        rotate = self.use_rope and rope is not None
        if rotate and self.q_norm is None:
            q, k, v = split_rotary_qkv(qkv, *rope, self.num_heads, self.num_kv_heads)
        else:
            q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if rotate:
                q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|KV, T, D)
        # NOTE: on CUDA, SDPA's fused kernels take grouped k/v only without a mask; with one it
        # would fall back to the math kernel (a T x T matrix per head), so k/v are expanded.
        native_gqa = doc_mask is None or x.device.type == "cpu"
        out = attend(q, k, v, doc_mask, native_gqa)  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(batch, seq_len, -1)  # (B, T, H * D)
        return self.o_proj(out)


def attend(
    q: Tensor, k: Tensor, v: Tensor, doc_mask: Tensor | None, native_gqa: bool = True
) -> Tensor:
    """Causal SDPA of q (B, H, T, D) over k, v (B, KV, T, D); (B, H, T, D) out.

    Args:
        doc_mask: (B, 1, T, T) boolean mask, or None for plain causal attention.
        native_gqa: let SDPA share k/v across head groups; otherwise repeat them per head.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not native_gqa:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=doc_mask, is_causal=doc_mask is None, enable_gqa=groups > 1
    )
