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

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.ingest.hub import MIRROR_ENV, folder_fingerprint

MODEL_PREFIX = "hf://models/"
FIELD = "safety.classifier.model"
_URI = re.compile(r"^hf://models/(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt")
_TOXIC = re.compile(r"toxic|hate")
_NEGATED = re.compile(r"(?:^|[\W_])(?:non|not|no)[\W_]?(?:toxic|hate)")


@dataclass(frozen=True)
class ClassifierSource:
    """Where a configured classifier loads from, and what it is pinned to."""

    uri: str
    revision: str
    folder: Path | None  # None: the Hub (loaded through the Hub cache at ``revision``)
    repo: str | None = None

    @property
    def name(self) -> str:
        """How cards and reports name it: ``OWNER/NAME@revision`` or ``FOLDER@fingerprint``."""
        return f"{self.repo or self.uri}@{self.revision}"


def check_uri(uri: str) -> str:
    """A configured model name, checked for form only (no file or network access)."""
    if uri.startswith("hf://") and not _URI.match(uri):
        raise BadInputError(
            f"{FIELD}={uri!r} is not a Hub model URI; expected "
            "hf://models/OWNER/NAME[@REVISION] or a local folder"
        )
    if not uri.strip():
        raise BadInputError(f"{FIELD} is empty; give hf://models/OWNER/NAME or a folder")
    return uri


def resolve(uri: str) -> ClassifierSource:
    """The source a configured model names, pinned; a local folder (or mirror folder) is checked
    to be a loadable sequence classifier.

    Raises:
        BadInputError: a malformed URI, an unreachable repo, a missing or changed mirror folder,
            or a folder that is not a sequence classifier, each naming the field and value.
    """
    match = _URI.match(check_uri(uri))
    if match is None:
        folder = Path(uri).expanduser()
        if not folder.is_dir():
            raise BadInputError(f"{FIELD}={uri!r}: no such folder")
        check_folder(folder, uri)
        return ClassifierSource(uri, _fingerprint(folder), folder.resolve())
    repo, revision = match["repo"], match["revision"]
    mirror = os.environ.get(MIRROR_ENV)
    if mirror:
        folder = Path(mirror) / repo
        if not folder.is_dir():
            raise BadInputError(
                f"{FIELD}={uri!r} is unreachable: no folder {folder} in the mirror ({MIRROR_ENV})"
            )
        check_folder(folder, uri)
        found = _fingerprint(folder)
        if (revision or "").startswith("local-") and revision != found:
            raise BadInputError(
                f"{FIELD}={uri!r}: the mirror folder {folder} now fingerprints as {found}, not "
                f"the pinned {revision}: its files changed"
            )
        return ClassifierSource(uri, found, folder, repo)
    if (revision or "").startswith("local-"):
        raise BadInputError(
            f"{FIELD}={uri!r} is pinned to a mirror folder's fingerprint, but {MIRROR_ENV} is "
            "not set: set it to the mirror that holds the pinned files"
        )
    return ClassifierSource(uri, _hub_commit(repo, revision, uri), None, repo)


@lru_cache(maxsize=32)
def _hub_commit(repo: str, revision: str | None, uri: str) -> str:
    """The commit the Hub resolves ``revision`` to (asked once per process: one run, one pin)."""
    from huggingface_hub import HfApi

    try:
        return HfApi().model_info(repo, revision=revision).sha
    except Exception as err:  # noqa: BLE001  (offline, 404, gated, auth: all say "unreachable")
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise BadInputError(f"{FIELD}={uri!r} is unreachable: {first}") from None


def _fingerprint(folder: Path) -> str:
    """The folder's fingerprint, computed once per content listing (names, sizes, mtimes)."""
    listing = tuple(
        (str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and ".cache" not in p.parts
    )
    return _cached_fingerprint(str(folder.resolve()), listing)


@lru_cache(maxsize=32)
def _cached_fingerprint(folder: str, listing: tuple) -> str:
    return folder_fingerprint(Path(folder))


def local_folder(source: ClassifierSource) -> Path:
    """The folder the classifier loads from: its own, the mirror's, or the Hub cache's snapshot
    of the pinned commit (downloaded once)."""
    if source.folder is not None:
        return source.folder
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(source.repo, revision=source.revision))
    except Exception as err:  # noqa: BLE001
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise BadInputError(f"{FIELD}={source.uri!r} cannot be downloaded: {first}") from None
    check_folder(folder, source.uri)
    return folder


def check_folder(folder: Path, uri: str) -> dict:
    """The folder's config.json, once it is known to hold a sequence classifier with weights and
    a tokenizer; otherwise a BadInputError naming what is missing."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise BadInputError(f"{FIELD}={uri!r}: {folder} has no config.json (not a model folder)")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise BadInputError(
            f"{FIELD}={uri!r}: {folder} is not a sequence classifier (config.json names "
            f"architectures {architectures}; a ...ForSequenceClassification model is needed)"
        )
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise BadInputError(
            f"{FIELD}={uri!r}: {folder} holds no weights (none of {', '.join(WEIGHT_FILES)})"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise BadInputError(
            f"{FIELD}={uri!r}: {folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
        )
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
