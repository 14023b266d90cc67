"""An extension stage's trainer config: its LR replaces the base's, Muon's group in proportion."""

from __future__ import annotations

import pytest

from llmflow.tasks.config import load_config
from llmflow.tasks.extend.config import extension_train_config


def test_muon_group_lr_keeps_its_ratio_to_the_adamw_lr_in_extension_stages():
    config = load_config(None, [])  # the quickstart pretrains with Muon
    base = config.pretrain.train
    assert base.optimizer.name == "muon"
    for stage in config.extend.stages:
        optimizer = extension_train_config(base, stage).optimizer
        assert optimizer.lr == stage.lr
        want = base.optimizer.muon_lr / base.optimizer.lr
        assert optimizer.muon_lr / optimizer.lr == pytest.approx(want, rel=1e-12)


def test_an_adamw_recipe_keeps_its_muon_field_untouched_so_its_hashes_stay():
    config = load_config(None, ["pretrain.train.optimizer.name=adamw"])
    base = config.pretrain.train
    for stage in config.extend.stages:
        assert extension_train_config(base, stage).optimizer.muon_lr == base.optimizer.muon_lr
