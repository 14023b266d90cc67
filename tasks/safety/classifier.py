"""The toxicity classifier: the quality filter's hashed n-gram model, taught hate vs neutral.

Trained once per run on ToxiGen's demonstration sentences (hateful = 1, neutral = 0) and on a
sample of the run's own training documents (ordinary text = 0). Without that background, text
unlike any demonstration (a small model's continuations) scores near the classes' prior, about
0.5, and every prompt would count as toxic. A share of each file and of the background is held
out: the held-out accuracy on ToxiGen and the false-positive rate on background text are reported.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from llmflow.tasks.curation.config import QualityModelConfig
from llmflow.tasks.curation.quality_model import HashedLinearModel, features, precision_recall
from llmflow.tasks.framework.step import Metrics, RawFiles, report_table, step
from llmflow.tasks.safety.config import ToxicityClassifierConfig
from llmflow.tasks.safety.data import ToxigenFile, read_toxigen
from llmflow.tasks.tokenizer.corpus import corpus_files, iter_batches

WEIGHTS = "classifier.npz"
REPORT = "report.json"


def _model_config(cfg: ToxicityClassifierConfig) -> QualityModelConfig:
    """The shared model's settings (it reads only these fields)."""
    fields = ("num_features", "max_ngram", "epochs", "learning_rate", "l2", "seed")
    return QualityModelConfig(**{name: getattr(cfg, name) for name in fields})


def split(files: list[ToxigenFile], cfg: ToxicityClassifierConfig) -> tuple[list, list]:
    """(text, label) pairs for training and for held-out accuracy, split within each file."""
    rng = random.Random(cfg.seed)
    train, held = [], []
    for demo in files:
        labelled = [(s, int(demo.kind == "hate")) for s in demo.sentences]
        part_train, part_held = _holdout(labelled, cfg.holdout_fraction, rng)
        train, held = train + part_train, held + part_held
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


def read_classifier_config(folder: Path) -> ToxicityClassifierConfig:
    """The settings a classifier output was trained with."""
    return ToxicityClassifierConfig(**json.loads((Path(folder) / REPORT).read_text())["config"])


@step("toxicity-classifier", version=1)
def toxicity_classifier(
    cfg: ToxicityClassifierConfig, data: RawFiles, out: Path, background: Path | None = None
) -> Metrics:
    """Train the hate/neutral classifier on ToxiGen sentences (and ordinary text from
    ``background``, a corpus output); report held-out accuracy and background false positives."""
    train, held = split(read_toxigen(data), cfg)
    ordinary = background_texts(background, cfg) if background is not None else []
    ordinary_train, ordinary_held = _holdout(
        ordinary, cfg.holdout_fraction, random.Random(cfg.seed)
    )
    train += [(t, 0) for t in ordinary_train] if ordinary else []
    model_cfg = _model_config(cfg)
    model = HashedLinearModel(model_cfg).fit(
        [features(t, model_cfg) for t, _ in train], [y for _, y in train]
    )
    predicted = [int(model.predict(features(t, model_cfg)) >= 0.5) for t, _ in held]
    scores = precision_recall(predicted, [y for _, y in held])
    flagged = (
        [model.predict(features(t, model_cfg)) >= 0.5 for t in ordinary_held] if ordinary else []
    )
    scores["background_false_positive_rate"] = sum(flagged) / len(flagged) if flagged else None
    np.savez(out / WEIGHTS, weights=model.weights, bias=model.bias)
    report = {"config": cfg.model_dump(), "train": len(train), "held_out": len(held), **scores}
    (out / REPORT).write_text(json.dumps(report, indent=1) + "\n")
    report_table("toxicity-classifier", [{"metric": k, "value": v} for k, v in scores.items()])
    return {
        "held_out_accuracy": scores["accuracy"],
        "background_false_positive_rate": scores["background_false_positive_rate"],
        "train": len(train),
        "held_out": len(held),
    }
