"""Preflight's layout rehearsal: which layouts a recipe's plans rehearse, the loss comparison,
and (slow) TP, CP and PP run through the trainer on CPU ranks against data parallelism."""

import pytest

from llmflow.tasks.config import load_config
from llmflow.tasks.preflight.layouts import (
    LOSS_TOLERANCE,
    _compare,
    rehearsal_layouts,
    world_size,
)
from llmflow.tasks.preflight.report import PreflightOptions, Report
from llmflow.tasks.pretrain.layout_planner import stage_layout_plans


def test_the_3b_recipe_rehearses_its_planned_layouts_at_degree_2():
    config = load_config("configs/smollm3-3b.yaml", [])
    planned = [p.layout for _, _, p in stage_layout_plans(config.pretrain, config.extend,
                                                          config.hardware)]  # fmt: skip
    assert {(lay.tp, lay.cp) for lay in planned} == {(1, 1), (1, 4), (1, 8)}
    layouts = rehearsal_layouts(config, "plan")
    assert layouts == [{"cp": 2, "dp_shard": 2}]  # no stage plans TP
    assert all(world_size(lay) == 4 for lay in layouts)


def test_plain_recipes_rehearse_nothing_unless_asked():
    config = load_config("configs/smollm3-1.7b.yaml", [])
    assert rehearsal_layouts(config, "plan") == []
    assert rehearsal_layouts(config, "none") == []
    assert [world_size(lay) for lay in rehearsal_layouts(config, "all")] == [4, 2, 2]
    with pytest.raises(ValueError, match="layouts"):
        PreflightOptions(layouts="some")


def test_losses_are_compared_step_by_step():
    reference = {1: 6.25, 2: 6.20}
    assert _compare({1: 6.25, 2: 6.20 * (1 + LOSS_TOLERANCE / 2)}, reference, 4, 2)["go"]
    off = _compare({1: 6.25, 2: 6.20 * (1 + 2 * LOSS_TOLERANCE)}, reference, 4, 2)
    assert not off["go"] and "worst relative difference" in off["detail"]
    assert not _compare({1: 6.25}, reference, 4, 2)["go"]  # a step missing


@pytest.mark.slow
def test_tp_cp_pp_rehearse_to_a_go_against_data_parallelism(tmp_path):
    """4 + 2 + 2 trainer ranks and 1 + 2 reference ranks on gloo (~3 min on 2 cores)."""
    from llmflow.tasks.preflight.layouts import rehearse_layouts

    config = load_config("configs/smollm3-3b.yaml", [])
    report = Report(recipe="smollm3-3b")
    options = PreflightOptions(layouts="all", timeout_s=600)
    rehearse_layouts(report, config, options, tmp_path, lambda _: None)
    rows = {c.check: c for c in report.checks}
    assert list(rows) == ["layout tp=2 x dp_shard=2", "layout cp=2 x dp_shard=1",
                          "layout pp=2 x dp_shard=1"]  # fmt: skip
    assert all(c.go for c in rows.values()), report.table()
    for name, numbers in report.numbers["layouts"].items():
        assert numbers["losses"].keys() == numbers["reference"].keys(), name
        assert len(numbers["losses"]) == 2
