"""Context parallelism's view of a batch: the tokens of each row one rank holds.

Under context parallelism a rank holds only some tokens of each row (a `SequenceShard`); its
queries attend to the keys and values of the whole rows, all-gathered over the context-parallel
group (`SequenceShard.gather`), causally in the rows' own token order and within documents.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


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

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """This rank's queries q (B, H, T, D) over the whole rows' k, v (B, KV, T_full, D)."""
        groups = q.shape[1] // k.shape[1]
        mask = self.mask()
        if q.device.type != "cpu" and groups > 1:  # SDPA's fused kernels take no grouped k/v
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            groups = 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)

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
