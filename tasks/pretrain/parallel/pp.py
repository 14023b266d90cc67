"""Pipeline parallelism: the transformer split into stages, run by torch's pipeline schedules.

Each pipeline rank builds the full model on the meta device and keeps only its stage's modules
(``build_stage``), as torchtitan's ``pipeline_llm`` does: parameter names (state-dict FQNs) are
the full model's (``layers.5.attn.q_proj.weight`` stays ``layers.5...``), so DCP checkpoints and
the HF export read the same names at any ``pp``. ``PipelineRunner`` runs a step's micro-batches
through ``torch.distributed.pipelining``'s ``ScheduleGPipe`` or ``Schedule1F1B``.

- The first stage holds the embedding, the last the final norm and the output projection, fused
  into the loss (``linear_cross_entropy``: no full logits). With tied embeddings the last stage
  holds its own copy of ``embed`` (same FQN) and ``sync_tied_gradients`` sums the two copies'
  gradients between the first and last stage, so both stay equal after every optimizer step.
- Document masking: every stage receives the micro-batch's ``position_ids`` (a keyword input the
  schedule splits like the tokens) and derives the document mask from them (a position that is
  not the previous one plus 1 starts a document: the same documents as the loader's
  ``cu_seqlens``, whose boundaries are the rows' and the documents' starts).
- The loss of micro-batch i is ``mean_loss_i * count_i * grad_scale``: with ``grad_scale =
  dp / num_valid`` the gradients summed over micro-batches (``scale_grads=False``) and averaged
  by FSDP over the ``dp`` ranks are those of the global token-mean loss, as in
  ``Parallelism.forward_backward`` (parts.py).

Bubble: ``(pp - 1) / n_microbatches`` of a step for both schedules. Activations in flight on the
first stage: all ``n_microbatches`` with GPipe, at most ``pp`` with 1F1B.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from llmflow.model.kernels import Documents
from llmflow.model.loss import IGNORE_INDEX, linear_cross_entropy
from llmflow.model.transformer import Transformer
from llmflow.tasks.framework.errors import ConfigError

if TYPE_CHECKING:
    from llmflow.tasks.pretrain.parallel.mesh import Mesh

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def split_layers(
    num_layers: int, num_stages: int, first_weight: float = 1.0, last_weight: float = 1.0
) -> list[range]:
    """The blocks of each stage, balancing the embedding and the output layer.

    The embedding counts as ``first_weight`` blocks on the first stage and the final norm plus
    output projection (and loss) as ``last_weight`` blocks on the last, as torchtitan's
    layer-equivalents do; stage k takes the blocks whose units fall in the k-th of ``num_stages``
    equal shares. E.g. 8 blocks at 2 stages: [0..3] and [4..7] (1 + 4 = 4 + 1); 6 at 4 stages:
    [0], [1, 2], [3, 4], [5].

    Raises:
        ConfigError: fewer blocks than stages (every stage needs at least one block).
    """
    if num_stages < 1 or num_layers < num_stages:
        raise ConfigError(
            f"pretrain.train.parallel.pp={num_stages} exceeds the model's num_layers={num_layers} "
            "(each pipeline stage needs at least one layer)"
        )
    share = (num_layers + first_weight + last_weight) / num_stages
    bounds = [0]
    for k in range(1, num_stages):
        cut = math.floor(k * share - first_weight + 0.5)
        lowest, highest = bounds[-1] + 1, num_layers - (num_stages - k)
        bounds.append(min(max(cut, lowest), highest))
    bounds.append(num_layers)
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


class StageLayers(nn.ModuleList):
    """A stage's blocks under their full-model indices (``layers.5`` stays ``layers.5``).

    Positional access (``layers[0]``, ``layers[0] = wrapped``) reaches the stage's first block,
    so activation checkpointing and compile, which replace blocks by position, keep the names.
    """

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def _key(self, idx: int) -> str:
        return list(self._modules)[idx]

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return [self._modules[k] for k in list(self._modules)[idx]]
        return self._modules[self._key(idx)]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        self.add_module(self._key(idx), module)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())


class TransformerStage(nn.Module):
    """One pipeline stage of a `Transformer`: its modules under the full model's names.

    The first stage maps token ids (B, T) to hidden states (B, T, C); a middle stage maps hidden
    states to hidden states; the last maps them to the loss of the micro-batch (its ``labels``;
    in eval mode its cross-entropy alone).
    Absent modules are None (no parameters, no state-dict entries).
    """

    def __init__(
        self,
        model: Transformer,
        layers: range,
        is_first: bool,
        is_last: bool,
        z_loss_weight: float = 0.0,
    ) -> None:
        super().__init__()
        self.cfg, self.is_first, self.is_last = model.cfg, is_first, is_last
        self.z_loss_weight = z_loss_weight
        tied = model.lm_head is None
        self.embed = model.embed if is_first or (is_last and tied) else None
        self.rope = model.rope
        self.layers = StageLayers({i: model.layers[i] for i in layers})
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None

    @property
    def tied(self) -> bool:
        return self.lm_head is None

    def init_weights(self, seed: int | None = None) -> None:
        """The full model's seeded init, restricted to this stage's modules (same values)."""
        Transformer.init_weights(self, seed)  # type: ignore[arg-type]

    def output_weight(self) -> Tensor:
        return Transformer.output_weight(self)  # type: ignore[arg-type]

    def forward(self, x: Tensor, position_ids: Tensor, labels: Tensor | None = None) -> Tensor:
        """Hidden states (B, T, C) of ``x`` (token ids on the first stage); on the last stage
        with ``labels``, the micro-batch's token-mean loss instead."""
        if self.is_first:
            x = self.embed(x)  # (B, T, C)
        # NOTE: under sequence parallelism a later stage's x holds T/tp tokens; attention
        # gathers the whole rows, whose length the positions give
        docs = Documents.of(x.shape[0], position_ids.shape[-1], position_ids)
        rope = self.rope(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, docs)
        if not self.is_last:
            return x
        x = self.norm(x)
        loss, metrics = linear_cross_entropy(x, self.output_weight(), labels, self.z_loss_weight)
        # NOTE: evaluation (``model.eval()``) reports the cross-entropy alone, as the Validator
        # does at every other layout; training backpropagates the z-loss too
        return loss if self.training else metrics["ce"]


def build_stage(
    model: Transformer,
    stage_index: int,
    num_stages: int,
    z_loss_weight: float = 0.0,
    first_weight: float = 1.0,
    last_weight: float = 1.0,
) -> TransformerStage:
    """Stage ``stage_index`` of ``model`` (built on the meta device; the rest is dropped)."""
    layers = split_layers(model.cfg.num_layers, num_stages, first_weight, last_weight)
    return TransformerStage(
        model,
        layers[stage_index],
        is_first=stage_index == 0,
        is_last=stage_index == num_stages - 1,
        z_loss_weight=z_loss_weight,
    )


def tied_group(pp_mesh_ranks: Tensor) -> dist.ProcessGroup | None:
    """The group of this rank and its peer holding the other copy of the tied embedding.

    Args:
        pp_mesh_ranks: the world mesh's ranks, pipeline dimension first (``mesh.world.mesh``);
            every rank must call this (``new_group`` is collective), in the same order.

    Returns:
        The (first stage, last stage) group this rank belongs to, or None on a middle stage.
    """
    columns = pp_mesh_ranks.reshape(pp_mesh_ranks.shape[0], -1).t()
    mine = None
    for column in columns.tolist():
        group = dist.new_group([column[0], column[-1]])
        if dist.get_rank() in (column[0], column[-1]):
            mine = group
    return mine


def sync_tied_gradients(stage: TransformerStage, group: dist.ProcessGroup | None) -> None:
    """Sum the tied embedding's gradient over its two copies (first and last stage)."""
    if not stage.tied or stage.embed is None or group is None:
        return
    grad = stage.embed.weight.grad
    if grad is None:
        grad = torch.zeros_like(stage.embed.weight)
        stage.embed.weight.grad = grad
    dist.all_reduce(_local(grad), op=dist.ReduceOp.SUM, group=group)


def clip_grad_norm_(stage: TransformerStage, max_norm: float, pp_group: dist.ProcessGroup) -> float:
    """Clip every stage's gradients by the global norm over all stages; return that norm.

    The last stage's copy of a tied embedding is left out of the norm (the first stage counts
    it once), but clipped with the rest.
    """
    params = [p for p in stage.parameters() if p.grad is not None]
    counted = [
        p
        for name, p in stage.named_parameters()
        if p.grad is not None
        and not (stage.tied and stage.is_last and not stage.is_first and name.startswith("embed."))
    ]
    grads = [p.grad for p in counted]
    device = next(stage.parameters()).device
    norm = (
        torch.nn.utils.get_total_norm(grads, foreach=True)
        if grads
        else torch.zeros((), device=device)
    )
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    square = norm.double().square().reshape(1)
    dist.all_reduce(square, op=dist.ReduceOp.SUM, group=pp_group)
    total = square.sqrt().to(norm.dtype).squeeze(0)  # the gradients' dtype, as torch's clip
    if max_norm != float("inf"):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return float(total)


class PipelineRunner:
    """Runs a step's micro-batches through one pipeline schedule on this rank's stage.

    A torch ``PipelineStage`` and schedule are made per micro-batch shape and count (batch-size
    warmup changes the shape; validation runs forward only) and kept for reuse.
    """

    def __init__(
        self,
        stage: TransformerStage,
        stage_index: int,
        num_stages: int,
        group: dist.ProcessGroup,
        device: torch.device,
        schedule: str = "1f1b",
        tied: dist.ProcessGroup | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ConfigError(
                f"pretrain.train.parallel.pp_schedule={schedule!r}: one of {sorted(SCHEDULES)}"
            )
        self.stage, self.stage_index, self.num_stages = stage, stage_index, num_stages
        self.group, self.device, self.schedule_name, self.tied = group, device, schedule, tied
        self._built: dict[tuple[Any, ...], Any] = {}
        self._grad_scale = 1.0
        self._loss_sums: list[Tensor] = []
        self.loss_scale = 1.0  # the loss's factor (fault injection's loss spike; faults.py)

    @classmethod
    def on_mesh(
        cls, stage: TransformerStage, mesh: Mesh, device: torch.device, schedule: str
    ) -> PipelineRunner:
        """The runner of this rank's stage on the trainer's mesh (collective: every rank calls
        it, as it makes the tied-embedding groups)."""
        tied = tied_group(mesh.world.mesh) if stage.cfg.tie_embeddings else None
        pp = mesh.layout.pp
        return cls(stage, mesh.rank("pp"), pp, mesh.group("pp"), device, schedule, tied)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global norm over all stages; return it (see `clip_grad_norm_`)."""
        return clip_grad_norm_(self.stage, max_norm, self.group)

    def gather_stages(self, full: dict[str, Tensor]) -> dict[str, Tensor]:
        """Every stage's full state dict (``full``, on each rank) merged on global rank 0, for
        the final ``model.safetensors``; ``{}`` on other ranks (collective over the pipeline
        group). A tied embedding comes from the first stage."""
        state = {name: value.detach().cpu() for name, value in full.items()}
        received: list[Any] | None = [None] * self.num_stages if self.stage_index == 0 else None
        dist.gather_object(state, received, group=self.group, group_dst=0)
        if dist.get_rank() != 0:
            return {}
        merged: dict[str, Tensor] = {}
        for part in received or []:
            for name, value in part.items():
                merged.setdefault(name, value)
        return merged

    def _schedule(self, key: tuple[Any, ...], num_microbatches: int) -> Any:
        """The schedule for one (micro-batch shape, count, training or not)."""
        if key not in self._built:
            stage = PipelineStage(
                self.stage, self.stage_index, self.num_stages, self.device, group=self.group
            )
            # NOTE: forward only, every schedule is GPipe's order (1F1B needs >= pp batches)
            schedule = SCHEDULES[self.schedule_name] if key[-1] else ScheduleGPipe
            self._built[key] = schedule(
                stage, num_microbatches, loss_fn=self._loss, scale_grads=False
            )
        return self._built[key]

    def _loss(self, loss: Tensor, labels: Tensor) -> Tensor:
        count = (labels != IGNORE_INDEX).sum()
        if self.loss_scale != 1.0:
            loss = loss * self.loss_scale
        if not loss.is_meta:  # NOTE: torch's shape inference calls the loss on meta tensors
            self._loss_sums.append(loss.detach().double() * count)
        return loss * (count * self._grad_scale)

    def step(self, batches: list[dict[str, Tensor]], grad_scale: float) -> Tensor:
        """Forward and backward over ``batches`` (every rank of the pipeline passes the same).

        Args:
            batches: the step's micro-batches (``input_ids``, ``position_ids``, ``labels``), one
                schedule micro-batch each, all of one shape.
            grad_scale: the factor of ``mean_loss_i * count_i`` backpropagated: ``dp /
                num_valid`` for the global token mean under FSDP's average over ``dp``.

        Returns:
            The float64 sum of ``mean_loss_i * count_i`` over the micro-batches, on every stage
            (summed over the pipeline group from the last stage).
        """
        total = self._run(batches, grad_scale, train=True)
        sync_tied_gradients(self.stage, self.tied)
        return total

    def evaluate(self, batches: list[dict[str, Tensor]]) -> Tensor:
        """The forward pass only (the schedule's ``eval``): the float64 sum of ``mean_loss_i *
        count_i`` over ``batches``, on every stage."""
        return self._run(batches, 1.0, train=False)

    def _run(self, batches: list[dict[str, Tensor]], grad_scale: float, train: bool) -> Tensor:
        ids = torch.cat([b["input_ids"] for b in batches]).to(self.device)
        positions = torch.cat([b["position_ids"] for b in batches]).to(self.device)
        labels = torch.cat([b["labels"] for b in batches]).to(self.device)
        key = (tuple(batches[0]["input_ids"].shape), len(batches), train)
        schedule = self._schedule(key, len(batches))
        self._grad_scale, self._loss_sums = grad_scale, []
        kwargs: dict[str, Tensor] = {"position_ids": positions}
        if self.stage.is_last:
            kwargs["labels"] = labels
        args = (ids,) if self.stage.is_first else ()
        target = labels if self.stage.is_last else None
        if train:
            schedule.step(*args, target=target, return_outputs=False, **kwargs)
        else:
            # NOTE: eval() passes its keywords on to step(): no merge of the scalar losses
            schedule.eval(*args, target=target, return_outputs=False, **kwargs)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for value in self._loss_sums[-len(batches) :]:
            total += value
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# --- the planner's terms for PP (`memory_model.memory`, `layout_planner`) --------------------


def stage_blocks(num_layers: int, pp: int) -> int:
    """Blocks of the fullest stage."""
    return math.ceil(num_layers / pp)


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """The pipeline bubble of GPipe and 1F1B, (p - 1) / m of the ideal step time."""
    return (pp - 1) / micro_batches


def stage_activations_bytes(
    blocks: float,
    embedding: float,
    loss_gradient: float,
    loss: float,
    once: float,
    *,
    num_layers: int,
    pp: int,
    micro_batches: int,
    schedule: str,
) -> float:
    """The fuller end stage's activations at the loss's forward pass, from one micro-batch's
    figures for the whole model: ``blocks`` (every block's), ``embedding`` (its output),
    ``loss_gradient`` (the hidden-state gradient the fused loss makes), ``loss`` (its buffers)
    and ``once`` (held once for all layers). The first stage holds its blocks' share and the
    embedding output of the micro-batches in flight (1F1B: min(pp, m); GPipe: all m); the last
    its share of one micro-batch (GPipe: all) with the loss."""
    stage = blocks * stage_blocks(num_layers, pp) / num_layers
    in_flight = micro_batches if schedule == "gpipe" else min(pp, micro_batches)
    first = in_flight * (stage + embedding) + once
    last_in_flight = micro_batches if schedule == "gpipe" else 1
    last = last_in_flight * (stage + loss_gradient) + loss
    return max(first, last)


def final_save_bytes(cfg, pp: int) -> float:
    """What the final save gathers on the GPU under PP: this stage's full state (every
    parameter whole, float32) on every rank (``get_model_state_dict(cpu_offload=False)``; each
    pipeline group sends it to its first rank). The optimizer's state is never gathered, and
    under TP each rank writes its own runs of canonical rows (``tp.CanonicalRows``): nothing."""
    if pp == 1:
        return 0.0
    c = cfg.hidden_size
    per_block = (cfg.num_parameters(non_embedding=True) - c) / cfg.num_layers
    return (stage_blocks(cfg.num_layers, pp) * per_block + cfg.vocab_size * c + c) * 4


def traffic_bytes(residual: float, *, tp: int, pp: int, micro_batches: int) -> float:
    """Bytes one GPU sends per step for PP: each micro-batch's activations forward and their
    gradients backward across a stage boundary (``residual`` = b·(s/cp)·h bytes, /tp)."""
    return 2 * micro_batches * residual / tp if pp > 1 else 0.0
