"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as transformers' Llama/SmolLM3 do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Back to the identity scale."""
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # NOTE: normalize in float32, cast back, then scale: the order transformers uses, so
        # bf16 exports give the same logits.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed
