"""Model-based quality filter in the style of Llama 3 / FineWeb-Edu.

A teacher scores a sample of documents; a small, fast classifier (a linear model over hashed
word n-grams, fastText-like, in numpy) learns the teacher's good/bad labels and then scores every
document. The teacher is pluggable: `rules` (a transparent heuristic scorer for the quickstart) or
`hf` (a local Hugging Face sequence-classification model, e.g. the FineWeb-Edu classifier, whose
regression output is compared with `teacher_threshold`).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from llmflow.tasks.curation.config import QualityModelConfig
from llmflow.tasks.curation.minhash import _excluded_ids, _word_hash
from llmflow.tasks.curation.shards import iter_rows, shards_in, write_drops, write_json
from llmflow.tasks.curation.text import simplify_text
from llmflow.tasks.framework.step import Metrics, step

_STOP = frozenset("the of and to a in is that it for as was with be by on are this from".split())


def rule_teacher(text: str) -> float:
    """Heuristic quality score in [0, 1]: prose with sentences, stop words, varied vocabulary."""
    words = text.split()
    if len(words) < 20:
        return 0.0
    alpha = sum(w.isalpha() for w in words) / len(words)
    stop = min(1.0, sum(w.lower() in _STOP for w in words) / len(words) / 0.25)
    diversity = min(1.0, len({w.lower() for w in words}) / len(words) / 0.4)
    sentences = max(1, sum(text.count(c) for c in ".!?"))
    sentence_len = len(words) / sentences
    sentence_score = 1.0 if 6 <= sentence_len <= 40 else 0.3
    lines = [line for line in text.split("\n") if line.strip()]
    upper = sum(line.isupper() for line in lines) / max(1, len(lines))
    return float(np.clip((alpha + stop + diversity + sentence_score) / 4 - 0.5 * upper, 0.0, 1.0))


def hf_teacher(path: str, texts: list[str], batch_size: int = 16) -> list[float]:
    """Scores texts with a local HF sequence-classification model (regression head: the raw
    output; classification head: the expected class index)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).eval()
    scores: list[float] = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size],
                truncation=True,
                max_length=512,
                padding=True,
                return_tensors="pt",
            )
            scores += _head_scores(model(**batch).logits.float())
    return scores


def _head_scores(logits) -> list[float]:
    """A regression head's raw output, or a classification head's expected class index."""
    import torch

    if logits.shape[-1] == 1:
        return logits[:, 0].tolist()
    probs = logits.softmax(-1)
    return (probs * torch.arange(probs.shape[-1])).sum(-1).tolist()


def features(text: str, cfg: QualityModelConfig) -> np.ndarray:
    """Hashed word 1..max_ngram-gram bucket indices of a document (deterministic)."""
    words = simplify_text(text).split()[:5000]
    hashes = np.fromiter((_word_hash(w) for w in words), np.uint64, len(words))
    grams = [hashes]
    with np.errstate(over="ignore"):
        for n in range(2, cfg.max_ngram + 1):
            grams.append(
                grams[-1][:-1] * np.uint64(0x9E3779B97F4A7C15) + hashes[n - 1 :] + np.uint64(n)
            )
    return np.unique(np.concatenate(grams) % np.uint64(cfg.num_features)).astype(np.int64)


class HashedLinearModel:
    """Logistic regression over hashed n-gram presence features, trained with SGD."""

    def __init__(self, cfg: QualityModelConfig):
        self.cfg = cfg
        self.weights = np.zeros(cfg.num_features, np.float64)
        self.bias = 0.0

    def _logit(self, feats: np.ndarray) -> float:
        return float(self.weights[feats].sum() / np.sqrt(max(1, len(feats))) + self.bias)

    def predict(self, feats: np.ndarray) -> float:
        """Probability that the document is good."""
        return float(1.0 / (1.0 + np.exp(-np.clip(self._logit(feats), -30, 30))))

    def fit(self, data: list[np.ndarray], labels: list[int]) -> HashedLinearModel:
        rng = random.Random(self.cfg.seed)
        positives = max(1, sum(labels))
        negatives = max(1, len(labels) - positives)
        class_weight = {1: len(labels) / (2 * positives), 0: len(labels) / (2 * negatives)}
        order = list(range(len(data)))
        for epoch in range(self.cfg.epochs):
            rng.shuffle(order)
            lr = self.cfg.learning_rate / (1 + epoch)
            for i in order:
                feats, label = data[i], labels[i]
                grad = (self.predict(feats) - label) * class_weight[label]
                scale = 1.0 / np.sqrt(max(1, len(feats)))
                self.weights[feats] -= lr * (grad * scale + self.cfg.l2 * self.weights[feats])
                self.bias -= lr * grad
        return self


def precision_recall(predicted: list[int], actual: list[int]) -> dict[str, float]:
    """Precision and recall of the positive (good) class, and accuracy."""
    tp = sum(p and a for p, a in zip(predicted, actual, strict=True))
    fp = sum(p and not a for p, a in zip(predicted, actual, strict=True))
    fn = sum(a and not p for p, a in zip(predicted, actual, strict=True))
    correct = sum(p == a for p, a in zip(predicted, actual, strict=True))
    return {
        "precision": tp / (tp + fp) if tp + fp else 1.0,
        "recall": tp / (tp + fn) if tp + fn else 1.0,
        "accuracy": correct / len(actual) if actual else 1.0,
    }


def _eligible_rows(cfg: QualityModelConfig, shard_dirs: list[Path], excluded: set[str]):
    for d in shard_dirs:
        for shard in shards_in(d):
            for row in iter_rows(shard, ("id", "text", "domain")):
                if row["id"] not in excluded and row["domain"] not in cfg.skip_domains:
                    yield row


def _teacher_labels(cfg: QualityModelConfig, sample: list[dict]) -> list[float]:
    texts = [r["text"] for r in sample]
    if cfg.teacher == "hf":
        return hf_teacher(cfg.teacher_path, texts)
    return [rule_teacher(t) for t in texts]


def _train(cfg: QualityModelConfig, sample: list[dict]) -> tuple[HashedLinearModel | None, dict]:
    scores = _teacher_labels(cfg, sample)
    labels = [int(s >= cfg.teacher_threshold) for s in scores]
    feats = [features(r["text"], cfg) for r in sample]
    num_holdout = int(len(sample) * cfg.holdout_fraction)
    report = {
        "teacher": cfg.teacher,
        "teacher_documents": len(sample),
        "teacher_positive_rate": sum(labels) / max(1, len(labels)),
        "threshold": cfg.threshold,
        "holdout_documents": num_holdout,
    }
    train_labels = labels[num_holdout:]
    if len(set(train_labels)) < 2:
        report["skipped"] = "teacher labels have a single class; nothing is filtered"
        return None, report
    model = HashedLinearModel(cfg).fit(feats[num_holdout:], train_labels)
    predicted = [int(model.predict(f) >= cfg.threshold) for f in feats[:num_holdout]]
    report["holdout"] = precision_recall(predicted, labels[:num_holdout])
    return model, report


def _sample(cfg: QualityModelConfig, filtered: list[Path], excluded: set[str]) -> list[dict]:
    """The documents the teacher labels: a seeded sample, in a seeded order."""
    ids = [r["id"] for r in _eligible_rows(cfg, filtered, excluded)] if cfg.enabled else []
    chosen = set(random.Random(cfg.seed).sample(ids, min(cfg.num_teacher_docs, len(ids))))
    return sorted(
        (r for r in _eligible_rows(cfg, filtered, excluded) if r["id"] in chosen),
        key=lambda r: random.Random(f"{cfg.seed}:{r['id']}").random(),
    )


def _score_all(
    cfg: QualityModelConfig, model: HashedLinearModel, filtered: list[Path], excluded: set[str]
) -> tuple[dict[str, list], np.ndarray]:
    """Drops (id, reason, score columns) of documents scored below threshold, and a histogram."""
    drops = {"id": [], "reason": [], "score": []}
    histogram = np.zeros(10, np.int64)
    for row in tqdm(
        _eligible_rows(cfg, filtered, excluded), desc="quality", leave=False, disable=None
    ):
        score = model.predict(features(row["text"], cfg))
        histogram[min(9, int(score * 10))] += 1
        if score < cfg.threshold:
            drops["id"].append(row["id"])
            drops["reason"].append("low_quality_score")
            drops["score"].append(score)
    return drops, histogram


def _write_drops(drops: dict[str, list], out: Path) -> None:
    write_drops(out, drops["id"], drops["reason"], score=pa.array(drops["score"], pa.float64()))


@step("curate-quality-model", version=1)
def quality_model(
    cfg: QualityModelConfig,
    filtered: list[Path],
    out: Path,
    exact: Path | None = None,
    near: Path | None = None,
) -> Metrics:
    """Train a classifier on teacher labels; drop documents it scores below threshold.

    Args:
        cfg: the quality model settings.
        filtered: filtered shard dirs (documents still alive).
        out: receives `drops.parquet` (id, reason, score), `classifier.npz` and `report.json`.
        exact: the exact dedup output, whose dropped documents are ignored.
        near: the near dedup output, likewise.
    """
    excluded = _excluded_ids([d for d in (exact, near) if d])
    sample = _sample(cfg, filtered, excluded)
    model, report = _train(cfg, sample) if sample else (None, {"skipped": "disabled or empty"})
    drops, histogram = {"id": [], "reason": [], "score": []}, np.zeros(10, np.int64)
    if model is not None:
        np.savez(out / "classifier.npz", weights=model.weights, bias=model.bias)
        drops, histogram = _score_all(cfg, model, filtered, excluded)
    _write_drops(drops, out)
    report.update(
        {
            "stage": "quality_model",
            "documents_scored": int(histogram.sum()),
            "documents_dropped": len(drops["id"]),
            "score_histogram": histogram.tolist(),
        }
    )
    write_json(out / "report.json", report)
    holdout = report.get("holdout", {})
    return {
        "documents_dropped": len(drops["id"]),
        "holdout_precision": holdout.get("precision"),
        "holdout_recall": holdout.get("recall"),
        "threshold": cfg.threshold,
    }
