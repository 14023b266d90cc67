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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from llmflow.model.config import ModelConfig
from llmflow.model.transformer import _canonical
from llmflow.tasks.framework.errors import ConfigError

ROW_ORDER = "row_order"
"""Attribute of a colwise ``nn.Linear`` whose weight rows are held in tensor-parallel order."""


def check_model(cfg: ModelConfig, tp: int, optimizer: str = "adamw", compile: bool = False) -> None:
    """Refuse what this plan cannot split evenly or does not support, naming the field (before
    any compute)."""
    field = "pretrain.train.parallel.tp"
    if compile:
        # NOTE: torch 2.13, blocks compiled after this plan: the backward of the sequence
        # all-gather receives a plain tensor ('Tensor' object has no attribute '_local_tensor').
        raise ConfigError(f"{field}={tp}: compile=true does not work with it yet")
    if optimizer == "muon":
        # NOTE: Muon orthogonalizes q, k, v (gate, up) as separate row blocks of row-sharded
        # matrices; tensor parallelism shards columns and holds fused rows in another order.
        raise ConfigError(f"{field}={tp}: optimizer.name='muon' does not support it yet")
    for name, size in (
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ):
        if size % tp:
            raise ConfigError(f"{field}={tp} does not divide the model's {name}={size}")
    if cfg.qk_norm:
        # NOTE: q_norm/k_norm act on this rank's heads only: their gradients would need a sum
        # over the TP group that no DTensor placement gives here.
        raise ConfigError(f"{field}={tp}: tensor parallelism does not support model.qk_norm yet")


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
    cfg = model.cfg
    check_model(cfg, tp)
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
    """A tensor-parallel-ordered DTensor (or full tensor) as one in canonical row order.

    NOTE: the whole tensor is gathered on every rank (one parameter at a time, at save time);
    the result is replicated over the same mesh, which DCP writes once.
    """
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


def canonical_state(
    model: nn.Module, model_sd: dict[str, Tensor], optim_sd: dict | None = None
) -> tuple[dict[str, Tensor], dict | None, dict[str, Tensor]]:
    """``get_state_dict``'s dicts with the permuted parameters (and their optimizer state) in
    canonical row order; also the tensor-parallel-ordered tensors they replaced (by name,
    ``optim/`` prefixed for optimizer state) for :func:`restore_order`.

    NOTE: new dicts: the optimizer state dict shares its per-parameter dicts with the optimizer,
    which must keep stepping its own tensors.
    """
    model_sd = dict(model_sd)
    if optim_sd is not None:
        optim_sd = {**optim_sd, "state": dict(optim_sd.get("state", {}))}
    replaced = {}
    for name, order in permuted(model):
        if name not in model_sd:
            continue
        shape = model_sd[name].shape
        replaced[name] = model_sd[name]
        model_sd[name] = to_canonical(model_sd[name], order)
        if optim_sd is None or name not in optim_sd["state"]:
            continue
        state = optim_sd["state"][name] = dict(optim_sd["state"][name])
        for key, value in state.items():
            if isinstance(value, Tensor) and value.shape == shape:
                replaced[f"optim/{name}/{key}"] = value
                state[key] = to_canonical(value, order)
    return model_sd, optim_sd, replaced


def restore_order(
    model: nn.Module,
    model_sd: dict[str, Tensor],
    optim_sd: dict | None,
    replaced: dict[str, Tensor],
) -> None:
    """After loading into :func:`canonical_state`'s dicts: copy the canonical tensors into the
    tensor-parallel-ordered ones they replaced and put those back in their place (in place)."""
    for name, order in permuted(model):
        if name not in replaced:
            continue
        from_canonical(replaced[name], model_sd[name], order)
        model_sd[name] = replaced[name]
        state = (optim_sd or {}).get("state", {}).get(name, {})
        for key in list(state):
            target = replaced.get(f"optim/{name}/{key}")
            if target is not None:
                from_canonical(target, state[key], order)
                state[key] = target


def canonical_full(model: nn.Module, full: dict[str, Tensor]) -> dict[str, Tensor]:
    """A full (gathered) model state dict in canonical row order (in place; returned)."""
    for name, order in permuted(model):
        if name in full:
            full[name] = _reorder(full[name], order)
    return full
