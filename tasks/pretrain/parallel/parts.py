"""The trainer's parallel layout as one object: every step that differs by layout, in one place.

``Parallelism`` composes the per-dimension code (``pp.py``, ``tp.py``, ``cp.py``, ``ep.py``, FSDP2 in
``distributed.py``) for the operations the trainer and its components need, as torchtitan's
per-model ``parallelize`` functions do:

- :meth:`Parallelism.parallelize`: the meta-device model made this rank's part (PP stage, TP,
  EP, activation checkpointing, compile, FSDP2, in that order);
- :meth:`Parallelism.attach`: after the weights exist, the pipeline schedule's runner (PP);
- :meth:`Parallelism.local_batches`: this rank's part of the micro-batches (CP: T/cp tokens);
- :meth:`Parallelism.forward_backward`, :meth:`Parallelism.clip_grad_norm_`,
  :meth:`Parallelism.eval_sums`: the step and the held-out loss (PP: through the schedule);
- :meth:`Parallelism.full_state_dict`: the whole model on rank 0, for ``model.safetensors``;
- :meth:`Parallelism.dp_sum`, :meth:`Parallelism.set_loss_scale`,
  :meth:`Parallelism.copy_tp_rank0`: the token sums and two fault injections' hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from llmflow.model.loss import IGNORE_INDEX
from llmflow.tasks.pretrain.distributed import (
    Runtime,
    all_reduce_sum,
    apply_activation_checkpointing,
    shard_model,
)
from llmflow.tasks.pretrain.parallel import ep, pp, tp
from llmflow.tasks.pretrain.parallel.config import Layout
from llmflow.tasks.pretrain.parallel.cp import shard_batch

if TYPE_CHECKING:
    from llmflow.tasks.pretrain.config import TrainConfig
    from llmflow.tasks.pretrain.parallel.mesh import Mesh

LossFn = Callable[[nn.Module, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]
"""``model_loss`` with its z-loss weight bound: (model, batch) -> (loss, metrics)."""


class Parallelism:
    """One rank's parallel layout: how it builds, steps, evaluates and exports the model.

    Args:
        layout: the resolved degrees.
        mesh: the world mesh (None in one process).
        runtime: this process's device and ranks.
        cfg: the training config (activation checkpointing, compile, z-loss, seed).
        compute_dtype: float32 or bf16 (``TrainConfig.compute_dtype``).
    """

    def __init__(
        self,
        layout: Layout,
        mesh: Mesh | None,
        runtime: Runtime,
        cfg: TrainConfig,
        compute_dtype: torch.dtype,
    ) -> None:
        self.layout, self.mesh, self.runtime, self.cfg = layout, mesh, runtime, cfg
        self.compute_dtype = compute_dtype
        # FSDP2 averages gradients over the ranks it shards on (data and context parallel)
        self.fsdp_ranks = layout.dp * layout.cp if runtime.distributed else 1
        # NOTE: one process computes in bf16 under autocast; sharded, FSDP2 gathers bf16
        # parameters (shard_model), so no autocast is needed there.
        self.autocast = (
            torch.autocast(runtime.device.type, dtype=compute_dtype)
            if compute_dtype != torch.float32 and self.fsdp_ranks == 1
            else contextlib.nullcontext()
        )
        self.pipeline: pp.PipelineRunner | None = None  # PP: set by attach

    # ------------------------------------------------------------------------- the model
    def parallelize(self, model: nn.Module) -> nn.Module:
        """This rank's part of ``model`` (built on the meta device), in torchtitan's order:
        PP stage, TP, EP, activation checkpointing, compile (per block), FSDP2."""
        cfg, layout = self.cfg, self.layout
        if layout.pp > 1:  # PP: keep this rank's stage, full-model names (pp.py)
            model = pp.build_stage(model, self.mesh.rank("pp"), layout.pp, cfg.z_loss)
        if layout.tp > 1:
            tp.apply_tp(model, self.mesh["tp"])
        if layout.ep > 1:
            ep.apply_ep(model, self.mesh["ep"])
        apply_activation_checkpointing(
            model, cfg.activation_checkpointing, cfg.activation_checkpointing_every_k
        )
        if cfg.compile:  # per block, before sharding, as torchtitan does
            for block in model.layers:
                block.compile()
        if self.fsdp_ranks > 1:
            experts = self.mesh["dp_shard_mod_ep"] if layout.ep > 1 else None
            shard_model(model, self.runtime, self.compute_dtype, self.fsdp_mesh(), experts,
                        self.fsdp_ranks)  # fmt: skip
        return model

    def fsdp_mesh(self) -> DeviceMesh | None:
        """FSDP2's mesh: ``dp_shard_cp``, with ``dp_replicate`` outside it (HSDP); None for
        plain data parallelism (all ranks, as the trainer always sharded)."""
        if self.layout.is_plain:
            return None
        if self.layout.dp_replicate > 1:
            return self.mesh.world[("dp_replicate", "dp_shard_cp")]
        return self.mesh["dp_shard_cp"]

    def attach(self, model: nn.Module) -> None:
        """Under PP, the runner of this rank's stage (collective: every rank calls it)."""
        if self.layout.pp > 1:
            self.pipeline = pp.PipelineRunner.on_mesh(
                model, self.mesh, self.runtime.device, self.layout.pp_schedule
            )

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """The whole model's tensors in canonical row order on global rank 0, for the final
        ``model.safetensors`` (collective). Under PP each rank holds one stage on the device
        and rank 0 gathers them (pp.py); otherwise rank 0 receives them on the CPU."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=self.pipeline is None)
        full = tp.canonical_full(model, get_model_state_dict(model, options=options))
        if self.pipeline is not None:
            full = self.pipeline.gather_stages(full)
        return full

    # ------------------------------------------------------------------------- the data
    def local_batches(self, batches: list[dict]) -> list[dict]:
        """This rank's part of the micro-batches: under CP its T/cp tokens of every row."""
        if self.layout.cp > 1:
            return [shard_batch(b, self.mesh.group("cp")) for b in batches]
        return batches

    def dp_sum(self, value: Tensor) -> Tensor:
        """Sum over the data- and context-parallel ranks (in place; returns it): the TP/PP
        ranks of one of them hold the same tokens, counted once; CP ranks hold different ones."""
        if self.mesh is None or self.layout.is_plain:
            return all_reduce_sum(value, self.runtime)
        torch.distributed.all_reduce(value, group=self.mesh.group("dp_cp"))
        return value

    # ------------------------------------------------------------------------- the step
    def forward_backward(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        batches: list[dict],
        counts: list[int],
        num_valid: float,
    ) -> Tensor:
        """Accumulate the gradients of the global token-mean loss over this rank's
        ``batches`` (``counts``: their labelled tokens; ``num_valid``: the global number).

        Returns the float64 sum of ``mean_loss_i * count_i`` (on every PP stage).
        """
        if self.pipeline is not None:  # PP: the schedule runs all micro-batches (pp.py)
            with self.autocast:
                return self.pipeline.step(batches, self.fsdp_ranks / max(num_valid, 1))
        return self._forward_backward(model, loss_fn, batches, counts, num_valid)

    def _forward_backward(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        batches: list[dict],
        counts: list[int],
        num_valid: float,
    ) -> Tensor:
        device = self.runtime.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for batch, count in zip(batches, counts, strict=True):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with self.autocast:
                loss, _ = loss_fn(model, batch)
            # NOTE: FSDP averages gradients over the ranks it shards on; weighting by this
            # micro-batch's share of the global tokens times their number makes the result the
            # global token mean. Tensor-parallel ranks share one loss and split its gradients.
            (loss * (count * self.fsdp_ranks / max(num_valid, 1))).backward()
            loss_sum += loss.detach().double() * count
        return loss_sum

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        """Clip the (possibly sharded) gradients; return the global norm before clipping."""
        if self.pipeline is not None:  # PP: the norm over every stage's gradients (pp.py)
            return self.pipeline.clip_grad_norm_(max_norm)
        if self.layout.ep > 1:  # EP: the experts' DTensors live on another mesh (ep.py)
            return ep.clip_grad_norm_(model, max_norm)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def set_loss_scale(self, scale: float) -> None:
        """The loss's factor inside the pipeline schedule (PP; elsewhere the loss function
        itself is replaced)."""
        if self.pipeline is not None:
            self.pipeline.loss_scale = scale

    def copy_tp_rank0(self, model: nn.Module) -> int | None:
        """Give every TP rank tp rank 0's shards (tp.py); the number copied, None without TP."""
        if self.layout.tp > 1:
            return tp.copy_rank0_shards(model, self.mesh["tp"])
        return None

    # ------------------------------------------------------------------------- evaluation
    def eval_sums(self, model: nn.Module, loss_fn: LossFn, batches: list[dict]) -> Tensor:
        """(cross-entropy summed over tokens, tokens) of this rank's part of ``batches``."""
        if self.pipeline is None:
            return self._eval_sums(model, loss_fn, self.local_batches(batches))
        # PP: the schedule's forward over all batches (pp.py), the sum on every stage
        with self.autocast:
            total = self.pipeline.evaluate(batches)
        count = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
        return torch.stack([total.double(), total.new_tensor(float(count), dtype=torch.float64)])

    def _eval_sums(self, model: nn.Module, loss_fn: LossFn, batches: list[dict]) -> Tensor:
        device = self.runtime.device
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for batch in batches:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with self.autocast:
                _, metrics = loss_fn(model, batch)
            # NOTE: the cross-entropy alone (no z-loss), a mean over this rank's tokens
            count = (batch["labels"] != IGNORE_INDEX).sum()
            totals += torch.stack([metrics["ce"].double() * count, count.double()])
        return totals
