"""Causal language-modelling loss with an optional z-loss (PaLM, arXiv 2204.02311)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

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
    logits = logits.reshape(-1, logits.shape[-1]).float()  # (N, V)
    labels = labels.reshape(-1)  # (N,)
    valid = labels != IGNORE_INDEX
    num_valid = valid.sum().clamp(min=1)
    if z_loss_weight == 0.0:
        ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum") / num_valid
        return ce, {"ce": ce.detach(), "z_loss": torch.zeros((), device=logits.device)}
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    target = logits.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1)  # (N,)
    ce = ((lse - target) * valid).sum() / num_valid
    z_loss = (lse.square() * valid).sum() / num_valid
    loss = ce + z_loss_weight * z_loss
    return loss, {"ce": ce.detach(), "z_loss": z_loss.detach()}


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, z_loss_weight: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """`causal_lm_loss(F.linear(hidden, weight), labels)` with the output projection fused in.

    Only the float32 log-probabilities are kept (the logits are freed in the forward pass), and
    the backward pass turns them in place into the logits' gradient: no zero-filled one-hot
    gradient and no separate softmax-gradient buffer, two N x V allocations and passes fewer,
    which saves time and memory on CPU where every large allocation is page-faulted afresh.

    Args:
        hidden: (B, T, C) or (N, C) final hidden states.
        weight: (V, C) output projection.
        labels: (B, T) or (N,) targets aligned with `hidden`, -100 where no loss is taken.
        z_loss_weight: weight of the z-loss `mean(logsumexp^2)`.

    Returns:
        (loss, {"ce": cross-entropy, "z_loss": unweighted z-loss}), as `causal_lm_loss`.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    loss, ce, z_loss = _LinearCrossEntropy.apply(hidden, weight, labels.reshape(-1), z_loss_weight)
    return loss, {"ce": ce.detach(), "z_loss": z_loss.detach()}


class _LinearCrossEntropy(torch.autograd.Function):
    """Output projection + (z-)cross-entropy with a hand-written, allocation-free backward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, z_weight: float):
        logits = F.linear(hidden, weight)  # (N, V), in the autocast dtype if any
        ctx.compute_dtype = logits.dtype
        logits = logits.float()
        # NOTE: one fused log-softmax pass (torch.logsumexp on CPU makes two N x V temporaries);
        # the logits themselves are then free, only the log-probabilities are kept.
        logp = torch.log_softmax(logits, dim=-1)
        lse = logits[:, 0] - logp[:, 0]  # (N,)
        del logits
        valid = labels != IGNORE_INDEX
        num_valid = valid.sum().clamp(min=1)
        target = logp.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1)
        ce = -(target * valid).sum() / num_valid
        z_loss = (lse.square() * valid).sum() / num_valid if z_weight else torch.zeros_like(ce)
        ctx.save_for_backward(hidden, weight, logp, lse, labels, num_valid)
        ctx.z_weight, ctx.consumed = z_weight, False
        ctx.mark_non_differentiable(ce, z_loss)
        return ce + z_weight * z_loss, ce, z_loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor, *_):
        if ctx.consumed:  # NOTE: the saved log-probabilities were overwritten by the first pass
            raise RuntimeError("linear_cross_entropy supports one backward pass (no retain_graph)")
        ctx.consumed = True
        hidden, weight, probs, lse, labels, num_valid = ctx.saved_tensors
        valid = labels != IGNORE_INDEX
        scale = grad_loss.float() / num_valid
        # d/dlogits = scale * (softmax * (1 + 2 z lse) - onehot(label)) on valid rows.
        row = valid * scale * (1 + 2 * ctx.z_weight * lse)  # (N,)
        probs.exp_().mul_(row[:, None])  # in place: log-probabilities -> gradient
        rows = valid.nonzero().squeeze(-1)
        probs[rows, labels[rows]] -= scale
        dtype = ctx.compute_dtype
        grad = probs.to(dtype)
        grad_hidden = (grad @ weight.to(dtype)).to(hidden.dtype)
        grad_weight = (grad.t() @ hidden.to(dtype)).to(weight.dtype)
        return grad_hidden, grad_weight, None, None
