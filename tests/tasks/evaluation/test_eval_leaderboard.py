"""Leaderboard and signal quality on hand-made results records (no model needed)."""

import csv
import json

import pytest

from llmflow.tasks.evaluation.leaderboard import (
    build_leaderboard,
    seed_spread,
    signal_quality,
    spearman,
)


def test_spearman_hand_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks x = 1,2,3,4; y = 1,3,2,4 -> 1 - 6 * (0 + 1 + 1 + 0) / (4 * 15) = 0.8
    assert spearman([1, 2, 3, 4], [5, 7, 6, 8]) == pytest.approx(0.8)
    # ties get average ranks: y ranks 1.5,1.5,3 vs x ranks 1,2,3 -> Pearson = sqrt(3)/2
    assert spearman([1, 2, 3], [0, 0, 1]) == pytest.approx(3**0.5 / 2)
    assert spearman([1, 2, 3], [5, 5, 5]) is None
    assert spearman([1], [2]) is None


def test_seed_spread_only_over_shared_points():
    points = [(1, 0.1, 0), (1, 0.3, 1), (2, 0.5, 0), (2, 0.9, 1), (3, 0.7, 0)]
    # std(ddof=1) of (0.1, 0.3) = 0.1414..., of (0.5, 0.9) = 0.2828...; x=3 has one seed
    assert seed_spread(points) == pytest.approx((0.02**0.5 + 0.08**0.5) / 2)
    assert seed_spread([(1, 0.1, 0), (2, 0.2, 0)]) is None


def _row(ckpt, seed, tokens, task, metric, value, higher):
    return {"checkpoint": ckpt, "suite_key": "s", "step": None, "tokens_seen": tokens,
            "seed": seed, "task": task, "metric": metric, "value": value,
            "higher_is_better": higher}  # fmt: skip


def test_signal_quality_signs_and_snr():
    rows = []
    for seed, offset in [(0, 0.0), (1, 0.02)]:
        for tokens, acc, ppl, noise in [(100, 0.3, 50, 0.5), (200, 0.4, 30, 0.1), (300, 0.5, 20, 0.4)]:  # fmt: skip
            rows.append(_row(f"c{seed}{tokens}", seed, tokens, "cf", "acc", acc + offset, True))
            rows.append(
                _row(f"c{seed}{tokens}", seed, tokens, "ppl", "word_perplexity", ppl, False)
            )
            rows.append(
                _row(f"c{seed}{tokens}", seed, tokens, "mcf", "acc", noise + offset * 10, True)
            )
    quality = {(q["task"], q["metric"]): q for q in signal_quality(rows)}
    cf = quality[("cf", "acc")]
    assert cf["monotonicity"] == pytest.approx(1.0) and cf["num_seeds"] == 2
    assert cf["seed_std"] == pytest.approx(0.02 / 2**0.5)
    # per-token means 0.31, 0.41, 0.51 -> range 0.2
    assert cf["snr"] == pytest.approx(0.2 / (0.02 / 2**0.5))
    assert cf["worth_watching"] is True
    ppl = quality[("ppl", "word_perplexity")]
    assert ppl["monotonicity"] == pytest.approx(1.0)  # falls with training: good
    assert ppl["seed_std"] == 0.0 and ppl["snr"] is None and ppl["worth_watching"] is True
    mcf = quality[("mcf", "acc")]  # spearman of (0.5, 0.1, 0.4) vs tokens = -0.5
    assert mcf["monotonicity"] == pytest.approx(-0.5) and mcf["worth_watching"] is False


def _record(key, suite, tokens, acc, seed=None):
    return {
        "suite_key": suite,
        "metrics": {"cf_arith": {"acc": acc, "acc_stderr": 0.1}},
        "higher_is_better": {"cf_arith": {"acc": True}},
        "checkpoint": {"key": key, "step": tokens // 10, "tokens_seen": tokens, "seed": seed},
    }


def test_build_leaderboard_files(tmp_path):
    records = [_record("b", "s1", 2000, 0.5), _record("a", "s1", 1000, 0.25)]
    summary = build_leaderboard(records, tmp_path)
    assert summary == {
        "num_models": 2,
        "num_metrics": 1,
        "num_worth_watching": 1,
        "num_plots": 1,
    }
    with open(tmp_path / "leaderboard.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["checkpoint"], r["tokens_seen"], r["cf_arith/acc"]) for r in table] == [
        ("a", "1000", "0.25"),
        ("b", "2000", "0.5"),
    ]
    wide = json.loads((tmp_path / "leaderboard.json").read_text())
    assert [r["checkpoint"] for r in wide] == ["a", "b"] and wide[1]["cf_arith/acc"] == 0.5
    assert "| a | s1 | 100 | 1000 |  | 0.25 |" in (tmp_path / "leaderboard.md").read_text()
    with open(tmp_path / "leaderboard_long.csv") as f:
        assert len(list(csv.DictReader(f))) == 2  # stderrs left out
    with open(tmp_path / "signal_quality.csv") as f:
        (quality,) = list(csv.DictReader(f))
    assert float(quality["monotonicity"]) == pytest.approx(1.0) and quality["x"] == "tokens_seen"
    assert (tmp_path / "plots" / "cf_arith__acc.png").exists()


def test_models_without_tokens_seen_plot_against_step(tmp_path):
    records = [_record("a", "s", 1000, 0.2), _record("b", "s", 2000, 0.4)]
    records.append({**_record("sft", "s", 0, 0.9), "checkpoint": {"key": "sft"}})
    build_leaderboard(records, tmp_path)
    with open(tmp_path / "signal_quality.csv") as f:
        (quality,) = list(csv.DictReader(f))
    assert quality["x"] == "step" and quality["num_checkpoints"] == "2"


def test_empty_leaderboard(tmp_path):
    summary = build_leaderboard([], tmp_path)
    assert summary["num_models"] == 0
    assert (tmp_path / "leaderboard.md").read_text() == "_no results yet_\n"
