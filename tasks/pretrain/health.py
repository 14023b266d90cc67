"""Health metrics the trainer already has the numbers for: where a step's time goes, and how each
layer's gradients and weights move.

- :class:`StepClock`: seconds spent waiting for data, in forward+backward, in the optimizer (clip
  and step), blocked by checkpointing and in validation, summed between two metric rows. Only
  ``time.perf_counter`` around calls the trainer makes anyway: no device synchronisation is
  added. NOTE: on CUDA the split is only as exact as the existing sync points make it: the loss's
  ``.item()`` ends forward+backward and the clip's ``float(norm)`` ends the clip, so their times
  are real; the optimizer's kernels are queued asynchronously and part of their time shows up
  in the next step's forward+backward.
- :class:`LayerStats`: per-layer gradient norms and update-to-weight ratios (``embed``,
  ``layers.i``, ``lm_head`` with the final norm), exact under FSDP2, TP and PP: each rank sums the
  squares of its local shards (a replicated copy counted once), one all-reduce over the world
  adds them up, so every rank (rank 0 included) gets every stage's layers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

if TYPE_CHECKING:
    from llmflow.tasks.pretrain.train import Trainer

WEIGHT_JUMP = 1.5  # a layer's weight norm moved by more than this factor: not the optimizer
PARTS = ("data", "compute", "optimizer", "checkpoint", "validation")
# NOTE: wrappers (torch.compile, activation checkpointing, FSDP1) add these to parameter names
WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


class StepClock:
    """Seconds per part of the step since the last metric row, and the batch being waited for."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.waiting_since: float | None = None  # perf_counter when the current data wait began

    @contextmanager
    def timing(self, part: str) -> Iterator[None]:
        """Add the time the block takes to ``part``."""
        started = time.perf_counter()
        if part == "data":
            self.waiting_since = started
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - started
            if part == "data":
                self.waiting_since = None

    def take(self) -> dict[str, float]:
        """The sums since the last call, as metric-row fields (``time_data_s``, ...); reset."""
        row = {f"time_{part}_s": value for part, value in self.seconds.items()}
        self.seconds = dict.fromkeys(PARTS, 0.0)
        return row


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: ``embed``, ``layers.i`` or ``lm_head`` (the output
    projection and the final norm)."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    if name.startswith("embed."):
        return "embed"
    if name.startswith("layers."):
        return ".".join(name.split(".")[:2])
    return "lm_head"


def layer_names(num_layers: int) -> list[str]:
    """Every layer of a model in order (the keys of the per-layer metrics)."""
    return ["embed", *(f"layers.{i}" for i in range(num_layers)), "lm_head"]


class LayerStats:
    """Per-layer gradient norms and update-to-weight ratios of one rank's model (collective).

    Every rank must call :meth:`grad_norms`, :meth:`snapshot` and :meth:`update_ratios` at the
    same steps: each ends in one all-reduce over the world.
    """

    def __init__(self, trainer: Trainer, every: int = 0) -> None:
        self.every = every
        self.names = layer_names(trainer.model_config.num_layers)
        index = {name: i for i, name in enumerate(self.names)}
        rt = trainer.runtime
        self.world = rt.world_size if rt.distributed else 1
        self.num_stages = trainer.layout.pp if rt.distributed else 1
        self.device = rt.device
        model = trainer.model
        tied_copy = _is_tied_copy(model)
        self.params = [
            (index[layer_of(name)], p)
            for name, p in model.named_parameters()
            if not (tied_copy and name.startswith("embed."))
        ]
        self.before: list[torch.Tensor] | None = None
        self.last_grad_norms: dict[str, float] = {}
        self.last_weight_norms: dict[str, float] = {}
        self.pending: dict[str, dict[str, float]] = {}

    def due(self, step: int) -> bool:
        """Whether the step that starts at ``step`` measures its layers (every ``every``)."""
        return self.every > 0 and (step + 1) % self.every == 0

    def before_update(self) -> dict[str, float]:
        """After the backward, before the clip: the gradient norms; keep the weights."""
        self.last_grad_norms = self.grad_norms()
        self.snapshot()
        return self.last_grad_norms

    def after_update(self) -> None:
        """After the optimizer step: the row's per-layer metrics (see :meth:`take`)."""
        self.pending = {
            "grad_norm_by_layer": self.last_grad_norms,
            "update_ratio_by_layer": self.update_ratios(),
        }

    def take(self) -> dict[str, dict[str, float]]:
        """The per-layer metrics measured since the last call (for the next metric row)."""
        pending, self.pending = self.pending, {}
        return pending

    def grad_norms(self, scale: float = 1.0) -> dict[str, float]:
        """The L2 norm of each layer's gradient (times ``scale``: undo a clip)."""
        sums = self._sums([p.grad for _, p in self.params])
        return {n: math.sqrt(s) * scale for n, s in zip(self.names, sums, strict=True)}

    def weight_norms(self) -> dict[str, float]:
        """The L2 norm of each layer's weights."""
        sums = self._sums([p.detach() for _, p in self.params])
        return {n: math.sqrt(s) for n, s in zip(self.names, sums, strict=True)}

    def snapshot(self) -> None:
        """Keep this rank's weights (local shards) to measure the next update by."""
        self.before = [_local(p.detach()).clone() for _, p in self.params]

    def update_ratios(self) -> dict[str, float]:
        """``||W_after - W_before|| / ||W_after||`` per layer since :meth:`snapshot`."""
        before, self.before = self.before, None
        if before is None:
            return {}
        params = [p.detach() for _, p in self.params]
        updates = self._sums(params, subtract=before)
        weights = self._sums(params)
        self.last_weight_norms = {n: math.sqrt(w) for n, w in zip(self.names, weights, strict=True)}
        return {
            n: math.sqrt(u) / max(math.sqrt(w), 1e-30)
            for n, u, w in zip(self.names, updates, weights, strict=True)
        }

    def _sums(
        self, tensors: list[torch.Tensor | None], subtract: list[torch.Tensor] | None = None
    ) -> list[float]:
        """Sum of squares per layer over every rank's part of ``tensors`` (collective)."""
        sums = torch.zeros(len(self.names), dtype=torch.float64, device=self.device)
        for i, ((layer, _), tensor) in enumerate(zip(self.params, tensors, strict=True)):
            if tensor is None:
                continue
            tensor = _no_partial(tensor)
            local = _local(tensor)
            if subtract is not None:
                local = local - subtract[i]
            square = local.detach().double().square().sum()
            sums[layer] += square / self._copies(tensor)
        if self.world > 1:
            dist.all_reduce(sums)
        return sums.tolist()

    def _copies(self, tensor: torch.Tensor) -> int:
        """How many ranks hold the same values as this rank's part of ``tensor``.

        A DTensor's replicated mesh dimensions hold copies; so do the ranks of the same pipeline
        stage outside its mesh (each stage's ranks are ``world / stages``).
        """
        ranks_per_stage = self.world // self.num_stages
        if not isinstance(tensor, DTensor):
            return ranks_per_stage
        mesh = tensor.device_mesh
        replicated = math.prod(
            mesh.size(d)
            for d, placement in enumerate(tensor.placements)
            if placement.is_replicate()
        )
        return replicated * (ranks_per_stage // mesh.size())


def _is_tied_copy(model) -> bool:
    """Whether ``model`` (a PP stage) holds the last stage's copy of a tied embedding."""
    # NOTE: PP: the last stage's copy of a tied embedding is the first stage's weight; it
    # is counted once, on the first stage (as the pipeline's clip does).
    return (
        getattr(model, "tied", False)
        and getattr(model, "is_last", False)
        and not getattr(model, "is_first", True)
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _no_partial(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor with pending sums reduced (gradients normally have none)."""
    if isinstance(tensor, DTensor) and any(p.is_partial() for p in tensor.placements):
        placements = [Replicate() if p.is_partial() else p for p in tensor.placements]
        return tensor.redistribute(tensor.device_mesh, placements)
    return tensor


def jumped_layers(
    norms: dict[str, float],
    history: list[dict[str, float]],
    top: int,
    weights: dict[str, float] | None = None,
    weights_before: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """The ``top`` layers whose gradient norm jumped most: this step's norm over the median of
    the recent ones (non-finite first; with no history, the largest norms).

    A layer whose weight norm moved by more than ``WEIGHT_JUMP`` times since it was last
    measured (``weights`` against ``weights_before``) comes first: no optimizer step does that,
    so the layer was changed from outside. NOTE: the gradient norms alone do not find such a
    layer: in a pre-norm residual stack a block with blown-up weights drowns the blocks after
    it (their gradients vanish) and amplifies the gradients of the blocks before it, so the
    largest gradient jumps are those of the earlier blocks.

    Returns ``[{"layer", "grad_norm", "median", "ratio", "weight_ratio"}, ...]``, the
    largest jump first.
    """
    weights, weights_before = weights or {}, weights_before or {}
    rows = []
    for layer, norm in norms.items():
        past = [h[layer] for h in history if layer in h and math.isfinite(h[layer])]
        typical = median(past) if past else None
        if not math.isfinite(norm):
            ratio = math.inf
        elif typical:
            ratio = norm / typical
        else:
            ratio = None
        before = weights_before.get(layer)
        moved = weights[layer] / before if before and layer in weights else None
        rows.append({"layer": layer, "grad_norm": norm, "median": typical, "ratio": ratio,
                     "weight_ratio": moved})  # fmt: skip
    return sorted(rows, key=_jump_order, reverse=True)[:top]


def _jump_order(row: dict[str, Any]) -> tuple[float, float, float]:
    moved = row["weight_ratio"]
    outside = 0.0
    if moved is not None and not (1 / WEIGHT_JUMP <= moved <= WEIGHT_JUMP):
        outside = abs(math.log(moved)) if 0 < moved < math.inf else math.inf
    ratio = row["ratio"] if row["ratio"] is not None else -1.0
    norm = row["grad_norm"] if math.isfinite(row["grad_norm"]) else math.inf
    return outside, ratio, norm


def median(values: list[float]) -> float:
    """The median of ``values`` (sorted or not; at least one)."""
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
