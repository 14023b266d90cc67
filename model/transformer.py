"""Decoder-only transformer in the Llama / SmolLM3 layout: pre-norm blocks, GQA, SwiGLU."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmflow.model.attention import (
    Attention,
    document_ids,
    document_mask,
    positions_from_cu_seqlens,
)
from llmflow.model.config import ModelConfig
from llmflow.model.norm import RMSNorm
from llmflow.model.rope import RotaryEmbedding


class MLP(nn.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`, gate and up fused in one matmul."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, I) each
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, use_rope=cfg.uses_rope(layer_idx))
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None, doc_mask: Tensor | None
    ) -> Tensor:
        h = x + self.attn(self.attn_norm(x), rope, doc_mask)
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    """Token ids in, next-token logits out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, init_std) everywhere, residual output projections scaled by 1/sqrt(2L).

        Args:
            seed: when given, draw from a private generator so the result does not depend on (or
                disturb) the global RNG state.
        """
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.num_layers)
        self.rope.reset_parameters()
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual_out = name.endswith(("o_proj", "down_proj"))
                module_std = residual_std if is_residual_out else std
                nn.init.normal_(module.weight, mean=0.0, std=module_std, generator=generator)

    def output_weight(self) -> Tensor:
        """The (V, C) output projection: the embedding when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, T, V) for `input_ids` (B, T).

        Args:
            input_ids: (B, T) token ids.
            position_ids: (B, T) positions restarting at 0 at each document; by default they are
                derived from `cu_seqlens`, or 0..T-1 without it.
            cu_seqlens: int32 cumulative document lengths over the flattened B*T tokens, e.g.
                B=2, T=4 with documents [3, 1 | 4] -> [0, 3, 4, 8]. With neither this nor
                `position_ids`, attention is plain causal.
        """
        batch, seq_len = input_ids.shape
        x = self.embed(input_ids)  # (B, T, C)
        doc_ids = document_ids(batch, seq_len, position_ids, cu_seqlens)
        if position_ids is None and doc_ids is not None:  # packed: restart RoPE at each doc
            position_ids = positions_from_cu_seqlens(batch, seq_len, cu_seqlens)
        elif position_ids is None:
            position_ids = torch.arange(seq_len, device=input_ids.device)[None]  # (1, T)
        doc_mask = None if doc_ids is None else document_mask(doc_ids)
        rope = self.rope(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, doc_mask)
        x = self.norm(x)
        return F.linear(x, self.output_weight())  # (B, T, V)
