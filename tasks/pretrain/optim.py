"""Optimizers: AdamW with sensible no-decay groups, or Muon for hidden matrices plus AdamW.

Each returned optimizer's param groups carry a ``base_lr`` key (the peak LR); the trainer sets
``lr = base_lr * schedule * guard scale`` before every step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from llmflow.model.moe import Router
from llmflow.tasks.pretrain.config import OptimizerConfig
from llmflow.tasks.pretrain.muon import Muon, logical_rows, row_orders


def split_parameters(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Sort trainable parameters into ``hidden_matrix``, ``decay`` and ``no_decay`` lists.

    ``no_decay``: embeddings, norms and biases (anything under 2-D, or owned by an Embedding).
    ``hidden_matrix``: 2-D weights inside the transformer blocks (``model.layers``), and the
    3-D stacks of a mixture of experts' matrices.
    ``decay``: the other 2-D weights (an untied output head, a mixture of experts' routers:
    Muon is for hidden matrices, a router is a classifier, as torchtitan and Moonlight treat
    it).
    """
    embedding_ids = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    layers = getattr(model, "layers", None)
    block_ids = {id(p) for p in layers.parameters()} if layers is not None else set()
    router_ids = {id(m.weight) for m in model.modules() if isinstance(m, Router)}
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {
        "hidden_matrix": [],
        "decay": [],
        "no_decay": [],
    }
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or id(param) in embedding_ids:
            groups["no_decay"].append((name, param))
        elif id(param) in block_ids and id(param) not in router_ids:
            groups["hidden_matrix"].append((name, param))
        else:
            groups["decay"].append((name, param))
    return groups


def _adamw(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.AdamW:
    groups = [g for g in groups if g["params"]]
    for group in groups:
        group["base_lr"] = group["lr"]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=cfg.fused or None
    )


def build_optimizers(model: nn.Module, cfg: OptimizerConfig) -> list[torch.optim.Optimizer]:
    """Return the optimizers for ``model`` (one for AdamW, two for Muon + AdamW)."""
    groups = split_parameters(model)
    params = {k: [p for _, p in v] for k, v in groups.items()}
    no_decay = {"params": params["no_decay"], "weight_decay": 0.0, "lr": cfg.lr}
    if cfg.name == "adamw":
        decay = params["hidden_matrix"] + params["decay"]
        return [
            _adamw(
                [{"params": decay, "weight_decay": cfg.weight_decay, "lr": cfg.lr}, no_decay], cfg
            )
        ]
    parts, orders = logical_rows(model), row_orders(model)
    hidden = groups["hidden_matrix"]
    muon = Muon(
        [{"params": params["hidden_matrix"], "lr": cfg.muon_lr, "base_lr": cfg.muon_lr}],
        lr=cfg.muon_lr,
        weight_decay=cfg.muon_weight_decay,
        momentum=cfg.muon_momentum,
        adjust_lr_fn=cfg.muon_adjust_lr,
        parts={p: parts[name] for name, p in hidden if name in parts},
        orders={p: orders[name] for name, p in hidden if name in orders},
    )
    adam = _adamw(
        [{"params": params["decay"], "weight_decay": cfg.weight_decay, "lr": cfg.lr}, no_decay], cfg
    )
    _say_who_takes_what(groups)
    return [muon, adam]


def _say_who_takes_what(groups: dict[str, list[tuple[str, nn.Parameter]]]) -> None:
    """One log line (rank 0): which parameters Muon takes and which go to AdamW, and why."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    others = groups["decay"] + groups["no_decay"]
    not_2d = sum(1 for _, p in others if p.ndim != 2)
    stacks = sum(1 for _, p in groups["hidden_matrix"] if p.ndim == 3)
    routers = sum(1 for name, _ in others if name.endswith("router.weight"))
    # NOTE: a dense model's line is as it was
    kind = (
        f"matrices ({stacks} of them 3-D stacks of experts' matrices)" if stacks else "2-D matrices"
    )
    rest = f", {routers} routers" if routers else ""
    print(
        f"muon: {len(groups['hidden_matrix'])} hidden {kind}; AdamW takes the "
        f"other {len(others)} parameters ({not_2d} not 2-D: norms, biases; the rest embeddings "
        f"or the output head{rest})",
        flush=True,
    )


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float) -> None:
    """Set every group's LR to ``base_lr * multiplier``."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * multiplier
