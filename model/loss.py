"""Causal language-modelling loss with an optional z-loss (PaLM, arXiv 2204.02311)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

IGNORE_INDEX = -100


def causal_lm_loss(
    logits: Tensor, labels: Tensor, z_loss_weight: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean cross-entropy over tokens whose label is not -100, plus a z-loss.

    The z-loss `mean(logsumexp(logits)^2)` keeps the softmax normalizer near 1, which keeps
    logits from drifting in low precision. Labels are already aligned with the logits: position t
    predicts `labels[t]`, no shift happens here.

    Args:
        logits: (B, T, V) in any float dtype; the loss is computed in float32.
        labels: (B, T) target ids, -100 where no loss is taken.
        z_loss_weight: weight of the z-loss term; at 0 it is neither computed nor reported
            (reported as 0).

    Returns:
        (loss, {"ce": cross-entropy, "z_loss": unweighted z-loss}); the dict values are detached.
    """
    logits, labels = _flatten(logits.float(), labels)  # (N, V), (N,)
    if z_loss_weight == 0.0:
        ce = _cross_entropy(logits, labels)
        return ce, {"ce": ce.detach(), "z_loss": torch.zeros((), device=logits.device)}
    ce, z_loss = _cross_entropy_and_z_loss(logits, labels)
    return ce + z_loss_weight * z_loss, {"ce": ce.detach(), "z_loss": z_loss.detach()}


def _flatten(hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(..., C) hidden states or logits as (N, C) rows, (...) labels as (N,)."""
    return hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)


def _cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of (N, V) float32 logits over the labels that are not -100."""
    num_valid = (labels != IGNORE_INDEX).sum().clamp(min=1)
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum") / num_valid


def _cross_entropy_and_z_loss(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Means of the cross-entropy and of `logsumexp^2` over the labels that are not -100."""
    valid = labels != IGNORE_INDEX
    num_valid = valid.sum().clamp(min=1)
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    target = logits.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1)  # (N,)
    return ((lse - target) * valid).sum() / num_valid, (lse.square() * valid).sum() / num_valid


# Rows per chunk of the fused loss: a (rows, V) float32 block of about 16 MiB at a time.
CHUNK_ELEMENTS = 1 << 22


class TiedGradient:
    """The (V, C) float32 gradient a tied embedding shares with the fused loss.

    Autograd sums two gradients of one weight out of place: the loss's (V, C) gradient waited
    for the embedding's dense (V, C) gradient to the end of the backward pass, then both and
    their sum were alive at once. With a `TiedGradient` passed to `linear_cross_entropy` and
    `tied_embedding`, the loss leaves its gradient here and the embedding's backward adds its
    rows into it in place (``index_add_``): one (V, C) buffer instead of three.
    """

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: Tensor | None = None


def tied_embedding(ids: Tensor, weight: Tensor, tied: TiedGradient) -> Tensor:
    """`F.embedding(ids, weight)` whose weight gradient is added into ``tied.grad``."""
    return _TiedEmbedding.apply(ids, weight, tied)


class _TiedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, tied: TiedGradient) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.tied, ctx.weight_shape, ctx.weight_dtype = tied, weight.shape, weight.dtype
        return F.embedding(ids, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        (ids,) = ctx.saved_tensors
        grad, ctx.tied.grad = ctx.tied.grad, None
        if grad is None:  # the loss took no weight gradient (or ran without this buffer)
            grad = grad_out.new_zeros(ctx.weight_shape, dtype=torch.float32)
        rows = grad_out.reshape(-1, grad_out.shape[-1]).to(grad.dtype)
        grad.index_add_(0, ids.reshape(-1), rows)
        return None, grad.to(ctx.weight_dtype), None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    z_loss_weight: float = 0.0,
    chunk_rows: int | None = None,
    tied: TiedGradient | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`causal_lm_loss(F.linear(hidden, weight), labels)` with the output projection fused in,
    computed over chunks of rows so the (N, V) logits never exist at once.

    With gradients needed, each chunk's logits become their gradient in place in the forward
    pass, which adds its share to the (N, C) hidden and (V, C) weight gradients; the backward
    pass only scales those. Memory holds one (rows, V) block instead of the full logits (with
    full activation checkpointing, the logits were the largest buffer left). Without gradients
    (evaluation, ``torch.no_grad``) only the loss is computed.

    Args:
        hidden: (B, T, C) or (N, C) final hidden states.
        weight: (V, C) output projection.
        labels: (B, T) or (N,) targets aligned with `hidden`, -100 where no loss is taken.
        z_loss_weight: weight of the z-loss `mean(logsumexp^2)`.
        chunk_rows: rows per chunk; by default about ``CHUNK_ELEMENTS / V``.
        tied: when the weight is also the embedding looked up by `tied_embedding` with the same
            `TiedGradient`, the weight's gradient is left there (float32) for the embedding's
            backward to complete, instead of being returned to autograd.

    Returns:
        (loss, {"ce": cross-entropy, "z_loss": unweighted z-loss}), as `causal_lm_loss`.
    """
    if isinstance(weight, DTensor):  # tensor parallel: vocabulary rows split over ranks
        return vocab_parallel_cross_entropy(hidden, weight, labels, z_loss_weight)
    hidden, labels = _flatten(hidden, labels)
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // weight.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss, ce, z_loss = _LinearCrossEntropy.apply(
            hidden, weight, labels, z_loss_weight, rows, tied
        )
    else:
        ce, z_loss, _, _ = _chunked(hidden, weight, labels, z_loss_weight, rows, None, None)
        loss = ce + z_loss_weight * z_loss
    return loss, {"ce": ce.detach(), "z_loss": z_loss.detach()}


def _chunked(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    z_weight: float,
    rows: int,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Cross-entropy and z-loss means over chunks of rows; when given, fills ``grad_hidden``
    and adds to ``grad_weight`` the gradients of ``num_valid * (ce + z_weight * z_loss)``."""
    valid = labels != IGNORE_INDEX
    num_valid = valid.sum().clamp(min=1)
    ce_sum = hidden.new_zeros((), dtype=torch.float32)
    z_sum = hidden.new_zeros((), dtype=torch.float32)
    compute_dtype = None
    for start in range(0, hidden.shape[0], rows):
        h, y, m = (
            hidden[start : start + rows],
            labels[start : start + rows],
            valid[start : start + rows],
        )
        logits = F.linear(h, weight)  # (R, V), in the autocast dtype if any
        compute_dtype = logits.dtype
        logits = logits.float()
        if grad_hidden is None and grad_weight is None:  # the loss only
            # NOTE: one fused log-softmax pass (torch.logsumexp on CPU makes two R x V temporaries)
            logp = torch.log_softmax(logits, dim=-1)
            lse = logits[:, 0] - logp[:, 0]  # (R,)
            target = logp.gather(-1, y.clamp(min=0)[:, None]).squeeze(-1)
            ce_sum -= (target * m).sum()
            if z_weight:
                z_sum += (lse.square() * m).sum()
            continue
        # NOTE: the softmax in one pass (log_softmax then exp_ was two passes over R x V); the
        # normalizer from the row's largest probability, lse = max - log(p_max), p_max >= 1/V
        probs = torch.softmax(logits, dim=-1)
        lse = logits.amax(dim=-1) - probs.amax(dim=-1).log()  # (R,)
        target = logits.gather(-1, y.clamp(min=0)[:, None]).squeeze(-1)
        del logits
        ce_sum += ((lse - target) * m).sum()
        # d/dlogits = softmax * (1 + 2 z lse) - onehot(label), on valid rows; in place
        if z_weight:
            z_sum += (lse.square() * m).sum()
            probs.mul_((m * (1 + 2 * z_weight * lse))[:, None])
        else:
            probs[(~m).nonzero().squeeze(-1)] = 0  # rows without a label (few): no gradient
        chosen = m.nonzero().squeeze(-1)
        probs[chosen, y[chosen]] -= 1
        grad = probs.to(compute_dtype)
        if grad_hidden is not None:
            grad_hidden[start : start + rows] = grad @ weight.to(compute_dtype)
        if grad_weight is not None:
            _add_matmul(grad_weight, grad.t(), h.to(compute_dtype))
        # NOTE: else this block lives on while the next chunk's logits and softmax are made:
        # three (R, V) blocks at once instead of two
        del probs, grad
    z_loss = z_sum / num_valid if z_weight else torch.zeros_like(ce_sum)
    return ce_sum / num_valid, z_loss, num_valid, compute_dtype


def _add_matmul(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` for a float32 ``out`` and operands in the compute dtype (bf16 too).

    NOTE: ``addmm_`` needs one dtype for all three, and a float32 accumulator with bf16
    operands (autocast, FSDP2's bf16 parameters) raised on the first step. In bf16 the product
    of one chunk is taken in bf16 (the GEMM accumulates in float32 inside; on CUDA it is written
    out in float32 where torch offers ``out_dtype``) and summed across chunks in float32.
    """
    if a.dtype == out.dtype:
        out.addmm_(a, b)
        return
    if out.is_cuda:
        try:
            out.add_(torch.mm(a, b, out_dtype=out.dtype))
            return
        except (RuntimeError, TypeError):  # an older torch, or no such kernel for this dtype
            pass
    out.add_(a @ b)


class _LinearCrossEntropy(torch.autograd.Function):
    """Output projection + (z-)cross-entropy, chunked, its gradients computed in the forward."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        z_weight: float,
        rows: int,
        tied: TiedGradient | None,
    ):
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_weight = None
        if weight.requires_grad:
            # NOTE: accumulated in the compute dtype's matmul, kept in float32 across chunks
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        ce, z_loss, num_valid, _ = _chunked(
            hidden, weight, labels, z_weight, rows, grad_hidden, grad_weight
        )
        ctx.save_for_backward(num_valid)
        ctx.grads, ctx.weight_dtype, ctx.tied = (grad_hidden, grad_weight), weight.dtype, tied
        ctx.mark_non_differentiable(ce, z_loss)
        return ce + z_weight * z_loss, ce, z_loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor, *_):
        if ctx.grads is None:  # NOTE: the gradients were scaled in place by the first pass
            raise RuntimeError("linear_cross_entropy supports one backward pass (no retain_graph)")
        (num_valid,) = ctx.saved_tensors
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        scale = grad_loss.float() / num_valid
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(scale.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(scale)
            if ctx.tied is not None:  # the embedding's backward adds its rows and returns it
                ctx.tied.grad, grad_weight = grad_weight, None
            else:
                grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


# ------------------------------------------------------------------------- tensor parallel
def _local_rows(hidden: Tensor, weight: DTensor) -> tuple[Tensor, Tensor, int, dist.ProcessGroup]:
    """Under tensor parallelism: the whole sequence's hidden states (a plain tensor whose
    gradient is this rank's partial sum), this rank's vocabulary rows, their first row, the group.
    """
    mesh = weight.device_mesh
    if isinstance(hidden, DTensor):  # sequence-parallel (B, T / tp, C) -> every rank all T
        hidden = hidden.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    _, offsets = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    return hidden, weight.to_local(), offsets[0], mesh.get_group()


def vocab_parallel_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """Full (B, T, V) logits from a vocabulary-row-sharded (V, C) DTensor (evaluation only)."""
    hidden, local, _, _ = _local_rows(hidden, weight)
    logits = F.linear(hidden, local)  # (B, T, V / tp)
    return DTensor.from_local(logits, weight.device_mesh, [Shard(-1)]).full_tensor()


def vocab_parallel_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, z_loss_weight: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """`linear_cross_entropy` for a (V, C) DTensor split by vocabulary rows (tensor parallel).

    Each rank projects the whole sequence onto its vocabulary rows; the row maximum, the sum of
    exponentials and the target logit are all-reduced over the group (Megatron-LM's
    vocab-parallel cross-entropy), so no rank holds the full logits. Every rank returns the
    same loss; gradients are each rank's share (its rows of the weight, its partial sum of the
    hidden states' gradient).
    """
    hidden, local, offset, group = _local_rows(hidden, weight)
    hidden, labels = _flatten(hidden, labels)
    rows = max(1, CHUNK_ELEMENTS // local.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or local.requires_grad):
        loss, ce, z_loss = _VocabParallelCrossEntropy.apply(
            hidden, local, labels, z_loss_weight, rows, offset, group
        )
    else:
        ce, z_loss, _ = _vocab_parallel_chunked(
            hidden, local, labels, z_loss_weight, rows, offset, group, None, None
        )
        loss = ce + z_loss_weight * z_loss
    return loss, {"ce": ce.detach(), "z_loss": z_loss.detach()}


def _vocab_parallel_chunked(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    z_weight: float,
    rows: int,
    offset: int,
    group: object,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`_chunked` on this rank's vocabulary rows [offset, offset + V_local)."""
    valid = labels != IGNORE_INDEX
    num_valid = valid.sum().clamp(min=1)
    ce_sum = hidden.new_zeros((), dtype=torch.float32)
    z_sum = hidden.new_zeros((), dtype=torch.float32)
    vocab = weight.shape[0]
    for start in range(0, hidden.shape[0], rows):
        h, y, m = (
            hidden[start : start + rows],
            labels[start : start + rows],
            valid[start : start + rows],
        )
        logits = F.linear(h, weight)  # (R, V / tp)
        compute_dtype = logits.dtype
        logits = logits.float()
        row_max = logits.amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        logits.sub_(row_max[:, None])
        mine = (y >= offset) & (y < offset + vocab) & m
        local_y = torch.where(mine, y - offset, 0)
        target = logits.gather(-1, local_y[:, None]).squeeze(-1) * mine
        sums = torch.stack([logits.exp().sum(-1), target])  # (2, R)
        dist.all_reduce(sums, group=group)
        lse = sums[0].log()  # of the shifted logits
        ce_sum += ((lse - sums[1]) * m).sum()
        lse = lse + row_max
        if z_weight:
            z_sum += (lse.square() * m).sum()
        if grad_hidden is None and grad_weight is None:
            continue
        # d/dlogits = softmax * (1 + 2 z lse) - onehot(label), on valid rows
        probs = logits.sub_((lse - row_max)[:, None]).exp_()
        scale = m * (1 + 2 * z_weight * lse) if z_weight else m.float()
        probs.mul_(scale[:, None])
        chosen = mine.nonzero().squeeze(-1)
        probs[chosen, local_y[chosen]] -= 1
        grad = probs.to(compute_dtype)
        if grad_hidden is not None:
            grad_hidden[start : start + rows] = grad @ weight.to(compute_dtype)
        if grad_weight is not None:
            _add_matmul(grad_weight, grad.t(), h.to(compute_dtype))
    z_loss = z_sum / num_valid if z_weight else torch.zeros_like(ce_sum)
    return ce_sum / num_valid, z_loss, num_valid


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """`_LinearCrossEntropy` on one rank's vocabulary rows; gradients computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, z_weight, rows, offset, group):
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_weight = None
        if weight.requires_grad:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        ce, z_loss, num_valid = _vocab_parallel_chunked(
            hidden, weight, labels, z_weight, rows, offset, group, grad_hidden, grad_weight
        )
        ctx.save_for_backward(num_valid)
        ctx.grads, ctx.weight_dtype = (grad_hidden, grad_weight), weight.dtype
        ctx.mark_non_differentiable(ce, z_loss)
        return ce + z_weight * z_loss, ce, z_loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor, *_):
        if ctx.grads is None:
            raise RuntimeError("vocab_parallel_cross_entropy supports one backward pass")
        (num_valid,) = ctx.saved_tensors
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        scale = grad_loss.float() / num_valid
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(scale.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(scale).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None
