"""Muon that orthogonalizes whole logical matrices, however FSDP2, HSDP and TP shard them.

Newton–Schulz needs the whole matrix, but a sharded parameter gives each rank a piece: a block of
rows under FSDP2 (``Shard(0)``), a block of columns under row-parallel TP (``Shard(1)``), both
on a 2-D ``(dp_shard, tp)`` mesh. As in Moonlight's distributed Muon and Dion, each matrix has
an owner rank (round-robin over the ranks that hold different pieces of it): the
momentum-updated gradient's pieces are sent to the owner (one ``all_to_all`` per round of
matrices, in bf16, the dtype Newton–Schulz works in), the owner puts the whole matrix together in
canonical row order, orthogonalizes it, and a second ``all_to_all`` sends every rank its piece
of the update. Ranks on a replicated mesh dim (HSDP's ``dp_replicate``) hold the same pieces:
each replica orthogonalizes within itself, so the exchange never crosses replicas (the
Newton–Schulz work is split over the ``dp_shard x tp`` ranks and repeated by each replica, as
data-parallel replicas repeat any optimizer step). The momentum, weight decay and the update
itself stay elementwise on the local pieces, so the optimizer state is sharded like AdamW's
(saved and loaded by DCP the same way).

A fused parameter (``qkv_proj``: q, k and v stacked by rows; ``gate_up_proj``: gate and up) is
orthogonalized per logical matrix, each with its own learning-rate adjustment: the update equals
``torch.optim.Muon`` applied to the separate q, k, v (gate, up) matrices. Under TP the fused
weights hold their rows in tensor-parallel order (``parallel/tp.py``: each rank's q, k, v
heads together); the owner puts the rows back in canonical order before cutting the blocks.

A mixture of experts' 3-D weights (``gate_up_proj`` (E, 2I, C), ``down_proj`` (E, C, I)) are
E stacked matrices (2E for ``gate_up_proj``: each expert's gate and up): Muon takes them as one
(E * rows, C) matrix of row blocks, each block orthogonalized on its own (one batched
Newton–Schulz over the experts), so the update equals ``torch.optim.Muon`` applied to every
expert's gate, up and down matrices separately. FSDP2 shards them by experts (dim 0): each rank
holds whole experts' rows, which the owner puts together like any row shard.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from llmflow.tasks.pretrain.parallel.tp import ROW_ORDER

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


def newton_schulz(update: Tensor, steps: int = NS_STEPS, eps: float = EPS) -> Tensor:
    """Approximate ``U V^T`` of ``update = U S V^T`` in bf16 (the quintic of torch.optim.Muon);
    a 3-D ``update`` is a batch of matrices, each orthogonalized on its own."""
    a, b, c = NS_COEFFICIENTS
    if update.ndim == 3:
        return _batched_newton_schulz(update, steps, eps)
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _batched_newton_schulz(update: Tensor, steps: int, eps: float) -> Tensor:
    """:func:`newton_schulz` of each matrix of a (B, R, C) batch (batched matmuls)."""
    a, b, c = NS_COEFFICIENTS
    x = update.bfloat16()
    tall = update.size(1) > update.size(2)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, rule: str, rows: int, cols: int) -> float:
    """torch.optim.Muon's ``adjust_lr_fn``: keep the update's RMS comparable across shapes."""
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def logical_rows(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Rows of each logical matrix stacked in a fused projection, by parameter name.

    ``qkv_proj`` stacks q (heads x head_dim rows), k and v (kv_heads x head_dim rows each);
    ``gate_up_proj`` stacks gate and up (half the rows each). Other matrices are whole, but a
    mixture of experts' 3-D weights are one matrix per expert (``default_parts``), and its
    ``gate_up_proj`` (E, 2I, C) is 2E matrices: each expert's gate and up.
    """
    found: dict[str, tuple[int, ...]] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        qkv = getattr(module, "qkv_proj", None)
        if isinstance(qkv, nn.Linear) and hasattr(module, "num_kv_heads"):
            q, kv = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
            # NOTE: tensor parallelism leaves each rank's module its own share of the heads
            # (apply_tp); the weight's shape is the whole matrix's.
            ranks = qkv.weight.shape[0] // (q + 2 * kv)
            found[f"{prefix}qkv_proj.weight"] = (q * ranks, kv * ranks, kv * ranks)
        gate_up = getattr(module, "gate_up_proj", None)
        if isinstance(gate_up, nn.Linear):
            half = gate_up.weight.shape[0] // 2
            found[f"{prefix}gate_up_proj.weight"] = (half, half)
        elif isinstance(gate_up, Tensor) and gate_up.ndim == 3:  # experts (model/moe.py)
            experts, rows, _ = gate_up.shape
            found[f"{prefix}gate_up_proj"] = (rows // 2,) * (2 * experts)
    return found


def default_parts(param: Tensor) -> tuple[int, ...]:
    """Rows of each logical matrix of a parameter without fused parts: the whole matrix, or
    each (rows, cols) matrix of a 3-D (experts, rows, cols) stack."""
    if param.ndim == 3:
        return (param.shape[1],) * param.shape[0]
    return (param.shape[0],)


def matrix_shape(param: Tensor) -> tuple[int, int]:
    """The 2-D shape Muon sees: a 3-D stack's matrices one under the other."""
    return param.numel() // param.shape[-1], param.shape[-1]


def _rows(tensor: Tensor) -> Tensor:
    """A 3-D local piece as the rows of its matrices (a 2-D one as it is)."""
    return tensor.reshape(-1, tensor.shape[-1]) if tensor.ndim == 3 else tensor


def row_orders(model: nn.Module) -> dict[str, Tensor]:
    """The canonical row of each stored row, by parameter name, of the weights tensor
    parallelism holds in its own row order (``parallel/tp.py``: ``row_order``)."""
    found = {}
    for name, module in model.named_modules():
        order = getattr(module, ROW_ORDER, None)
        if order is not None:
            found[f"{name}.weight" if name else "weight"] = order
    return found


@dataclass(frozen=True)
class Spread:
    """Where each piece of a parameter sits in the whole matrix (in canonical row order).

    ``group`` holds the ranks with different pieces (the mesh dims that shard the parameter);
    None: this rank holds the whole matrix. ``rows[r]``: the canonical row of each row of group
    rank r's piece; ``cols[r]``: its columns.
    """

    group: dist.ProcessGroup | None
    rank: int
    rows: list[Tensor]
    cols: list[Tensor]

    @property
    def world(self) -> int:
        return len(self.rows)

    def numel(self, rank: int) -> int:
        return len(self.rows[rank]) * len(self.cols[rank])

    def assemble(self, pieces: Sequence[Tensor], shape: torch.Size) -> Tensor:
        """The whole matrix from every group rank's piece (flattened)."""
        whole = pieces[0].new_empty(shape)
        for rows, cols, piece in zip(self.rows, self.cols, pieces, strict=True):
            whole[rows[:, None], cols] = piece.view(len(rows), len(cols))
        return whole

    def piece(self, whole: Tensor, rank: int) -> Tensor:
        """Group rank ``rank``'s piece of ``whole`` (flattened)."""
        return whole[self.rows[rank][:, None], self.cols[rank]].reshape(-1)


@dataclass
class _Matrix:
    """One parameter's view for a step: its local piece and where the pieces sit."""

    param: Tensor
    local: Tensor  # this rank's piece of the momentum-updated gradient (fp32)
    parts: tuple[int, ...]  # rows of each logical matrix
    spread: Spread

    @property
    def batched(self) -> bool:
        """A stack of equal matrices (experts): one batched Newton–Schulz."""
        return self.param.ndim == 3


class Muon(torch.optim.Optimizer):
    """Muon (momentum + Newton–Schulz) over whole matrices of plain or sharded parameters.

    Every rank must build it and call ``step`` (both hold collectives when the parameters are
    sharded DTensors).
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
        orders: dict[Tensor, Tensor] | None = None,
    ) -> None:
        """``parts``: rows of each logical matrix of a fused parameter; ``orders``: the canonical
        row of each stored row of a parameter held in tensor-parallel row order."""
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            adjust_lr_fn=adjust_lr_fn,
            ns_steps=ns_steps,
        )
        super().__init__(params, defaults)
        params = [p for group in self.param_groups for p in group["params"]]
        for p in params:
            if p.ndim not in (2, 3):
                raise ValueError(
                    f"Muon takes 2-D parameters (or 3-D stacks of experts' matrices), got shape "
                    f"{tuple(p.shape)}"
                )
        self.parts = {id(p): v for p, v in (parts or {}).items()}
        orders = {id(p): v for p, v in (orders or {}).items()}
        self.spreads = spreads(params, orders)
        # (first, last + 1, rows of its logical matrix) of each run of local rows in one matrix
        self.runs = {
            id(p): _runs(self.spreads[id(p)], self.parts.get(id(p), default_parts(p)))
            for p in params
        }

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
        """Update the momentum buffer on the local piece; return the piece to orthogonalize."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad)
        grad, buf = _local(param.grad), _local(state["momentum_buffer"])
        buf.lerp_(grad, 1 - group["momentum"])
        local = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        parts = self.parts.get(id(param), default_parts(param))
        return _Matrix(param, _rows(local), parts, self.spreads[id(param)])

    def _apply(self, matrix: _Matrix, update: Tensor, group: dict) -> None:
        """Decay, then add each logical matrix's rows of the update with its adjusted LR."""
        lr = group["lr"]
        param = _rows(_local(matrix.param))
        param.mul_(1 - lr * group["weight_decay"])
        for lo, hi, rows in self.runs[id(matrix.param)]:
            step = adjusted_lr(lr, group["adjust_lr_fn"], rows, matrix.param.shape[-1])
            param[lo:hi].add_(update[lo:hi], alpha=-step)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# ------------------------------------------------------------------------ where the pieces sit
def spreads(params: Sequence[Tensor], orders: dict[int, Tensor]) -> dict[int, Spread]:
    """Each parameter's :class:`Spread`, by ``id``; ``orders``: the row orders, by ``id``.

    Each rank finds its own piece's rows and columns, then one ``all_gather_object`` per
    process group tells every rank the others' (collective: every rank calls it, once).
    """
    found: dict[int, Spread] = {}
    shared: dict[dist.ProcessGroup, list[tuple[Tensor, int, Tensor, Tensor]]] = {}
    for param in params:
        group, rank = _shard_group(param)
        rows, cols = _local_indices(param, orders.get(id(param)))
        if group is None:
            found[id(param)] = Spread(None, 0, [rows], [cols])
        else:
            shared.setdefault(group, []).append((param, rank, rows, cols))
    for group, members in shared.items():
        gathered: list = [None] * dist.get_world_size(group)
        mine = [(rows.cpu(), cols.cpu()) for _, _, rows, cols in members]
        dist.all_gather_object(gathered, mine, group=group)
        for i, (param, rank, rows, _) in enumerate(members):
            device = rows.device
            found[id(param)] = Spread(
                group,
                rank,
                [pieces[i][0].to(device) for pieces in gathered],
                [pieces[i][1].to(device) for pieces in gathered],
            )
    return found


def _shard_group(param: Tensor) -> tuple[dist.ProcessGroup | None, int]:
    """The process group over the mesh dims that shard ``param`` and this rank's place in it;
    (None, 0) if no dim does (a plain tensor, or only replicated dims)."""
    if not isinstance(param, DTensor):
        return None, 0
    mesh = param.device_mesh
    dims = [
        i
        for i, placement in enumerate(param.placements)
        if not isinstance(placement, Replicate) and mesh.size(i) > 1
    ]
    if not dims:
        return None, 0
    if len(dims) == 1:
        return mesh.get_group(dims[0]), mesh.get_local_rank(dims[0])
    if mesh.mesh_dim_names is None:
        raise ValueError(f"Muon needs named mesh dims to shard over {len(dims)} of them")
    names = tuple(mesh.mesh_dim_names[i] for i in dims)
    # NOTE: torch 2.13 has no public way to flatten mesh dims into one group (parallel/mesh.py
    # uses _flatten too); the same dims flatten to the same cached mesh on every call.
    flat = (mesh if len(dims) == mesh.ndim else mesh[names])._flatten()
    return flat.get_group(), flat.get_local_rank()


def _local_indices(param: Tensor, order: Tensor | None) -> tuple[Tensor, Tensor]:
    """Canonical rows and the columns of this rank's piece of ``param`` (of a 3-D stack's
    matrices one under the other: row ``e * rows + r`` is row r of matrix e).

    The piece of an index matrix placed like ``param`` (Replicate to its placements cuts
    locally, no communication) holds the indices.
    """
    rows, cols = matrix_shape(param)
    device = _local(param).device
    row_index = order.to(device) if order is not None else torch.arange(rows, device=device)
    col_index = torch.arange(cols, device=device)
    if not isinstance(param, DTensor):
        return row_index, col_index
    shape = param.shape

    def piece(index: Tensor) -> Tensor:
        mesh = param.device_mesh
        whole = DTensor.from_local(index.reshape(shape), mesh, [Replicate()] * mesh.ndim,
                                   run_check=False)  # fmt: skip
        return _rows(whole.redistribute(mesh, param.placements).to_local())

    local_rows = piece(row_index[:, None].expand(rows, cols))
    if local_rows.numel() == 0:  # an empty piece (uneven row shards): no columns to place
        return row_index[:0].clone(), col_index[:0].clone()
    local_cols = piece(col_index[None, :].expand(rows, cols))
    return local_rows[:, 0].clone(), local_cols[0].clone()


def _runs(spread: Spread, parts: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Runs of this rank's rows that fall in one logical matrix: (first, last + 1, its rows)."""
    rows = spread.rows[spread.rank].cpu()
    if len(rows) == 0:
        return []
    bounds = torch.tensor(list(itertools.accumulate(parts))[:-1], dtype=rows.dtype)
    part = torch.bucketize(rows, bounds, right=True)
    starts = [0, *(torch.nonzero(part[1:] != part[:-1]).flatten() + 1).tolist(), len(rows)]
    return [(lo, hi, parts[int(part[lo])]) for lo, hi in itertools.pairwise(starts)]


# ------------------------------------------------------------------------------- the exchange
def orthogonalize(matrices: Sequence[_Matrix], ns_steps: int = NS_STEPS) -> list[Tensor]:
    """This rank's piece of each matrix's orthogonalized update (bf16).

    A whole matrix is orthogonalized here; the sharded ones of one process group go round by
    round, matrix j of a round to group rank j.
    """
    out: list[Tensor | None] = [None] * len(matrices)
    shared: dict[dist.ProcessGroup, list[int]] = {}
    for i, matrix in enumerate(matrices):
        if matrix.spread.group is None:
            out[i] = _whole_update(matrix.local, matrix.parts, ns_steps, matrix.batched)
        else:
            shared.setdefault(matrix.spread.group, []).append(i)
    for members in shared.values():
        world = matrices[members[0]].spread.world
        for start in range(0, len(members), world):
            chunk = members[start : start + world]
            updates = _round([matrices[i] for i in chunk], ns_steps)
            for i, update in zip(chunk, updates, strict=True):
                out[i] = update
    return out


def _round(matrices: Sequence[_Matrix], ns_steps: int) -> list[Tensor]:
    """Matrix j goes to group rank j: gather its pieces there, orthogonalize, send them back."""
    first = matrices[0].spread
    group, world, rank = first.group, first.world, first.rank
    sizes = [m.spread.numel(rank) for m in matrices] + [0] * (world - len(matrices))
    send = torch.cat([m.local.bfloat16().reshape(-1) for m in matrices])
    owned = matrices[rank] if rank < len(matrices) else None
    mine = [owned.spread.numel(r) for r in range(world)] if owned is not None else [0] * world
    received = send.new_empty(sum(mine))
    dist.all_to_all_single(received, send, mine, sizes, group=group)
    back = send.new_empty(0)
    if owned is not None:
        whole = owned.spread.assemble(received.split(mine), matrix_shape(owned.param))
        update = _whole_update(whole, owned.parts, ns_steps, owned.batched)
        back = torch.cat([owned.spread.piece(update, r) for r in range(world)])
    result = send.new_empty(sum(sizes))
    dist.all_to_all_single(result, back, sizes, mine, group=group)
    chunks = result.split(sizes[: len(matrices)])
    return [c.view(m.local.shape) for c, m in zip(chunks, matrices, strict=True)]


def _whole_update(
    whole: Tensor, parts: tuple[int, ...], ns_steps: int, batched: bool = False
) -> Tensor:
    """Newton–Schulz on each logical matrix (row block) of ``whole``, stacked back; ``batched``
    (a stack of experts' matrices): blocks of one height go through one batched call."""
    if batched and len(set(parts)) == 1:
        stack = whole.view(len(parts), parts[0], whole.shape[-1])
        return newton_schulz(stack, ns_steps).reshape(whole.shape)
    return torch.cat([newton_schulz(block, ns_steps) for block in whole.split(list(parts))])
