"""Tensor parallelism with sequence parallelism (Megatron-LM SP, arXiv 2205.05198) on DTensor.

The plan is torchtitan's Llama plan (``torchtitan/models/llama3/infra/parallelize.py``) on our
module names:

- ``embed``: rowwise (vocabulary rows split), the output reduce-scattered along the sequence;
- ``attn_norm``, ``mlp_norm``, ``norm``: ``SequenceParallel`` (each rank normalises its tokens);
- ``attn.qkv_proj``, ``mlp.gate_up_proj``: colwise (output features split), on the whole
  sequence all-gathered before them; ``attn.o_proj``, ``mlp.down_proj``: rowwise, their partial
  sums reduce-scattered back along the sequence;
- the output projection (``lm_head``, or the tied ``embed``): vocabulary rows split; the loss is
  vocabulary-parallel (``model/loss.py``), so no rank ever holds the full logits.

Between blocks each rank holds ``T / tp`` tokens of the residual stream; attention and the MLP
see all ``T`` tokens and ``1 / tp`` of the heads and of the intermediate features.

NOTE: the fused ``qkv_proj`` stores its rows as [q heads; k heads; v heads] and ``gate_up_proj``
as [gate; up]: a plain split of the rows would give rank 0 all of q. Their DTensors therefore
hold the rows in a tensor-parallel order (``row_order``: rank 0's q, k, v heads, then rank 1's,
...), so each rank's contiguous shard is its own heads of q, k and v (its own half of gate and
up). The seeded init draws each row from its canonical position (``init_normal_(rows=...)``),
and checkpoints and ``final/`` hold the canonical order (:func:`to_canonical`,
:func:`from_canonical`): a checkpoint moves between layouts and exports the same.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from llmflow.model.transformer import _canonical

ROW_ORDER = "row_order"
"""Attribute of a colwise ``nn.Linear`` whose weight rows are held in tensor-parallel order."""


def row_order(part_rows: list[int], tp: int) -> Tensor:
    """Canonical row of each row of a fused weight in tensor-parallel order.

    The weight stacks parts (q, k, v or gate, up) of ``part_rows`` rows each; in the returned
    order rank r's contiguous block is [part 0's r-th slice; part 1's r-th slice; ...].
    """
    order, starts = [], [sum(part_rows[:i]) for i in range(len(part_rows))]
    for rank in range(tp):
        for start, rows in zip(starts, part_rows, strict=True):
            size = rows // tp
            order.append(torch.arange(start + rank * size, start + (rank + 1) * size))
    return torch.cat(order)


def apply_tp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Parallelise a ``Transformer`` (on any device, meta included) over the 1-D ``mesh``."""
    tp = mesh.size()
    cfg = model.cfg  # the layout was checked before (support.check_layout)
    parallelize_module(
        model,
        mesh,
        {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
        },
    )
    if model.lm_head is not None:  # its forward never runs: the loss takes its weight
        parallelize_module(model.lm_head, mesh, ColwiseParallel())
    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        head_rows = [cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads]
        setattr(attn.qkv_proj, ROW_ORDER, row_order([h * cfg.head_dim for h in head_rows], tp))
        setattr(mlp.gate_up_proj, ROW_ORDER, row_order([cfg.intermediate_size] * 2, tp))
        parallelize_module(
            block,
            mesh,
            {
                "attn_norm": SequenceParallel(),
                "attn.qkv_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "mlp_norm": SequenceParallel(),
                "mlp.gate_up_proj": ColwiseParallel(),  # MLP.forward takes its local rows
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
        attn.register_forward_pre_hook(_replicated_input(mesh, local=False))
        mlp.register_forward_pre_hook(_replicated_input(mesh, local=True))
        attn.num_heads, attn.num_kv_heads = cfg.num_heads // tp, cfg.num_kv_heads // tp
    return model


def _replicated_input(mesh: DeviceMesh, local: bool):
    """A pre-hook: the module's first input all-gathered along the sequence (dim 1).

    ``local``: handed on as a plain tensor whose gradient is a partial sum (each rank's heads or
    features contribute theirs), reduce-scattered back along the sequence in the backward pass.
    """

    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        x = x.redistribute(placements=[Replicate()])
        if local:
            x = x.to_local(grad_placements=[Partial()])
        return (x, *args[1:])

    return hook


# ------------------------------------------------------------------------- canonical row order
def permuted(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(state-dict name, row order) of each parameter held in tensor-parallel row order."""
    for name, module in model.named_modules():
        order = getattr(module, ROW_ORDER, None)
        if order is None:
            continue
        prefix = _canonical(name)
        yield f"{prefix}.weight", order
        if getattr(module, "bias", None) is not None:
            yield f"{prefix}.bias", order


def to_canonical(tensor: Tensor, order: Tensor) -> Tensor:
    """A tensor-parallel-ordered DTensor (or full tensor) as one in canonical row order, whole
    on every rank (a collective for a DTensor)."""
    if not isinstance(tensor, DTensor):
        return _reorder(tensor, order)
    full = _reorder(tensor.full_tensor(), order)
    return DTensor.from_local(full, tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)


def from_canonical(target: Tensor, canonical: Tensor, order: Tensor) -> None:
    """Copy a canonical-order tensor (DTensor or full) into a tensor-parallel-ordered one."""
    full = canonical.full_tensor() if isinstance(canonical, DTensor) else canonical
    full = full[order.to(full.device)]
    if isinstance(target, DTensor):
        mesh = target.device_mesh
        whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
        target.to_local().copy_(whole.redistribute(mesh, target.placements).to_local())
    else:
        target.copy_(full)


def _reorder(full: Tensor, order: Tensor) -> Tensor:
    """Rows back from tensor-parallel order to canonical order."""
    out = torch.empty_like(full)
    out[order.to(full.device)] = full
    return out


class CanonicalRows:
    """This rank's rows of a tensor-parallel-ordered tensor, placed at their canonical rows.

    The rank's local shard holds rows ``[start, start + n)`` of the tensor in tensor-parallel
    order; in canonical order they are a few runs of consecutive rows (its q, k and v heads; its
    gate and up features). DCP writes each run as one chunk of the canonical tensor and reads
    overlapping chunks straight into the run's rows: no rank ever gathers or copies the tensor
    (see :class:`CanonicalSavePlanner`, :class:`CanonicalLoadPlanner`). On disk it is the same
    canonical tensor whatever the layout, so any layout reads it back.

    NOTE: the runs are views of the live tensor; an asynchronous save's stager deep-copies this
    object like any other, which copies ``local`` to host memory.
    """

    def __init__(self, tensor: Tensor, order: Tensor) -> None:
        self.global_size = tensor.shape
        if isinstance(tensor, DTensor):
            sizes, offsets = compute_local_shape_and_global_offset(
                tensor.shape, tensor.device_mesh, tensor.placements
            )
            local = tensor.to_local()
        else:
            sizes, offsets, local = tuple(tensor.shape), (0,) * tensor.ndim, tensor
        if tuple(local.shape) != tuple(sizes):
            raise ValueError(f"local shard {tuple(local.shape)} is not the expected {sizes}")
        self.local = local.detach()
        self.inner_offsets = tuple(offsets[1:])  # NOTE: rows are the only dimension reordered
        # (canonical first row, local first row, rows) of each run of consecutive rows
        canonical = order[offsets[0] : offsets[0] + sizes[0]].tolist()
        self.runs: list[tuple[int, int, int]] = []
        for row, target in enumerate(canonical):
            last = self.runs[-1] if self.runs else None
            if last is not None and target == last[0] + last[2]:
                self.runs[-1] = (last[0], last[1], last[2] + 1)
            else:
                self.runs.append((target, row, 1))

    def size(self) -> torch.Size:
        """The whole tensor's shape (DCP checks it against the checkpoint's on load)."""
        return torch.Size(self.global_size)

    def _chunk(self, run: tuple[int, int, int]) -> ChunkStorageMetadata:
        offsets = torch.Size((run[0], *self.inner_offsets))
        sizes = torch.Size((run[2], *self.local.shape[1:]))
        return ChunkStorageMetadata(offsets=offsets, sizes=sizes)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk(run) for run in self.runs]

    def __create_write_items__(self, fqn: str, _: object) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.size()),
            )
            for chunk in self.__create_chunk_list__()
        ]

    def rows(self, index: MetadataIndex) -> Tensor:
        """The local rows (a view) of the chunk at ``index.offset``."""
        for run in self.runs:
            if run[0] == index.offset[0]:
                return self.local[run[1] : run[1] + run[2]]
        raise ValueError(f"{index.fqn}: no rows at canonical offset {tuple(index.offset)}")


class CanonicalSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, also writing :class:`CanonicalRows` entries."""

    def lookup_object(self, index: MetadataIndex) -> object:
        found = self.state_dict.get(index.fqn)
        if isinstance(found, CanonicalRows):
            return found.rows(index)
        return super().lookup_object(index)


class CanonicalLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, also reading into :class:`CanonicalRows` entries."""

    def set_up_planner(self, state_dict: dict, metadata=None, is_coordinator: bool = False) -> None:
        # NOTE: DCP's set-up (``_init_state_dict``) replaces values of types it does not know by
        # None, in place: hide the entries from it, then put them back in both dicts.
        hidden = _take_rows(state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for path, rows in hidden:
            parent = state_dict
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = rows
            self.state_dict[".".join(path)] = rows

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        found = self.state_dict.get(index.fqn)
        if isinstance(found, CanonicalRows):
            return found.rows(index)
        return super().lookup_tensor(index)


def _take_rows(state: dict, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    """The :class:`CanonicalRows` entries of nested dicts with their key paths; each replaced
    by None in place."""
    found = []
    for key, value in state.items():
        if isinstance(value, CanonicalRows):
            found.append(((*path, key), value))
            state[key] = None
        elif isinstance(value, dict):
            found += _take_rows(value, (*path, key))
    return found


def _optim_keys(optim_sd: dict, name: str, shape: torch.Size) -> list[str]:
    """The keys of parameter ``name``'s per-row optimizer state (moments shaped like it) in a
    flattened optimizer state dict (``state.<name>.<key>``)."""
    prefix = f"state.{name}."
    return [
        key
        for key, value in optim_sd.items()
        if key.startswith(prefix)
        and "." not in key[len(prefix) :]
        and isinstance(value, Tensor)
        and value.shape == shape
    ]


def canonical_state(
    model: nn.Module, model_sd: dict[str, Tensor], optim_sd: dict | None = None
) -> tuple[dict[str, Tensor], dict | None, dict[str, Tensor]]:
    """``get_state_dict``'s dicts (the optimizer's flattened: ``flatten_optimizer_state_dict``)
    with each permuted parameter and its optimizer moments as :class:`CanonicalRows`: written
    and read in canonical row order by :class:`CanonicalSavePlanner` /
    :class:`CanonicalLoadPlanner`. Also the tensors they stand for (``model/<name>``,
    ``optim/<key>``), which :func:`restore_order` puts back after a load.

    Nothing is gathered or copied: each entry views this rank's own rows, so the peak memory of
    a checkpoint is that of its state (an async save's host copy included), never a whole
    tensor. New dicts: the optimizer keeps stepping its own.
    """
    if optim_sd is not None and isinstance(optim_sd.get("state"), dict):
        raise ValueError("canonical_state takes a flattened optimizer state dict")
    model_sd = dict(model_sd)
    optim_sd = dict(optim_sd) if optim_sd is not None else None
    replaced: dict[str, Tensor] = {}
    with torch.no_grad():
        for name, order in permuted(model):
            if name not in model_sd:
                continue
            tensor = model_sd[name]
            replaced[f"model/{name}"] = tensor
            model_sd[name] = CanonicalRows(tensor, order)
            for key in _optim_keys(optim_sd or {}, name, tensor.shape):
                replaced[f"optim/{key}"] = optim_sd[key]
                optim_sd[key] = CanonicalRows(optim_sd[key], order)
    return model_sd, optim_sd, replaced


def restore_order(
    model: nn.Module,
    model_sd: dict[str, Tensor],
    optim_sd: dict | None,
    replaced: dict[str, Tensor],
) -> None:
    """After a load into :func:`canonical_state`'s dicts (which read straight into the tensors'
    own rows): put the tensors back in place of their :class:`CanonicalRows` (in place)."""
    for where, tensor in replaced.items():
        part, key = where.split("/", 1)
        target = model_sd if part == "model" else optim_sd
        if target is not None and isinstance(target.get(key), CanonicalRows):
            target[key] = tensor


def canonical_full(model: nn.Module, full: dict[str, Tensor]) -> dict[str, Tensor]:
    """A full (gathered) model state dict in canonical row order (in place; returned)."""
    for name, order in permuted(model):
        if name in full:
            full[name] = _reorder(full[name], order)
    return full


def copy_rank0_shards(model: nn.Module, mesh: DeviceMesh) -> int:
    """Overwrite each tensor-parallel shard with tp rank 0's (what ranks seeded alike draw);
    return the number of parameters copied (collective over the 1-D ``mesh``)."""
    copied = 0
    with torch.no_grad():
        for param in model.parameters():
            if not isinstance(param, DTensor) or param.device_mesh.mesh_dim_names is None:
                continue
            names = param.device_mesh.mesh_dim_names
            if "tp" not in names or not isinstance(param.placements[names.index("tp")], Shard):
                continue
            torch.distributed.broadcast(param.to_local(), group=mesh.get_group(), group_src=0)
            copied += 1
    return copied


# --- the planner's terms for TP (`memory_model.memory`, `layout_planner.communication`) ------

EMBEDDING_BACKWARD_BUFFERS = {"cuda": 2, "cpu": 4}
"""(V/tp, C) buffers the tied embedding's backward adds under TP, beside its gradient."""


def embedding_backward_bytes(cfg, tp: int, grad_bytes: int, device: str) -> float:
    """What the tied embedding's backward pass adds under tensor parallelism.

    In one process the fused loss and the embedding share one float32 gradient buffer
    (``model/loss.py`` `TiedGradient`); under TP (a DTensor weight) they do not: the embedding's
    dense (V/tp, C) gradient and its sum with the loss's are made beside the loss's gradient.
    On CPU the dense backward makes two more (measured: 4 buffers at the embedding's backward,
    tests/tasks/pretrain/test_planner_parallel_memory.py).
    """
    if tp == 1 or not cfg.tie_embeddings:
        return 0.0
    buffers = EMBEDDING_BACKWARD_BUFFERS.get(device, EMBEDDING_BACKWARD_BUFFERS["cuda"])
    return buffers * cfg.vocab_size / tp * cfg.hidden_size * grad_bytes


def traffic_bytes(
    residual: float, *, tp: int, blocks: int, micro_batches: int, recomputed: float
) -> float:
    """Bytes one GPU sends per step for TP + SP: 4 all-gathers/reduce-scatters of the residual
    stream (``residual`` = b·(s/cp)·h bytes) per block forward, 4 backward, and the forward's
    again for the ``recomputed`` share of blocks; a ring moves (tp-1)/tp of each."""
    return (8 + 4 * recomputed) * residual * (tp - 1) / tp * blocks * micro_batches
