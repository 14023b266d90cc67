"""The annealing ablation: its arms' weights by hand, its graph, and a real tiny run through
``llmflow ablate``; a change to one pretraining stage re-runs that stage and those after it only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmflow.flows.ablation import AblationConfig, ablation_graph, arm_weights
from llmflow.tasks.config import load_config
from llmflow.tasks.framework.store import Store

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "sample.num_code_files=4",
    "sample.num_math_docs=30",
    "sample.num_exact_duplicates=4",
    "sample.num_near_duplicates=4",
    "sample.num_junk=3",
    "tokenizer.vocab_size=512",
    "pretrain.stages.0.mixture.num_tokens=8192",
    "pretrain.stages.1.mixture.num_tokens=4096",
    "pretrain.stages.2.mixture.num_tokens=4096",
    "pretrain.train.checkpoint.interval=2",
    "pretrain.train.schedule.warmup_steps=1",
    "evaluate.tasks=[cf_arith,mcf_arith]",
    "evaluate.num_items=8",
]


def test_candidate_arm_is_forty_sixty():
    w = arm_weights({"prose": 2.0, "code": 1.0, "math": 1.0}, "math", 0.6)
    assert w == pytest.approx({"prose": 0.2, "code": 0.1, "math": 0.1 + 0.6})
    assert sum(w.values()) == pytest.approx(1.0)
    w = arm_weights({"prose": 1.0}, "code", 0.6)
    assert w == pytest.approx({"prose": 0.4, "code": 0.6})


def test_a_baseline_naming_no_domain_is_refused_not_made_a_candidate_only_arm():
    from llmflow.tasks.framework.errors import BadInputError

    # weights {} trains on the data's domains by tokens: arm_weights made {"code": 0.6} of it
    with pytest.raises(BadInputError, match=r"mixture.weights is \{\}"):
        arm_weights({}, "code", 0.6)


def test_arms_anneal_from_the_chosen_stage_on_their_own_mixtures():
    config = load_config(None, TINY)
    graph, models = ablation_graph(config, AblationConfig(candidate="math", num_tokens=2048))
    stages = [n for n in graph.find(step="pretrain") if "-ablation-" not in n.name]
    arms = [n for n in graph.find(step="pretrain") if "-ablation-" in n.name]
    assert [n.name for n in stages] == [f"quickstart-stage{i}" for i in (1, 2, 3)]
    assert [n.name for n in arms] == [
        "quickstart-ablation-baseline",
        "quickstart-ablation-plus-math",
    ]
    baseline = config.pretrain.stages[-1].mixture.weights
    for arm, weights in zip(arms, [baseline, arm_weights(baseline, "math", 0.6)], strict=True):
        assert arm.inputs["init"] is stages[1]  # from_stage=-2: stage 2 of 3
        assert arm.inputs["data"].config.weights == pytest.approx(weights)
        assert arm.inputs["data"].config.num_tokens == 2048
        assert arm.config.train.num_tokens == 2048 and arm.config.train.schedule.name == "linear"
    assert [m.label for m in models] == [
        "ablation-baseline",
        "ablation-plus-math",
    ]


@pytest.fixture(scope="module")
def pretrained(prefect_harness, tmp_path_factory):
    """The pipeline run until pretrain on a tiny config: (root, results by (step, label))."""
    from llmflow.flows.pipeline import pipeline

    root = tmp_path_factory.mktemp("ablation-root")
    return root, _by_address(pipeline(load_config(None, [f"root={root}", "until=pretrain", *TINY])))


def _by_address(results) -> dict[tuple[str, str], object]:
    return {Store.address_of(r.uri)[:2]: r for r in results}


@pytest.mark.slow
def test_stage2_change_reruns_stage2_and_stage3_only(pretrained):
    from llmflow.flows.pipeline import pipeline

    root, first = pretrained
    assert not any(r.cached for r in first.values())
    changed = ["pretrain.stages.1.mixture.seed=7"]
    second = _by_address(
        pipeline(load_config(None, [f"root={root}", "until=pretrain", *TINY, *changed]))
    )
    assert set(second) == set(first)
    rerun = {
        ("mixture", "quickstart-stage2"),
        ("pretrain", "quickstart-stage2"),
        ("pretrain", "quickstart-stage3"),
    }
    for key, result in second.items():
        if key in rerun:
            assert not result.cached and result.uri != first[key].uri, key
        else:  # found in the store at the same address, not executed again
            assert result.cached and result.uri == first[key].uri, key
    lineage = Store(str(root)).read_lineage(second["pretrain", "quickstart-stage3"].uri)
    assert second["pretrain", "quickstart-stage2"].uri in json.dumps(lineage["inputs"])


@pytest.mark.slow
def test_llmflow_ablate_runs_both_arms_from_the_cached_curriculum(pretrained):
    root, first = pretrained
    store = Store(str(root))
    stages_before = set(store.list_outputs("pretrain"))
    args = [sys.executable, "-m", "llmflow.flows.cli", "ablate", "--root", str(root)]
    args += ["--candidate", "math", "--num-tokens", "2048"]
    for override in TINY:
        args += ["--set", override]
    out = subprocess.run(
        args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # The curriculum came from the store: no new stage outputs, two annealed arms.
    new = set(store.list_outputs("pretrain")) - stages_before
    assert sorted(Store.address_of(u)[1] for u in new) == [
        "quickstart-ablation-baseline",
        "quickstart-ablation-plus-math",
    ]
    scores = {}
    for arm in ("baseline", "plus-math"):
        (evaluation,) = [
            u for u in store.list_outputs("evaluate") if f"quickstart-ablation-{arm}-" in u
        ]
        scores[arm] = store.read_lineage(evaluation)["metrics"]
        (annealed,) = [u for u in store.list_outputs("pretrain") if f"ablation-{arm}-" in u]
        summary = json.loads((Path(annealed) / "summary.json").read_text())
        assert 2048 <= summary["tokens_seen"] < 2048 + 8 * 256  # one batch of rounding at most
        lineage = json.dumps(store.read_lineage(annealed)["inputs"])
        assert first["pretrain", "quickstart-stage2"].uri in lineage
    table = {
        line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[-10:] if "/" in line
    }
    for metric in ("cf_arith/acc", "mcf_arith/acc"):
        base, cand, diff = (float(v) for v in table[metric])
        assert base == pytest.approx(scores["baseline"][metric], abs=1e-4)
        assert cand == pytest.approx(scores["plus-math"][metric], abs=1e-4)
        assert diff == pytest.approx(cand - base, abs=1e-3)
