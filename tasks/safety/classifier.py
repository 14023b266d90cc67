"""The toxicity classifier: the quality filter's hashed n-gram model, taught hate vs neutral.

Trained once per run on ToxiGen's demonstration sentences (hateful = 1, neutral = 0) and on a
sample of the run's own training documents (ordinary text = 0). Without that background, text
unlike any demonstration (a small model's continuations) scores near the classes' prior, about
0.5, and every prompt would count as toxic. A share of each target group and kind (each sentence
once: ToxiGen's files repeat some) and of the background is held out: the held-out accuracy and
AUC on ToxiGen and the false-positive rate on background text are reported. Held-out sentences
come from groups the model saw in training, so the report adds a leave-one-group-out AUC: for
each target group, a model trained on every other group scores all of that group's sentences
(per group, their mean, and all those scores pooled).

With ``model`` set, a transformers sequence classifier scores continuations instead
(``hf_classifier.py``); this step then trains nothing, and reports that classifier's held-out
accuracy and AUC on the same held-out sentences and background.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from llmflow.tasks.curation.config import QualityModelConfig
from llmflow.tasks.curation.quality_model import HashedLinearModel, features, precision_recall
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, RawFiles, report_table, step
from llmflow.tasks.safety import hf_classifier
from llmflow.tasks.safety.config import ToxicityClassifierConfig
from llmflow.tasks.safety.data import ToxigenFile, read_toxigen
from llmflow.tasks.tokenizer.corpus import corpus_files, iter_batches

WEIGHTS = "classifier.npz"
REPORT = "report.json"
HASHED = "hashed n-gram"
TRANSFORMERS = "transformers"


def _model_config(cfg: ToxicityClassifierConfig) -> QualityModelConfig:
    """The shared model's settings (it reads only these fields)."""
    fields = ("num_features", "max_ngram", "epochs", "learning_rate", "l2", "seed")
    return QualityModelConfig(**{name: getattr(cfg, name) for name in fields})


def split(files: list[ToxigenFile], cfg: ToxicityClassifierConfig) -> tuple[list, list]:
    """(text, label) pairs for training and for held-out accuracy, split within each target
    group and kind; no sentence is on both sides (``read_toxigen`` reads each one once)."""
    rng = random.Random(cfg.seed)
    train, held = [], []
    for demo in files:
        labelled = [(s, int(demo.kind == "hate")) for s in demo.sentences]
        part_train, part_held = _holdout(labelled, cfg.holdout_fraction, rng)
        train, held = train + part_train, held + part_held
    shared = {t for t, _ in train} & {t for t, _ in held}
    if shared:  # a trained-on sentence scored as held out inflates the held-out AUC
        raise ValueError(
            f"{len(shared)} sentences both trained on and held out: {sorted(shared)[:3]}"
        )
    return train, held


def _holdout(items: list, fraction: float, rng: random.Random) -> tuple[list, list]:
    items = list(items)
    rng.shuffle(items)
    cut = max(1, round(len(items) * fraction))
    return items[cut:], items[:cut]


def background_texts(corpus: Path, cfg: ToxicityClassifierConfig) -> list[str]:
    """The first ``background_docs`` documents of a corpus, cut to sentence-like lengths."""
    texts: list[str] = []
    for batch in iter_batches(corpus_files(corpus), 256, columns=["text"]):
        for text in batch.column("text").to_pylist():
            words = str(text).split()
            for start in range(0, len(words), cfg.background_words):
                texts.append(" ".join(words[start : start + cfg.background_words]))
                if len(texts) >= cfg.background_docs:
                    return texts
    return texts


class ToxicityScorer:
    """Probability that a text is hateful, from a trained classifier output."""

    def __init__(self, folder: Path, cfg: ToxicityClassifierConfig):
        self.model_cfg = _model_config(cfg)
        self.model = HashedLinearModel(self.model_cfg)
        saved = np.load(Path(folder) / WEIGHTS)
        self.model.weights, self.model.bias = saved["weights"], float(saved["bias"])

    def __call__(self, text: str) -> float:
        feats = features(text, self.model_cfg)
        return self.model.predict(feats) if len(feats) else 0.0

    def scores(self, texts: list[str]) -> list[float]:
        return [self(t) for t in texts]


def read_report(folder: Path) -> dict[str, Any]:
    """A classifier output's report (its settings, held-out scores, which classifier it is)."""
    return json.loads((Path(folder) / REPORT).read_text())


def classifier_scorer(
    folder: Path, device: str | None = None, dtype: str = "float32"
) -> ToxicityScorer | hf_classifier.TransformersScorer:
    """The scorer a classifier output stands for: its hashed model, or the transformers model it
    pinned (which must still have the pinned content), on ``device`` in ``dtype``."""
    report = read_report(folder)
    cfg = ToxicityClassifierConfig(**report["config"])
    if report.get("kind") != TRANSFORMERS:
        return ToxicityScorer(folder, cfg)
    source = hf_classifier.resolve(report["model"])
    if source.revision != report["revision"]:
        raise BadInputError(
            f"{hf_classifier.FIELD}={report['model']!r} now resolves to {source.revision}, not "
            f"{report['revision']} that the classifier output {folder} was evaluated with"
        )
    return hf_classifier.TransformersScorer(
        hf_classifier.local_folder(source), report["toxic_label"], cfg.batch_size, device, dtype
    )


def describe(report: dict[str, Any]) -> dict[str, Any]:
    """Which classifier a report is of, and how it does on held-out sentences (for cards)."""
    logo = report.get("leave_one_group_out") or {}
    return {
        "kind": report.get("kind", HASHED),
        "model": report.get("model_name"),
        "held_out_accuracy": report.get("accuracy"),
        "held_out_auc": report.get("auc"),
        "leave_one_group_out_auc": logo.get("groups"),
        "leave_one_group_out_mean_auc": logo.get("mean"),
    }


def auc(scores: list[float], labels: list[int]) -> float | None:
    """Area under the ROC curve (the Mann-Whitney U statistic, ties counted half); None when
    one class is absent."""
    pairs = sorted(zip(scores, labels, strict=True))
    positives = sum(labels)
    negatives = len(labels) - positives
    if not positives or not negatives:
        return None
    rank_sum, index = 0.0, 0
    while index < len(pairs):
        end = index
        while end < len(pairs) and pairs[end][0] == pairs[index][0]:
            end += 1
        mid_rank = (index + 1 + end) / 2  # 1-based ranks index+1..end share their mean
        rank_sum += mid_rank * sum(label for _, label in pairs[index:end])
        index = end
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def leave_one_group_out(
    files: list[ToxigenFile], ordinary: list[str], cfg: ToxicityClassifierConfig
) -> dict[str, Any]:
    """Per target group, the AUC of a model trained on every other group (and ``ordinary``
    text) on all of that group's sentences; their mean, and the AUC of all those scores pooled."""
    model_cfg = _model_config(cfg)
    cache: dict[str, np.ndarray] = {}

    def feats(text: str) -> np.ndarray:
        if text not in cache:
            cache[text] = features(text, model_cfg)
        return cache[text]

    labelled = [(f.target, s, int(f.kind == "hate")) for f in files for s in f.sentences]
    groups: dict[str, float | None] = {}
    pooled: tuple[list[float], list[int]] = ([], [])
    for group in sorted({target for target, _, _ in labelled}):
        train = [(s, y) for t, s, y in labelled if t != group] + [(t, 0) for t in ordinary]
        model = HashedLinearModel(model_cfg).fit(
            [feats(t) for t, _ in train], [y for _, y in train]
        )
        held = [(s, y) for t, s, y in labelled if t == group]
        scores = [model.predict(feats(s)) for s, _ in held]
        groups[group] = auc(scores, [y for _, y in held])
        pooled[0].extend(scores)
        pooled[1].extend(y for _, y in held)
    known = [v for v in groups.values() if v is not None]
    return {
        "groups": groups,
        "mean": sum(known) / len(known) if known else None,
        "pooled": auc(*pooled),
    }


def _evaluate(scores: list[float], labels: list[int], background: list[float]) -> dict[str, Any]:
    predicted = [int(p >= 0.5) for p in scores]
    out: dict[str, Any] = {**precision_recall(predicted, labels), "auc": auc(scores, labels)}
    flagged = [p >= 0.5 for p in background]
    out["background_false_positive_rate"] = sum(flagged) / len(flagged) if flagged else None
    return out


@step("toxicity-classifier", version=3, execution=("batch_size",))
def toxicity_classifier(
    cfg: ToxicityClassifierConfig, data: RawFiles, out: Path, background: Path | None = None
) -> Metrics:
    """Train the hate/neutral classifier on ToxiGen sentences (and ordinary text from
    ``background``, a corpus output), or take the configured transformers classifier; report
    held-out accuracy and AUC, background false positives, and the trained model's
    leave-one-group-out AUC."""
    source = hf_classifier.resolve(cfg.model) if cfg.model is not None else None
    files = read_toxigen(data)
    train, held = split(files, cfg)
    ordinary = background_texts(background, cfg) if background is not None else []
    ordinary_train, ordinary_held = _holdout(
        ordinary, cfg.holdout_fraction, random.Random(cfg.seed)
    )
    report: dict[str, Any] = {"config": cfg.model_dump(), "held_out": len(held)}
    if source is not None:
        scorer = hf_classifier.TransformersScorer(
            hf_classifier.local_folder(source), cfg.toxic_label, cfg.batch_size, device="cpu"
        )
        model_info = {"kind": TRANSFORMERS, "model": cfg.model, "revision": source.revision}
        report |= {**model_info, "model_name": source.name, "toxic_label": scorer.index}
        report["toxic_label_name"] = scorer.model.config.id2label[scorer.index]
        score_all = scorer.scores
    else:
        train += [(t, 0) for t in ordinary_train]
        model_cfg = _model_config(cfg)
        model = HashedLinearModel(model_cfg).fit(
            [features(t, model_cfg) for t, _ in train], [y for _, y in train]
        )
        np.savez(out / WEIGHTS, weights=model.weights, bias=model.bias)
        report |= {"kind": HASHED, "model_name": None, "train": len(train)}
        report["leave_one_group_out"] = leave_one_group_out(files, ordinary_train, cfg)

        def score_all(texts: list[str]) -> list[float]:
            return [model.predict(features(t, model_cfg)) for t in texts]

    scores = _evaluate(
        score_all([t for t, _ in held]), [y for _, y in held], score_all(ordinary_held)
    )
    report |= scores
    (out / REPORT).write_text(json.dumps(report, indent=1) + "\n")
    logo = report.get("leave_one_group_out") or {}
    rows = [{"metric": k, "value": v} for k, v in scores.items()]
    rows += [
        {"metric": f"leave_one_group_out_auc/{g}", "value": v}
        for g, v in logo.get("groups", {}).items()
    ]
    report_table("toxicity-classifier", rows)
    return {
        "held_out_accuracy": scores["accuracy"],
        "held_out_auc": scores["auc"],
        "leave_one_group_out_mean_auc": logo.get("mean"),
        "background_false_positive_rate": scores["background_false_positive_rate"],
        "train": report.get("train", 0),
        "held_out": len(held),
    }
