"""Per-model evaluation is wired once (flows/model_evaluation.py): the recipe, ``llmflow evaluate``
and the scheduled evaluation all get evaluate, safety and card from it, and no flow module keeps
state between graph builds."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from tests.flows.hub_models import save_hub_model

REPO = Path(__file__).resolve().parents[2]
BUILDER = REPO / "flows" / "model_evaluation.py"
STORE_OUTPUT = "/r/export/quickstart-base-0123456789abcdef"  # a committed export, by address

_spec = importlib.util.spec_from_file_location(
    "eval_fixtures",
    Path(__file__).resolve().parents[1] / "tasks" / "evaluation" / "eval_fixtures.py",
)
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> Path:
    """A tiny causal Llama (a model made elsewhere) and a tiny Llama sequence classifier."""
    root = tmp_path_factory.mktemp("mirror")
    save_hub_model(root, "acme/tiny-llama", "llama", commit="a" * 40)
    save_hub_model(root, "acme/classifier", "llama-classifier")
    return root


def _per_model(graph) -> dict[str, tuple]:
    """Each evaluate node's label -> (its model, its safety node, its card node)."""
    found = {}
    for scores in graph.find(step="evaluate"):
        (card,) = [c for c in graph.find(step="card") if c.inputs["evaluation"] is scores]
        checked = [s for s in graph.find(step="safety") if s.name == scores.name]
        assert len(checked) <= 1
        found[scores.name] = (scores.inputs["model"], checked[0] if checked else None, card)
    return found


def test_scheduled_evaluation_has_a_safety_and_a_card_node_per_model(mirror):
    from llmflow.flows.evaluate_scheduled import ScheduledEvaluationConfig, evaluation_graph
    from llmflow.tasks.evaluation.external import pin_model
    from llmflow.tasks.framework.graph import Existing

    external = [pin_model(str(mirror / "acme" / "tiny-llama"))]
    classifier = {"classifier": {"model": str(mirror / "acme" / "classifier")}}
    config = ScheduledEvaluationConfig(root="/r", safety=classifier)
    graph = evaluation_graph(config, [STORE_OUTPUT], external)
    per_model = _per_model(graph)
    assert sorted(per_model) == ["quickstart-base", "tiny-llama"]
    (trained,) = graph.find(step="toxicity-classifier")  # one classifier, shared
    (copied,) = graph.find(step="external-model")
    assert per_model["quickstart-base"][0] == Existing(STORE_OUTPUT)
    assert per_model["tiny-llama"][0] is copied
    for model, checked, card in per_model.values():
        assert checked.inputs["model"] == model and checked.inputs["classifier"] is trained
        assert card.inputs["model"] == model and card.inputs["safety"] is checked
        assert checked.config.dtype == config.evaluate.dtype  # run as evaluate runs the model
    assert per_model["tiny-llama"][2].config.model_name == "tiny-llama"
    # the hashed classifier with no corpus to learn ordinary text from: safety off, cards kept
    plain = evaluation_graph(ScheduledEvaluationConfig(root="/r"), [STORE_OUTPUT], external)
    assert not plain.find(step="safety") and not plain.find(step="toxicity-classifier")
    assert [checked for _, checked, _ in _per_model(plain).values()] == [None, None]
    assert evaluation_graph(config, [], []).nodes == []  # no model: no classifier either


def test_a_scheduled_run_commits_a_card_per_model_and_the_leaderboard_carries_them(
    prefect_harness, mirror, tmp_path
):
    from llmflow.flows.evaluate_scheduled import ScheduledEvaluationConfig, scheduled_evaluation
    from llmflow.tasks.evaluation.config import EvalConfig
    from llmflow.tasks.evaluation.export import ExportConfig, export
    from llmflow.tasks.framework.store import Store

    store = Store(tmp_path)
    tokenizer = fx.fixture_tokenizer.run(store, fx.TokenizerFixture(), "tiny").uri
    progress = fx.CheckpointFixture(seed=0, total_tokens_seen=1000)
    checkpoint = fx.fixture_checkpoint.run(store, progress, "a").uri
    inputs = {"checkpoint": checkpoint, "tokenizer": tokenizer}
    model = export.run(store, ExportConfig(label="a"), "a", inputs).uri
    small = {"crows_limit": 4, "prompts_per_file": 1, "samples_per_prompt": 1, "max_new_tokens": 4}
    safety = {"classifier": {"model": str(mirror / "acme" / "classifier")}, "eval": small}
    cfg = ScheduledEvaluationConfig(
        root=str(tmp_path), evaluate=EvalConfig(tasks=["cf_arith"], num_items=8, limit=8),
        safety=safety,
    )  # fmt: skip

    (row,) = scheduled_evaluation(cfg)
    assert (row["checkpoint"], row["status"], row["cached"]) == (model, "ok", False)
    (card,) = store.list_outputs("card")
    (checked,) = store.list_outputs("safety")
    assert row["card"] == card
    assert _inputs(store, card) == {
        "model": [model], "evaluation": [row["evaluation"]], "safety": [checked]
    }  # fmt: skip
    text = (Path(card) / "hf" / "README.md").read_text()
    assert "cf_arith" in text
    bias = text.split("## Bias and toxicity")[1].split("\n## ")[0]
    assert "not recorded" not in bias  # the safety step ran and the card reports it
    (board,) = store.list_outputs("leaderboard")
    assert _inputs(store, board)["cards"] == [card]
    again = scheduled_evaluation(cfg)
    assert [(r["cached"], r["card"]) for r in again] == [(True, card)]
    assert len(store.list_outputs("card")) == 1  # run-once: the card is found, not rewritten


def _inputs(store, uri: str) -> dict[str, list[str]]:
    """An output's upstream URIs by input name, from its lineage record."""
    found: dict[str, list[str]] = {}
    for record in store.read_lineage(uri)["inputs"]:
        found.setdefault(record["name"], []).append(record["uri"])
    return found


STEPS_OF_ONE_MODEL = re.compile(r"\.add\(\s*(evaluate|safety|model_card|leaderboard)\s*,")


def test_evaluate_safety_card_and_leaderboard_nodes_are_added_only_by_the_builder():
    adders = sorted(
        str(path.relative_to(REPO))
        for folder in ("flows", "tasks", "benchmarks")
        for path in (REPO / folder).rglob("*.py")
        if STEPS_OF_ONE_MODEL.search(path.read_text())
    )
    assert adders == ["flows/model_evaluation.py"]
    uses = [
        f.name for f in (REPO / "flows").glob("*.py") if "add_model_evaluation(" in f.read_text()
    ]
    assert sorted(uses) == [
        "evaluate_models.py", "evaluate_scheduled.py", "model_evaluation.py", "recipe.py"
    ]  # fmt: skip


MUTABLE = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "Counter", "OrderedDict", "deque"}


def _module_mutables(path: Path) -> list[str]:
    """Names bound at module level to a dict, list or set (state that outlives a graph build)."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            value = node.value
            call = isinstance(value, ast.Call) and getattr(value.func, "id", "") in MUTABLE_CALLS
            if isinstance(value, MUTABLE) or call:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [ast.unparse(t) for t in targets]
    return found


@pytest.mark.parametrize(
    "module", ["recipe", "evaluate_models", "evaluate_scheduled", "ablation", "model_evaluation"]
)
def test_no_module_level_mutable_state(module):
    assert _module_mutables(REPO / "flows" / f"{module}.py") == []


def test_the_recipe_builds_the_same_graph_twice_and_has_no_models_holder():
    import llmflow.flows.recipe as recipe_module
    from llmflow.tasks.config import load_config

    assert not hasattr(recipe_module, "_SAID") and not hasattr(recipe_module, "Models")
    config = load_config(None, ["safety.data_root=null"])
    first, second = recipe_module.recipe(config), recipe_module.recipe(config)
    assert [(n.step.name, n.name, n.phase) for n in first.nodes] == [
        (n.step.name, n.name, n.phase) for n in second.nodes
    ]
    (board,) = first.find(step="leaderboard")
    assert board.config.labels == ["base", "extended", "sft", "dpo", "grpo", "merged"]
    assert board.inputs["cards"] == first.find(step="card")
