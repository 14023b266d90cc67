"""Grouped-query attention with optional RoPE and QK-norm, causal within each packed document.

The documents of a batch arrive as `Documents` (their boundaries, never a mask) and
`model/kernels.py:attend` picks the kernel. Under context parallelism a rank holds only some
tokens of each row (`model/context.py:SequenceShard`); its queries attend to the keys and values
of the whole rows, all-gathered over the context-parallel group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from llmflow.model.config import ModelConfig
from llmflow.model.kernels import Documents, attend, document_mask
from llmflow.model.norm import RMSNorm
from llmflow.model.rope import apply_rotary, split_rotary_qkv

if TYPE_CHECKING:
    from llmflow.model.context import SequenceShard

__all__ = ["Attention", "Documents", "document_ids", "document_mask", "positions_from_cu_seqlens"]


def document_ids(
    batch_size: int,
    seq_len: int,
    position_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor | None:
    """Which document each token belongs to, (B, T), or None when every row is one document
    (`Documents.of` reads the boundaries: `cu_seqlens` first, else where `position_ids` do not
    step by 1)."""
    docs = Documents.of(batch_size, seq_len, position_ids, cu_seqlens)
    return None if docs is None else docs.ids()


def positions_from_cu_seqlens(batch_size: int, seq_len: int, cu_seqlens: Tensor) -> Tensor:
    """Position of each token inside its document, (B, T), restarting at 0 at each start."""
    docs = Documents.of(batch_size, seq_len, cu_seqlens=cu_seqlens)
    if docs is None:  # one document per row
        return torch.arange(seq_len, device=cu_seqlens.device).expand(batch_size, -1)
    return docs.positions()


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
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        docs: Documents | None,
        context: SequenceShard | None = None,
    ) -> Tensor:
        """Attend over `x` (B, T, C).

        Args:
            x: normalized residual stream (B, T, C).
            rope: (cos, sin), each (B or 1, T, head_dim); ignored by a NoPE layer.
            docs: the rows' documents, or None when each row is one document; unused under
                `context`, which holds the whole rows' documents.
            context: this rank's shard of the rows under context parallelism: the keys and
                values of the whole rows are gathered over its group.
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
        if context is not None:  # the KV heads of the whole rows, in their order
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|KV, T, D)
            k, v = context.gather(k), context.gather(v)  # (B, KV, T_full, D)
            out = context.attend(q, k, v).transpose(1, 2)  # (B, T, H, D)
        else:
            out = attend(q, k, v, docs)  # (B, T, H, D)
        return self.o_proj(out.reshape(batch, seq_len, -1))  # (B, T, H * D) in
