"""Mixture of experts: a token-choice top-k router and routed (plus optional shared) SwiGLU experts.

Dropless: every token goes to its `num_experts_per_tok` experts, no capacity factor, no token
dropped. The (token, expert) pairs are sorted by expert and each expert's rows form one group of
a grouped matmul (`torch._grouped_mm` where the device has it, `grouped_mm`'s per-expert `mm`
otherwise), so no Python loop over experts runs on the hot path where the kernel exists.

Load balancing, each off by default and set in `ModelConfig`:
- `router_aux_loss_coef`: the auxiliary load-balancing loss (Switch Transformer, transformers'
  `load_balancing_loss_func`), `(E / k) * sum_e f_e * P_e` per sparse layer, 1 when balanced;
- `router_z_loss_coef`: the router z-loss (ST-MoE), `mean(logsumexp(logits)^2)`;
- `router_bias_update_rate`: DeepSeek-V3's auxiliary-loss-free balancing. A per-expert bias is
  added to the scores to *select* experts, never to *weight* them; after each optimizer step the
  trainer moves it by `rate * sign(mean load - load)` from the token counts summed over the
  data-parallel ranks (`update_expert_bias`). It is a buffer: never decayed, never in an
  optimizer, saved with the weights.

The two losses enter training through `AddAuxiliaryLoss`: the block's output carries their
gradient, so they need no plumbing to the loss (pipeline stages and activation checkpointing
included). Their scale over micro-batches is `MoE.aux_scale` (the trainer sets 1 / accumulation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from llmflow.model.config import ModelConfig

__all__ = ["MoE", "GroupedExperts", "Router", "grouped_mm", "moe_layers", "update_expert_bias"]

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def grouped_mm(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """`x[rows of group e] @ weight[e].T` for every group e, rows sorted by group.

    Args:
        x: (S, K) rows, grouped: rows [offsets[e-1], offsets[e]) belong to group e.
        weight: (E, N, K), one matrix per group (transformers' and our experts' layout).
        offsets: (E,) int32 cumulative row counts; offsets[-1] == S.
    """
    if _has_grouped_mm(x.dtype):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    return _grouped_mm_loop(x, weight, offsets)


def _grouped_mm_loop(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """The fallback: one `mm` per group with rows (a host sync for the offsets)."""
    bounds = [0] + offsets.tolist()
    outs = [
        x[a:b] @ weight[e].t()
        for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
        if b > a
    ]
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])


class AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on `x`; in the backward pass the scalar `loss` gets gradient 1 (DeepSeek's
    `AddAuxiliaryLoss`): an auxiliary loss trained without being added to the model's loss."""

    @staticmethod
    def forward(ctx, x: Tensor, loss: Tensor) -> Tensor:
        ctx.dtype, ctx.device = loss.dtype, loss.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, torch.ones((), dtype=ctx.dtype, device=ctx.device)


class Router(nn.Module):
    """Scores every expert for every token and keeps the top k.

    `weight` (E, C) is the gate; `expert_bias` (E,) the auxiliary-loss-free bias (selection
    only); `scoring_func` softmax (Qwen3-MoE, Mixtral) or sigmoid (DeepSeek-V3).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.num_experts
        self.scoring_func, self.norm_topk_prob = cfg.scoring_func, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(N, C) tokens -> (logits (N, E) float32, scores (N, E) float32, top-k ids (N, k),
        top-k weights (N, k) float32)."""
        logits = F.linear(x, _local(self.weight).to(x.dtype)).float()
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        with torch.no_grad():
            # NOTE: a zero bias adds exactly 0; testing it first would sync the host per layer
            ids = (scores + self.expert_bias).topk(self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, scores, ids, weights


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts held as 3-D weights (transformers' layout):
    `gate_up_proj` (E, 2I, C) with rows [gate; up], `down_proj` (E, C, I).

    `use_loop`: None (default) runs one `mm` per expert on CPU, where it measured faster than
    torch's CPU `_grouped_mm` (benchmarks/bench_moe.py, part d), and `torch._grouped_mm`
    elsewhere; True or False forces one of the two.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.use_loop: bool | None = None

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """(S, C) rows sorted by expert, `counts` (E,) rows per expert -> (S, C)."""
        dtype = _autocast_dtype(x) or x.dtype
        loop = self.use_loop
        if loop is None:
            loop = x.device.type == "cpu" or not _has_grouped_mm(dtype)
        elif not loop and not _has_grouped_mm(dtype):
            raise ValueError(f"torch._grouped_mm is not available for {dtype}")
        with torch.autocast(x.device.type, enabled=False):
            return _ExpertsSwiGLU.apply(
                x.to(dtype),
                counts,
                _local(self.gate_up_proj).to(dtype),
                _local(self.down_proj).to(dtype),
                loop,
            )


class _ExpertsSwiGLU(torch.autograd.Function):
    """Every expert's `down(silu(x @ gate.T) * (x @ up.T))` over its rows, by hand.

    As `transformer._SwiGLU`: gate and up are separate contiguous outputs (not strided halves
    of one (S, 2I) output), and the per-expert path writes each expert's outputs and weight
    gradients in place into one buffer (no `cat`).
    """

    @staticmethod
    def forward(ctx, x: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor, loop: bool):
        inter = down.shape[2]
        gate_w, up_w = gate_up[:, :inter], gate_up[:, inter:]  # (E, I, C) each
        if loop:
            bounds = _bounds(counts)
            gate, up = _mm_per_expert(x, gate_w, bounds), _mm_per_expert(x, up_w, bounds)
        else:
            bounds, offsets = None, counts.cumsum(0).to(torch.int32)
            gate, up = grouped_mm(x, gate_w, offsets), grouped_mm(x, up_w, offsets)
        act = F.silu(gate)
        h = act * up
        out = _mm_per_expert(h, down, bounds) if loop else grouped_mm(h, down, offsets)
        ctx.bounds, ctx.loop = bounds, loop
        ctx.save_for_backward(x, gate_up, down, gate, up, act, h, None if loop else offsets)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, gate_up, down, gate, up, act, h, offsets = ctx.saved_tensors
        grad, bounds, inter = grad.contiguous(), ctx.bounds, down.shape[2]
        gate_w, up_w = gate_up[:, :inter], gate_up[:, inter:]
        if ctx.loop:
            grad_h = _mm_per_expert(grad, down.transpose(1, 2), bounds)
            grad_down = _weight_grad_per_expert(grad, h, bounds, torch.empty_like(down))
        else:
            grad_h = grouped_mm(grad, down.transpose(1, 2), offsets)
            grad_down = torch._grouped_mm(grad.t(), h, offs=offsets)
        grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate)
        grad_up = grad_h.mul_(act)
        if ctx.loop:
            grad_x = _mm_per_expert(grad_gate, gate_w.transpose(1, 2), bounds)
            for e, (a, b) in enumerate(bounds):
                if b > a:
                    grad_x[a:b].addmm_(grad_up[a:b], up_w[e])
            grad_gate_up = torch.empty_like(gate_up)
            _weight_grad_per_expert(grad_gate, x, bounds, grad_gate_up[:, :inter])
            _weight_grad_per_expert(grad_up, x, bounds, grad_gate_up[:, inter:])
        else:
            grad_x = grouped_mm(grad_gate, gate_w.transpose(1, 2), offsets)
            grad_x += grouped_mm(grad_up, up_w.transpose(1, 2), offsets)
            grad_gate_up = torch.cat(
                [
                    torch._grouped_mm(grad_gate.t(), x, offs=offsets),
                    torch._grouped_mm(grad_up.t(), x, offs=offsets),
                ],
                dim=1,
            )
        return grad_x, None, grad_gate_up, grad_down, None


def _bounds(counts: Tensor) -> list[tuple[int, int]]:
    """Each group's [start, stop) rows from the (E,) counts (one host sync)."""
    ends = counts.cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends, strict=True))


def _mm_per_expert(x: Tensor, weight: Tensor, bounds: list[tuple[int, int]]) -> Tensor:
    """`x[rows of e] @ weight[e].T` for every expert e, written in place into one (S, N)."""
    out = x.new_empty(x.shape[0], weight.shape[1])
    for e, (a, b) in enumerate(bounds):
        if b > a:
            torch.mm(x[a:b], weight[e].t(), out=out[a:b])
    return out


def _weight_grad_per_expert(
    grad: Tensor, x: Tensor, bounds: list[tuple[int, int]], out: Tensor
) -> Tensor:
    """`out[e] = grad[rows of e].T @ x[rows of e]` (an expert without rows: zeros)."""
    for e, (a, b) in enumerate(bounds):
        if b > a:
            torch.mm(grad[a:b].t(), x[a:b], out=out[e])
        else:
            out[e].zero_()
    return out


class _Dispatch(torch.autograd.Function):
    """`tokens[source]`: each (token, choice) row, sorted by expert. The backward sums each
    token's k row gradients in one pass (`embedding_bag` over the inverse permutation;
    deterministic, where autograd's indexing backward is an accumulating scatter)."""

    @staticmethod
    def forward(ctx, tokens: Tensor, source: Tensor, inverse: Tensor, top_k: int) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return tokens.index_select(0, source)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        grad_tokens = F.embedding_bag(inverse.view(-1, ctx.top_k), grad, mode="sum")
        return grad_tokens, None, None, None


class _Combine(torch.autograd.Function):
    """`y[t] = sum_j weights[t, j] * out[row of (t, j)]`: the experts' outputs (sorted by
    expert) weighted back into token order, with no weighted (N*k, C) copy. The backward
    gathers each row's token gradient already scaled by its weight (`embedding_bag`, one
    pass) and takes the weights' gradient from the rows in token order saved by the forward."""

    @staticmethod
    def forward(ctx, out: Tensor, weights: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        num_tokens, top_k = weights.shape
        pairs = out.index_select(0, inverse).view(num_tokens, top_k, out.shape[-1])
        ctx.save_for_backward(pairs, weights, order)
        return torch.bmm(weights.unsqueeze(1), pairs).squeeze(1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        pairs, weights, order = ctx.saved_tensors
        grad = grad.contiguous()
        grad_weights = None
        if ctx.needs_input_grad[1]:
            grad_weights = torch.bmm(pairs, grad.unsqueeze(2)).view_as(weights)
        source = (order // weights.shape[1]).view(-1, 1)  # each sorted row's token
        scale = weights.reshape(-1)[order].view(-1, 1)
        grad_out = F.embedding_bag(source, grad, mode="sum", per_sample_weights=scale)
        return grad_out, grad_weights, None, None


class MoE(nn.Module):
    """The sparse feed-forward block: router, routed experts, optional shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from llmflow.model.transformer import MLP  # the shared experts are one SwiGLU MLP

        self.cfg, self.num_experts, self.top_k = cfg, cfg.num_experts, cfg.num_experts_per_tok
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_size)
        self.shared_experts = (
            MLP(cfg, cfg.n_shared_experts * cfg.expert_size) if cfg.n_shared_experts else None
        )
        self.aux_scale = 1.0  # the auxiliary losses' weight in one backward (1 / accumulation)
        self.dispatcher = None  # expert parallelism: moves rows to their experts' ranks
        # tokens routed to each expert since the trainer last read them (training forwards)
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        self.last_metrics: dict[str, Tensor] = {}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Zero the bias and the counts (the weights are drawn by `Transformer.init_weights`)."""
        self.router.expert_bias.zero_()
        self.tokens_per_expert.zero_()

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, C)
        logits, scores, ids, weights = self.router(tokens)
        flat = ids.reshape(-1)  # (N * k,)
        order = flat.argsort(stable=True)  # the (token, choice) pairs sorted by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        inverse = torch.empty_like(order)  # each pair's row in the sorted order
        inverse[order] = torch.arange(order.numel(), device=order.device)
        rows = _Dispatch.apply(tokens, order // self.top_k, inverse, self.top_k)  # (N * k, C)
        if self.dispatcher is not None:
            out = self.dispatcher(rows, counts, self.experts)
        else:
            out = self.experts(rows, counts)
        y = _Combine.apply(out, weights.to(out.dtype), order, inverse)  # (N, C)
        if self.shared_experts is not None:
            y = y + self.shared_experts(tokens)
        y = y.view(shape)
        if self.training and torch.is_grad_enabled():
            self._record(counts, logits, scores)
            loss = self._aux_loss(logits, scores, counts)
            if loss is not None:
                y = AddAuxiliaryLoss.apply(y, loss * self.aux_scale)
        return y

    def _aux_loss(self, logits: Tensor, scores: Tensor, counts: Tensor) -> Tensor | None:
        cfg, loss = self.cfg, None
        if cfg.router_aux_loss_coef:
            loss = cfg.router_aux_loss_coef * load_balancing_loss(scores, counts, self.top_k)
        if cfg.router_z_loss_coef:
            z = cfg.router_z_loss_coef * router_z_loss(logits)
            loss = z if loss is None else loss + z
        return loss

    @torch.no_grad()
    def _record(self, counts: Tensor, logits: Tensor, scores: Tensor) -> None:
        """Counts and router statistics of a training forward (not of a recompute under
        activation checkpointing, which runs inside the backward pass)."""
        if torch._C._current_graph_task_id() != -1:
            return
        self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        probs = scores / scores.sum(dim=-1, keepdim=True)
        self.last_metrics = {
            "router_entropy": -(probs * probs.clamp_min(1e-20).log()).sum(-1).mean(),
            "aux_loss": load_balancing_loss(scores, counts, self.top_k),
            "z_loss": router_z_loss(logits),
        }


def load_balancing_loss(scores: Tensor, counts: Tensor, top_k: int) -> Tensor:
    """`(E / k) * sum_e (counts_e / N) * P_e`, P_e the mean normalized score of expert e over the
    N tokens (1 when every expert gets N*k/E tokens and mean probability 1/E)."""
    num_tokens, num_experts = scores.shape
    probs = scores / scores.sum(dim=-1, keepdim=True)
    fraction = counts.to(probs.dtype) / max(num_tokens, 1)
    return (num_experts / top_k) * (fraction * probs.mean(dim=0)).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE's router z-loss: `mean over tokens of logsumexp(logits)^2`."""
    return logits.logsumexp(dim=-1).square().mean()


def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """(layer index, block) of every sparse layer of `model` (any wrapping)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            index = next((int(p) for p in name.split(".") if p.isdigit()), len(found))
            found.append((index, module))
    return found


@torch.no_grad()
def update_expert_bias(moe: MoE, load: Tensor, rate: float) -> None:
    """DeepSeek-V3's bias update: `bias += rate * sign(mean(load) - load)`, `load` the tokens
    each expert got over the step (summed over the data-parallel ranks)."""
    load = load.to(moe.router.expert_bias)
    moe.router.expert_bias.add_(rate * torch.sign(load.mean() - load))


def _has_grouped_mm(dtype: torch.dtype) -> bool:
    return HAS_GROUPED_MM and dtype in (torch.float32, torch.bfloat16)


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _local(weight: Tensor) -> Tensor:
    """A DTensor's local part (expert parallelism shards experts; FSDP2 gathers before use)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight
