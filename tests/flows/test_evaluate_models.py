"""``llmflow evaluate MODEL...``: models made elsewhere (Hub-layout folders in an offline mirror)
scored with the suite, on the leaderboard with their cards; bad input fails before anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flows.hub_models import save_hub_model

REPO = Path(__file__).resolve().parents[2]
SMALL = ["evaluate.num_items=8", "evaluate.limit=8", "evaluate.tasks=[cf_arith,mcf_arith]"]
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> Path:
    """A Hub mirror with a tiny Llama (a --local-dir download of commit A) and a tiny Qwen2."""
    root = tmp_path_factory.mktemp("mirror")
    save_hub_model(root, "acme/tiny-llama", "llama", commit=COMMIT_A)
    save_hub_model(root, "acme/tiny-qwen", "qwen2", seed=1)
    return root


@pytest.fixture
def with_mirror(mirror, monkeypatch) -> Path:
    monkeypatch.setenv("LLMFLOW_HUB_MIRROR", str(mirror))
    return mirror


def _run(models: list[str], root: Path, **fields):
    from llmflow.flows.evaluate_models import EvaluateModelsRun, plan_evaluation

    run = EvaluateModelsRun(models=models, root=str(root), overrides=SMALL, **fields)
    return plan_evaluation(run)


def _cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llmflow.flows.cli", "evaluate", *args]
    cmd += [a for o in SMALL for a in ("--set", o)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow  # two lm-eval runs and a temporary Prefect API through the CLI: ~60 s
def test_two_models_through_the_cli_reach_the_leaderboard_with_their_cards(mirror, tmp_path):
    from llmflow.tasks.evaluation.config import EvalConfig
    from llmflow.tasks.evaluation.harness import evaluate_hf

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(LLMFLOW_HUB_MIRROR=str(mirror), PREFECT_HOME=str(tmp_path / "prefect"))
    models = ["hf://models/acme/tiny-llama", "hf://models/acme/tiny-qwen"]
    out = _cli([*models, "--root", str(tmp_path / "runs"), "--name", "byo"], env)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = tmp_path / "runs"
    (board,) = (runs / "leaderboard").glob("byo-*/leaderboard.md")
    header, _, *lines = board.read_text().splitlines()
    names = [c.strip() for c in header.split("|")[1:-1]]
    rows = {}
    for line in lines[:2]:
        cells = dict(zip(names, (c.strip() for c in line.split("|")[1:-1]), strict=True))
        rows[cells["checkpoint"]] = cells
    assert set(rows) == {"tiny-llama", "tiny-qwen"}
    # each score is lm-eval's on the model as released: the mirror folder scored directly
    cfg = EvalConfig(tasks=["cf_arith", "mcf_arith"], num_items=8, limit=8)
    direct = evaluate_hf(cfg, mirror / "acme" / "tiny-qwen", tmp_path)
    (evaluation,) = (runs / "evaluate").glob("byo-tiny-qwen-*")
    results = json.loads((evaluation / "results.json").read_text())
    assert results["metrics"] == json.loads((tmp_path / "results.json").read_text())["metrics"]
    assert direct["mcf_arith/acc"] == results["metrics"]["mcf_arith"]["acc"]
    assert results["contamination"]["cf_arith"]["label"] == "not checked"  # no --corpus
    assert float(rows["tiny-qwen"]["mcf_arith/acc"]) == results["metrics"]["mcf_arith"]["acc"]
    # the cards name the pinned source: the commit the mirror records, else its fingerprint
    (llama_card,) = (runs / "card").glob("byo-tiny-llama-*/hf/README.md")
    text = llama_card.read_text()
    assert "base_model: acme/tiny-llama" in text
    assert f"`hf://models/acme/tiny-llama@{COMMIT_A}`" in text
    # no --corpus: the hashed toxicity classifier would have no ordinary text to learn from
    safety = text.split("## Bias and toxicity")[1].split("\n## ")[0]
    assert safety.strip() == "not recorded"  # the safety step did not run
    assert "safety is off for these models" in out.stdout + out.stderr
    (qwen_card,) = (runs / "card").glob("byo-tiny-qwen-*/hf/README.md")
    assert "`hf://models/acme/tiny-qwen@local-" in qwen_card.read_text()
    assert "config.json" not in qwen_card.read_text().split("---")[1]  # not a data set


def test_safety_runs_with_a_corpus_or_a_transformers_classifier_only(with_mirror, tmp_path):
    graph = _run(["hf://models/acme/tiny-qwen"], tmp_path / "runs")
    assert not [n for n in graph.nodes if n.step.name in ("safety", "toxicity-classifier")]


def test_a_pinned_revision_changes_the_evaluate_hash(tmp_path, monkeypatch):
    from llmflow.tasks.framework.errors import BadInputError
    from llmflow.tasks.framework.executor import Executor

    mirror = tmp_path / "mirror"
    monkeypatch.setenv("LLMFLOW_HUB_MIRROR", str(mirror))
    save_hub_model(mirror, "acme/m", "llama", seed=0, commit=COMMIT_A)

    def evaluate_address(ref: str) -> str:
        # the graph's first two nodes, without the recipe's imports: pin, copy, then address
        from llmflow.tasks.evaluation.config import EvalConfig
        from llmflow.tasks.evaluation.external import external_model, pin_model
        from llmflow.tasks.evaluation.harness import evaluate
        from llmflow.tasks.framework.graph import Graph, Raw

        source, files = pin_model(ref)
        graph = Graph()
        model = graph.add(external_model, source, "m", files=Raw(files))
        executor = Executor(str(tmp_path / "runs"))
        uri = executor.run(graph)[model].uri
        return evaluate.address(executor.store, EvalConfig(), "m", {"model": uri})[0]

    at_a = evaluate_address(f"hf://models/acme/m@{COMMIT_A}")
    assert evaluate_address("hf://models/acme/m") == at_a  # the same files, the same pin
    save_hub_model(mirror, "acme/m", "llama", seed=1, commit=COMMIT_B)  # the repo moved on
    at_b = evaluate_address(f"hf://models/acme/m@{COMMIT_B}")
    assert at_b != at_a
    with pytest.raises(BadInputError, match=f"revision '{COMMIT_A}' is not in the mirror"):
        evaluate_address(f"hf://models/acme/m@{COMMIT_A}")
    # a local folder: its files' sha256 enter the hash (one changed byte is another model)
    folder = mirror / "acme" / "m"
    before = evaluate_address(str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert evaluate_address(str(folder)) != before


def _no_weights(mirror: Path) -> str:
    folder = save_hub_model(mirror, "acme/no-weights", "llama")
    (folder / "model.safetensors").unlink()
    return "hf://models/acme/no-weights"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda m: "hf://models/acme/missing", "no repo acme/missing in the mirror"),
        (lambda m: f"hf://models/acme/tiny-llama@{COMMIT_B}", f"revision '{COMMIT_B}' is not"),
        (_no_weights, "holds no weights"),
        (
            lambda m: str(save_hub_model(m, "acme/classifier", "llama-classifier")),
            r"architectures=\['LlamaForSequenceClassification'\] is not a causal",
        ),
        (lambda m: str(m / "acme" / "nowhere"), "no such folder"),
    ],
    ids=["missing-repo", "missing-revision", "no-weights", "classifier", "missing-folder"],
)
def test_bad_models_fail_in_seconds_naming_them_with_nothing_written(
    with_mirror, tmp_path, make, message
):
    import llmflow.flows.evaluate_models  # noqa: F401  (imported before the clock starts)
    from llmflow.tasks.framework.errors import BadInputError

    ref = make(with_mirror)
    started = time.perf_counter()
    with pytest.raises(BadInputError, match=message) as err:
        _run(["hf://models/acme/tiny-qwen", ref], tmp_path / "runs")
    assert time.perf_counter() - started < 10
    assert ref in str(err.value)
    assert not (tmp_path / "runs").exists()


def test_a_corpus_that_is_not_in_the_store_fails_naming_it(with_mirror, tmp_path):
    from llmflow.tasks.framework.errors import BadInputError

    corpus = str(tmp_path / "runs" / "decontaminate" / "nope-0123456789abcdef")
    with pytest.raises(BadInputError, match="corpus=.*is not a committed output"):
        _run(["hf://models/acme/tiny-qwen"], tmp_path / "runs", corpus=corpus)


def test_the_cli_refuses_a_classifier_before_prefect_starts(mirror, tmp_path):
    save_hub_model(mirror, "acme/cls", "llama-classifier")
    env = {**os.environ, "LLMFLOW_HUB_MIRROR": str(mirror), "PREFECT_HOME": str(tmp_path / "p")}
    out = _cli(["hf://models/acme/cls", "--root", str(tmp_path / "runs")], env)
    assert out.returncode == 2
    assert "model='hf://models/acme/cls'" in out.stderr and "not a causal" in out.stderr
    assert not (tmp_path / "runs").exists() and not list((tmp_path / "p").rglob("*.db"))


@pytest.mark.slow  # an lm-eval run on the Prefect harness: ~30-60 s
def test_scheduled_evaluation_scores_an_external_model_once_and_a_bad_one_fails_alone(
    prefect_harness, with_mirror, tmp_path
):
    from llmflow.flows.evaluate_scheduled import ScheduledEvaluationConfig, scheduled_evaluation
    from llmflow.tasks.evaluation.config import EvalConfig
    from llmflow.tasks.framework.store import Store

    suite = EvalConfig(tasks=["cf_arith"], num_items=8, limit=8)
    models = ["hf://models/acme/tiny-llama", "hf://models/acme/gone"]
    cfg = ScheduledEvaluationConfig(root=str(tmp_path), evaluate=suite, models=models)
    first = scheduled_evaluation(cfg, return_state=True)
    assert first.is_failed()
    with pytest.raises(
        Exception, match="(?s)1 checkpoint.*hf://models/acme/gone: .*no repo acme/gone"
    ):
        first.result()
    store = Store(tmp_path)
    (copied,) = store.list_outputs("external-model")
    assert len(store.list_outputs("evaluate")) == 1
    (board,) = store.list_outputs("leaderboard")
    assert "| tiny-llama |" in (Path(board) / "leaderboard.md").read_text()
    again = scheduled_evaluation(cfg.model_copy(update={"models": models[:1]}))
    assert [(r["checkpoint"], r["status"], r["cached"]) for r in again] == [(copied, "ok", True)]


@pytest.mark.slow  # the real ingest and decontaminate steps, then one lm-eval run: ~30-60 s
def test_with_a_corpus_scores_carry_the_share_of_items_found_in_it(with_mirror, tmp_path):
    from llmflow.flows.evaluate_models import evaluation_graph
    from llmflow.tasks.config import load_config
    from llmflow.tasks.decontam.config import DecontamSettings, decontam_config
    from llmflow.tasks.decontam.step import decontaminate
    from llmflow.tasks.evaluation.synthetic import fact_items
    from llmflow.tasks.framework.executor import Executor
    from llmflow.tasks.framework.step import RawFiles
    from llmflow.tasks.framework.store import Store
    from llmflow.tasks.ingest.ingest import IngestConfig, ingest_sources

    suite = ["evaluate.num_items=8", "evaluate.limit=8", "evaluate.tasks=[cf_facts]"]
    config = load_config(None, [f"root={tmp_path / 'runs'}", *suite])
    # one of the 8 items on a web page (a fact: datatrove's normalization makes every digit 0)
    item = fact_items(8, config.evaluate.seed)[2]
    assert item["question"] == "What month comes after November?"
    docs = [f"Homework. {item['question']} {item['answer']}. Well done!", "Nothing to see here."]
    raw = tmp_path / "corpus.jsonl"
    raw.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    store = Store(tmp_path / "runs")
    ingested = ingest_sources.run(store, IngestConfig(), "c", {"files": RawFiles((str(raw),))})
    checked = decontam_config(DecontamSettings(mode="flag", min_item_words=1), config.evaluate)
    corpus = decontaminate.run(store, checked, "c", {"corpus": ingested.uri}).uri

    graph = evaluation_graph(config, ["hf://models/acme/tiny-llama"], corpus=corpus)
    outcome = Executor(str(tmp_path / "runs")).run(graph)
    (scores,) = graph.find(step="evaluate")
    results = json.loads((Path(outcome[scores].uri) / "results.json").read_text())
    assert results["contamination_source"] == corpus
    marks = results["contamination"]
    assert (marks["cf_facts"]["contaminated_items"], marks["cf_facts"]["items"]) == (1, 8)
    assert marks["cf_facts"]["share"] == pytest.approx(1 / 8)
    (card,) = graph.find(step="card")
    assert "12.5% (1/8 items)" in (Path(outcome[card].uri) / "hf" / "README.md").read_text()


def test_a_model_output_of_the_store_is_evaluated_where_it_stands(with_mirror, tmp_path):
    from llmflow.tasks.evaluation.external import external_model, pin_model
    from llmflow.tasks.framework.executor import Executor
    from llmflow.tasks.framework.graph import Existing, Graph, Raw

    source, files = pin_model("hf://models/acme/tiny-qwen")
    first = Graph()
    node = first.add(external_model, source, "tiny-qwen", files=Raw(files))
    output = Executor(str(tmp_path / "runs")).run(first)[node].uri  # a model output, committed
    graph = _run([output, "hf://models/acme/tiny-llama"], tmp_path / "other-root")
    (stored, copied) = graph.find(step="evaluate")
    assert stored.inputs["model"] == Existing(output)  # not copied: its lineage follows it
    assert stored.name == "quickstart-tiny-qwen"
    assert [n.name for n in graph.find(step="external-model")] == ["tiny-llama"]
    assert copied.inputs["model"] is graph.find(step="external-model")[0]
