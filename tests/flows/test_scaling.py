"""Scaling ladder: the Chinchilla fit against known constants, isoflop points, ranking, plan."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel
from scipy.optimize import check_grad

from llmflow.flows.cli import main
from llmflow.flows.scaling import LadderConfig, Size, isoflop_points, ladder_graph, rank_table
from llmflow.model.config import preset
from llmflow.tasks.config import load_config
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.scaling.fit import (
    ScalingFitConfig,
    ScalingLaw,
    _objective,
    find_law,
    fit_law,
    scaling_fit,
)

TRUE = ScalingLaw(E=1.7, A=400.0, alpha=0.34, B=410.0, beta=0.28)  # Chinchilla's constants
GRID = [(n, d) for n in (1e5, 3e5, 1e6, 3e6) for d in (1e6, 3e6, 1e7)]


def test_fit_recovers_a_known_law_and_predicts_a_larger_model():
    n, d = zip(*GRID, strict=True)
    law = fit_law(list(n), list(d), [TRUE.predict(*p) for p in GRID])
    assert law.alpha == pytest.approx(TRUE.alpha, rel=1e-3)
    assert law.beta == pytest.approx(TRUE.beta, rel=1e-3)
    assert law.E == pytest.approx(TRUE.E, rel=1e-3)
    assert law.predict(3e7, 3e8) == pytest.approx(TRUE.predict(3e7, 3e8), rel=1e-4)


def test_huber_fit_shrugs_off_one_bad_run():
    n, d = zip(*GRID, strict=True)
    loss = [TRUE.predict(*p) for p in GRID]
    loss[4] *= 1.3  # one diverged run
    law = fit_law(list(n), list(d), loss)
    assert law.predict(1e7, 1e8) == pytest.approx(TRUE.predict(1e7, 1e8), rel=0.01)


def test_objective_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    log_n, log_d = np.log([1e5, 1e6, 3e6]), np.log([1e6, 1e7, 2e6])
    log_l = np.log([3.0, 2.5, 2.6])
    for _ in range(3):
        theta = rng.uniform([2, 2, 0, 0.2, 0.2], [8, 8, 1, 0.8, 0.8])
        err = check_grad(
            lambda t: _objective(t, log_n, log_d, log_l, 0.1)[0],
            lambda t: _objective(t, log_n, log_d, log_l, 0.1)[1],
            theta,
        )
        assert err < 1e-5


def test_compute_optimal_split_is_the_argmin_on_the_isoflop_curve():
    flops = 1e20
    n_opt, d_opt = TRUE.optimal_split(flops)
    sizes = np.geomspace(n_opt / 10, n_opt * 10, 2001)
    losses = [TRUE.predict(s, flops / (6 * s)) for s in sizes]
    assert sizes[int(np.argmin(losses))] == pytest.approx(n_opt, rel=0.01)
    assert 6 * n_opt * d_opt == pytest.approx(flops)


def test_isoflop_points_spend_the_budget():
    ladder = LadderConfig(sizes=[Size(hidden_size=32, num_layers=2)], flops=[1e10, 1e13])
    n = preset("debug", **Size(hidden_size=32, num_layers=2).overrides()).num_parameters(
        non_embedding=True
    )
    base = load_config(None).pretrain.train
    ((size, tokens),) = isoflop_points(ladder, base)  # 1e13 is past max_tokens: skipped
    assert tokens == int(1e10 / (6 * n)) and size.hidden_size == 32


def test_isoflop_points_count_the_recipes_own_model():
    # A recipe whose preset is not debug (qk-norm on, say): N is that model's, not debug's.
    base = load_config(None, ["pretrain.train.model.overrides.qk_norm=true"]).pretrain.train
    size = Size(hidden_size=32, num_layers=2)
    ladder = LadderConfig(sizes=[size], flops=[1e10])
    n = preset("debug", qk_norm=True, **size.overrides()).num_parameters(non_embedding=True)
    assert n != preset("debug", **size.overrides()).num_parameters(non_embedding=True)
    ((_, tokens),) = isoflop_points(ladder, base)
    assert tokens == int(1e10 / (6 * n))


def test_ladder_graph_builds_every_run_on_the_first_stage(tmp_path):
    cfg = load_config(None, [f"root={tmp_path}"])
    planned = ladder_graph(cfg, LadderConfig())
    ladder_runs = [n.config.train for n in planned.points]
    points = isoflop_points(LadderConfig(), cfg.pretrain.train)
    assert len(ladder_runs) == len(points)
    assert {t.num_tokens for t in ladder_runs} == {d for _, d in points}
    wsd = [
        planned.ranking[("wsd", s.hidden_size)].config.train for s in LadderConfig().ranking_sizes
    ]
    assert {t.schedule.name for t in wsd} == {"wsd"}
    assert planned.fit.inputs["runs"] == planned.points


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_ladder_lr_scale_moves_the_recipes_own_learning_rates(tmp_path, optimizer):
    overrides = [f"root={tmp_path}", f"pretrain.train.optimizer.name={optimizer}"]
    cfg = load_config(None, [*overrides, "pretrain.train.optimizer.lr=0.003"])
    recipe_optimizer = cfg.pretrain.train.optimizer
    same = ladder_graph(cfg, LadderConfig())
    doubled = ladder_graph(cfg, LadderConfig(lr_scale=2.0))
    for kept, scaled in zip(same.points + [same.heldout], doubled.points + [doubled.heldout],
                            strict=True):  # fmt: skip
        assert kept.config.train.optimizer == recipe_optimizer  # 1.0: the recipe's own rates
        got = scaled.config.train.optimizer
        assert got.lr == pytest.approx(0.006)
        # Muon's own rate moves with AdamW's (their ratio is the recipe's); AdamW has none
        want = 2 * recipe_optimizer.muon_lr if optimizer == "muon" else recipe_optimizer.muon_lr
        assert got.muon_lr == pytest.approx(want)


def test_rank_table_flags_a_flip():
    same = {("cosine", 32): 3.0, ("wsd", 32): 2.9, ("cosine", 64): 2.5, ("wsd", 64): 2.4}
    rows, consistent = rank_table(same)
    assert consistent and rows[0]["order"] == "wsd < cosine"
    flipped = {**same, ("wsd", 64): 2.6}
    assert not rank_table(flipped)[1]


class FakeRun(BaseModel):
    hidden_size: int
    tokens: int


@step("test-ladder-run")
def ladder_run(cfg: FakeRun, out: Path) -> Metrics:
    """A pretrain-shaped output (config + summary) whose loss follows TRUE exactly."""
    heads = cfg.hidden_size // 16
    train = TrainConfig.model_validate(
        {
            "model": {
                "overrides": {
                    "hidden_size": cfg.hidden_size,
                    "num_heads": heads,
                    "num_kv_heads": heads,
                }
            },
            "max_steps": 1,
        }
    )
    train.save(out / "train_config.json")
    n = train.model_config_obj().num_parameters(non_embedding=True)
    summary = {"val_loss": TRUE.predict(n, cfg.tokens), "total_tokens_seen": cfg.tokens}
    (out / "summary.json").write_text(json.dumps(summary))
    return {}


def test_fit_step_is_found_by_plan(tmp_path, capsys):
    graph = Graph()
    runs = [
        graph.add(ladder_run, FakeRun(hidden_size=h, tokens=t), "fake")
        for h in (32, 64, 128, 256)
        for t in (10**6, 3 * 10**6, 10**7)  # three token counts: B, beta and E need them
    ]
    fit = graph.add(scaling_fit, ScalingFitConfig(), "quickstart", runs=runs)
    outcome = Executor(str(tmp_path)).run(graph)
    assert outcome[fit].metrics["max_fit_error"] < 1e-3
    law = find_law(str(tmp_path), "quickstart")
    assert law.alpha == pytest.approx(TRUE.alpha, rel=1e-2)
    assert find_law(str(tmp_path), "another-recipe") is None
    main(["plan", "--set", f"root={tmp_path}"])
    printed = capsys.readouterr().out
    cfg = load_config(None, []).pretrain
    n = cfg.train.model_config_obj().num_parameters(non_embedding=True)
    tokens = sum(s.mixture.num_tokens for s in cfg.stages)
    assert f"predicted val loss   {law.predict(n, tokens):.4f}" in printed


def test_too_few_runs_to_fit_is_bad_input():
    with pytest.raises(BadInputError, match="at least 5 runs"):
        fit_law([1e5, 1e6], [1e6, 1e7], [3.0, 2.5])


# --------------------------------------------------------------------------------- degenerate fits
# A hand-computed ladder: N in {1e5, 1e6, 1e7} and D in {1e6, 1e7, 1e8}, each term halving per
# decade (alpha = beta = log10(2)): A/N^alpha = 10, 5, 2.5 (A = 10 * 1e5^alpha) and
# B/D^beta = 4, 2, 1 (B = 4 * 1e6^beta). Three values per axis: with two, B, beta and E (or A,
# alpha and E) meet only two levels and any beta fits.
HALVING = math.log10(2)
HAND_N = {1e5: 10.0, 1e6: 5.0, 1e7: 2.5}
HAND_D = {1e6: 4.0, 1e7: 2.0, 1e8: 1.0}


def hand_ladder(floor: float, n_terms=HAND_N) -> tuple[list[float], list[float], list[float]]:
    """Every (N, D) of the hand ladder: loss = floor + N term + D term, from the tables above."""
    points = [(n, d, floor + n_terms[n] + HAND_D[d]) for n in n_terms for d in HAND_D]
    return tuple(list(column) for column in zip(*points, strict=True))


def test_hand_ladder_is_the_law_it_claims():
    law = ScalingLaw(E=1.0, A=10 * 1e5**HALVING, alpha=HALVING, B=4 * 1e6**HALVING, beta=HALVING)
    n, d, loss = hand_ladder(1.0)
    assert loss == [15.0, 13.0, 12.0, 10.0, 8.0, 7.0, 7.5, 5.5, 4.5]
    assert [law.predict(*p) for p in zip(n, d, strict=True)] == pytest.approx(loss, rel=1e-12)


def test_well_posed_hand_ladder_is_recovered_and_predicts():
    n, d, loss = hand_ladder(1.0)  # E = 1: a floor the nine runs pin down
    law = fit_law(n, d, loss)
    assert law.degenerate is None
    assert law.E == pytest.approx(1.0, rel=1e-2)
    assert law.alpha == pytest.approx(HALVING, rel=1e-2)
    assert law.beta == pytest.approx(HALVING, rel=1e-2)
    # N = 1e8 halves the N term again (1.25), D = 1e9 the D term (0.5)
    assert law.predict(1e8, 1e9) == pytest.approx(1.0 + 1.25 + 0.5, rel=1e-2)


def test_ladder_with_no_loss_floor_is_degenerate_and_predicts_nothing():
    n, d, loss = hand_ladder(0.0)  # true E = 0: the law is two power laws and nothing under them
    law = fit_law(n, d, loss)
    assert law.degenerate is not None and law.degenerate.startswith("fit degenerate: E = ")
    assert law.E < 0.01 * min(loss)
    with pytest.raises(ValueError, match="fit degenerate: E"):
        law.predict(1e8, 1e9)


def test_losses_that_ignore_model_size_leave_alpha_undetermined():
    flat = dict.fromkeys(HAND_N, 0.0)  # the N term is 0 at every size
    n, d, loss = hand_ladder(1.0, flat)
    law = fit_law(n, d, loss)
    assert law.degenerate is not None and "A/N^alpha" in law.degenerate


def test_runs_at_one_token_count_cannot_identify_the_fit():
    n = [1e5, 3e5, 1e6, 3e6, 1e7]
    loss = [TRUE.predict(size, 1e7) for size in n]  # five sizes, one D: B and beta are free
    law = fit_law(n, [1e7] * 5, loss)
    assert law.degenerate == (
        "fit degenerate: the runs saw 1 distinct token count (1e+07); B, beta and E need 3 or more"
    )


def test_constant_losses_are_degenerate():
    n, d, _ = hand_ladder(0.0)
    law = fit_law(n, d, [3.0] * 9)
    assert law.degenerate == (
        "fit degenerate: every run's loss is 3, so no law improves on a constant"
    )


def test_law_from_noise_does_not_improve_on_a_constant():
    n, d, _ = hand_ladder(0.0)
    # a checkerboard over (N, D): no loss that falls with N and D explains it
    loss = [3.0, 3.3, 3.0, 3.3, 3.0, 3.3, 3.0, 3.3, 3.0]
    law = fit_law(n, d, loss)
    assert law.degenerate is not None and "a constant" in law.degenerate


def test_degenerate_fit_step_writes_the_reason_and_plan_finds_no_law(tmp_path):
    graph = Graph()
    runs = [
        graph.add(ladder_run, FakeRun(hidden_size=h, tokens=10**6), "fake")
        for h in (32, 64, 128, 256, 512)
    ]
    fit = graph.add(scaling_fit, ScalingFitConfig(), "quickstart", runs=runs)
    outcome = Executor(str(tmp_path)).run(graph)
    written = json.loads((Path(outcome[fit].uri) / "law.json").read_text())
    reason = "fit degenerate: the runs saw 1 distinct token count (1e+06)"
    assert written["law"]["degenerate"].startswith(reason)
    assert outcome[fit].metrics["degenerate"] == written["law"]["degenerate"]
    assert all(p["fitted"] is None for p in written["points"])  # no values from a degenerate law
    assert find_law(str(tmp_path), "quickstart") is None


def test_heldout_check_of_a_degenerate_law_reports_it_without_a_prediction():
    from llmflow.flows.scaling import heldout_check

    law = ScalingLaw(E=0.0, A=1.0, alpha=0.3, B=1.0, beta=0.3, degenerate="fit degenerate: E")
    check = heldout_check(law, 1e6, {"val_loss": 3.0, "total_tokens_seen": 10**6})
    assert check == {
        "n": 1e6, "d": 10**6, "predicted": None, "actual": 3.0, "relative_error": None,
        "degenerate": "fit degenerate: E",
    }  # fmt: skip
    good = ScalingLaw(E=1.0, A=10 * 1e5**HALVING, alpha=HALVING, B=4 * 1e6**HALVING, beta=HALVING)
    check = heldout_check(good, 1e5, {"val_loss": 12.0, "total_tokens_seen": 10**6})
    assert check["predicted"] == pytest.approx(15.0)  # 1 + 10 + 4
    assert check["relative_error"] == pytest.approx(3 / 12)
    assert check["degenerate"] is None
