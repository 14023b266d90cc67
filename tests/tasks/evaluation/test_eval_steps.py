"""The export, evaluate and leaderboard steps through the store: layout, progress, read audit."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from eval_fixtures import (
    LINEAGE_DECOY,
    CheckpointFixture,
    TokenizerFixture,
    fixture_checkpoint,
    fixture_tokenize,
    fixture_tokenizer,
)
from safetensors.torch import load_file

from llmflow.model.config import ModelConfig
from llmflow.model.hf import export_hf, load_model
from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.export import ExportConfig, export
from llmflow.tasks.evaluation.harness import ModelLoadError, evaluate
from llmflow.tasks.evaluation.leaderboard import LeaderboardConfig, leaderboard
from llmflow.tasks.evaluation.models import load_hf_model, load_tokenizer, read_progress
from llmflow.tasks.framework.audit import unhashed_reads
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.store import Store

CFG = EvalConfig(tasks=["cf_arith", "heldout_ppl"], limit=4, num_items=4, device="cpu")
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}


def _audited(step, store, cfg, name, inputs):
    reads: set[str] = set()
    result = step.run(store, cfg, name, inputs, reads=reads)
    assert unhashed_reads(step.config_type, reads, step.execution) == []
    return result, reads


def test_export_is_export_hf_in_hf_and_progress_from_summary(tmp_path):
    store = Store(tmp_path / "runs")
    ckpt = Path(fixture_checkpoint.run(store, CheckpointFixture(), "tiny").uri)
    tok = Path(fixture_tokenizer.run(store, TokenizerFixture(), "tiny").uri)
    inputs = {"checkpoint": str(ckpt), "tokenizer": str(tok)}
    result, reads = _audited(export, store, ExportConfig(label="base"), "base", inputs)
    out = Path(result.uri)
    assert reads >= {"label", "rope_scaling", "max_seq_len"}
    # The same files, byte for byte, as export_hf writes for this checkpoint.
    fields = json.loads((ckpt / "final" / "model_config.json").read_text())
    reference = tmp_path / "reference"
    export_hf(
        load_file(ckpt / "final" / "model.safetensors"), ModelConfig(**fields), reference, tok
    )
    assert sorted(p.name for p in (out / "hf").iterdir()) == sorted(
        p.name for p in reference.iterdir()
    )
    for path in reference.iterdir():
        assert (out / "hf" / path.name).read_bytes() == path.read_bytes(), path.name
    ours, hf = load_model(ckpt / "final").eval(), load_hf_model(out / "hf").eval()
    ids = torch.randint(0, fields["vocab_size"], (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)
    assert (
        load_tokenizer(out / "hf")("What is 3 + 4?")["input_ids"]
        == load_tokenizer(tok)("What is 3 + 4?")["input_ids"]
    )
    # Progress comes from summary.json (total over the curriculum), never from lineage.json.
    assert json.loads((ckpt / "lineage.json").read_text())["metrics"]["total_tokens_seen"] == (
        LINEAGE_DECOY
    )
    assert read_progress(out) == {"tokens_seen": 1000, "step": 10}
    assert (result.metrics["tokens_seen"], result.metrics["label"]) == (1000, "base")


def test_export_falls_back_to_stage_tokens_and_sets_rope(tmp_path):
    store = Store(tmp_path / "runs")
    ckpt = fixture_checkpoint.run(store, CheckpointFixture(total_tokens_seen=None), "old").uri
    tok = fixture_tokenizer.run(store, TokenizerFixture(), "tiny").uri
    cfg = ExportConfig(label="long", rope_scaling=YARN, max_seq_len=512)
    result = export.run(store, cfg, "long", {"checkpoint": ckpt, "tokenizer": tok})
    assert read_progress(Path(result.uri)) == {"tokens_seen": 400, "step": 10}
    config = json.loads((Path(result.uri) / "hf" / "config.json").read_text())
    assert config["max_position_embeddings"] == 512
    assert (config.get("rope_parameters") or config["rope_scaling"])["rope_type"] == "yarn"


def _recipe(seeds: list[int], tokens: list[int]) -> Graph:
    graph = Graph()
    tok = graph.add(fixture_tokenizer, TokenizerFixture(), "tiny")
    heldout = graph.add(fixture_tokenize, TokenizerFixture(), "tiny")
    models, scores = [], []
    for seed, total in zip(seeds, tokens, strict=True):
        name = f"s{seed}"
        ckpt = graph.add(fixture_checkpoint, CheckpointFixture(seed=seed, total_tokens_seen=total), name)  # fmt: skip
        models.append(
            graph.add(export, ExportConfig(label=name), name, checkpoint=ckpt, tokenizer=tok)
        )
        scores.append(graph.add(evaluate, CFG, name, model=models[-1], heldout=heldout))
    labels = LeaderboardConfig(labels=[f"s{s}" for s in seeds])
    graph.add(leaderboard, labels, "board", evaluations=scores, models=models)
    return graph


def test_graph_of_the_three_steps_passes_the_read_audit_and_caches(tmp_path):
    executor = Executor(str(tmp_path / "runs"), audit=True)
    graph = _recipe(seeds=[1, 0], tokens=[2000, 1000])
    outcome = executor.run(graph)
    assert executor.unhashed_reads(graph) == {}
    assert executor.reads["evaluate"] >= {"batch_size", "device", "tasks"}  # the audit saw reads
    score = outcome[graph.find(step="evaluate")[0]]
    assert 0.0 <= score.metrics["cf_arith/acc"] <= 1.0
    assert score.metrics["ppl_prose/word_perplexity"] > 1.0  # held-out docs from the input
    board = Path(outcome[graph.find(step="leaderboard")[0]].uri)
    with open(board / "leaderboard.csv") as f:
        table = list(csv.DictReader(f))
    # Ordered by tokens seen, which come from each export's progress.json.
    assert [(r["checkpoint"], r["tokens_seen"], r["step"]) for r in table] == [
        ("s0", "1000", "10"),
        ("s1", "2000", "10"),
    ]
    assert json.loads((board / "leaderboard.json").read_text())[0]["checkpoint"] == "s0"
    assert (board / "plots" / "cf_arith__acc.png").stat().st_size > 1000
    assert "tokens_seen" in (board / "signal_quality.csv").read_text().splitlines()[1]
    again = Executor(str(tmp_path / "runs")).run(_recipe(seeds=[1, 0], tokens=[2000, 1000]))
    assert all(r.cached for r in again.rows())


def test_leaderboard_needs_one_label_per_evaluation(tmp_path):
    with pytest.raises(BadInputError, match="2 labels, 1 evaluations and 1 models"):
        leaderboard(LeaderboardConfig(labels=["a", "b"]), [tmp_path], [tmp_path], out=tmp_path)


def test_evaluate_reads_hf_only(tmp_path, tiny_model):
    """A model folder at the output's root is not found: nothing probes other layouts."""
    output = tmp_path / "root-layout"
    shutil.copytree(tiny_model, output)
    with pytest.raises(ModelLoadError, match=str(output / "hf")):
        evaluate(EvalConfig(tasks=["cf_arith"], limit=2, device="cpu"), output, out=tmp_path)
