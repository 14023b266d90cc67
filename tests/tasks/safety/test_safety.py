"""Safety evaluation: CrowS-Pairs against hand log-likelihoods, toxicity scoring by hand, the
classifier on ToxiGen, and the step end to end on a tiny model with the real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.harness import load_model
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import RawFiles
from llmflow.tasks.safety.classifier import ToxicityScorer, split, toxicity_classifier
from llmflow.tasks.safety.config import SafetyEvalConfig, ToxicityClassifierConfig
from llmflow.tasks.safety.crows import crows_pairs
from llmflow.tasks.safety.data import read_crows, read_lexicon, read_toxigen, safety_files
from llmflow.tasks.safety.step import (
    CONTINUATIONS,
    RESULTS,
    generation_tokenizer,
    safety,
)
from llmflow.tasks.safety.toxicity import LexiconScorer, Prompt, aggregate
from tests.tasks.evaluation.eval_fixtures import make_tiny_model


@pytest.fixture(scope="module")
def safety_dir(shared_data: Path) -> Path:
    from tests.needs import shared_path

    return shared_path("safety")


@pytest.fixture(scope="module")
def model_output(tmp_path_factory) -> Path:
    """A model output as the store holds it: ``<output>/hf/`` with weights and tokenizer."""
    output = tmp_path_factory.mktemp("model")
    make_tiny_model(output / "hf")
    return output


@pytest.fixture(scope="module")
def background(tmp_path_factory, shared_data: Path) -> Path:
    """A corpus output of ordinary text (Shakespeare and WikiText paragraphs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = tmp_path_factory.mktemp("corpus")
    text = (shared_data / "text" / "tinyshakespeare.txt").read_text()[:200_000]
    text += (shared_data / "text" / "wikitext2_valid.txt").read_text()[:200_000]
    paragraphs = [p for p in text.split("\n\n") if len(p.split()) > 20]
    (corpus / "shards").mkdir()
    rows = {
        "id": [f"d{i}" for i in range(len(paragraphs))],
        "text": paragraphs,
        "domain": ["prose"] * len(paragraphs),
        "source": ["test"] * len(paragraphs),
    }
    pq.write_table(pa.table(rows), corpus / "shards" / "part-0.parquet")
    return corpus


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, safety_dir: Path, background: Path) -> Path:
    out = tmp_path_factory.mktemp("classifier")
    data = RawFiles(safety_files(safety_dir))
    toxicity_classifier(ToxicityClassifierConfig(), data=data, out=out, background=background)
    return out


def sentence_loglik(model, tokenizer, prefix_id: int, text: str) -> float:
    """log p(text | prefix token), summed over the text's tokens (lm-eval's empty context)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens = torch.tensor([[prefix_id, *ids]])
    with torch.no_grad():
        logprobs = model(tokens).logits[0, :-1].float().log_softmax(-1)
    return float(logprobs[torch.arange(len(ids)), torch.tensor(ids)].sum())


def test_crows_pairs_equals_hand_loglikelihoods(model_output, safety_dir):
    folder = model_output / "hf"
    lm = load_model(EvalConfig(batch_size=8), folder)
    result = crows_pairs(lm, safety_dir / "crows_pairs_anonymized.csv", limit=24)
    rows = read_crows(safety_dir / "crows_pairs_anonymized.csv", limit=24)
    model, tokenizer = lm.model.eval(), lm.tokenizer
    gaps = [
        sentence_loglik(model, tokenizer, lm.prefix_token_id, r["sent_more"])
        - sentence_loglik(model, tokenizer, lm.prefix_token_id, r["sent_less"])
        for r in rows
    ]
    assert result["pairs"] == 24
    assert result["pct_stereotype"] == pytest.approx(sum(g > 0 for g in gaps) / 24)
    assert result["likelihood_diff"] == pytest.approx(sum(abs(g) for g in gaps) / 24, rel=1e-4)
    counts = {}
    for r in rows:
        counts[r["bias_type"]] = counts.get(r["bias_type"], 0) + 1
    assert {k: v["pairs"] for k, v in result["by_bias_type"].items()} == counts


def test_rtp_metrics_by_hand():
    prompts = [
        Prompt("a", "hate", "x", ["1", "2"], {"s": [0.2, 0.7]}),
        Prompt("a", "neutral", "y", ["1", "2"], {"s": [0.1, 0.3]}),
        Prompt("b", "neutral", "z", ["1", "2"], {"s": [0.5, 0.0]}),
    ]
    out = aggregate(prompts, threshold=0.5)["s"]
    assert out["all"]["expected_max_toxicity"] == pytest.approx((0.7 + 0.3 + 0.5) / 3)
    assert out["all"]["toxicity_probability"] == pytest.approx(2 / 3)
    assert out["all/neutral"]["toxicity_probability"] == pytest.approx(1 / 2)
    assert out["a/hate"] == {
        "prompts": 1,
        "expected_max_toxicity": 0.7,
        "toxicity_probability": 1.0,
    }


def test_lexicon_matches_whole_words_and_phrases():
    scorer = LexiconScorer(["ass", "2 girls 1 cup"])
    assert scorer("what an Ass.") == 1.0
    assert scorer("a class of glass") == 0.0
    assert scorer("they said 2 girls 1 cup") == 1.0
    assert scorer("2 girls") == 0.0


def test_classifier_separates_held_out_hate_from_neutral(classifier, safety_dir):
    report = json.loads((classifier / "report.json").read_text())
    # 0.667 with each sentence read once; 0.72 when 14 held-out sentences were trained on too
    assert report["held_out"] > 100 and report["accuracy"] >= 0.65
    # Ordinary text is not flagged: the background teaches the classifier what is not hateful.
    assert report["background_false_positive_rate"] <= 0.05
    cfg = ToxicityClassifierConfig()
    _, held = split(read_toxigen(safety_files(safety_dir)), cfg)
    scorer = ToxicityScorer(classifier, cfg)
    hate = [scorer(t) for t, y in held if y == 1]
    neutral = [scorer(t) for t, y in held if y == 0]
    assert sum(hate) / len(hate) > sum(neutral) / len(neutral) + 0.2
    correct = sum((scorer(t) >= 0.5) == bool(y) for t, y in held)
    assert correct / len(held) == pytest.approx(report["accuracy"])


def test_safety_step_end_to_end(model_output, classifier, safety_dir, tmp_path):
    cfg = SafetyEvalConfig(
        crows_limit=16, prompts_per_file=1, samples_per_prompt=2, max_new_tokens=6
    )
    data = RawFiles(safety_files(safety_dir))
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        out.mkdir()
        metrics = safety(cfg, model=model_output, classifier=classifier, data=data, out=out)
        runs.append(out)
    results = json.loads((runs[0] / RESULTS).read_text())
    rows = [json.loads(line) for line in (runs[0] / CONTINUATIONS).read_text().splitlines()]
    files = read_toxigen(data)
    assert len(rows) == len(files)  # one prompt per file
    lexicon = LexiconScorer(read_lexicon(safety_dir / "ldnoobw_en.txt"))
    for row in rows:
        assert len(row["continuations"]) == 2
        assert row["scores"]["lexicon"] == [lexicon(t) for t in row["continuations"]]
        assert all(0.0 <= s <= 1.0 for s in row["scores"]["classifier"])
    # Seeded sampling: a rerun writes the same continuations.
    assert (runs[0] / CONTINUATIONS).read_text() == (runs[1] / CONTINUATIONS).read_text()
    overall = results["toxicity"]["classifier"]["all"]
    maxima = [max(r["scores"]["classifier"]) for r in rows]
    assert overall["expected_max_toxicity"] == pytest.approx(sum(maxima) / len(maxima))
    assert metrics["crows_pairs/pct_stereotype"] == results["crows_pairs"]["pct_stereotype"]
    # the results say which classifier scored, with its held-out and per-group AUCs
    report = json.loads((classifier / "report.json").read_text())
    assert results["classifier"]["kind"] == "hashed n-gram"
    assert results["classifier"]["held_out_auc"] == report["auc"]
    assert set(results["classifier"]["leave_one_group_out_auc"]) == {f.target for f in files}


def test_missing_safety_files_are_named(tmp_path):
    with pytest.raises(BadInputError, match="crows_pairs_anonymized.csv"):
        safety_files(tmp_path)


def test_model_without_tokenizer_is_named(tmp_path):
    (tmp_path / "hf").mkdir()
    with pytest.raises(BadInputError, match="needs the model's tokenizer"):
        generation_tokenizer(tmp_path / "hf")
