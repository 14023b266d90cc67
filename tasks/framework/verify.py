"""``llmflow verify ROOT``: check every committed output against the checksums in its lineage.

When an output is committed, the store records each file's size and sha256 in its
``lineage.json`` (``files``). Verifying re-reads every file of every committed output, on a local
root or an ``s3://`` one, and reports each output whose files no longer match: a file missing, a
truncated (or grown) file, or one whose bytes changed. Outputs committed before checksums were
recorded have no ``files`` and are reported as unchecked, never as corrupt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmflow.tasks.framework import lineage
from llmflow.tasks.framework.store import Store

Status = Literal["ok", "corrupt", "unchecked"]


@dataclass
class OutputCheck:
    """What verifying one committed output found."""

    uri: str
    status: Status
    num_files: int = 0
    num_bytes: int = 0
    problems: list[str] = field(default_factory=list)  # one line per bad file: path and reason


def verify_output(store: Store, uri: str) -> OutputCheck:
    """Check one committed output's files against the manifest in its ``lineage.json``."""
    try:
        record = store.read_lineage(uri)
    except (OSError, ValueError) as err:
        return OutputCheck(uri, "corrupt", problems=[f"{lineage.LINEAGE_FILE}: unreadable ({err})"])
    manifest: dict[str, dict[str, Any]] | None = record.get(lineage.FILES_KEY)
    if manifest is None:
        return OutputCheck(uri, "unchecked")
    sizes = _sizes(store, uri)
    problems = []
    for rel, expected in manifest.items():
        problem = _check_file(store, f"{uri}/{rel}", sizes.get(rel), expected)
        if problem:
            problems.append(f"{uri}/{rel}: {problem}")
    num_bytes = sum(int(e["bytes"]) for e in manifest.values())
    status: Status = "corrupt" if problems else "ok"
    return OutputCheck(uri, status, len(manifest), num_bytes, problems)


def _sizes(store: Store, uri: str) -> dict[str, int]:
    """Size of each file under an output, by path relative to it (one listing, also on S3)."""
    store._forget_listings(uri)
    prefix = store.fs._strip_protocol(uri).rstrip("/") + "/"
    found = store.fs.find(uri, detail=True)
    return {path.removeprefix(prefix): int(info.get("size") or 0) for path, info in found.items()}


def _check_file(store: Store, path: str, size: int | None, expected: dict[str, Any]) -> str | None:
    """The reason a file does not match its record, or None when it does."""
    problem = size_problem(size, int(expected["bytes"]))
    if problem:
        return problem
    digest = hashlib.sha256()
    with store.fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest_problem(digest.hexdigest(), expected["sha256"])


def size_problem(size: int | None, want: int) -> str | None:
    """Why a file of ``size`` bytes (None: absent) is not the recorded one of ``want`` bytes."""
    if size is None:
        return f"missing (recorded {want} bytes)"
    if size < want:
        return f"truncated: {size} of {want} bytes"
    if size > want:
        return f"size changed: {size} bytes, recorded {want}"
    return None


def digest_problem(found: str, recorded: str) -> str | None:
    if found == recorded:
        return None
    return f"content changed: sha256 {found[:12]}..., recorded {recorded[:12]}..."


def local_file_problem(path: Path, expected: dict[str, Any]) -> str | None:
    """The reason a local file does not match its recorded size and sha256, or None."""
    size = path.stat().st_size if path.is_file() else None
    problem = size_problem(size, int(expected["bytes"]))
    return problem or digest_problem(lineage.file_digest(path), expected["sha256"])


def committed_outputs(store: Store) -> Iterator[str]:
    """URIs of every committed output under the store's root, sorted by step and name."""
    fs, root = store.fs, store.root
    store._forget_listings(root)
    if not fs.exists(root):
        return
    for step_dir in sorted(fs.ls(root, detail=False)):
        step = step_dir.rstrip("/").rsplit("/", 1)[-1]
        if step.startswith(".") or not fs.isdir(step_dir):
            continue
        for folder in sorted(fs.ls(step_dir, detail=False)):
            name = folder.rstrip("/").rsplit("/", 1)[-1]
            uri = f"{root}/{step}/{name}"
            if not name.startswith(".") and fs.isdir(folder) and store.is_complete(uri):
                yield uri


def verify_root(
    root: str, on_output: Callable[[OutputCheck], Any] = lambda _: None
) -> list[OutputCheck]:
    """Verify every committed output under ``root``; ``on_output`` sees each as it is done."""
    store = Store(root)
    checks = []
    for uri in committed_outputs(store):
        check = verify_output(store, uri)
        on_output(check)
        checks.append(check)
    return checks


def format_check(check: OutputCheck) -> str:
    """One line per output, and one indented line per bad file."""
    if check.status == "ok":
        head = f"ok         {check.uri}  ({check.num_files} files, {check.num_bytes:,} bytes)"
    elif check.status == "unchecked":
        head = f"unchecked  {check.uri}  (committed before checksums were recorded)"
    else:
        head = f"CORRUPT    {check.uri}"
    return "\n".join([head, *(f"    {p}" for p in check.problems)])


def summary_line(checks: list[OutputCheck]) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "corrupt", "unchecked")}
    return (
        f"{len(checks)} committed outputs: {counts['ok']} ok, {counts['corrupt']} corrupt, "
        f"{counts['unchecked']} unchecked"
    )
