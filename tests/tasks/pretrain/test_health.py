"""Health metrics: the step clock, per-layer gradient norms and update ratios (one process,
against a computation by hand), the layers a spike names, the metric row's new fields."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_MODEL

from llmflow.model.config import preset
from llmflow.model.transformer import Transformer
from llmflow.tasks.pretrain.health import LayerStats, StepClock, jumped_layers, layer_of


def test_layer_of_names_every_parameter():
    assert layer_of("embed.weight") == "embed"
    assert layer_of("layers.3.attn.qkv_proj.weight") == "layers.3"
    assert layer_of("layers.12._orig_mod.mlp.down_proj.weight") == "layers.12"
    assert layer_of("layers.0._checkpoint_wrapped_module.attn_norm.weight") == "layers.0"
    assert layer_of("norm.weight") == layer_of("lm_head.weight") == "lm_head"


def test_step_clock_sums_parts_and_marks_the_data_wait():
    clock = StepClock()
    with clock.timing("data"):
        assert clock.waiting_since is not None
        time.sleep(0.02)
    assert clock.waiting_since is None
    with clock.timing("compute"):
        pass
    row = clock.take()
    assert set(row) == {f"time_{p}_s" for p in ("data", "compute", "optimizer", "checkpoint",
                                                 "validation")}  # fmt: skip
    assert row["time_data_s"] >= 0.02 and row["time_optimizer_s"] == 0.0
    assert clock.take()["time_data_s"] == 0.0  # reset by take


def _fake_trainer(model: Transformer) -> SimpleNamespace:
    runtime = SimpleNamespace(world_size=1, distributed=False, device=torch.device("cpu"))
    return SimpleNamespace(model=model, model_config=model.cfg, runtime=runtime,
                           layout=SimpleNamespace(pp=1))  # fmt: skip


def test_layer_stats_match_a_hand_computation():
    torch.manual_seed(0)
    model = Transformer(preset("debug", **{**TINY_MODEL, "num_layers": 3}))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    stats = LayerStats(_fake_trainer(model), every=2)
    assert [stats.due(s) for s in range(4)] == [False, True, False, True]

    expected: dict[str, float] = {}
    for name, p in model.named_parameters():
        expected[layer_of(name)] = expected.get(layer_of(name), 0.0) + float(
            p.grad.double().square().sum()
        )
    norms = stats.before_update()
    assert list(norms) == ["embed", "layers.0", "layers.1", "layers.2", "lm_head"]
    for layer, value in norms.items():
        assert value == pytest.approx(math.sqrt(expected[layer]), rel=1e-9), layer

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    stats.after_update()
    got = stats.take()
    assert set(got) == {"grad_norm_by_layer", "update_ratio_by_layer"} and stats.take() == {}
    update: dict[str, float] = {}
    weight: dict[str, float] = {}
    for name, p in model.named_parameters():
        layer, p = layer_of(name), p.detach()
        update[layer] = update.get(layer, 0.0) + float((p - before[name]).double().square().sum())
        weight[layer] = weight.get(layer, 0.0) + float(p.double().square().sum())
    for layer, ratio in got["update_ratio_by_layer"].items():
        assert ratio == pytest.approx(math.sqrt(update[layer] / weight[layer]), rel=1e-6), layer
    assert stats.weight_norms()["layers.1"] == pytest.approx(math.sqrt(weight["layers.1"]))


def test_jumped_layers_ranks_by_ratio_to_the_median_and_weight_jumps_first():
    history = [{"a": 1.0, "b": 10.0, "c": 2.0}, {"a": 3.0, "b": 10.0, "c": 2.0},
               {"a": 2.0, "b": 10.0, "c": 2.0}]  # fmt: skip
    now = {"a": 8.0, "b": 30.0, "c": 2.0}  # a: x4 its median 2, b: x3 its median 10
    rows = jumped_layers(now, history, top=2)
    assert [r["layer"] for r in rows] == ["a", "b"]
    assert rows[0]["median"] == 2.0 and rows[0]["ratio"] == pytest.approx(4.0)
    # a non-finite gradient norm comes first
    assert jumped_layers({**now, "c": math.nan}, history, top=1)[0]["layer"] == "c"
    # a layer whose weights jumped (x10) comes before any gradient jump; a small drift does not
    weights, before = {"a": 1.0, "b": 1.01, "c": 10.0}, {"a": 1.0, "b": 1.0, "c": 1.0}
    rows = jumped_layers(now, history, 3, weights, before)
    assert [r["layer"] for r in rows] == ["c", "a", "b"]
    assert rows[0]["weight_ratio"] == pytest.approx(10.0)
    # no history: the largest norms
    assert [r["layer"] for r in jumped_layers(now, [], top=2)] == ["b", "a"]


def test_the_monitor_section_moves_no_address_and_checks_its_window():
    from conftest import tiny_config

    from llmflow.tasks.framework.errors import ConfigError
    from llmflow.tasks.pretrain.config import versioned_fields

    plain = tiny_config()
    watched = plain.replaced(monitor={"layer_stats_every": 1, "stall_s": 5.0})
    assert "monitor" not in versioned_fields(watched)
    assert versioned_fields(watched) == versioned_fields(plain)
    with pytest.raises(ConfigError, match="throughput_min_rows"):
        plain.replaced(monitor={"throughput_window": 4, "throughput_min_rows": 5})
