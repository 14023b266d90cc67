"""Datasets on the Hugging Face Hub as ingest sources, streamed (never downloaded whole).

A source is a URI::

    hf://datasets/OWNER/NAME[/CONFIG][@REVISION]?split=train&domain=web
        [&text_field=text][&max_docs=N][&max_tokens=N]

``CONFIG`` is the dataset's config (subset) name, ``REVISION`` a branch, tag or commit. The query
names the split (default ``train``), the domain every record of the source gets, the field that
holds the text, and caps: at most ``max_docs`` documents kept, or about ``max_tokens`` tokens
(counted at 4 UTF-8 bytes per token: the tokenizer is trained later, from this very data).

Records stream through ``datasets.load_dataset(..., streaming=True)``. When the recipe is built,
an unpinned source is pinned to the commit the Hub resolves its revision to, so that commit enters
the ingest hash and the lineage. Offline, ``LLMFLOW_HUB_MIRROR=/dir`` maps
``hf://datasets/OWNER/NAME`` to the folder ``/dir/OWNER/NAME``, laid out as the Hub repo (data
files plus a README.md whose YAML header lists the ``configs``); ``datasets`` reads that folder
exactly as it reads the repo, and its revision is a fingerprint of its files. A source pinned to
a commit (a recipe pinned online, run offline) reads the mirror only when the folder proves it
holds that commit: every file has the download record ``huggingface-cli download --local-dir``
writes, naming that commit, with the file's own etag (``check_mirror_revision``).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

from llmflow.tasks.framework.errors import BadInputError

PREFIX = "hf://datasets/"
MIRROR_ENV = "LLMFLOW_HUB_MIRROR"
BYTES_PER_TOKEN = 4
"""Estimated UTF-8 bytes per token of a BPE tokenizer on English text and code."""
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_QUERY_KEYS = {"split", "domain", "text_field", "max_docs", "max_tokens"}
_URI = re.compile(
    r"^hf://datasets/(?P<repo>[\w.-]+/[\w.-]+)(?:/(?P<config>[\w.+-]+))?"
    r"(?:@(?P<revision>[\w./-]+))?(?:\?(?P<query>.*))?$"
)


def is_hub(uri: str) -> bool:
    """Whether a ``--data`` entry names a Hub dataset."""
    return uri.startswith(PREFIX)


@dataclass(frozen=True)
class HubSource:
    """One Hub dataset split, as a ``--data`` URI names it."""

    uri: str
    repo: str
    config: str | None = None
    revision: str | None = None
    split: str = "train"
    domain: str | None = None
    text_field: str | None = None
    max_docs: int | None = None
    max_tokens: int | None = None

    @property
    def dataset(self) -> str:
        """``OWNER/NAME[/CONFIG]``: how reports name the source."""
        return self.repo + (f"/{self.config}" if self.config else "")

    def with_revision(self, revision: str) -> HubSource:
        """The same source pinned to ``revision`` (its URI says so too)."""
        return replace(self, revision=revision, uri=format_uri(replace(self, revision=revision)))

    def location(self) -> str:
        """What ``datasets.load_dataset`` is given: the repo id, or its folder in the mirror."""
        mirror = os.environ.get(MIRROR_ENV)
        return str(Path(mirror) / self.repo) if mirror else self.repo

    def full(self, kept: int, kept_bytes: int) -> bool:
        """Whether the caps are reached after ``kept`` documents of ``kept_bytes`` bytes."""
        if self.max_docs is not None and kept >= self.max_docs:
            return True
        return self.max_tokens is not None and kept_bytes >= self.max_tokens * BYTES_PER_TOKEN


def parse_uri(uri: str) -> HubSource:
    """Parse a ``hf://datasets/...`` URI; a malformed one is a BadInputError naming it."""
    match = _URI.match(uri)
    if not match:
        raise BadInputError(
            f"--data {uri!r} is not a Hub dataset URI; expected "
            "hf://datasets/OWNER/NAME[/CONFIG][@REVISION]?split=train&domain=D"
        )
    query = dict(parse_qsl(match["query"] or "", keep_blank_values=True, strict_parsing=False))
    unknown = sorted(set(query) - _QUERY_KEYS)
    if unknown:
        raise BadInputError(
            f"--data {uri!r}: unknown option(s) {unknown}; allowed {sorted(_QUERY_KEYS)}"
        )
    caps = {
        key: _positive_int(uri, key, query.pop(key))
        for key in ("max_docs", "max_tokens")
        if key in query
    }
    if query.get("split") == "":
        raise BadInputError(f"--data {uri!r}: split is empty")
    return HubSource(uri, match["repo"], match["config"], match["revision"], **query, **caps)


def _positive_int(uri: str, key: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise BadInputError(f"--data {uri!r}: {key}={value!r} must be a positive integer")
    return int(value)


def format_uri(source: HubSource) -> str:
    """The URI of a source (the inverse of ``parse_uri``)."""
    path = PREFIX + source.repo + (f"/{source.config}" if source.config else "")
    path += f"@{source.revision}" if source.revision else ""
    fields = ("split", "domain", "text_field", "max_docs", "max_tokens")
    query = {f: getattr(source, f) for f in fields if getattr(source, f) is not None}
    return f"{path}?{urlencode(query)}"


def split_sources(data: list[str]) -> tuple[list[str], list[HubSource]]:
    """``--data`` entries as (local or fsspec paths, parsed Hub sources); parsing is offline."""
    return [d for d in data if not is_hub(d)], [parse_uri(d) for d in data if is_hub(d)]


def resolve_revision(source: HubSource) -> str:
    """The commit a source's revision names on the Hub, or its mirror folder's fingerprint.

    Raises:
        BadInputError: the repo or revision cannot be reached, naming the source.
    """
    mirror = os.environ.get(MIRROR_ENV)
    if mirror:
        return _fingerprint(Path(mirror) / source.repo, source)
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(source.repo, revision=source.revision).sha
    except Exception as err:  # noqa: BLE001  (offline, 404, gated, auth: all say "unreachable")
        raise BadInputError(
            f"Hub source {source.uri!r} is unreachable: {_first_line(err)}"
        ) from None


def _fingerprint(folder: Path, source: HubSource) -> str:
    """``local-<sha256>`` of the mirror folder's file names, sizes and whole contents."""
    if not folder.is_dir():
        raise BadInputError(
            f"Hub source {source.uri!r} is unreachable: no folder {folder} in the mirror"
        )
    return folder_fingerprint(folder)


def repo_files(folder: Path) -> list[Path]:
    """The files of a repo folder, sorted, less its own ``.cache`` (download records).

    Only a ``.cache`` *inside* the folder is left out: the test is on the path relative to it,
    since a mirror under ``~/.cache/...`` has ``.cache`` among its parents, and testing the
    absolute path left out every file (every such folder then fingerprinted as empty).
    """
    return sorted(
        p for p in folder.rglob("*") if p.is_file() and ".cache" not in p.relative_to(folder).parts
    )


def folder_fingerprint(folder: Path) -> str:
    """``local-<sha256>`` of a folder's file names, sizes and whole contents (its ``.cache``
    left out): the revision of a mirrored Hub repo or of any local model folder."""
    digest = hashlib.sha256()
    for path in repo_files(folder):
        digest.update(f"{path.relative_to(folder)}\0{path.stat().st_size}\0".encode())
        digest.update(file_sha256(path).encode())
    return "local-" + digest.hexdigest()[:16]


def file_sha256(path: Path) -> str:
    """sha256 of a whole file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_records(folder: Path) -> dict[str, tuple[str, str]]:
    """``{file: (commit, etag)}`` as ``huggingface-cli download --local-dir`` records them, in
    ``.cache/huggingface/download/<file>.metadata`` (commit, etag, time: one per line)."""
    root = folder / ".cache" / "huggingface" / "download"
    records = {}
    for meta in root.rglob("*.metadata"):
        lines = meta.read_text(encoding="utf-8", errors="replace").split("\n")
        name = meta.relative_to(root).as_posix().removesuffix(".metadata")
        records[name] = (lines[0].strip(), lines[1].strip() if len(lines) > 1 else "")
    return records


def recorded_commits(folder: Path) -> set[str]:
    """Commits a ``--local-dir`` download recorded (first line of each ``.metadata`` file)."""
    return {commit for commit, _ in download_records(folder).values() if _COMMIT.match(commit)}


@lru_cache(maxsize=4096)
def _etag_matches(path: str, size: int, mtime_ns: int, etag: str) -> bool:
    """Whether a file's bytes are those the Hub's etag names: an LFS file's sha256, or another
    file's git blob id (sha1 of ``blob SIZE\\0`` and the bytes). Cached per size and mtime, as
    the recipe's build and the ingest step check the same files."""
    if re.fullmatch(r"[0-9a-f]{64}", etag):
        return file_sha256(Path(path)) == etag
    if not _COMMIT.match(etag):
        return False
    digest = hashlib.sha1(b"blob %d\0" % size)  # noqa: S324  (git's object id, not security)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest() == etag


def _unproven(folder: Path, commit: str) -> tuple[list[str], set[str]]:
    """(files whose bytes no record of ``commit`` vouches for, other commits recorded)."""
    records, unproven, others = download_records(folder), [], set()
    for path in repo_files(folder):
        name = path.relative_to(folder).as_posix()
        found, etag = records.get(name, (None, ""))
        stat = path.stat()
        if found is None:
            unproven.append(f"{name} (no download record)")
        elif found != commit:
            others.add(found)
        elif not _etag_matches(str(path), stat.st_size, stat.st_mtime_ns, etag):
            unproven.append(f"{name} (changed since the download: not the recorded etag)")
    return unproven, others


def check_mirror_revision(source: HubSource, folder: Path) -> None:
    """A source pinned to a Hub revision reads a mirror folder only if it proves it holds it.

    A commit is proven when every file of the folder has a download record naming that commit
    whose etag matches the file's bytes (a file added, changed or from another snapshot is no
    proof). Otherwise the folder's data would be stored under the commit's address, so this
    fails, naming the source, the pinned revision and what the mirror holds. A branch or tag
    other than ``main`` cannot be told offline at all (the records name commits only).
    Offline, a folder holding only some of the commit's files cannot be told from a whole one.
    """
    revision = source.revision or ""
    if not folder.is_dir():
        raise BadInputError(
            f"Hub source {source.uri!r} is unreachable: no folder {folder} in the mirror"
        )
    commits = sorted(recorded_commits(folder))
    held = f"records commit {', '.join(commits)}" if commits else "records none"
    if not _COMMIT.match(revision):
        raise BadInputError(
            f"Hub source {source.uri!r}: revision {revision!r} cannot be checked against the "
            f"mirror folder {folder} (it {held}); pin a commit, or drop @{revision} to read the "
            "folder as it is (pinned to its fingerprint)"
        )
    unproven, others = _unproven(folder, revision)
    if others or unproven:
        detail = f"; unproven: {', '.join(unproven[:3])}" if unproven else ""
        raise BadInputError(
            f"Hub source {source.uri!r} is pinned to commit {revision}, but the mirror folder "
            f"{folder} {held}{detail}: mirror that commit (huggingface-cli download "
            f"--repo-type dataset --revision {revision} --local-dir {folder}) or drop "
            f"@{revision} to read the folder as it is"
        )


def check_mirror_pin(source: HubSource) -> None:
    """A pinned source reads a mirror only if the mirror holds what the pin names.

    A ``local-`` revision names the content of a mirror folder; the Hub has no such commit.
    Reading the live Hub instead (the mirror unset) or a changed folder would put other data
    under the pinned hash, so both fail, naming the pin and what differs. A commit (or any
    revision but ``main``) read from a mirror is checked by ``check_mirror_revision``.
    """
    mirror = os.environ.get(MIRROR_ENV)
    if mirror and source.revision not in (None, "main") and not is_local_pin(source.revision):
        check_mirror_revision(source, Path(mirror) / source.repo)
    if is_local_pin(source.revision):
        _check_local_pin(source, mirror)


def _check_local_pin(source: HubSource, mirror: str | None) -> None:
    """A ``local-`` pin needs the mirror set, and its folder's fingerprint equal to the pin."""
    if not mirror:
        raise BadInputError(
            f"Hub source {source.uri!r} is pinned to a mirror folder's fingerprint "
            f"({source.revision}), but {MIRROR_ENV} is not set: set it to the mirror that "
            "holds the pinned files (the live Hub has no such revision)"
        )
    found = _fingerprint(Path(mirror) / source.repo, source)
    if found != source.revision:
        raise BadInputError(
            f"Hub source {source.uri!r}: the mirror folder {Path(mirror) / source.repo} now "
            f"fingerprints as {found}, not the pinned {source.revision}: its files changed; "
            "pin the new content (drop @revision) or restore the files"
        )


def is_local_pin(revision: str | None) -> bool:
    """Whether a revision is a mirror folder's fingerprint (``local-...``)."""
    return (revision or "").startswith("local-")


def pin(uri: str) -> str:
    """The URI with its revision resolved to a commit (an already pinned commit is kept).

    A pinned source is checked against the mirror here, when the recipe is built, so a mirror
    that does not hold the pin fails before any compute (``check_mirror_pin``).
    """
    source = parse_uri(uri)
    check_mirror_pin(source)
    if source.revision and re.fullmatch(r"[0-9a-f]{40}|local-[0-9a-f]{16}", source.revision):
        return source.uri
    return source.with_revision(resolve_revision(source)).uri


def file_streams(source: HubSource) -> list[Any]:
    """The source's split as one streamed dataset per data file (``datasets``' shards, cut
    contiguously one file each), in the order `stream` reads them: their records end to end are
    `stream`'s. Each can be pickled to a worker that reads its file (ingest's parallel read)."""
    dataset = _streamed(source)
    count = dataset.num_shards
    return [dataset.shard(num_shards=count, index=i, contiguous=True) for i in range(count)]


def read_all(dataset: Any) -> Iterator[dict[str, Any]]:
    """In a worker: every record of one of `file_streams`' datasets, streamed."""
    return iter(dataset)


def _streamed(source: HubSource) -> Any:
    """The source's split as a streaming ``datasets.IterableDataset`` (not yet read)."""
    import datasets

    check_mirror_pin(source)
    # NOTE: a mirror folder is read as it is (checked above against the pin); a revision means
    # nothing to a folder.
    revision = (
        None if os.environ.get(MIRROR_ENV) or is_local_pin(source.revision) else source.revision
    )
    try:
        return datasets.load_dataset(
            source.location(), name=source.config, split=source.split, revision=revision,
            streaming=True,
        )  # fmt: skip
    except (ValueError, FileNotFoundError, OSError) as err:
        raise BadInputError(f"Hub source {source.uri!r}: {_first_line(err)}") from None


def stream(source: HubSource) -> Iterator[dict[str, Any]]:
    """The source's records, streamed; a missing config or split or an unreachable repo is a
    BadInputError naming the source (raised before the first record)."""
    dataset = _streamed(source)
    try:
        records = iter(dataset)
        first = next(records, None)
    except (ValueError, FileNotFoundError, OSError) as err:
        raise BadInputError(f"Hub source {source.uri!r}: {_first_line(err)}") from None
    if first is None:
        return
    yield first
    yield from records


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def sample_documents(source: HubSource, text_field: str, count: int = 2) -> list[str]:
    """The first ``count`` texts of a source: proof that it is reachable and yields documents.

    Raises:
        BadInputError: unreachable, no records, or no string ``text_field``, naming the source.
    """
    field = source.text_field or text_field
    texts = []
    for record in stream(source):
        value = record.get(field)
        if not isinstance(value, str):
            raise BadInputError(
                f"Hub source {source.uri!r}: records have no string field {field!r} (fields: "
                f"{sorted(record)}); set text_field= in the URI"
            )
        texts.append(value)
        if len(texts) >= count:
            break
    if not texts:
        raise BadInputError(f"Hub source {source.uri!r} yields no records")
    return texts


def check_domains(sources: list[HubSource], weights: dict[str, dict[str, float]]) -> None:
    """Every domain a mixture weighs must have a source; ``weights`` maps a stage to its weights.

    Only meaningful when every source is a Hub source naming its domain (local files carry their
    domains inside their records).
    """
    provided = {s.domain for s in sources}
    for stage, stage_weights in weights.items():
        missing = sorted(d for d, w in stage_weights.items() if w > 0 and d not in provided)
        if missing:
            raise BadInputError(
                f"{stage} weighs domain(s) {missing} that no --data source provides; the sources "
                f"give {sorted(d for d in provided if d)} (add &domain=NAME to a source URI)"
            )


def data_sources(config: Any) -> tuple[list[str], list[str]]:
    """A pipeline config's ``data`` as (local paths, Hub URIs pinned to a commit).

    When every source is a Hub dataset naming its domain, each domain a mixture weighs (each
    pretraining stage, the context extension) must be one of theirs.
    """
    local, hub = split_sources(config.data)
    if hub and not local and all(source.domain for source in hub):
        weights = {f"pretrain.stages.{s.name}": s.mixture.weights for s in config.pretrain.stages}
        if config.extend.stages:  # without stages no extension mixture is built
            weights["extend.weights"] = config.extend.weights
        check_domains(hub, weights)
    return local, [pin(source.uri) for source in hub]
