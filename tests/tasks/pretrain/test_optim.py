"""Optimizer parameter groups, Muon, and the LR wiring."""

from __future__ import annotations

import json

import torch
from conftest import TINY_MODEL, run_trainer, tiny_config

from llmflow.model.config import preset
from llmflow.model.transformer import Transformer
from llmflow.tasks.pretrain.config import OptimizerConfig
from llmflow.tasks.pretrain.muon import Muon
from llmflow.tasks.pretrain.optim import build_optimizers, set_lr, split_parameters


def _model(**changes):
    return Transformer(preset("debug", **{**TINY_MODEL, **changes}))


def test_no_weight_decay_on_embeddings_norms_and_biases():
    model = _model(tie_embeddings=False)
    groups = {k: {n for n, _ in v} for k, v in split_parameters(model).items()}
    assert "embed.weight" in groups["no_decay"]
    assert "norm.weight" in groups["no_decay"]
    assert all("norm" in n or n == "embed.weight" for n in groups["no_decay"])
    assert groups["decay"] == {"lm_head.weight"}
    assert all(n.startswith("layers.") for n in groups["hidden_matrix"])
    every = {n for n, _ in model.named_parameters()}
    assert set().union(*groups.values()) == every

    (adamw,) = build_optimizers(model, OptimizerConfig(weight_decay=0.1))
    decay_of = {id(p): g["weight_decay"] for g in adamw.param_groups for p in g["params"]}
    assert decay_of[id(model.embed.weight)] == 0.0
    assert decay_of[id(model.layers[0].attn_norm.weight)] == 0.0
    assert decay_of[id(model.layers[0].mlp.down_proj.weight)] == 0.1
    assert decay_of[id(model.lm_head.weight)] == 0.1


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    model = _model()
    muon, adamw = build_optimizers(model, OptimizerConfig(name="muon", muon_lr=0.02, lr=1e-3))
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    muon_params = {id(p) for g in muon.param_groups for p in g["params"]}
    assert id(model.layers[0].mlp.gate_up_proj.weight) in muon_params
    assert id(model.embed.weight) not in muon_params
    assert all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    set_lr([muon, adamw], 0.5)
    assert muon.param_groups[0]["lr"] == 0.01
    assert {g["lr"] for g in adamw.param_groups} == {5e-4}


def test_muon_run_learns(tmp_path, train_data):
    cfg = tiny_config(max_steps=20, optimizer={"name": "muon", "lr": 3e-3, "muon_lr": 0.02},
                      checkpoint={"interval": 10, "keep_last": 1})  # fmt: skip
    run_trainer(cfg, train_data, tmp_path / "muon")
    rows = [json.loads(r) for r in (tmp_path / "muon" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
