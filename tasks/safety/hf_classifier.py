"""A transformers sequence classifier as the toxicity scorer (``safety.classifier.model``).

The model is named ``hf://models/OWNER/NAME[@REVISION]`` or by a local folder. Like a Hub dataset
source (``tasks/ingest/hub.py``), a Hub model is pinned: to the commit the Hub resolves its
revision to, or, offline with ``LLMFLOW_HUB_MIRROR=/dir``, read from ``/dir/OWNER/NAME`` and
pinned to that folder's fingerprint (``local-<sha256>`` of its files). A local folder is pinned to
its fingerprint too. The pin enters the classifier step's hash, so another classifier, or changed
weights, is another output.

The toxic probability is the toxic class's softmax probability (a sigmoid for a multi-label or
one-logit head). The toxic class is ``toxic_label`` (index or id2label name), else the one label
whose name says toxic or hate, else ``LABEL_1`` of a two-label head; anything else fails, naming
the labels.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.ingest import models
from llmflow.tasks.ingest.models import MODEL_PREFIX, TOKENIZER_FILES, WEIGHT_FILES  # noqa: F401

FIELD = "safety.classifier.model"
_TOXIC = re.compile(r"toxic|hate")
_NEGATED = re.compile(r"(?:^|[\W_])(?:non|not|no)[\W_]?(?:toxic|hate)")

ClassifierSource = models.ModelSource


def check_uri(uri: str) -> str:
    """A configured model name, checked for form only (no file or network access)."""
    return models.check_uri(uri, FIELD)


def resolve(uri: str) -> ClassifierSource:
    """The source a configured model names, pinned (``tasks/ingest/models.py``); a local or
    mirror folder is checked to be a loadable sequence classifier.

    Raises:
        BadInputError: a malformed URI, an unreachable repo, a missing or changed mirror folder,
            or a folder that is not a sequence classifier, each naming the field and value.
    """
    return models.resolve(uri, FIELD, check_folder)


def local_folder(source: ClassifierSource) -> Path:
    """The folder the classifier loads from: its own, the mirror's, or the Hub cache's snapshot
    of the pinned commit (downloaded once)."""
    return models.local_folder(source, FIELD, check_folder)


def check_folder(folder: Path, uri: str) -> dict:
    """The folder's config.json, once it is known to hold a sequence classifier with weights and
    a tokenizer; otherwise a BadInputError naming what is missing."""
    config = models.read_config(folder, uri, FIELD)
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise BadInputError(
            f"{FIELD}={uri!r}: {folder} is not a sequence classifier (config.json names "
            f"architectures {architectures}; a ...ForSequenceClassification model is needed)"
        )
    models.check_files(folder, uri, FIELD)
    return config


def toxic_index(id2label: dict, toxic_label: int | str | None) -> int:
    """The index of the toxic class among ``id2label`` (see the module's docstring)."""
    labels = {int(k): str(v) for k, v in id2label.items()}
    shown = {k: labels[k] for k in sorted(labels)}
    if isinstance(toxic_label, int):
        if toxic_label not in labels:
            raise BadInputError(
                f"safety.classifier.toxic_label={toxic_label} is not a class of the model "
                f"(id2label {shown})"
            )
        return toxic_label
    if isinstance(toxic_label, str):
        found = [k for k, name in labels.items() if name == toxic_label]
        if not found:
            raise BadInputError(
                f"safety.classifier.toxic_label={toxic_label!r} is not a label of the model "
                f"(id2label {shown})"
            )
        return found[0]
    toxic = [
        k
        for k, name in labels.items()
        if _TOXIC.search(name.lower()) and not _NEGATED.search(name.lower())
    ]
    if len(toxic) == 1:
        return toxic[0]
    if not toxic and set(labels.values()) == {"LABEL_0", "LABEL_1"}:
        return next(k for k, name in labels.items() if name == "LABEL_1")
    which = "several labels name toxicity" if toxic else "no label names toxicity"
    raise BadInputError(
        f"{which} in the classifier's id2label {shown}: set safety.classifier.toxic_label "
        "to the toxic class's index or name"
    )


class TransformersScorer:
    """Toxic-class probability of texts from a local sequence-classifier folder, batched."""

    def __init__(
        self,
        folder: Path,
        toxic_label: int | str | None = None,
        batch_size: int = 32,
        device: str | None = None,
        dtype: str = "float32",
    ):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
        model = AutoModelForSequenceClassification.from_pretrained(
            str(folder), local_files_only=True, dtype=torch_dtype
        )
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.eval().to(self.device)
        self.index = toxic_index(model.config.id2label, toxic_label)
        self.multi_label = (
            model.config.problem_type == "multi_label_classification"
            or model.config.num_labels == 1
        )
        self.batch_size = batch_size
        self.max_length = min(self.tokenizer.model_max_length, 512)

    def scores(self, texts: list[str]) -> list[float]:
        """The toxic probability of each text, ``batch_size`` texts per forward pass. A text
        with no tokens (an empty continuation, with a tokenizer that adds no special tokens)
        scores 0, as it does with the hashed model."""
        import torch

        out: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            chunk = list(texts[start : start + self.batch_size])
            encoded = self.tokenizer(chunk, truncation=True, max_length=self.max_length)
            rows = [i for i, ids in enumerate(encoded["input_ids"]) if len(ids)]
            values = [0.0] * len(chunk)
            if rows:
                kept = {key: [encoded[key][i] for i in rows] for key in encoded}
                batch = self.tokenizer.pad(kept, return_tensors="pt").to(self.device)
                with torch.no_grad():
                    logits = self.model(**batch).logits.float()
                probs = logits.sigmoid() if self.multi_label else logits.softmax(-1)
                for row, value in zip(rows, probs[:, self.index].tolist(), strict=True):
                    values[row] = value
            out += values
        return out

    def __call__(self, text: str) -> float:
        return self.scores([text])[0]
