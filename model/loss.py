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
