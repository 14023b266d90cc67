"""Process group, device, FSDP2 sharding and seeding for the trainer."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from llmflow.tasks.framework.errors import ConfigError


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: rank, world size, device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_world_size() -> int:
    """The world size the launcher set (``WORLD_SIZE``), known before joining any group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup_runtime() -> Runtime:
    """Join the process group started by torchrun / accelerate launch (env://), if any."""
    world_size = launched_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if world_size > 1 else 0
    return Runtime(rank, world_size, local_rank, device)


def teardown_runtime() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard_model(
    model: nn.Module,
    runtime: Runtime,
    compute_dtype: torch.dtype = torch.float32,
    mesh: DeviceMesh | None = None,
    expert_mesh: DeviceMesh | None = None,
    expert_divide_factor: float | None = None,
) -> nn.Module:
    """Apply FSDP2 per transformer block and at the root, as torchtitan does.

    With a bf16 ``compute_dtype``: float32 sharded parameters (the master weights the optimizer
    steps), gathered in bf16 for the forward and backward, gradients reduced in float32. On a
    CPU over gloo too, so CI runs the path GPU users run.

    Args:
        mesh: the data-parallel mesh to shard over (``dp_shard_cp``, or 2-D
            ``(dp_replicate, dp_shard_cp)`` for HSDP), after tensor parallelism; by default all
            ranks (plain FSDP2).
        expert_mesh: under expert parallelism, the experts' own FSDP2 mesh
            (``dp_shard_mod_ep``; parallel/ep.py), their gradients divided by
            ``expert_divide_factor``.
    """
    if mesh is None:
        mesh = init_device_mesh(runtime.device.type, (runtime.world_size,))
    if compute_dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    for block in model.layers:
        if expert_mesh is not None:
            from llmflow.tasks.pretrain.parallel.ep import shard_experts

            shard_experts(block, expert_mesh, policy, expert_divide_factor or mesh.size())
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def materialize_sharded(model: nn.Module, runtime: Runtime, seed: int) -> nn.Module:
    """Allocate a meta-device model's shards on the real device and initialize them.

    `model` was built under ``torch.device("meta")`` and sharded (`shard_model`); no rank ever
    holds the full weights. The seeded init draws each shard's rows of the same full tensors a
    one-process ``init_weights(seed)`` draws, so the weights are identical.
    """
    model.to_empty(device=runtime.device)
    model.init_weights(seed=seed)
    return model


def apply_activation_checkpointing(model: nn.Module, mode: str, every_k: int = 1) -> nn.Module:
    """Recompute blocks in the backward pass: every block (``full``) or every k-th (``selective``).

    Each chosen block of ``model.layers`` is wrapped in place with torch's `checkpoint_wrapper`
    (non-reentrant), before compile and FSDP2, as torchtitan does. The wrapper strips its prefix
    from state dicts, so checkpoints and exports keep their names.

    Raises:
        ConfigError: the model has no ``layers`` ModuleList of blocks to wrap.
    """
    if mode == "none":
        return model
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ConfigError(
            f"activation_checkpointing={mode!r} needs a model with a non-empty `layers` "
            f"ModuleList of blocks; {type(model).__name__} has none"
        )
    every = 1 if mode == "full" else every_k
    for index, block in enumerate(layers):
        if (index + 1) % every == 0:
            layers[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model


def sharding_report(model: nn.Module) -> dict[str, int]:
    """Count parameters that are DTensors sharded on dim 0, and local vs global elements."""
    sharded = local = total = 0
    for param in model.parameters():
        total += param.numel()
        if isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements):
            sharded += 1
            local += param.to_local().numel()
        else:
            local += param.numel()
    num_params = sum(1 for _ in model.parameters())
    return {
        "num_params": num_params,
        "num_sharded": sharded,
        "local_numel": local,
        "global_numel": total,
    }


def all_reduce_sum(value: torch.Tensor, runtime: Runtime) -> torch.Tensor:
    """Sum a tensor over ranks (in place; returns it)."""
    if runtime.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def param_checksum(model: nn.Module) -> float:
    """A float64 fingerprint of all parameters, summed over shards: the same on every rank."""
    with torch.no_grad():
        total = sum((_local(p).double() * (i + 1)).sum() for i, p in enumerate(model.parameters()))
        total = torch.as_tensor(total, dtype=torch.float64)
        if any(isinstance(p, DTensor) for p in model.parameters()):
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return float(total)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param
