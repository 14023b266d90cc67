"""The model-based quality filter and the whole curate step end to end."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from llmflow.tasks.curation.config import CurateConfig, QualityModelConfig
from llmflow.tasks.curation.quality_model import (
    HashedLinearModel,
    features,
    precision_recall,
    quality_model,
    rule_teacher,
)
from llmflow.tasks.framework.executor import Executor, Mapped
from llmflow.tasks.framework.store import Store
from tests.tasks.curation.helpers import curation_graph, ids_in, near_copy, prose, write_shards

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
    metrics = quality_model(QualityModelConfig(skip_domains=["code"]), [tmp_path / "in"], out)
    dropped = set(pq.read_table(out / "drops.parquet").column("id").to_pylist())
    assert dropped == {f"s{i}" for i in range(40)}
    assert metrics["holdout_precision"] == 1.0 and metrics["holdout_recall"] == 1.0
    report = json.loads((out / "report.json").read_text())
    assert report["threshold"] == 0.5 and report["teacher"] == "rules"


def test_hf_teacher_needs_a_path():
    with pytest.raises(ValueError, match="teacher_path"):
        QualityModelConfig(teacher="hf")


def _cached(outcome, graph) -> dict[str, bool]:
    """Per step name: whether every output of its node (every shard, if mapped) was cached."""
    rows = {}
    for node in graph.nodes:
        result = outcome[node]
        results = result.results if isinstance(result, Mapped) else [result]
        rows[node.step.name] = all(r.cached for r in results)
    return rows


def test_filter_threshold_change_reruns_only_filter_and_global_stages(tmp_path):
    records, _ = _corpus(random.Random(5))
    graph, _ = curation_graph(records, num_shards=3)
    first = Executor(str(tmp_path)).run(graph)
    assert not any(_cached(first, graph).values())
    changed = CurateConfig.model_validate(
        {"filters": {"gopher_quality": {"min_doc_words": 10}}, "minhash": {"keep": "longest"}}
    )
    graph, _ = curation_graph(records, changed, num_shards=3)
    again = _cached(Executor(str(tmp_path)).run(graph), graph)
    assert again == {
        "test-rows": True,
        "curate-normalize": True,
        "curate-exact-hashes": True,
        "curate-minhash": True,
        "curate-filter": False,
        "curate-exact-dedup": False,
        "curate-near-dedup": False,
        "curate-quality-model": False,
        "curate": False,
    }


def test_stage_configs_hold_only_what_each_stage_reads():
    cfg = CurateConfig.model_validate({"minhash": {"keep": "longest", "seed": 3}})
    assert cfg.minhash.signature_config().model_dump() == {
        "n_grams": 5,
        "num_buckets": 14,
        "hashes_per_bucket": 8,
        "seed": 3,
    }
    assert cfg.exact_dedup.hash_config().model_dump() == {
        "level": "document",
        "min_paragraph_chars": 50,
    }
    assert set(cfg.filter_config().model_dump()) == {"filters", "pii"}


def test_curation_graph_reads_no_unhashed_field(tmp_path):
    records, _ = _corpus(random.Random(6))
    cfg = CurateConfig.model_validate({"exact_dedup": {"level": "paragraph"}})
    graph, _ = curation_graph(records, cfg, num_shards=2)
    executor = Executor(str(tmp_path), audit=True)
    executor.run(graph)
    assert executor.unhashed_reads(graph) == {}
    assert "min_doc_words" not in str(executor.reads["curate-minhash"])
    assert executor.reads["curate-minhash"] >= {"n_grams", "num_buckets", "seed"}
    assert "filters.gopher_quality.min_doc_words" in executor.reads["curate-filter"]


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


def _curated(outcome, final, root: Path) -> Path:
    return Store(str(root)).local_path(outcome[final].uri)


def test_curate_end_to_end(tmp_path):
    records, planted = _corpus(random.Random(3))
    graph, final = curation_graph(records, num_shards=3)
    outcome = Executor(str(tmp_path / "store")).run(graph)
    out, result = _curated(outcome, final, tmp_path / "store"), outcome[final]
    metrics = result.metrics
    kept = ids_in(out / "shards")
    for copy, original in planted.items():
        assert (copy in kept) != (original in kept), copy
    assert not {"junk-empty", "junk-lorem", "junk-repeat", "junk-soup"} & kept
    assert {f"code-{i}" for i in range(5)} <= kept
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["code", "web"]
    report = json.loads((out / "curation_report.json").read_text())
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
    shards = (out / "shards").rglob("*.parquet")
    text = "".join(t for p in shards for t in pq.read_table(p).column("text").to_pylist())
    assert "<EMAIL>" in text
    assert "bob@example.com" not in text
    assert "| near_dedup |" in (out / "summary.md").read_text()
    keys = [a["key"] for a in result.artifacts]
    assert keys == ["curation-report", "curation-stages"]
    assert result.artifacts[1]["rows"] == report["stages"]


@pytest.mark.slow
def test_prefect_fan_out_matches_in_process(tmp_path, prefect_harness):
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from llmflow.tasks.framework.executor import PrefectExecutor

    records, _ = _corpus(random.Random(4))
    graph, final = curation_graph(records, num_shards=3)

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def curate_in_parallel():
        return PrefectExecutor(str(tmp_path / "two")).run(graph)

    parallel = _curated(curate_in_parallel(), final, tmp_path / "two")
    sequential = _curated(Executor(str(tmp_path / "one")).run(graph), final, tmp_path / "one")
    assert ids_in(parallel / "shards") == ids_in(sequential / "shards")
    assert len(ids_in(parallel / "shards")) > 40


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
    from llmflow.tasks.curation.quality_model import hf_teacher

    _tiny_hf_classifier(tmp_path / "teacher")
    texts = ["good good", "bad text here and more bad words", "good"]
    together = hf_teacher(str(tmp_path / "teacher"), texts, batch_size=3)
    alone = [hf_teacher(str(tmp_path / "teacher"), [t])[0] for t in texts]
    assert len(together) == 3 and len(set(together)) == 3
    assert together == pytest.approx(alone, abs=1e-5)
