"""Decoder-only transformer in the Llama / SmolLM3 layout: pre-norm blocks, GQA, SwiGLU."""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from llmflow.model.attention import Attention
from llmflow.model.config import ModelConfig
from llmflow.model.context import SequenceShard
from llmflow.model.kernels import Documents
from llmflow.model.loss import (
    TiedGradient,
    linear_cross_entropy,
    tied_embedding,
    vocab_parallel_logits,
)
from llmflow.model.moe import GroupedExperts, MoE, Router
from llmflow.model.norm import RMSNorm
from llmflow.model.rope import RotaryEmbedding

INIT_BLOCK_ROWS = 1024
"""Rows drawn from one generator by a seeded init (the unit a shard's rows are drawn in)."""
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _canonical(name: str) -> str:
    """A module's name without wrapper segments (activation checkpointing, compile)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _block_seed(seed: int, key: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{key}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def normal_rows(
    shape: tuple[int, ...], start: int, stop: int, std: float, seed: int, key: str
) -> Tensor:
    """Rows [start, stop) of a Normal(0, std) tensor of `shape`, drawn in blocks of rows.

    Block b (rows [b * INIT_BLOCK_ROWS, (b + 1) * INIT_BLOCK_ROWS)) comes from its own CPU
    generator seeded by (seed, key, b), so any row range is reproducible without drawing the
    rest of the tensor, and the result is the same on every device.
    """
    width = math.prod(shape[1:])
    out = torch.empty(stop - start, width)
    first, last = start // INIT_BLOCK_ROWS, (stop - 1) // INIT_BLOCK_ROWS if stop > start else -1
    for block in range(first, last + 1):
        lo = block * INIT_BLOCK_ROWS
        rows = min(INIT_BLOCK_ROWS, shape[0] - lo)
        generator = torch.Generator().manual_seed(_block_seed(seed, key, block))
        drawn = torch.empty(rows, width).normal_(0.0, std, generator=generator)
        a, b = max(start, lo), min(stop, lo + rows)
        out[a - start : b - start] = drawn[a - lo : b - lo]
    return out.view(stop - start, *shape[1:])


def _init_projection(name: str, module: nn.Module, std: float, seed: int | None) -> None:
    """A linear or embedding module's weight drawn from Normal(0, std), its bias (if any) zeroed."""
    rows = getattr(module, "row_order", None)  # tensor parallel (parallel/tp.py)
    init_normal_(module.weight, std, seed, _canonical(name), rows)
    if getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)


def init_normal_(
    weight: Tensor, std: float, seed: int | None, key: str, rows: Tensor | None = None
) -> None:
    """Fill `weight` (a tensor or a DTensor sharded on rows and/or columns) from the seeded row
    blocks.

    Args:
        rows: the row of the seeded full tensor each row of `weight` takes (tensor parallelism
            holds fused weights in another row order); by default row i is row i.
    """
    if seed is None:
        nn.init.normal_(weight, mean=0.0, std=std)
        return
    local, offsets = weight, (0,) * weight.dim()
    if isinstance(weight, DTensor):
        local = weight.to_local()
        _, offsets = compute_local_shape_and_global_offset(
            weight.shape, weight.device_mesh, weight.placements
        )
    if not local.numel():
        return
    start, stop, shape = offsets[0], offsets[0] + local.shape[0], tuple(weight.shape)
    if rows is None:
        values = normal_rows(shape, start, stop, std, seed, key)
    else:  # each run of consecutive source rows drawn at once
        wanted = rows[start:stop].tolist()
        breaks = [0] + [i for i in range(1, len(wanted)) if wanted[i] != wanted[i - 1] + 1]
        runs = zip(breaks, breaks[1:] + [len(wanted)], strict=True)
        values = torch.cat(
            [normal_rows(shape, wanted[a], wanted[b - 1] + 1, std, seed, key) for a, b in runs]
        )
    for dim in range(1, local.dim()):  # a column shard (rowwise tensor parallelism)
        values = values.narrow(dim, offsets[dim], local.shape[dim])
    local.copy_(values)


class MLP(nn.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`, gate and up fused in one weight."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.gate_up_proj.weight
        if isinstance(weight, DTensor):  # tensor parallel: this rank's rows of gate and of up
            weight = weight.to_local()
        return self.down_proj(swiglu(x, weight))


def swiglu(x: Tensor, gate_up_weight: Tensor) -> Tensor:
    """`silu(x @ gate.T) * (x @ up.T)` for a fused (2I, C) weight whose rows are [gate; up].

    Autograd over `F.linear(x, w).chunk(2, -1)` works on strided halves of one (..., 2I) output,
    which halves the speed of every elementwise kernel after it on CPU, and concatenates the two
    halves' gradients again in the backward pass. Here each half is its own contiguous matmul
    output, and the backward writes the weight's gradient halves in place: no copies.
    """
    dtype = _autocast_dtype(x) or gate_up_weight.dtype
    with torch.autocast(x.device.type, enabled=False):
        out = _SwiGLU.apply(x.reshape(-1, x.shape[-1]).to(dtype), gate_up_weight.to(dtype))
    return out.view(*x.shape[:-1], -1)


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        gate_w, up_w = weight.chunk(2)  # (I, C) each, contiguous rows
        gate, up = x @ gate_w.t(), x @ up_w.t()  # (N, I) each
        act = F.silu(gate)
        ctx.save_for_backward(x, weight, gate, up, act)
        return act * up

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, weight, gate, up, act = ctx.saved_tensors
        gate_w, up_w = weight.chunk(2)
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        grad_up = grad * act
        grad_x = (grad_gate @ gate_w).addmm_(grad_up, up_w)
        grad_weight = torch.empty_like(weight)
        grad_gate_w, grad_up_w = grad_weight.chunk(2)
        torch.mm(grad_gate.t(), x, out=grad_gate_w)
        torch.mm(grad_up.t(), x, out=grad_up_w)
        return grad_x, grad_weight


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, use_rope=cfg.uses_rope(layer_idx))
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_sparse(layer_idx) else MLP(cfg)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        docs: Documents | None,
        context: SequenceShard | None = None,
    ) -> Tensor:
        h = x + self.attn(self.attn_norm(x), rope, docs, context)
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

        Biases (the q/k/v bias of `attention_bias`) start at 0.

        Args:
            seed: when given, every weight is drawn block by block from generators seeded by
                (seed, its name, the block), so the result does not depend on (or disturb) the
                global RNG, and a rank holding only a shard of a weight (FSDP2 DTensor, after
                `to_empty` from the meta device) draws exactly its rows of the same full tensor.
                Without a seed, weights come from the global RNG (unsharded models only).
        """
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.num_layers)
        self.rope.reset_parameters()
        for name, module in self.named_modules():
            if isinstance(module, (RMSNorm, MoE)):
                module.reset_parameters()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual_out = name.endswith(("o_proj", "down_proj"))
                _init_projection(name, module, residual_std if is_residual_out else std, seed)
            elif isinstance(module, Router):
                init_normal_(module.weight, std, seed, _canonical(name))
            elif isinstance(module, GroupedExperts):  # rows: the experts (EP and FSDP2 shard)
                key = _canonical(name)
                init_normal_(module.gate_up_proj, std, seed, key + ".gate_up_proj")
                init_normal_(module.down_proj, residual_std, seed, key + ".down_proj")

    def output_weight(self) -> Tensor:
        """The (V, C) output projection: the embedding when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        labels: Tensor | None = None,
        z_loss_weight: float = 0.0,
        context: SequenceShard | None = None,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """Logits (B, T, V) for `input_ids` (B, T); with `labels`, the loss instead.

        Args:
            input_ids: (B, T) token ids.
            position_ids: (B, T) positions restarting at 0 at each document; by default they are
                derived from `cu_seqlens`, or 0..T-1 without it.
            cu_seqlens: int32 cumulative document lengths over the flattened B*T tokens, e.g.
                B=2, T=4 with documents [3, 1 | 4] -> [0, 3, 4, 8]. With neither this nor
                `position_ids`, attention is plain causal.
            labels: (B, T) targets aligned with the logits (-100: no loss); when given, return
                `linear_cross_entropy`'s (loss, metrics), the output projection fused into the
                loss so the full logits are never kept twice.
            z_loss_weight: z-loss weight of that loss.
            context: under context parallelism, which tokens of the whole rows `input_ids`
                holds (`tasks/pretrain/parallel/cp.py:shard_batch`); `position_ids` are then
                required (the whole rows' positions of these tokens) and `cu_seqlens` unused.
        """
        batch, seq_len = input_ids.shape
        tied = None
        trains = torch.is_grad_enabled() and self.embed.weight.requires_grad
        parallel = isinstance(self.embed.weight, DTensor)  # tensor parallel: the module's plan
        if labels is not None and self.lm_head is None and trains and not parallel:
            # NOTE: one (V, C) gradient buffer for both uses of the tied weight (TiedGradient)
            tied = TiedGradient()
            x = tied_embedding(input_ids, self.embed.weight, tied)  # (B, T, C)
        else:
            x = self.embed(input_ids)  # (B, T, C)
        if context is not None:  # positions and documents come from the whole rows
            if position_ids is None:
                raise ValueError("position_ids are required with a context-parallel shard")
            docs = None  # the shard holds the whole rows' documents
        else:
            docs = Documents.of(batch, seq_len, position_ids, cu_seqlens)
            if position_ids is None and docs is not None:  # packed: restart RoPE at each doc
                position_ids = docs.positions()
            elif position_ids is None:
                position_ids = torch.arange(seq_len, device=input_ids.device)[None]  # (1, T)
        rope = self.rope(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, docs, context)
        x = self.norm(x)
        if labels is not None:
            return linear_cross_entropy(x, self.output_weight(), labels, z_loss_weight, tied=tied)
        if isinstance(self.output_weight(), DTensor):  # tensor parallel: vocabulary rows split
            return vocab_parallel_logits(x, self.output_weight())  # (B, T, V)
        return F.linear(x, self.output_weight())  # (B, T, V)
