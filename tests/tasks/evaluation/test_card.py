"""The model card: written from a model's lineage, loaded and checked by huggingface_hub offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from eval_fixtures import (
    CheckpointFixture,
    TokenizerFixture,
    fixture_checkpoint,
    fixture_tokenize,
    fixture_tokenizer,
)
from huggingface_hub import ModelCard, metadata_load
from huggingface_hub.repocard_data import model_index_to_eval_results
from pydantic import BaseModel

from llmflow.tasks.curation.shards import ShardWriter
from llmflow.tasks.decontam.config import DecontamConfig
from llmflow.tasks.decontam.step import decontaminate
from llmflow.tasks.evaluation.card import NOT_RECORDED, CardConfig, card_config, model_card
from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.export import ExportConfig, export
from llmflow.tasks.evaluation.harness import evaluate
from llmflow.tasks.evaluation.leaderboard import LeaderboardConfig, leaderboard
from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.step import Metrics, step


def output(root: Path, name: str, step: str, inputs=(), **fields) -> Path:
    """A committed-looking output: its lineage.json (and any extra files given as JSON)."""
    out = root / f"{step}-{name}"
    out.mkdir(parents=True)
    files = fields.pop("files", {})
    record = {
        "step": step,
        "name": name,
        "hash": f"h-{step}-{name}",
        "inputs": [{"name": key, "uri": str(uri)} for key, uri in inputs],
        "started_at": fields.pop("started_at", "2026-01-01T00:00:00"),
        **fields,
    }
    (out / "lineage.json").write_text(json.dumps(record))
    for file, content in files.items():
        (out / file).write_text(json.dumps(content))
    return out


@pytest.fixture
def lineage(tmp_path: Path) -> dict[str, Path]:
    """sample -> ingest -> curate -> decontaminate -> tokenize -> 2 stages -> export -> sft."""
    root = tmp_path / "runs"
    sample = output(root, "q", "sample")
    raw = {"uri": "/data/web.jsonl", "sha256": "ab" * 32, "bytes": 10}
    ingest = output(root, "q", "ingest", [("sample", sample)], sources=[raw])
    stages = [{"stage": "filters", "documents_in": 100, "documents_out": 80,
               "removed": {"gopher_short": {"docs": 15}, "c4_badwords": {"docs": 5}}}]  # fmt: skip
    curate = output(
        root, "q", "curate", [("x", ingest)], files={"curation_report.json": {"stages": stages}}
    )
    decont = output(root, "q", "decontaminate", [("corpus", curate)],
                    metrics={"documents_removed": 3, "documents_contaminated": 3})  # fmt: skip
    tokenized = output(root, "q", "tokenize", [("corpus", decont)])
    train = {"optimizer": {"lr": 0.003}, "schedule": {"warmup_steps": 20, "min_lr_ratio": 0.1}}
    stage_metrics = {"tokens_seen": 7200, "tokens_per_s": 3600.0, "world_size": 2, "steps": 9}
    s1 = output(root, "q-stage1", "pretrain", [("data", tokenized)], config={"train": train},
                metrics=stage_metrics, started_at="2026-01-01T01:00:00")  # fmt: skip
    s2 = output(root, "q-stage2", "pretrain", [("init", s1)], config={"train": train},
                metrics={**stage_metrics, "final_loss": 2.5}, started_at="2026-01-01T02:00:00")  # fmt: skip
    export = output(root, "q-extended", "export", [("checkpoint", s2)],
                    metrics={"num_parameters": 1000})  # fmt: skip
    (export / "hf").mkdir()
    (export / "hf" / "config.json").write_text('{"model_type": "llama"}')
    (export / "hf" / "model.safetensors").write_bytes(b"weights")
    sft = output(root, "q", "sft", [("model", export)],
                 metrics={"num_steps": 60, "train_loss": 1.5})  # fmt: skip
    (sft / "hf").mkdir()
    (sft / "hf" / "model.safetensors").write_bytes(b"tuned")
    results = {
        "metrics": {"gsm8k_local": {"exact_match": 0.25, "exact_match_stderr": 0.1},
                    "ppl_prose": {"word_perplexity": 42.0}},
        "contamination": {"gsm8k_local": {"share": 0.025, "label": "2.5% (3/120 items)"}},
    }  # fmt: skip
    evaluation = tmp_path / "evaluation"
    evaluation.mkdir()
    (evaluation / "results.json").write_text(json.dumps(results))
    return {"export": export, "sft": sft, "evaluation": evaluation}


def write_card(cfg: CardConfig, model: Path, evaluation: Path, out: Path, **kw) -> Path:
    out.mkdir()
    model_card(cfg, model=model, evaluation=evaluation, out=out, **kw)
    return out / "hf" / "README.md"


def test_the_card_loads_with_huggingface_hub_and_says_how_the_model_was_made(lineage, tmp_path):
    from llmflow.tasks.config import load_config

    cfg = card_config(load_config(None), "sft")
    path = write_card(cfg, lineage["sft"], lineage["evaluation"], tmp_path / "card")
    card = ModelCard.load(path)  # parses the YAML block; validate() would need the Hub
    data = card.data
    assert (data.license, data.library_name, data.pipeline_tag) == (
        "apache-2.0",
        "transformers",
        "text-generation",
    )
    assert data.language == ["en"] and data.base_model == "q-extended"
    assert data.datasets == ["generated sample (step 'sample')", "web.jsonl"]
    results = {(r.dataset_name, r.metric_type): r.metric_value for r in data.eval_results}
    assert results == {("gsm8k_local", "exact_match"): 0.25, ("ppl_prose", "word_perplexity"): 42.0}
    meta = metadata_load(path)  # the raw YAML, read as the Hub reads it
    name, parsed = model_index_to_eval_results(meta["model-index"])
    assert name == "quickstart-sft" and len(parsed) == 2
    text = card.text
    assert "ab" * 32 in text  # the source's sha256
    assert "| filters | 100 | 80 | gopher_short 15, c4_badwords 5 |" in text
    assert "3 training documents matched an evaluation set; 3 removed." in text
    assert "| q-stage1 | 7200 | 9 | 0.003 | warmup_steps=20, min_lr_ratio=0.1 |" in text
    assert "2.5% (3/120 items)" in text
    # 6 x 1000 parameters x 14400 tokens; 2 stages x 2 s x 2 devices = 8 s
    assert "training FLOPs (6·N·D estimate): 8.640e+07" in text
    assert f"device-hours (pretraining, from tokens/s and world size): {8 / 3600:.4f}" in text
    assert f"## Bias and toxicity\n\n{NOT_RECORDED}" in text
    assert "llmflow run llmflow_config.yaml" in text and cfg.config_hash in text
    folder = path.parent
    assert (folder / "llmflow_config.yaml").read_text() == cfg.config_yaml
    linked = folder / "model.safetensors"
    assert os.stat(linked).st_ino == os.stat(lineage["sft"] / "hf" / "model.safetensors").st_ino


def test_safety_metrics_are_read_when_given(lineage, tmp_path):
    safety = tmp_path / "safety"
    safety.mkdir()
    (safety / "metrics.json").write_text(json.dumps({"crows_pairs/pct_stereotype": 0.56}))
    classifier = {"kind": "transformers", "model": "org/tox@abc123", "held_out_auc": 0.9132}
    (safety / "results.json").write_text(json.dumps({"classifier": classifier}))
    cfg = CardConfig(model_name="q-extended")
    path = write_card(cfg, lineage["export"], lineage["evaluation"], tmp_path / "c", safety=safety)
    text = path.read_text()
    assert "| crows_pairs/pct_stereotype | 0.56 |" in text
    assert "Toxicity classifier: `org/tox@abc123` (transformers; held-out AUC 0.913" in text
    assert ModelCard.load(path).data.base_model is None  # an export: trained from scratch


def test_missing_facts_write_not_recorded_and_never_fail(tmp_path):
    model = tmp_path / "bare"
    (model / "hf").mkdir(parents=True)
    (model / "hf" / "config.json").write_text("{}")
    evaluation = tmp_path / "eval"
    evaluation.mkdir()
    path = write_card(CardConfig(model_name="bare"), model, evaluation, tmp_path / "c")
    card = ModelCard.load(path)
    assert card.data.datasets == [NOT_RECORDED] and card.data.eval_results is None
    for section in ("Data sources", "Curation", "Decontamination", "Evaluation", "toxicity"):
        after = card.text.split(section, 1)[1]
        assert after.lstrip("#\n ").startswith(NOT_RECORDED), section


def test_the_leaderboard_links_each_card_and_shows_contamination(tmp_path):
    from llmflow.tasks.evaluation.leaderboard import model_cards

    marks = {"gsm8k_local": {"label": "2.5% (3/120 items)"}, "cf_arith": {"label": "not checked"}}
    records = [{"contamination": marks}, {}]
    cards = [tmp_path / "card-base", tmp_path / "card-sft"]
    rows = model_cards(["base", "sft"], records, cards, tmp_path)
    assert rows[0] == {
        "model": "base",
        "card": f"[README.md]({cards[0] / 'hf' / 'README.md'})",
        "cf_arith contamination": "not checked",
        "gsm8k_local contamination": "2.5% (3/120 items)",
    }
    assert rows[1]["card"].endswith("card-sft/hf/README.md)")
    assert json.loads((tmp_path / "models.json").read_text()) == rows
    assert model_cards(["base"], records[:1], None, tmp_path)[0]["card"] == "not written"


class TinyCorpus(BaseModel):
    text: str = "Homework. What is 12 + 5? 17. What is 9 - 4? 5. " + "Plain words follow. " * 20


@step("fixture-curated")
def fixture_curated(cfg: TinyCorpus, out: Path) -> Metrics:
    """A curated corpus (shards/<domain>/*.parquet) of two documents, one with arithmetic."""
    (out / "shards" / "prose").mkdir(parents=True)
    with ShardWriter(out / "shards" / "prose" / "part-00000.parquet") as writer:
        writer.write({"id": "math", "text": cfg.text, "domain": "prose", "source": "t"})
        writer.write({"id": "clean", "text": "Nothing to see. " * 10, "domain": "prose"})
    return {}


@step("fixture-trained")
def fixture_trained(cfg: CheckpointFixture, data: Path, out: Path) -> Metrics:
    """A checkpoint 'trained' on ``data`` (so its lineage leads to the corpus)."""
    return fixture_checkpoint.fn(cfg, out)


@pytest.mark.slow  # evaluates a model with lm-eval through the executor (~30 s on a busy box)
def test_decontaminate_evaluate_card_and_leaderboard_through_the_executor(tmp_path):
    cfg = EvalConfig(tasks=["cf_arith", "heldout_ppl"], limit=4, num_items=4, device="cpu")
    # 4-grams: "What is 3 + 4? 7" normalizes to "what is 0 0 0", which the corpus holds
    decont_cfg = DecontamConfig(tasks=cfg.tasks, num_items=4, n=4)
    graph = Graph()
    corpus = graph.add(fixture_curated, TinyCorpus(), "tiny")
    decont = graph.add(decontaminate, decont_cfg, "tiny", corpus=corpus)
    tok = graph.add(fixture_tokenizer, TokenizerFixture(), "tiny")
    heldout = graph.add(fixture_tokenize, TokenizerFixture(), "tiny")
    ckpt = graph.add(fixture_trained, CheckpointFixture(), "tiny", data=decont)
    model = graph.add(export, ExportConfig(label="base"), "q-base", checkpoint=ckpt, tokenizer=tok)
    score = graph.add(evaluate, cfg, "q-base", model=model, heldout=heldout)
    card = graph.add(
        model_card, CardConfig(model_name="q-base"), "q-base", model=model, evaluation=score
    )
    graph.add(
        leaderboard,
        LeaderboardConfig(labels=["base"]),
        "board",
        evaluations=[score],
        models=[model],
        cards=[card],
    )
    executor = Executor(str(tmp_path / "runs"), audit=True)
    outcome = executor.run(graph)
    assert executor.unhashed_reads(graph) == {}
    results = json.loads((Path(outcome[score].uri) / "results.json").read_text())
    # the default mode removes the matching document, so the item counts as unseen
    marks = results["contamination"]["cf_arith"]
    assert marks["label"] == "0% (removed before training: 100.0% (4/4 items) matched)"
    assert marks["share"] == 0.0 and marks["matched_share"] == 1.0
    assert results["contamination"]["ppl_prose"]["label"].startswith("held out")
    assert results["contamination_source"] == outcome[decont].uri
    assert outcome[score].metrics["cf_arith/contamination"] == 0.0
    readme = Path(outcome[card].uri) / "hf" / "README.md"
    assert "removed before training: 100.0% (4/4 items) matched" in ModelCard.load(readme).text
    board = Path(outcome[graph.find(step="leaderboard")[0]].uri)
    assert str(readme) in (board / "models.md").read_text()
