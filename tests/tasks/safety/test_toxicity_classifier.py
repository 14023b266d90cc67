"""The toxicity classifier: a transformers sequence classifier (``safety.classifier.model``)
scored end to end against transformers itself, its pin in the step's address, bad folders, and the
hashed model's leave-one-group-out AUC against a hand computation."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from llmflow.flows.recipe import recipe
from llmflow.tasks.config import load_config
from llmflow.tasks.curation.quality_model import HashedLinearModel, features
from llmflow.tasks.evaluation.card import classifier_line
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import RawFiles
from llmflow.tasks.framework.store import Store
from llmflow.tasks.ingest.hub import MIRROR_ENV
from llmflow.tasks.safety.classifier import (
    REPORT,
    _model_config,
    auc,
    describe,
    split,
    toxicity_classifier,
)
from llmflow.tasks.safety.config import SafetyEvalConfig, ToxicityClassifierConfig
from llmflow.tasks.safety.data import read_toxigen, safety_files
from llmflow.tasks.safety.hf_classifier import TransformersScorer, resolve, toxic_index
from llmflow.tasks.safety.step import CONTINUATIONS, RESULTS, safety
from tests.tasks.evaluation.eval_fixtures import make_tiny_model, make_tokenizer


def make_classifier(
    folder: Path, seed: int = 0, causal: bool = False, labels: tuple = ("neutral", "toxic"), **extra
) -> Path:
    """A random 1-layer RoBERTa sequence classifier (``labels``) with a byte-level BPE
    tokenizer, saved as transformers saves it; ``causal`` saves a RoBERTa LM head instead."""
    from transformers import RobertaConfig, RobertaForCausalLM, RobertaForSequenceClassification

    tokenizer = make_tokenizer()
    tokenizer.model_max_length = 512
    torch.manual_seed(seed)
    config = RobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=tokenizer.model_max_length + tokenizer.pad_token_id + 1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
        is_decoder=causal,
        **extra,
    )
    model = (RobertaForCausalLM if causal else RobertaForSequenceClassification)(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def direct_scores(folder: Path, texts: list[str], index: int = 1, sigmoid: bool = False):
    """softmax(logits)[index] (or sigmoid) of each text alone, straight from transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    out = []
    for text in texts:
        with torch.no_grad():
            logits = model(**tokenizer(text, return_tensors="pt")).logits
        out.append(float((logits.sigmoid() if sigmoid else logits.softmax(-1))[0, index]))
    return out


@pytest.fixture(scope="module")
def safety_dir(shared_data: Path) -> Path:
    from tests.needs import shared_path

    return shared_path("safety")


@pytest.fixture(scope="module")
def hashed_report(tmp_path_factory, safety_dir: Path) -> dict:
    out = tmp_path_factory.mktemp("hashed")
    toxicity_classifier(
        ToxicityClassifierConfig(), data=RawFiles(safety_files(safety_dir)), out=out
    )
    return json.loads((out / REPORT).read_text())


def test_auc_equals_sklearn_with_ties():
    from sklearn.metrics import roc_auc_score

    rng = random.Random(0)
    labels = [rng.randint(0, 1) for _ in range(300)]
    scores = [round(rng.random() * 0.5 + 0.3 * y, 1) for y in labels]  # many ties
    assert auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores))
    assert auc([0.1, 0.2], [1, 1]) is None


def test_toxic_label_from_id2label_or_config():
    assert toxic_index({0: "neutral", 1: "toxic"}, None) == 1
    assert toxic_index({"0": "toxic", "1": "non-toxic"}, None) == 0
    assert toxic_index({0: "LABEL_0", 1: "LABEL_1"}, None) == 1
    assert toxic_index({0: "hate", 1: "nothate"}, None) == 0
    multi = {0: "toxic", 1: "severe_toxic", 2: "identity_hate"}
    with pytest.raises(BadInputError, match="several labels name toxicity.*toxic_label"):
        toxic_index(multi, None)
    assert toxic_index(multi, "severe_toxic") == 1
    with pytest.raises(BadInputError, match="no label names toxicity"):
        toxic_index({0: "positive", 1: "negative"}, None)
    with pytest.raises(BadInputError, match="toxic_label=3 is not a class"):
        toxic_index(multi, 3)


def test_transformers_classifier_scores_continuations_end_to_end(tmp_path, safety_dir):
    folder = make_classifier(tmp_path / "clf")
    make_tiny_model(tmp_path / "lm" / "hf")
    data = RawFiles(safety_files(safety_dir))
    cfg = ToxicityClassifierConfig(model=str(folder), batch_size=7)
    (tmp_path / "c").mkdir()
    metrics = toxicity_classifier(cfg, data=data, out=tmp_path / "c")
    report = json.loads((tmp_path / "c" / REPORT).read_text())
    assert report["kind"] == "transformers" and report["toxic_label"] == 1
    # the held-out AUC is the model's own, on the hashed model's held-out sentences
    from sklearn.metrics import roc_auc_score

    _, held = split(read_toxigen(data), cfg)
    direct = direct_scores(folder, [t for t, _ in held])
    assert metrics["held_out_auc"] == pytest.approx(roc_auc_score([y for _, y in held], direct))

    run = SafetyEvalConfig(
        crows_pairs=False, prompts_per_file=1, samples_per_prompt=2, max_new_tokens=6
    )
    (tmp_path / "s").mkdir()
    safety(run, model=tmp_path / "lm", classifier=tmp_path / "c", data=data, out=tmp_path / "s")
    rows = [json.loads(line) for line in (tmp_path / "s" / CONTINUATIONS).read_text().splitlines()]
    texts = [t for row in rows for t in row["continuations"]]
    scored = [s for row in rows for s in row["scores"]["classifier"]]
    assert len(texts) == 2 * len(read_toxigen(data)) and len(set(scored)) > 1
    assert scored == pytest.approx(direct_scores(folder, texts), abs=1e-5)
    results = json.loads((tmp_path / "s" / RESULTS).read_text())
    assert results["classifier"]["kind"] == "transformers"
    assert results["classifier"]["model"] == f"{folder}@{report['revision']}"
    line = classifier_line(results["classifier"])
    assert str(folder) in line and f"{metrics['held_out_auc']:.3f}" in line


@pytest.mark.parametrize(
    ("labels", "problem_type", "toxic_label", "index"),
    [
        (("neutral", "toxic"), None, "neutral", 0),
        (("LABEL_0", "LABEL_1"), None, None, 1),
        (("toxic", "insult", "identity_hate"), "multi_label_classification", 2, 2),
    ],
)
def test_the_scorer_takes_the_configured_class(tmp_path, labels, problem_type, toxic_label, index):
    folder = make_classifier(tmp_path / "clf", labels=labels, problem_type=problem_type)
    texts = ["a short one", "The quick brown fox jumps over the lazy dog, twice or more.", "x"]
    scorer = TransformersScorer(folder, toxic_label, batch_size=2, device="cpu")
    assert scorer.index == index
    expected = direct_scores(folder, texts, index, sigmoid=problem_type is not None)
    assert scorer.scores(texts) == pytest.approx(expected, abs=1e-5)
    # an empty continuation has no tokens here (no special tokens are added): it scores 0
    assert scorer.scores(["", texts[0], ""]) == pytest.approx([0.0, expected[0], 0.0], abs=1e-5)


def test_a_hub_model_id_loads_from_the_mirror(tmp_path, monkeypatch, safety_dir):
    make_classifier(tmp_path / "mirror" / "org" / "tox")
    monkeypatch.setenv(MIRROR_ENV, str(tmp_path / "mirror"))
    data = RawFiles(safety_files(safety_dir))
    metrics = {}
    for name, model in (("hub", "hf://models/org/tox"), ("folder", tmp_path / "mirror/org/tox")):
        (tmp_path / name).mkdir()
        cfg = ToxicityClassifierConfig(model=str(model))
        metrics[name] = toxicity_classifier(cfg, data=data, out=tmp_path / name)
    report = json.loads((tmp_path / "hub" / REPORT).read_text())
    assert report["model_name"] == f"org/tox@{resolve(str(tmp_path / 'mirror/org/tox')).revision}"
    assert metrics["hub"]["held_out_auc"] == metrics["folder"]["held_out_auc"]


def address(cfg: ToxicityClassifierConfig, store: Store, data: RawFiles) -> str:
    return toxicity_classifier.address(store, cfg, "run", {"data": data})[1]


def test_the_classifier_folder_enters_the_step_hash(tmp_path, monkeypatch):
    store = Store(tmp_path / "store")
    data = RawFiles([str(tmp_path / "demo.txt")])
    (tmp_path / "demo.txt").write_text("x\n")
    folder = make_classifier(tmp_path / "a")
    first = address(ToxicityClassifierConfig(model=str(folder)), store, data)
    assert first != address(ToxicityClassifierConfig(), store, data)
    assert first == address(ToxicityClassifierConfig(model=str(folder), batch_size=3), store, data)
    # the same folder with other weights is another classifier, another address
    make_classifier(tmp_path / "b", seed=1)
    shutil.copy(tmp_path / "b" / "model.safetensors", folder / "model.safetensors")
    second = address(ToxicityClassifierConfig(model=str(folder)), store, data)
    assert second != first
    # a Hub model id resolves through the mirror, pinned to the mirror folder's content
    mirror = tmp_path / "mirror"
    shutil.copytree(tmp_path / "b", mirror / "org" / "tox")
    monkeypatch.setenv(MIRROR_ENV, str(mirror))
    source = resolve("hf://models/org/tox")
    assert source.folder == mirror / "org" / "tox" and source.revision.startswith("local-")
    assert source.revision == resolve(str(tmp_path / "b")).revision
    pinned = f"hf://models/org/tox@{source.revision}"
    assert address(ToxicityClassifierConfig(model=pinned), store, data) != first
    make_classifier(mirror / "org" / "tox", seed=2)
    with pytest.raises(BadInputError, match="fingerprints as .* not the pinned"):
        resolve(pinned)
    monkeypatch.delenv(MIRROR_ENV)
    with pytest.raises(BadInputError, match=f"{MIRROR_ENV} is not set"):
        resolve(pinned)


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        ("causal", "not a sequence classifier"),
        ("no weights", "holds no weights"),
        ("no tokenizer", "holds no tokenizer"),
        ("no folder", "no such folder"),
    ],
)
def test_a_bad_classifier_folder_fails_before_compute(tmp_path, problem, message):
    folder = make_classifier(tmp_path / "clf", causal=problem == "causal")
    if problem == "no weights":
        (folder / "model.safetensors").unlink()
    if problem == "no tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).unlink()
    if problem == "no folder":
        shutil.rmtree(folder)
    cfg = ToxicityClassifierConfig(model=str(folder))
    (tmp_path / "demo.txt").write_text("x\n")
    data = RawFiles([str(tmp_path / "demo.txt")])
    with pytest.raises(BadInputError, match=f"safety.classifier.model=.*{message}"):
        toxicity_classifier.address(Store(tmp_path / "store"), cfg, "run", {"data": data})
    # the run's graph is not even built (its cards hash the config), so nothing runs
    overrides = [f"root={tmp_path / 'root'}", f"safety.classifier.model={folder}"]
    with pytest.raises(BadInputError, match=f"safety.classifier.model=.*{message}"):
        recipe(load_config(None, overrides))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BadInputError, match=message):
        toxicity_classifier(cfg, data=data, out=out)
    assert not any(out.iterdir())


def test_a_malformed_model_uri_is_named():
    with pytest.raises(ValueError, match="safety.classifier.model='hf://datasets/a/b'"):
        ToxicityClassifierConfig(model="hf://datasets/a/b")


def test_leave_one_group_out_auc_per_group(hashed_report, safety_dir):
    from sklearn.metrics import roc_auc_score

    logo = hashed_report["leave_one_group_out"]
    files = read_toxigen(safety_files(safety_dir))
    assert set(logo["groups"]) == {f.target for f in files}  # every target group held out once
    # one group by hand: trained on every other group's sentences, scored on all of its own
    cfg = ToxicityClassifierConfig()
    model_cfg = _model_config(cfg)
    group = "lgbtq"
    train = [(s, int(f.kind == "hate")) for f in files if f.target != group for s in f.sentences]
    held = [(s, int(f.kind == "hate")) for f in files if f.target == group for s in f.sentences]
    model = HashedLinearModel(model_cfg).fit(
        [features(t, model_cfg) for t, _ in train], [y for _, y in train]
    )
    scores = [model.predict(features(t, model_cfg)) for t, _ in held]
    assert logo["groups"][group] == pytest.approx(roc_auc_score([y for _, y in held], scores))
    values = list(logo["groups"].values())
    assert logo["mean"] == pytest.approx(sum(values) / len(values))
    assert len(set(values)) > 1
    # groups it never saw are harder than held-out sentences of groups it trained on
    assert logo["mean"] < hashed_report["auc"]
    assert logo["pooled"] != pytest.approx(logo["mean"])
    line = classifier_line(describe(hashed_report))  # what the safety step gives the card
    assert "hashed n-gram" in line and f"held-out AUC {hashed_report['auc']:.3f}" in line
    assert f"{logo['mean']:.3f}" in line and f"lgbtq {logo['groups']['lgbtq']:.3f}" in line
