"""Grouped-query attention with optional RoPE, QK-norm and intra-document masking.

Under context parallelism a rank holds only some tokens of each row (a `SequenceShard`); its
queries attend to the keys and values of the whole rows, all-gathered over the context-parallel
group (`SequenceShard.gather`), under a mask that is causal in the rows' own token order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
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
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        doc_mask: Tensor | None,
        context: SequenceShard | None = None,
    ) -> Tensor:
        """Attend over `x` (B, T, C).

        Args:
            x: normalized residual stream (B, T, C).
            rope: (cos, sin), each (B or 1, T, head_dim); ignored by a NoPE layer.
            doc_mask: (B, 1, T, T) boolean block-diagonal causal mask, or None for plain causal;
                under `context`, `context.mask()`, (B or 1, 1, T, T_full).
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
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|KV, T, D)
        if context is not None:  # the KV heads of the whole rows, in their order
            k, v = context.gather(k), context.gather(v)  # (B, KV, T_full, D)
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


@dataclass(frozen=True)
class SequenceShard:
    """The tokens of each row one rank holds under context parallelism, and the whole rows' layout.

    Every rank of `group` holds the same rows (B, T_full) cut along T into different tokens; the
    queries stay local and the keys/values are all-gathered (GQA: only the KV heads travel).

    Attributes:
        group: the context-parallel process group.
        index: (T,) ascending positions in the full row (0..T_full-1) of this rank's tokens.
        order: (T_full,) for each full-row position, where it lies in the rank-major all-gather
            (rank 0's T tokens, then rank 1's, ...).
        doc_ids: (B, T_full) document of every token of the full rows, or None (one per row).
    """

    group: dist.ProcessGroup
    index: Tensor
    order: Tensor
    doc_ids: Tensor | None = None

    def mask(self) -> Tensor:
        """(B or 1, 1, T, T_full) boolean: causal in full-row positions, within one document."""
        keys = torch.arange(self.order.numel(), device=self.index.device)
        allowed = self.index[:, None] >= keys[None, :]  # (T, T_full)
        if self.doc_ids is not None:
            same_doc = self.doc_ids[:, self.index, None] == self.doc_ids[:, None, :]
            allowed = same_doc & allowed  # (B, T, T_full)
        else:
            allowed = allowed[None]
        return allowed.unsqueeze(1)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SequenceShard:
        """The same shard with its tensors on `device` (moved with the batch that holds it)."""
        doc_ids = self.doc_ids
        if doc_ids is not None:
            doc_ids = doc_ids.to(device, non_blocking=non_blocking)
        index = self.index.to(device, non_blocking=non_blocking)
        order = self.order.to(device, non_blocking=non_blocking)
        return replace(self, index=index, order=order, doc_ids=doc_ids)

    def gather(self, x: Tensor) -> Tensor:
        """(B, N, T, D) local heads -> (B, N, T_full, D) of the whole rows (autograd: the backward
        reduce-scatters the gradient back to the rank that holds each token)."""
        return _GatherSequence.apply(x, self.group, self.order)


# NOTE: torch 2.13 renamed the dim-0 collectives (`*_into_tensor` / `*_tensor` are deprecated).
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, order: Tensor) -> Tensor:
        world = dist.get_world_size(group)
        local = x.movedim(2, 0).contiguous()  # (T, B, N, D): the collective cuts dim 0
        gathered = local.new_empty((world * local.shape[0], *local.shape[1:]))
        _ALL_GATHER(gathered, local, group=group)
        ctx.group, ctx.order, ctx.world = group, order, world
        return gathered.index_select(0, order).movedim(0, 2)  # (B, N, T_full, D)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        full = grad.movedim(2, 0)  # (T_full, B, N, D) in row order
        rank_major = torch.empty_like(full, memory_format=torch.contiguous_format)
        rank_major.index_copy_(0, ctx.order, full)  # back to the all-gather's layout
        local = rank_major.new_empty((rank_major.shape[0] // ctx.world, *rank_major.shape[1:]))
        _REDUCE_SCATTER(local, rank_major, group=ctx.group)  # summed over ranks
        return local.movedim(0, 2), None, None
