"""Content-addressed artifact store over fsspec, and the runner every step goes through.

Every step writes ``{root}/{step}/{name}-{hash}``. The hash covers the step's versioned config,
its inputs' hashes and its code version. An output is complete once ``_COMMITTED`` exists in it;
that marker is written last (locally the whole directory appears by one atomic rename), so a
crash never leaves an output that looks complete. A complete output is never recomputed.

A mapped step's output is one **stage output** at the same kind of address, its shards under
``shards/{label}/``. Each shard commits on its own (its files, then its ``_COMMITTED``, which
holds the shard's lineage row: inputs, times, metrics, files), so a re-run of the stage redoes
only the shards without one; the stage's ``lineage.json`` (one record, a row per shard, every
file's checksum) and its ``_COMMITTED`` come last, once every shard is in.

Work happens in a *partial* directory whose path is fixed by the hash, so a retried or restarted
step finds the previous attempt's state (a trainer resumes from its checkpoints there). Local
partial directories are guarded by a file lock, so concurrent runs of one step don't interleave.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from llmflow.tasks.framework import lineage, s3config
from llmflow.tasks.framework.disk import (  # noqa: F401 (part of this module's API)
    DISK_FULL,
    SHORT_WRITE,
    NoSpaceError,
    _short_write_error,
    disk_error,
    no_space_message,
)

COMMIT_MARKER = "_COMMITTED"
PARTIAL_DIR = ".partial"
SHARDS_DIR = "shards"  # a stage output's shards: {stage}/shards/{label}/
log = logging.getLogger("llmflow.store")


def default_cache_dir() -> Path:
    """Local cache for remote inputs and partial work of remote outputs."""
    return Path(os.environ.get("LLMFLOW_CACHE", Path.home() / ".cache" / "llmflow"))


_INPUT_HASHES: dict[str, str] = {}
"""A committed output's hash by URI (``Store.input_hash``); outputs are immutable once committed."""
_INPUT_HASHES_MAX = 100_000


class Store:
    """Outputs under one root: a local folder or any fsspec URI (``s3://bucket/prefix``)."""

    def __init__(self, root: str | os.PathLike, cache_dir: Path | None = None):
        root = str(root)
        self.fs, _ = s3config.filesystem(root)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.root = str(Path(root).expanduser().resolve()) if self.is_local else root.rstrip("/")
        self.cache_dir = cache_dir or default_cache_dir()

    # -- addresses -------------------------------------------------------------------------
    def uri(self, step: str, name: str, digest: str) -> str:
        return f"{self.root}/{step}/{name}-{digest}"

    @staticmethod
    def address_of(uri: str) -> tuple[str, str, str]:
        """The (step, name, hash) of an output's URI: the inverse of ``uri``."""
        step, folder = uri.rstrip("/").rsplit("/", 2)[-2:]
        name, _, digest = folder.rpartition("-")
        return step, name, digest

    @staticmethod
    def shard_uri(stage_uri: str, label: str) -> str:
        """Where one shard of a stage output lives."""
        return f"{stage_uri}/{SHARDS_DIR}/{label}"

    @staticmethod
    def split_shard(uri: str) -> tuple[str, str] | None:
        """(stage URI, shard label) of a shard's URI; None for any other output.

        A step's output is ``{root}/{step}/{name}-{hash}`` and no step is named ``shards``, so
        only a shard of a stage output has ``shards`` as its second-to-last component.
        """
        parts = uri.rstrip("/").rsplit("/", 2)
        if len(parts) == 3 and parts[1] == SHARDS_DIR:
            return parts[0], parts[2]
        return None

    def listdir(self, uri: str, folder: str) -> list[str]:
        """Names of the files in one folder of an output, read remotely (nothing downloaded).

        On a remote root the answer comes from the file list recorded in a committed output's
        lineage, never from a listing: a listing cut short (an eventually consistent store) would
        silently drop shards, and a mapped step would run and commit on fewer of them.
        """
        manifest = None if self.is_local else self._manifest(uri)
        if manifest is not None:
            inside = (
                rel.removeprefix(f"{folder}/") for rel in manifest if rel.startswith(f"{folder}/")
            )
            return sorted({rel.split("/", 1)[0] for rel in inside})
        path = f"{uri}/{folder}"
        self._forget_listings(path)
        if not self.fs.exists(path):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False))

    def is_complete(self, uri: str) -> bool:
        marker = f"{uri}/{COMMIT_MARKER}"
        self._forget_listings(marker)
        return self.fs.exists(marker)

    def _forget_listings(self, path: str) -> None:
        # NOTE: s3fs caches directory listings per process and answers exists() from them, so a
        # long-lived process (a worker, `llmflow serve`) would not see what others committed since.
        if not self.is_local:
            self.fs.invalidate_cache(path)

    def read_lineage(self, uri: str) -> dict[str, Any]:
        """An output's lineage record; for a shard of a stage, the stage's record with that
        shard's row (its inputs, times, metrics and files) in place of the stage's own."""
        shard = self.split_shard(uri)
        if shard is not None:
            return self._shard_lineage(uri, *shard)
        with self.fs.open(f"{uri.rstrip('/')}/{lineage.LINEAGE_FILE}", "r") as f:
            return json.load(f)

    def shard_row(self, uri: str) -> dict[str, Any]:
        """A committed shard's lineage row, kept in its commit marker."""
        with self.fs.open(f"{uri.rstrip('/')}/{COMMIT_MARKER}", "r") as f:
            return json.load(f)

    def _shard_lineage(self, uri: str, stage: str, label: str) -> dict[str, Any]:
        row = self.shard_row(uri)
        try:
            record = self.read_lineage(stage)
        except FileNotFoundError:  # the stage is still running: the row alone
            record = {"step": self.address_of(stage)[0], "hash": self.address_of(stage)[2]}
        record = {k: v for k, v in record.items() if k not in ("shards", lineage.FILES_KEY)}
        read = row.get("inputs", {})
        inputs = [  # the mapped input as the upstream shard this one read, when it is one
            {**i, "uri": read[i["name"]]}
            if i.get("mapped") and isinstance(read.get(i["name"]), str)
            else i
            for i in record.get("inputs", [])
        ]
        return {
            **record,
            **row,
            "inputs": inputs,
            "uri": uri,
            "stage": stage,
            "hash": f"{record['hash']}/{label}",
        }

    def _manifest(self, uri: str) -> dict[str, dict[str, Any]] | None:
        """The files (with sizes) a committed output's lineage records (a shard's: its commit
        marker's row); None before commit-time manifests existed or for an output that is not
        committed."""
        if not self.is_complete(uri):
            return None
        if self.split_shard(uri) is not None:
            return self.shard_row(uri).get(lineage.FILES_KEY)
        self._forget_listings(f"{uri}/{lineage.LINEAGE_FILE}")
        try:
            return self.read_lineage(uri).get(lineage.FILES_KEY)
        except FileNotFoundError:
            return None

    def output_bytes(self, uri: str) -> int | None:
        """The bytes of a committed output's files, from its lineage's manifest (None: not
        committed, or committed before manifests existed)."""
        manifest = self._manifest(uri) if isinstance(uri, str) else None
        return None if manifest is None else sum(int(f["bytes"]) for f in manifest.values())

    def input_hash(self, uri: str) -> str:
        """The hash of a complete output, read from its lineage record.

        Remembered per process: a committed output never changes, and every shard of a mapped
        stage reads its upstream's record, whose file manifest grows with the shards (re-reading
        it made a stage of n shards cost O(n^2)).
        """
        if not self.is_complete(uri):
            raise FileNotFoundError(f"input {uri} is not a complete output (no {COMMIT_MARKER})")
        shard = self.split_shard(uri)
        if shard is not None:  # a shard of a complete stage: the stage's hash and its label
            return f"{self.input_hash(shard[0])}/{shard[1]}"
        if uri not in _INPUT_HASHES:
            if len(_INPUT_HASHES) >= _INPUT_HASHES_MAX:
                _INPUT_HASHES.clear()
            _INPUT_HASHES[uri] = self.read_lineage(uri)["hash"]
        return _INPUT_HASHES[uri]

    # -- local views -----------------------------------------------------------------------
    def local_path(self, uri: str) -> Path:
        """A local directory holding the output at ``uri`` (downloaded once for remote roots)."""
        if self.is_local:
            return Path(uri)
        target = self.cache_dir / "inputs" / hashlib.sha256(uri.encode()).hexdigest()[:24]
        if not (target / COMMIT_MARKER).exists():
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            manifest = self._manifest(uri)
            if manifest is None:  # committed before its lineage listed its files: a listing
                self.fs.get(f"{uri}/", f"{tmp}/", recursive=True)
            else:
                self._download_listed(uri, manifest, tmp)
            shutil.rmtree(target, ignore_errors=True)
            try:
                tmp.rename(target)
            except OSError:  # another process put the same complete copy there first
                if not (target / COMMIT_MARKER).exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        return target

    def _download_listed(self, uri: str, manifest: dict[str, dict[str, Any]], tmp: Path) -> None:
        """Fetch exactly the files a committed output's lineage lists, by key, and check sizes.

        The commit marker comes last, so a copy missing any file is never taken as complete.
        """
        names = sorted(manifest)
        if self.split_shard(uri) is None:  # a shard's lineage is its marker's row
            names.append(lineage.LINEAGE_FILE)
        for rel in names:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.fs.get([f"{uri}/{rel}" for rel in names], [str(tmp / rel) for rel in names])
        except FileNotFoundError as exc:
            missing = [rel for rel in names if not self.fs.exists(f"{uri}/{rel}")]
            raise FileNotFoundError(
                f"committed output {uri} lacks {', '.join(missing) or exc}, which its "
                f"{lineage.LINEAGE_FILE} lists: the output is damaged (see llmflow verify)"
            ) from exc
        _check_sizes(uri, manifest, tmp)
        self.fs.get_file(f"{uri}/{COMMIT_MARKER}", str(tmp / COMMIT_MARKER))

    def partial_uri(self, step: str, name: str, digest: str) -> str:
        return f"{self.root}/{step}/{PARTIAL_DIR}/{name}-{digest}"

    def _work_path(self, step: str, name: str, digest: str) -> Path:
        """An output's working directory: its partial folder, in the local cache if remote."""
        if self.is_local:
            return Path(self.partial_uri(step, name, digest))
        return self.cache_dir / "partial" / step / f"{name}-{digest}"

    @contextlib.contextmanager
    def workdir(self, step: str, name: str, digest: str) -> Iterator[Path]:
        """The fixed working directory of one output, locked against concurrent writers."""
        work = self._work_path(step, name, digest)
        pull = None if self.is_local else lambda: self._pull_partial(step, name, digest, work)
        with _locked(work, f"step {step!r} output {name}-{digest}", pull):
            yield work

    @contextlib.contextmanager
    def shard_workdir(self, stage_uri: str, label: str) -> Iterator[Path]:
        """The fixed, locked working directory of one shard of a stage output (beside the
        stage, never inside it: the stage folder holds committed shards only)."""
        step, name, digest = self.address_of(stage_uri)
        work = self._work_path(step, name, digest) / label
        with _locked(work, f"step {step!r} output {name}-{digest} shard {label}", None):
            yield work

    def _pull_partial(self, step: str, name: str, digest: str, work: Path) -> None:
        remote = self.partial_uri(step, name, digest)
        self._forget_listings(remote)
        if self.fs.exists(remote) and not any(work.iterdir()):
            log.info("resuming from remote partial state %s", remote)
            self.fs.get(f"{remote}/", f"{work}/", recursive=True)
            _sync_state_path(work).unlink(missing_ok=True)

    def sync_partial(self, step: str, name: str, digest: str, work: Path) -> None:
        """Mirror the working directory to the remote partial area (after a checkpoint).

        Changed files go up one by one, oldest first, so a marker written after its data (a
        checkpoint's ``COMPLETE``) never reaches the remote before that data; then remote files
        deleted locally (pruned checkpoints) are removed, so a resume never sees them.
        """
        if self.is_local:
            return
        remote = self.partial_uri(step, name, digest)
        state_path = _sync_state_path(work)
        synced = json.loads(state_path.read_text()) if state_path.exists() else {}
        current: dict[str, list[int]] = {}
        for path in _files_oldest_first(work):
            rel, stat = path.relative_to(work).as_posix(), path.stat()
            current[rel] = [stat.st_size, stat.st_mtime_ns]
            if synced.get(rel) != current[rel]:
                self.fs.put_file(str(path), f"{remote}/{rel}")
        self._forget_listings(remote)
        prefix = self.fs._strip_protocol(remote).rstrip("/") + "/"
        stale = [p for p in self.fs.find(remote) if p.removeprefix(prefix) not in current]
        if stale:
            self.fs.rm(stale)
        state_path.write_text(json.dumps(current))

    def commit(self, work: Path, uri: str, step: str, name: str, digest: str) -> None:
        """Publish a finished working directory at ``uri``; the commit marker comes last.

        Each file's size and sha256 go into the output's ``lineage.json`` first (what
        ``llmflow verify`` checks).
        """
        lineage.add_file_manifest(work, skip=(COMMIT_MARKER,))
        self._publish(work, uri, now())
        if not self.is_local:
            partial = self.partial_uri(step, name, digest)
            if self.fs.exists(partial):
                self.fs.rm(partial, recursive=True)
            _sync_state_path(work).unlink(missing_ok=True)

    def commit_shard(self, work: Path, uri: str, row: dict[str, Any]) -> dict[str, Any]:
        """Publish one finished shard at ``uri`` (inside its stage output); its marker, which
        holds ``row`` with the shard's file manifest, comes last. Gives the committed shard's
        row: another writer's, when it committed this shard first (``work`` is then dropped)."""
        row = {**row, lineage.FILES_KEY: lineage.file_manifest(work, skip=(COMMIT_MARKER,))}
        return row if self._publish(work, uri, lineage.dumps(row)) else self.shard_row(uri)

    def _publish(self, work: Path, uri: str, marker: str) -> bool:
        """``work``'s files at ``uri``, then ``marker`` as its ``_COMMITTED`` (locally the whole
        folder appears by one rename); an incomplete leftover at ``uri`` is replaced.

        A committed output is never removed or rewritten: when another writer committed ``uri``
        first, its files stay, ``work`` is dropped and this gives False.
        """
        if self.is_local:
            return self._publish_local(work, Path(uri), marker)
        if self.is_complete(uri):
            return self._keep_committed(work, uri)
        if self.fs.exists(uri):  # an incomplete leftover: never trusted, replaced
            self.fs.rm(uri, recursive=True)
        self.fs.put(f"{work}/", f"{uri}/", recursive=True)
        # NOTE: S3 has no rename: a writer that uploaded while another committed must not put
        # its marker over the other's (whose row holds the checksums a stage records). Two
        # uploads at the same moment on two hosts can still interleave their files; one host
        # serializes its writers of one output under the workdir lock.
        if self.is_complete(uri):
            return self._keep_committed(work, uri)
        with self.fs.open(f"{uri}/{COMMIT_MARKER}", "w") as f:
            f.write(marker)
        shutil.rmtree(work, ignore_errors=True)
        return True

    def _publish_local(self, work: Path, final: Path, marker: str) -> bool:
        (work / COMMIT_MARKER).write_text(marker)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists() and not (final / COMMIT_MARKER).exists():
            _discard_leftover(final)
        try:
            os.rename(work, final)  # fails onto a non-empty folder: one writer wins
        except OSError:
            if not (final / COMMIT_MARKER).exists():
                raise
            return self._keep_committed(work, str(final))
        return True

    def _keep_committed(self, work: Path, uri: str) -> bool:
        log.info("%s was committed by another writer; keeping it, dropping %s", uri, work)
        shutil.rmtree(work, ignore_errors=True)
        return False

    def commit_stage(self, uri: str, record: dict[str, Any]) -> None:
        """Mark a stage output complete: its ``lineage.json`` (``record``, with a row per shard
        and every shard file's checksum), then its ``_COMMITTED``. Every shard is already in."""
        text = lineage.dumps(record)
        if self.is_local:
            final = Path(uri)
            final.mkdir(parents=True, exist_ok=True)
            tmp = final / f".{lineage.LINEAGE_FILE}.{os.getpid()}"
            tmp.write_text(text)
            os.replace(tmp, final / lineage.LINEAGE_FILE)
            (final / COMMIT_MARKER).write_text(now())
            step, name, digest = self.address_of(uri)
            shutil.rmtree(self.partial_uri(step, name, digest), ignore_errors=True)
            return
        with self.fs.open(f"{uri}/{lineage.LINEAGE_FILE}", "w") as f:
            f.write(text)
        with self.fs.open(f"{uri}/{COMMIT_MARKER}", "w") as f:
            f.write(now())

    def list_outputs(self, step: str) -> list[str]:
        """Complete outputs of one step, newest first."""
        base = f"{self.root}/{step}"
        self._forget_listings(base)
        if not self.fs.exists(base):
            return []
        found = []
        for path in self.fs.ls(base, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            uri = f"{base}/{name}"
            if not name.startswith(".") and self.is_complete(uri):
                found.append(uri)
        return sorted(found, key=lambda u: self.read_lineage(u).get("ended_at", ""), reverse=True)


def _discard_leftover(final: Path) -> None:
    """Remove an incomplete folder at ``final``: first renamed aside (one atomic step), so a
    writer that committed there meanwhile gets its folder back instead of losing it."""
    aside = final.with_name(f".{final.name}.leftover{os.getpid()}")
    try:
        os.rename(final, aside)
    except FileNotFoundError:  # another writer moved it first
        return
    if (aside / COMMIT_MARKER).exists():  # committed between the check and the rename
        with contextlib.suppress(OSError):
            os.rename(aside, final)
            return
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def _locked(work: Path, what: str, pull: Any) -> Iterator[Path]:
    """``work`` created and held under its ``.lock`` file; a full disk named in the error."""
    work.parent.mkdir(parents=True, exist_ok=True)
    lock_path = work.with_name(work.name + ".lock")
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            work.mkdir(exist_ok=True)
            if pull is not None:
                pull()
            yield work
        except Exception as exc:
            full = disk_error(exc)
            if full is None or isinstance(exc, NoSpaceError):
                raise
            raise NoSpaceError(full.errno, no_space_message(full, work, what)) from exc
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _files_oldest_first(folder: Path) -> list[Path]:
    return sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)


def _sync_state_path(work: Path) -> Path:
    """Sizes and mtimes of a remote partial directory's files as last pushed (beside ``work``)."""
    return work.with_name(work.name + ".synced.json")


def now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _check_sizes(uri: str, manifest: dict[str, dict[str, Any]], tmp: Path) -> None:
    """Each downloaded file under ``tmp`` has the size the lineage's manifest records."""
    for rel, expected in manifest.items():
        size = (tmp / rel).stat().st_size if (tmp / rel).exists() else None
        if size != int(expected["bytes"]):
            raise OSError(
                f"{uri}/{rel}: downloaded {size} bytes, its {lineage.LINEAGE_FILE} records "
                f"{expected['bytes']}: the output is damaged (see llmflow verify)"
            )
