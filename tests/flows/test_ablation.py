"""The annealing ablation's candidate arm: 40% baseline mix + 60% candidate, by hand."""

import pytest

from llmflow.flows.ablation import arm_weights


def test_candidate_arm_is_forty_sixty():
    w = arm_weights({"prose": 2.0, "code": 1.0, "math": 1.0}, "math", 0.6)
    assert w == pytest.approx({"prose": 0.2, "code": 0.1, "math": 0.1 + 0.6})
    assert sum(w.values()) == pytest.approx(1.0)
    w = arm_weights({"prose": 1.0}, "code", 0.6)
    assert w == pytest.approx({"prose": 0.4, "code": 0.6})
