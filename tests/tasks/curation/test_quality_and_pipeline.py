"""The model-based quality filter and the whole curate step end to end."""

from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import pytest

from llmflow.tasks.curation.config import CurateConfig, QualityModelConfig
from llmflow.tasks.curation.pipeline import curate, stage_config
from llmflow.tasks.curation.quality_model import (
    HashedLinearModel,
    features,
    precision_recall,
    quality_model,
    rule_teacher,
)
from tests.tasks.curation.helpers import ids_in, near_copy, prose, write_shards

_SPAM = (
    "buy cheap pills now best price click here free shipping winner casino bonus "
    "limited offer deal discount"
).split()


def _spam(rng: random.Random) -> str:
    return " ".join(rng.choice(_SPAM) for _ in range(80))


def test_precision_recall_by_hand():
    assert precision_recall([1, 1, 0, 0], [1, 0, 1, 0]) == {
        "precision": 0.5,
        "recall": 0.5,
        "accuracy": 0.5,
    }


def test_rule_teacher_orders_prose_above_spam():
    rng = random.Random(0)
    assert rule_teacher(prose(rng, 10)) >= 0.5 > rule_teacher(_spam(rng))
    assert rule_teacher("too short") == 0.0


def test_hashed_linear_model_learns_separable_labels():
    rng = random.Random(1)
    cfg = QualityModelConfig(num_features=1 << 12, epochs=3)
    texts = [prose(rng, 5) for _ in range(60)] + [_spam(rng) for _ in range(60)]
    labels = [1] * 60 + [0] * 60
    model = HashedLinearModel(cfg).fit([features(t, cfg) for t in texts], labels)
    held_out = [prose(rng, 5) for _ in range(10)] + [_spam(rng) for _ in range(10)]
    predicted = [int(model.predict(features(t, cfg)) >= 0.5) for t in held_out]
    assert predicted == [1] * 10 + [0] * 10


def test_quality_model_stage_drops_low_scores(tmp_path):
    rng = random.Random(2)
    records = [{"id": f"p{i}", "text": prose(rng, 6), "domain": "web"} for i in range(80)]
    records += [{"id": f"s{i}", "text": _spam(rng), "domain": "web"} for i in range(40)]
    records += [{"id": "c0", "text": _spam(rng), "domain": "code"}]  # skipped domain
    write_shards(tmp_path / "in", records)
    out = tmp_path / "q"
    out.mkdir()
    metrics = quality_model(CurateConfig(), [tmp_path / "in"], out)
    dropped = set(pq.read_table(out / "drops.parquet").column("id").to_pylist())
    assert dropped == {f"s{i}" for i in range(40)}
    assert metrics["holdout_precision"] == 1.0 and metrics["holdout_recall"] == 1.0
    report = json.loads((out / "report.json").read_text())
    assert report["threshold"] == 0.5 and report["teacher"] == "rules"


def test_hf_teacher_needs_a_path():
    with pytest.raises(ValueError, match="teacher_path"):
        QualityModelConfig(teacher="hf")


def test_stage_config_isolates_signatures_from_filters():
    base = CurateConfig()
    changed = CurateConfig.model_validate(
        {"filters": {"gopher_quality": {"min_doc_words": 10}}, "minhash": {"keep": "longest"}}
    )
    assert stage_config(base, "minhash_signatures") == stage_config(changed, "minhash_signatures")
    assert stage_config(base, "exact_hashes") == stage_config(changed, "exact_hashes")
    assert stage_config(base, "filter") != stage_config(changed, "filter")
    assert stage_config(base, "near_dedup") != stage_config(changed, "near_dedup")
    assert "num_workers" not in json.dumps(stage_config(base, "filter"))


def test_paragraph_level_conflicts_with_c4_rewriting():
    with pytest.raises(ValueError, match="rewrite_lines"):
        CurateConfig.model_validate(
            {"exact_dedup": {"level": "paragraph"}, "filters": {"c4": {"rewrite_lines": True}}}
        )


def _corpus(rng: random.Random) -> tuple[list[dict], dict[str, str]]:
    records = [{"id": f"web-{i:03d}", "text": prose(rng, 24), "domain": "web"} for i in range(60)]
    names = [f"{a}_{b}" for a, b in zip("abcde", "vwxyz", strict=True)]
    records += [
        {"id": f"code-{i}", "text": f"def {n}(x):\n    return {{x: '{n}'}}\n", "domain": "code"}
        for i, n in enumerate(names)
    ]
    planted = {}
    for i in range(0, 20, 2):
        planted[f"exact-{i}"] = f"web-{i:03d}"
        records.append({"id": f"exact-{i}", "text": records[i]["text"].lower(), "domain": "web"})
    for i in range(20, 40, 2):
        planted[f"near-{i}"] = f"web-{i:03d}"
        records.append(
            {"id": f"near-{i}", "text": near_copy(rng, records[i]["text"], 2), "domain": "web"}
        )
    records += [
        {"id": "junk-empty", "text": "   ", "domain": "web"},
        {
            "id": "junk-lorem",
            "text": prose(rng, 9) + "\nLorem ipsum dolor sit amet.",
            "domain": "web",
        },
        {
            "id": "junk-repeat",
            "text": "\n".join(["Click here to subscribe now."] * 30),
            "domain": "web",
        },
        {"id": "junk-soup", "text": " ".join("#$%&*@!{}" for _ in range(100)), "domain": "web"},
        {"id": "pii", "text": prose(rng, 24) + " Mail me at bob@example.com.", "domain": "web"},
    ]
    rng.shuffle(records)
    return records, planted


def test_curate_end_to_end(tmp_path):
    records, planted = _corpus(random.Random(3))
    write_shards(tmp_path / "in", records, num_shards=3)
    metrics = curate(CurateConfig(), tmp_path / "in", tmp_path / "out")
    kept = ids_in(tmp_path / "out" / "shards")
    for copy, original in planted.items():
        assert (copy in kept) != (original in kept), copy
    assert not {"junk-empty", "junk-lorem", "junk-repeat", "junk-soup"} & kept
    assert {f"code-{i}" for i in range(5)} <= kept
    assert sorted(p.name for p in (tmp_path / "out" / "shards").iterdir()) == ["code", "web"]
    report = json.loads((tmp_path / "out" / "curation_report.json").read_text())
    stages = {s["stage"]: s for s in report["stages"]}
    assert list(stages) == ["normalize", "filters", "exact_dedup", "near_dedup", "quality_model"]
    assert stages["exact_dedup"]["removed"]["exact_duplicate"]["docs"] == 10
    assert stages["near_dedup"]["removed"]["near_duplicate"]["docs"] == 10
    assert stages["normalize"]["removed"]["whitespace_only"]["docs"] == 1
    assert report["pii"]["email"] == 1 and report["output"]["documents"] == metrics["documents_out"]
    assert metrics["documents_in"] == len(records)
    # every document is accounted for: output + removals of every stage == input
    removed = sum(c["docs"] for s in report["stages"] for c in s["removed"].values())
    assert removed + metrics["documents_out"] == len(records)
    assert {r["reason"] for r in report["removed_samples"]} >= {"lorem_ipsum"}
    shards = (tmp_path / "out" / "shards").rglob("*.parquet")
    text = "".join(t for p in shards for t in pq.read_table(p).column("text").to_pylist())
    assert "<EMAIL>" in text
    assert "bob@example.com" not in text
    assert "| near_dedup |" in (tmp_path / "out" / "summary.md").read_text()


@pytest.mark.slow
def test_curate_with_workers_matches_sequential(tmp_path):
    records, _ = _corpus(random.Random(4))
    write_shards(tmp_path / "in", records, num_shards=3)
    curate(CurateConfig(), tmp_path / "in", tmp_path / "one")
    curate(CurateConfig(), tmp_path / "in", tmp_path / "two", num_workers=2)
    assert ids_in(tmp_path / "one" / "shards") == ids_in(tmp_path / "two" / "shards")


def _tiny_hf_classifier(path) -> None:
    """A 1-layer BERT regression model with a word-level tokenizer, saved locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "good": 4, "bad": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
    }
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(path)
    config = BertConfig(
        vocab_size=6,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        intermediate_size=16,
        num_labels=1,
        max_position_embeddings=64,
    )
    BertForSequenceClassification(config).save_pretrained(path)


@pytest.mark.slow
def test_hf_teacher_scores_each_text_independently_of_batching(tmp_path):
    pytest.importorskip("transformers")
    from llmflow.tasks.curation.quality_model import hf_teacher

    _tiny_hf_classifier(tmp_path / "teacher")
    texts = ["good good", "bad text here and more bad words", "good"]
    together = hf_teacher(str(tmp_path / "teacher"), texts, batch_size=3)
    alone = [hf_teacher(str(tmp_path / "teacher"), [t])[0] for t in texts]
    assert len(together) == 3 and len(set(together)) == 3
    assert together == pytest.approx(alone, abs=1e-5)
