"""Muon that orthogonalizes whole logical matrices, also when FSDP2 shards them by rows.

Newton–Schulz needs the whole matrix, but FSDP2 gives each rank a block of rows (``Shard(0)``).
As in Moonlight's distributed Muon and Dion, each matrix has an owner rank (round-robin over
ranks): the momentum-updated gradient is sent to its owner (one ``all_to_all`` per round of
``world_size`` matrices, in bf16, the dtype Newton–Schulz works in), the owner orthogonalizes it,
and a second ``all_to_all`` sends every rank the rows of the update it holds. The momentum, weight
decay and the update itself stay elementwise on the local shards, so the optimizer state is
sharded like AdamW's (saved and loaded by DCP the same way).

A fused parameter (``qkv_proj``: q, k and v stacked by rows; ``gate_up_proj``: gate and up) is
orthogonalized per logical matrix, each with its own learning-rate adjustment: the update equals
``torch.optim.Muon`` applied to the separate q, k, v (gate, up) matrices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


def newton_schulz(update: Tensor, steps: int = NS_STEPS, eps: float = EPS) -> Tensor:
    """Approximate ``U V^T`` of ``update = U S V^T`` in bf16 (the quintic of torch.optim.Muon)."""
    a, b, c = NS_COEFFICIENTS
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, rule: str, rows: int, cols: int) -> float:
    """torch.optim.Muon's ``adjust_lr_fn``: keep the update's RMS comparable across shapes."""
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def logical_rows(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Rows of each logical matrix stacked in a fused projection, by parameter name.

    ``qkv_proj`` stacks q (heads x head_dim rows), k and v (kv_heads x head_dim rows each);
    ``gate_up_proj`` stacks gate and up (half the rows each). Other matrices are whole.
    """
    found: dict[str, tuple[int, ...]] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        qkv = getattr(module, "qkv_proj", None)
        if isinstance(qkv, nn.Linear) and hasattr(module, "num_kv_heads"):
            q, kv = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
            found[f"{prefix}qkv_proj.weight"] = (q, kv, kv)
        gate_up = getattr(module, "gate_up_proj", None)
        if isinstance(gate_up, nn.Linear):
            half = gate_up.out_features // 2
            found[f"{prefix}gate_up_proj.weight"] = (half, half)
    return found


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows per rank under ``Shard(0)`` (torch.chunk: ceil-sized blocks, the last ones short)."""
    block = -(-rows // world)
    return [max(0, min(block, rows - r * block)) for r in range(world)]


@dataclass
class _Matrix:
    """One parameter's view for a step: its local rows and where they sit in the whole."""

    param: Tensor
    local: Tensor  # this rank's rows of the momentum-updated gradient (fp32)
    rows: int
    cols: int
    counts: list[int]  # rows held by each rank
    parts: tuple[int, ...]  # rows of each logical matrix

    @property
    def block(self) -> int:
        return max(self.counts)

    def padded(self, tensor: Tensor) -> Tensor:
        """``tensor``'s rows padded with zeros to the largest shard, flattened (bf16)."""
        out = tensor.new_zeros((self.block, self.cols), dtype=torch.bfloat16)
        out[: tensor.size(0)] = tensor
        return out.reshape(-1)


class Muon(torch.optim.Optimizer):
    """Muon (momentum + Newton–Schulz) over whole matrices of plain or ``Shard(0)`` parameters.

    Every rank must call ``step`` (it holds collectives when the parameters are DTensors).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        adjust_lr_fn: str = "original",
        ns_steps: int = NS_STEPS,
        parts: dict[Tensor, tuple[int, ...]] | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            adjust_lr_fn=adjust_lr_fn,
            ns_steps=ns_steps,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D parameters, got shape {tuple(p.shape)}")
        self.parts = {id(p): v for p, v in (parts or {}).items()}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201  (torch.optim.Optimizer's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            matrices = [self._momentum(p, group) for p in group["params"] if p.grad is not None]
            updates = orthogonalize(matrices, group["ns_steps"])
            for matrix, update in zip(matrices, updates, strict=True):
                self._apply(matrix, update, group)
        return loss

    def _momentum(self, param: Tensor, group: dict) -> _Matrix:
        """Update the momentum buffer on the local rows; return the rows to orthogonalize."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad)
        grad, buf = _local(param.grad), _local(state["momentum_buffer"])
        buf.lerp_(grad, 1 - group["momentum"])
        local = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        rows, cols = param.shape
        counts = _row_counts(param, local.size(0))
        parts = self.parts.get(id(param), (rows,))
        return _Matrix(param, local, rows, cols, counts, parts)

    def _apply(self, matrix: _Matrix, update: Tensor, group: dict) -> None:
        """Decay, then add each logical matrix's rows of the update with its adjusted LR."""
        lr = group["lr"]
        param = _local(matrix.param)
        param.mul_(1 - lr * group["weight_decay"])
        first = sum(matrix.counts[: _rank_of(matrix.param)])
        start = 0
        for rows in matrix.parts:
            lo, hi = max(start, first) - first, min(start + rows, first + param.size(0)) - first
            if hi > lo:
                step = adjusted_lr(lr, group["adjust_lr_fn"], rows, matrix.cols)
                param[lo:hi].add_(update[lo:hi], alpha=-step)
            start += rows


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _is_sharded(param: Tensor) -> bool:
    return isinstance(param, DTensor) and param.device_mesh.size() > 1


def _rank_of(param: Tensor) -> int:
    return param.device_mesh.get_local_rank() if _is_sharded(param) else 0


def _row_counts(param: Tensor, local_rows: int) -> list[int]:
    """Rows held by each rank; only 1-D meshes with ``Shard(0)`` are supported."""
    if not _is_sharded(param):
        return [local_rows]
    if param.device_mesh.ndim != 1 or param.placements != (Shard(0),):
        raise ValueError(f"Muon shards only by rows on a 1-D mesh, got {param.placements}")
    counts = shard_rows(param.shape[0], param.device_mesh.size())
    if counts[_rank_of(param)] != local_rows:
        raise ValueError(f"unexpected shard of {local_rows} rows (expected {counts})")
    return counts


def orthogonalize(matrices: Sequence[_Matrix], ns_steps: int = NS_STEPS) -> list[Tensor]:
    """This rank's rows of each matrix's orthogonalized update (bf16), owners round-robin."""
    if not matrices or not _is_sharded(matrices[0].param):
        return [_whole_update(m.local, m.parts, ns_steps) for m in matrices]
    mesh = matrices[0].param.device_mesh
    group, world, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    out: list[Tensor] = []
    for start in range(0, len(matrices), world):
        out += _round(matrices[start : start + world], group, world, rank, ns_steps)
    return out


def _round(
    matrices: Sequence[_Matrix], group: dist.ProcessGroup, world: int, rank: int, ns_steps: int
) -> list[Tensor]:
    """Matrix j goes to rank j: gather its rows there, orthogonalize, send the rows back."""
    sizes = [m.block * m.cols for m in matrices] + [0] * (world - len(matrices))
    send = torch.cat([m.padded(m.local) for m in matrices])
    owned = matrices[rank] if rank < len(matrices) else None
    mine = [owned.block * owned.cols] * world if owned is not None else [0] * world
    received = send.new_empty(sum(mine))
    dist.all_to_all_single(received, send, mine, sizes, group=group)
    back = send.new_empty(0)
    if owned is not None:
        pieces = received.view(world, owned.block, owned.cols)
        whole = torch.cat([pieces[r, :n] for r, n in enumerate(owned.counts)])
        update = _whole_update(whole, owned.parts, ns_steps)
        offsets = [sum(owned.counts[:r]) for r in range(world)]
        back = torch.cat(
            [owned.padded(update[o : o + n]) for o, n in zip(offsets, owned.counts, strict=True)]
        )
    result = send.new_empty(sum(sizes))
    dist.all_to_all_single(result, back, sizes, mine, group=group)
    chunks = result.split(sizes[: len(matrices)])
    return [
        c.view(m.block, m.cols)[: m.counts[rank]] for c, m in zip(chunks, matrices, strict=True)
    ]


def _whole_update(whole: Tensor, parts: tuple[int, ...], ns_steps: int) -> Tensor:
    """Newton–Schulz on each logical matrix (row block) of ``whole``, stacked back."""
    return torch.cat([newton_schulz(block, ns_steps) for block in whole.split(list(parts))])
