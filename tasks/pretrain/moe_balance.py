"""Mixture-of-experts load balancing and router metrics, a trainer component.

After every accepted optimizer step, :class:`MoEBalance`:

- sums each sparse layer's ``tokens_per_expert`` over the data-parallel ranks (one all-reduce of
  every layer's counts stacked, ``Trainer.dp_sum``: the ranks that read different tokens);
- moves each layer's selection bias (DeepSeek-V3's auxiliary-loss-free balancing,
  ``update_expert_bias``) when ``router_bias_update_rate`` > 0: every rank computes the same
  update from the same summed counts, so the replicated buffer stays identical on every rank and
  the checkpoint (the bias is a buffer of the model's state dict) holds it;
- resets the counts.

A step the stability guard refuses is never counted: the counts are reset before every step
(``on_step_start``, which runs again after a refused step), so its forwards leave no trace and the
bias does not move. At build it sets every block's ``aux_scale`` to ``1 / grad_accum_steps``: the
auxiliary losses are a mean over micro-batches (and FSDP's gradient averaging makes them a mean
over the data-parallel ranks).

Metrics: at each metric row (the logger's cadence) the row gets ``moe/load_max_mean`` (the
largest over the sparse layers of max/mean tokens per expert, summed over the steps since the last
row) and, per sparse layer ``i``, ``moe/layer{i}/...``: ``load_max_mean``, ``router_entropy``,
``aux_loss``, ``z_loss`` (the last micro-batch's, averaged over the ranks), ``bias_min`` and
``bias_max``. ``summary.json`` gets ``moe_load_max_mean`` (the last row's). Only a model with
sparse layers gets this component: a dense model's rows and summary are unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from llmflow.model.moe import MoE, moe_layers, update_expert_bias
from llmflow.tasks.pretrain.callbacks import Callback
from llmflow.tasks.pretrain.state import StepOutput

if TYPE_CHECKING:
    from llmflow.tasks.pretrain.train import Trainer

ROUTER_METRICS = ("router_entropy", "aux_loss", "z_loss")


class MoEBalance(Callback):
    """Sums the expert loads over the data-parallel ranks, moves the selection bias, logs.

    Runs on every rank (the all-reduce is collective) and before the checkpointer and the logger
    in the hook order: a checkpoint at a step's end holds the bias after that step's update.
    """

    state_key = "moe_balance"  # the loads since the last row, the last row (state_registry.py)

    def __init__(self, layers: list[tuple[int, MoE]], grad_accum_steps: int, rate: float):
        self.layers, self.rate = layers, rate
        for _, moe in layers:
            moe.aux_scale = 1.0 / grad_accum_steps
        self.interval_load: torch.Tensor | None = None  # (L, E) loads since the last row
        self.last_load: torch.Tensor | None = None  # (L, E) the last step's loads, all ranks
        self.last_row: dict[str, float] = {}

    @classmethod
    def build(cls, trainer: Trainer) -> MoEBalance | None:
        """The component for ``trainer.model``, None for a dense model."""
        layers = moe_layers(trainer.model)
        if not layers:
            return None
        accum = trainer.cfg.batch.grad_accum_steps
        return cls(layers, accum, trainer.model_config.router_bias_update_rate)

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        self.reset()  # NOTE: the counts of a step the guard refused are dropped here

    def reset(self) -> None:
        for _, moe in self.layers:
            moe.tokens_per_expert.zero_()

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        load, router = self.reduce(trainer)
        if self.rate > 0:
            for (_, moe), layer_load in zip(self.layers, load, strict=True):
                update_expert_bias(moe, layer_load, self.rate)
        self.reset()
        self.last_load = load
        self.interval_load = load if self.interval_load is None else self.interval_load + load
        if _row_due(trainer, out.step):
            self.last_row = self.metrics(self.interval_load, router)
            out.metrics.update(self.last_row)
            self.interval_load = None

    def reduce(self, trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
        """(L, E) tokens per expert over the data-parallel ranks, float64; (L, 3) the router
        metrics of each rank's last micro-batch, averaged over those ranks (one all-reduce)."""
        rows = []
        for _, moe in self.layers:
            last = moe.last_metrics
            extra = [
                last[k].detach().reshape(1) if k in last else _zero(moe) for k in ROUTER_METRICS
            ]
            ones = torch.ones(1, device=moe.tokens_per_expert.device)
            rows.append(torch.cat([moe.tokens_per_expert, *[e.float() for e in extra], ones]))
        stacked = trainer.dp_sum(torch.stack(rows).double())
        ranks = stacked[:, -1:]
        return stacked[:, : -1 - len(ROUTER_METRICS)], stacked[
            :, -1 - len(ROUTER_METRICS) : -1
        ] / ranks

    def metrics(self, load: torch.Tensor, router: torch.Tensor) -> dict[str, float]:
        """The row's ``moe/...`` entries (host numbers; one device sync per row)."""
        ratios = (load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-9)).tolist()
        router_rows = router.tolist()
        row: dict[str, float] = {"moe/load_max_mean": max(ratios)}
        for (index, moe), ratio, values in zip(self.layers, ratios, router_rows, strict=True):
            prefix = f"moe/layer{index}/"
            row[prefix + "load_max_mean"] = ratio
            row.update({prefix + k: v for k, v in zip(ROUTER_METRICS, values, strict=True)})
            bias = moe.router.expert_bias
            row[prefix + "bias_min"], row[prefix + "bias_max"] = (
                bias.min().item(),
                bias.max().item(),
            )
        return row

    def state_dict(self) -> dict[str, Any]:
        load = self.interval_load
        return {"interval_load": None if load is None else load.tolist(), "last_row": self.last_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load, device = state.get("interval_load"), self.layers[0][1].tokens_per_expert.device
        self.interval_load = None if load is None else torch.tensor(load, dtype=torch.float64,
                                                                    device=device)  # fmt: skip
        self.last_row = dict(state.get("last_row", {}))

    def summary(self) -> dict[str, Any]:
        """What ``summary.json`` adds: the last row's largest max/mean load."""
        return {"moe_load_max_mean": self.last_row.get("moe/load_max_mean")}


def _row_due(trainer: Trainer, step: int) -> bool:
    """Whether the logger writes a row at ``step`` (``MetricsLogger.on_step_end``'s rule)."""
    cfg = trainer.cfg
    return (
        step % cfg.log_interval == 0
        or step % cfg.eval_interval == 0
        or step == trainer.state.end_step
    )


def _zero(moe: MoE) -> torch.Tensor:
    return torch.zeros(1, device=moe.tokens_per_expert.device)
