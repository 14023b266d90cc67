"""Models on the Hugging Face Hub (or in a local folder) as inputs of the graph.

A model is named ``hf://models/OWNER/NAME[@REVISION]`` or by a local folder. Like a Hub dataset
source (``hub.py``), it is pinned when the recipe is built:

- on the Hub, to the commit its revision resolves to (``HfApi().model_info``); a missing repo or
  revision fails, naming it;
- offline, with ``LLMFLOW_HUB_MIRROR=/dir``, ``hf://models/OWNER/NAME`` is the folder
  ``/dir/OWNER/NAME`` laid out as the Hub repo, pinned to its fingerprint (``local-<sha256>`` of
  its files' names, sizes and whole contents). A ``local-`` pin must still match the folder, and a
  named revision must be the commit the folder records (``huggingface-cli download --local-dir``
  writes it under ``.cache``); neither is ever silently replaced by what the folder holds now;
- a local folder is pinned to its fingerprint too.

``pinned_uri`` is the string a recipe keeps (``hf://models/OWNER/NAME@<commit>``), and
``model_files`` the raw files whose sha256 enter a step's hash and its lineage. Users:
``init:`` (``tasks/ingest/import_model.py``) and ``safety.classifier.model``
(``tasks/safety/hf_classifier.py``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.ingest.hub import MIRROR_ENV, folder_fingerprint, recorded_commits, repo_files

MODEL_PREFIX = "hf://models/"
_URI = re.compile(r"^hf://models/(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt")

FolderCheck = Callable[[Path, str], Any]
"""``check(folder, uri)``: raises BadInputError when the folder is not the model wanted."""


@dataclass(frozen=True)
class ModelSource:
    """Where a configured model loads from, and what it is pinned to."""

    uri: str
    revision: str
    folder: Path | None  # None: the Hub (downloaded through the Hub cache at ``revision``)
    repo: str | None = None

    @property
    def name(self) -> str:
        """How cards and reports name it: ``OWNER/NAME@revision`` or ``FOLDER@fingerprint``."""
        return f"{self.repo or self.uri}@{self.revision}"

    @property
    def pinned_uri(self) -> str:
        """``hf://models/OWNER/NAME@revision`` for a Hub model; a local folder's path (its
        files' hashes pin it)."""
        return f"{MODEL_PREFIX}{self.repo}@{self.revision}" if self.repo else str(self.folder)


def check_uri(uri: str, field: str) -> str:
    """A configured model name, checked for form only (no file or network access)."""
    if not uri.strip():
        raise BadInputError(f"{field} is empty; give hf://models/OWNER/NAME or a folder")
    if uri.startswith("hf://") and not _URI.match(uri):
        raise BadInputError(
            f"{field}={uri!r} is not a Hub model URI; expected "
            "hf://models/OWNER/NAME[@REVISION] or a local folder"
        )
    return uri


def resolve(uri: str, field: str, check: FolderCheck | None = None) -> ModelSource:
    """The source ``uri`` names, pinned; a local or mirror folder is checked with ``check``.

    Raises:
        BadInputError: a malformed URI, a missing repo, revision or folder, a mirror folder whose
            files changed since it was pinned, or a folder ``check`` refuses; each names
            ``field`` and the value.
    """
    match = _URI.match(check_uri(uri, field))
    if match is None:
        folder = Path(uri).expanduser()
        if not folder.is_dir():
            raise BadInputError(f"{field}={uri!r}: no such folder")
        if check is not None:
            check(folder, uri)
        return ModelSource(uri, fingerprint(folder), folder.resolve())
    repo, revision = match["repo"], match["revision"]
    mirror = os.environ.get(MIRROR_ENV)
    if mirror:
        folder = Path(mirror) / repo
        if not folder.is_dir():
            raise BadInputError(
                f"{field}={uri!r}: no repo {repo} in the mirror ({MIRROR_ENV}={mirror} has no "
                f"folder {folder})"
            )
        found = fingerprint(folder)
        _check_mirror_revision(folder, revision, found, uri, field)
        if check is not None:
            check(folder, uri)
        return ModelSource(uri, found, folder, repo)
    if (revision or "").startswith("local-"):
        raise BadInputError(
            f"{field}={uri!r} is pinned to a mirror folder's fingerprint, but {MIRROR_ENV} is "
            "not set: set it to the mirror that holds the pinned files"
        )
    return ModelSource(uri, _hub_commit(repo, revision, uri, field), None, repo)


def _check_mirror_revision(
    folder: Path, revision: str | None, found: str, uri: str, field: str
) -> None:
    """A revision named with a mirror folder must be what the folder holds (see module doc)."""
    if revision is None or revision == found:
        return
    if revision.startswith("local-"):
        raise BadInputError(
            f"{field}={uri!r}: the mirror folder {folder} now fingerprints as {found}, not "
            f"the pinned {revision}: its files changed; restore them or drop @{revision}"
        )
    commits = recorded_commits(folder)
    if revision in commits or revision == "main":
        return
    held = f"it records commit {', '.join(sorted(commits))}" if commits else "it records none"
    raise BadInputError(
        f"{field}={uri!r}: revision {revision!r} is not in the mirror folder {folder} ({held}); "
        f"mirror that revision or drop @{revision}"
    )


@lru_cache(maxsize=32)
def _hub_commit(repo: str, revision: str | None, uri: str, field: str) -> str:
    """The commit the Hub resolves ``revision`` to (asked once per process: one run, one pin)."""
    from huggingface_hub import HfApi

    try:
        return HfApi().model_info(repo, revision=revision).sha
    except Exception as err:  # noqa: BLE001  (offline, 404, gated, auth: all say "unreachable")
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise BadInputError(f"{field}={uri!r} is unreachable: {first}") from None


def fingerprint(folder: Path) -> str:
    """The folder's fingerprint, computed once per content listing (names, sizes, mtimes)."""
    listing = tuple(
        (str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in repo_files(folder)
    )
    return _cached_fingerprint(str(folder.resolve()), listing)


@lru_cache(maxsize=32)
def _cached_fingerprint(folder: str, listing: tuple) -> str:
    return folder_fingerprint(Path(folder))


def local_folder(source: ModelSource, field: str, check: FolderCheck | None = None) -> Path:
    """The folder the model loads from: its own, the mirror's, or the Hub cache's snapshot of
    the pinned commit (downloaded once, then checked with ``check``)."""
    if source.folder is not None:
        return source.folder
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(source.repo, revision=source.revision))
    except Exception as err:  # noqa: BLE001
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise BadInputError(f"{field}={source.uri!r} cannot be downloaded: {first}") from None
    if check is not None:
        check(folder, source.uri)
    return folder


def pin(uri: str, field: str, check: FolderCheck | None = None) -> str:
    """The pinned form of a configured model: ``hf://models/OWNER/NAME@<commit or local->``,
    or the folder itself (its files' hashes pin it, see ``model_files``)."""
    return resolve(uri, field, check).pinned_uri


def model_files(source: ModelSource) -> tuple[str, ...]:
    """The files of a local or mirror model folder (``.cache`` left out), for a ``Raw`` input:
    each one's sha256 enters the step hash and the lineage. A Hub model has none here: its
    commit, in the pinned URI, names its content."""
    if source.folder is None:
        return ()
    return tuple(str(p) for p in repo_files(source.folder))


def read_config(folder: Path, uri: str, field: str) -> dict:
    """The folder's config.json as a dict, or a BadInputError naming what is wrong."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise BadInputError(f"{field}={uri!r}: {folder} has no config.json (not a model folder)")
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise BadInputError(f"{field}={uri!r}: {config_file} is not JSON: {err}") from None


def check_files(folder: Path, uri: str, field: str) -> None:
    """The folder holds weights and a tokenizer; otherwise a BadInputError naming the missing."""
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise BadInputError(
            f"{field}={uri!r}: {folder} holds no weights (none of {', '.join(WEIGHT_FILES)})"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise BadInputError(
            f"{field}={uri!r}: {folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
        )
