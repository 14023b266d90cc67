"""Expert parallelism (EP): each sparse layer's experts split over the ranks of the ``ep`` mesh.

The ``ep`` ranks are carved from the FSDP2 ranks, as torchtitan does: ``dp_shard =
dp_shard_mod_ep x ep``. Each EP rank holds ``num_experts / ep`` whole experts: the experts'
weights are DTensors ``Shard(0)`` on the ``ep`` mesh, so the seeded init draws each rank's rows of
the one full tensor, and DCP checkpoints reshard between EP degrees and one process. The rest of
each block (attention, norms, router) stays under FSDP2 over ``dp_shard_cp``; the experts go under
FSDP2 of their own over the remaining ``dp_shard_mod_ep`` ranks (``shard_experts``).

The dispatcher (:class:`ExpertDispatcher`), set on each ``MoE``, moves the (token, choice) rows
the router sorted by expert to the rank owning their expert, runs the local experts and brings
the outputs back in the same order (``MoE.forward`` stays as in one process):

1. the per-expert counts, all-to-all (each rank learns how many rows it gets per local expert);
2. the rows, all-to-all (autograd-aware: the backward sends the gradients back the same way);
3. the received rows regrouped from (source rank, local expert) to (local expert, source rank);
4. the local experts' grouped matmul on the local weights with the local counts;
5. 3 and 2 undone.

Gradient scale: the trainer multiplies the loss by the FSDP2 ranks (``Parallelism.fsdp_ranks``)
and FSDP2 divides by the ranks it reduces over. An expert's gradient arrives summed over the EP
ranks by the all-to-all's backward, then FSDP2 sums it over ``dp_shard_mod_ep``: its divide
factor is set to the same ``fsdp_ranks`` (torchtitan's ``set_gradient_divide_factor``).

The planner's terms (``expert_parameters``, ``dispatch_bytes``, ``traffic_bytes``) live here too,
as the other dimensions' do in ``tp.py`` and ``cp.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from llmflow.model.moe import GroupedExperts, MoE

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from llmflow.model.config import ModelConfig

__all__ = [
    "ExpertDispatcher",
    "apply_ep",
    "clip_grad_norm_",
    "dispatch_bytes",
    "expert_parameters",
    "shard_experts",
    "traffic_bytes",
]


# ------------------------------------------------------------------------------ the all-to-all
class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows with uneven splits; the backward sends the gradients
    back with the splits swapped (gloo and NCCL both run it)."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out = grad.new_empty(sum(ctx.in_splits), *grad.shape[1:])
        dist.all_to_all_single(
            out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group
        )
        return out, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """Rows ``x`` (split ``in_splits`` over the group's ranks) exchanged: this rank receives
    ``out_splits[r]`` rows from rank r, in rank order. Differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertDispatcher:
    """``MoE.dispatcher`` under EP: ``(rows sorted by expert, counts (E,), experts) -> the
    experts' outputs for those rows, same order``; the experts hold this rank's E/ep experts."""

    def __init__(self, ep_mesh: DeviceMesh, num_experts: int) -> None:
        self.group, self.ep = ep_mesh.get_group(), ep_mesh.size()
        self.num_local = num_experts // self.ep

    def __call__(self, rows: Tensor, counts: Tensor, experts: GroupedExperts) -> Tensor:
        ep, local = self.ep, self.num_local
        # 1. rows per (destination rank, its local expert) -> rows per (source rank, local expert)
        send = counts.to(torch.int64)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        in_splits = send.view(ep, local).sum(1).tolist()
        out_splits = received.view(ep, local).sum(1).tolist()
        # 2. the rows to their experts' ranks
        got = all_to_all(rows, out_splits, in_splits, self.group)
        # 3. (source rank, local expert) -> (local expert, source rank)
        per_block = received.view(ep, local)
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(ep),
            per_block.reshape(-1).to(rows.device),
        )
        order = expert_of_row.argsort(stable=True)
        # 4. this rank's experts, their counts summed over the source ranks
        out = experts(got[order], per_block.sum(0).to(counts.device))
        # 5. back to (source rank, local expert), then to the rows' ranks
        back = torch.empty_like(out).index_copy(0, order, out)
        return all_to_all(back, in_splits, out_splits, self.group)


# ------------------------------------------------------------------------------ the model
def _shard_rows(param: nn.Parameter, ep_mesh: DeviceMesh) -> nn.Parameter:
    """A (meta or real) full expert weight as a DTensor ``Shard(0)`` on ``ep_mesh``: this rank's
    E/ep experts (the values are drawn later, by ``init_weights``)."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    rows = param.shape[0] // ep
    local = param.detach()[rank * rows : (rank + 1) * rows].clone()
    shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
    return nn.Parameter(shard, requires_grad=param.requires_grad)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard every sparse layer's experts over ``ep_mesh`` (dim 0: the experts) and set each
    ``MoE``'s dispatcher (in place; returns ``model``). Before activation checkpointing,
    compile and FSDP2, on the meta device."""
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        if experts.num_experts % ep_mesh.size():
            raise ValueError(f"ep={ep_mesh.size()} does not divide {experts.num_experts} experts")
        experts.gate_up_proj = _shard_rows(experts.gate_up_proj, ep_mesh)
        experts.down_proj = _shard_rows(experts.down_proj, ep_mesh)
        module.dispatcher = ExpertDispatcher(ep_mesh, experts.num_experts)
    return model


def shard_experts(
    block: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy, divide_factor: float
) -> None:
    """FSDP2 over ``mesh`` (``dp_shard_mod_ep``) for the EP-sharded experts of ``block``, before
    the block's own FSDP2 (which then leaves them alone). Their gradients, summed over the EP
    ranks by the all-to-all, are divided by ``divide_factor`` (the trainer's FSDP2 ranks), as
    every other parameter's are."""
    from torch.distributed.fsdp import fully_shard

    for module in block.modules():
        if isinstance(module, MoE) and module.dispatcher is not None:
            fully_shard(module.experts, mesh=mesh, mp_policy=policy)
            module.experts.set_gradient_divide_factor(divide_factor)
            if mesh.device_type == "cpu" and mesh.size() > 1:
                # NOTE: gloo has no PREMUL_SUM: a sum, then a divide. Not on one rank: torch
                # 2.13 then divides twice (the copy and the post-divide), halving the gradients.
                module.experts.set_force_sum_reduction_for_comms(True)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> float:
    """Clip the gradients by their global 2-norm; return it. The experts' DTensors live on the
    ``(dp_shard_mod_ep, ep)`` mesh, the rest on FSDP2's: one norm per mesh (each ``full_tensor``),
    combined, then each group scaled (torchtitan's ``_clip_grad_norm_with_ep``)."""
    groups: dict[object, list[Tensor]] = {}
    for param in model.parameters():
        if param.grad is not None:
            mesh = param.device_mesh if isinstance(param, DTensor) else None
            groups.setdefault(mesh, []).append(param)
    squares = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.double().square())
    total = torch.stack(squares).sum().sqrt().float() if squares else torch.zeros(())
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return float(total)


# ------------------------------------------------------------------------------ the planner's terms
def _sparse_layers(model: ModelConfig, layers: range | None = None) -> int:
    layers = range(model.num_layers) if layers is None else layers
    return sum(1 for i in layers if model.is_sparse(i))


def expert_parameters(
    model: ModelConfig, ep: int = 1, fsdp: int = 1, layers: range | None = None
) -> float:
    """Routed-expert parameters one rank holds: each sparse layer's ``E x 3 x C x I`` split over
    the ``ep`` ranks (whole experts), then over the ``fsdp`` (``dp_shard_mod_ep``) ranks.

    Args:
        layers: the layers counted (a pipeline stage's); all by default.
    """
    if not model.num_experts:
        return 0.0
    per_layer = model.num_experts * 3 * model.hidden_size * model.expert_size
    return _sparse_layers(model, layers) * per_layer / (ep * fsdp)


def dispatch_bytes(model: ModelConfig, tokens: float, dtype_bytes: int, ep: int = 1) -> float:
    """Activation bytes one sparse layer keeps for the backward pass for ``tokens`` tokens of
    this rank (under EP a rank receives, on average, as many rows as it sends): per
    (token, choice) row, ``N x k`` of them, the dispatched row of width C (the grouped matmul's
    input), the experts' ``2I`` gate/up output, silu(gate) and its product with up (``I``
    each), the expert output (C) the routing weight multiplies; under EP the received rows
    (C) too. Per token beside them: the router's float32 logits and scores (E each) and the
    shared experts' SwiGLU (``4 x n_shared x I``). Replaces a dense layer's ``4 x
    intermediate_size`` in ``memory_model.block_activation_bytes``."""
    if not model.num_experts:
        return 0.0
    c, width = model.hidden_size, model.expert_size
    row = (2 + (ep > 1)) * c + 4 * width
    per_token = model.num_experts_per_tok * row + 4 * model.n_shared_experts * width
    return tokens * (per_token * dtype_bytes + 2 * model.num_experts * 4)


def traffic_bytes(
    model: ModelConfig, tokens: float, ep: int, dtype_bytes: int, recomputed: float = 0.0
) -> float:
    """All-to-all bytes one rank sends per step for ``tokens`` tokens (all its micro-batches):
    per sparse layer the ``N x k`` rows of width C to their experts and back (forward: 2
    all-to-alls), their gradients both ways (backward: 2), the forward's again for the
    ``recomputed`` share of layers; the share ``(ep - 1) / ep`` leaves the rank (balanced
    routing)."""
    if ep <= 1 or not model.num_experts:
        return 0.0
    rows = tokens * model.num_experts_per_tok
    per_layer = (4 + 2 * recomputed) * rows * model.hidden_size * dtype_bytes * (ep - 1) / ep
    return _sparse_layers(model) * per_layer
