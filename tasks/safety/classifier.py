"""The toxicity classifier: the quality filter's hashed n-gram model, taught hate vs neutral.

Trained once per run on ToxiGen's demonstration sentences (hateful = 1, neutral = 0); a share of
each file is held out and the held-out accuracy is reported, so a user sees how far to trust it.
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
        rng.shuffle(labelled)
        cut = max(1, round(len(labelled) * cfg.holdout_fraction))
        held += labelled[:cut]
        train += labelled[cut:]
    return train, held


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
def toxicity_classifier(cfg: ToxicityClassifierConfig, data: RawFiles, out: Path) -> Metrics:
    """Train the hate/neutral classifier on ToxiGen sentences; report held-out accuracy."""
    train, held = split(read_toxigen(data), cfg)
    model_cfg = _model_config(cfg)
    model = HashedLinearModel(model_cfg).fit(
        [features(t, model_cfg) for t, _ in train], [y for _, y in train]
    )
    predicted = [int(model.predict(features(t, model_cfg)) >= 0.5) for t, _ in held]
    scores = precision_recall(predicted, [y for _, y in held])
    np.savez(out / WEIGHTS, weights=model.weights, bias=model.bias)
    report = {"config": cfg.model_dump(), "train": len(train), "held_out": len(held), **scores}
    (out / REPORT).write_text(json.dumps(report, indent=1) + "\n")
    report_table("toxicity-classifier", [{"metric": k, "value": v} for k, v in scores.items()])
    return {"held_out_accuracy": scores["accuracy"], "train": len(train), "held_out": len(held)}
