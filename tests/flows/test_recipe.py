"""The recipe as a graph: its shape, its queries, and the read audit over every step."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import pytest

from llmflow.flows.recipe import recipe
from llmflow.tasks.config import PHASES, load_config
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.executor import Executor

TINY = [
    "sample.num_code_files=6",
    "sample.num_math_docs=60",
    "sample.num_exact_duplicates=4",
    "sample.num_near_duplicates=4",
    "sample.num_junk=3",
    "tokenizer.vocab_size=512",
    "pretrain.stages.0.mixture.num_tokens=6000",
    "pretrain.stages.1.mixture.num_tokens=3000",
    "pretrain.stages.2.mixture.num_tokens=3000",
    "pretrain.train.checkpoint.interval=2",
    "pretrain.train.schedule.warmup_steps=1",
    "extend.stages.0.num_tokens=4000",
    "extend.stages.1.num_tokens=4000",
    "extend.eval.lengths=[256]",
    "extend.eval.depths=[0.5]",
    "extend.eval.trials=1",
    "extend.eval.position_loss_len=512",
    "evaluate.tasks=[heldout_ppl,cf_arith,gen_arith]",
    "evaluate.num_items=4",
    "evaluate.num_ppl_docs=2",
    "sft.max_steps=2",
    "sft.num_quickstart_examples=32",
    "sft.num_heldout=4",
    "dpo.max_steps=2",
    "dpo.num_quickstart_examples=32",
    "dpo.num_heldout=4",
    "grpo.max_steps=1",
    "grpo.num_quickstart_examples=8",
    "grpo.num_heldout=4",
    "grpo.per_device_batch_size=4",
    "grpo.num_generations=4",
    "grpo.max_completion_length=4",
]


def test_the_recipe_is_the_whole_dag_in_run_order():
    graph = recipe(load_config(None))
    steps = [n.step.name for n in graph.nodes]
    assert steps[:2] == ["sample", "ingest"] and steps[-1] == "leaderboard"
    assert steps.count("pretrain") == 5 and steps.count("evaluate") == 6
    phases = [PHASES.index(n.phase) for n in graph.nodes]
    assert phases == sorted(phases)  # so cutting at a phase keeps a prefix of the run order
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:  # every input comes from an earlier node
        assert all(index[id(up)] < index[id(node)] for up in node.upstream())
    stages = graph.find(step="pretrain", phase="pretrain")
    assert [n.name for n in stages] == [
        "quickstart-stage1",
        "quickstart-stage2",
        "quickstart-stage3",
    ]
    assert stages[1].inputs["init"] is stages[0]


def test_until_is_a_query_on_the_graph():
    graph = recipe(load_config(None))
    data = graph.until("mixture")
    assert {n.step.name for n in data.nodes} >= {"tokenize", "validation", "mixture"}
    assert not data.find(step="pretrain")
    assert [n.step.name for n in graph.until("ingest").nodes] == ["sample", "ingest"]


def test_the_quickstart_evaluates_bias_and_toxicity_by_default_on_the_packaged_data():
    from llmflow.tasks.safety.data import packaged_root

    graph = recipe(load_config(None))
    (classifier,) = graph.find(step="toxicity-classifier")
    assert all(Path(f).is_relative_to(packaged_root()) for f in classifier.inputs["data"].files)
    evaluated = {n.name for n in graph.find(step="evaluate")}
    checked = graph.find(step="safety")
    assert {n.name for n in checked} == evaluated and len(checked) == 6  # every model
    assert all(n.inputs["classifier"] is classifier for n in checked)
    cards = graph.find(step="card")
    assert all(c.inputs["safety"] in checked for c in cards) and len(cards) == 6
    off = recipe(load_config(None, ["safety.data_root=null"]))
    assert not off.find(step="safety") and not off.find(step="toxicity-classifier")
    with pytest.raises(BadInputError, match="safety data not found: /no/such/crows"):
        recipe(load_config(None, ["safety.data_root=/no/such"]))


def test_a_missing_data_path_fails_before_anything_starts():
    config = load_config(None).model_copy(update={"data": ["/no/such/file"]})
    started = time.perf_counter()
    with pytest.raises(BadInputError, match="does not exist: /no/such/file"):
        recipe(config)
    assert time.perf_counter() - started < 1.0


def _audited(tmp_path, graph):
    executor = Executor(str(tmp_path), audit=True)
    executor.run(graph)
    return executor


def test_the_audit_catches_a_planted_unhashed_read_in_a_real_step(tmp_path, monkeypatch):
    import llmflow.flows.recipe as recipe_module

    undeclared = dataclasses.replace(recipe_module.train_tokenizer, execution=())
    monkeypatch.setattr(recipe_module, "train_tokenizer", undeclared)
    graph = recipe(load_config(None, TINY)).until("tokenizer")
    executor = _audited(tmp_path, graph)
    assert executor.unhashed_reads(graph) == {"tokenizer": ["read_batch_rows"]}


SAFETY = [  # the safety steps, sized for a test
    "safety.eval.crows_limit=8",
    "safety.eval.prompts_per_file=1",
    "safety.eval.samples_per_prompt=1",
    "safety.eval.max_new_tokens=4",
    "safety.classifier.background_docs=50",
]


@pytest.mark.slow
def test_every_step_reads_only_what_its_hash_covers(tmp_path):
    graph = recipe(load_config(None, TINY + SAFETY))  # on the packaged data (the default)
    executor = _audited(tmp_path, graph)
    assert {"safety", "toxicity-classifier"} <= set(executor.reads)
    assert set(executor.reads) == {n.step.name for n in graph.nodes}  # every step ran, audited
    assert executor.unhashed_reads(graph) == {}


def test_the_readme_lists_every_phase_and_draws_every_step():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    until = readme[readme.index("- `--until PHASE`") :].split("\n- ")[0]
    assert re.findall(r"`([a-z]+)`", until) == list(PHASES)
    picture = readme[readme.index("## What one run does") :].split("```")[1]
    steps = {n.step.name for n in recipe(load_config(None)).nodes} | {"grpo", "merge", "average"}
    for name in steps - {"validation", "mixture", "tokenize", "toxicity-classifier", "safety"}:
        assert name.split("-")[0] in picture, name


def test_only_a_run_that_reaches_the_merge_needs_mergekit(monkeypatch):
    """A machine without the merge extra runs ``--until pretrain``; the whole run is refused
    before anything starts, naming the extra."""
    import importlib.util

    from llmflow.flows.recipe import planned

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mergekit" else real(name, *a)
    )
    config = load_config(None)
    assert planned(config.model_copy(update={"until": "pretrain"})).nodes
    with pytest.raises(BadInputError, match=r"merge.enabled needs mergekit"):
        planned(config)
    assert planned(load_config(None, ["merge.enabled=false"])).nodes
