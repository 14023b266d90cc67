"""A run's checkpoint folders: their names, which are complete, the newest intact one (files
against ``checksums.json``), pruning, and the partial folders a crash left (``checkpoint.py``
writes and loads them)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmflow.tasks.framework.lineage import file_digest
from llmflow.tasks.framework.verify import local_file_problem

STEP_DIR = re.compile(r"^step-(\d{6,})$")
MARKER = "COMPLETE"
CHECKSUMS = "checksums.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).exists()


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Return complete step checkpoints under ``out_dir/checkpoints``, oldest first."""
    root = Path(out_dir) / "checkpoints"
    if not root.exists():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(out_dir: Path) -> Path | None:
    """Return the newest complete checkpoint (``final/`` wins), or None."""
    final = Path(out_dir) / "final"
    if is_complete(final):
        return final
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def write_checksums(folder: Path, known: dict[str, dict[str, Any]] | None = None) -> None:
    """Record the size and sha256 of every file of a checkpoint folder (before its marker).

    ``known`` holds entries other ranks already computed (their own files), not hashed again.
    """
    known = known or {}
    manifest = {}
    for path in sorted(Path(folder).rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel not in (CHECKSUMS, MARKER):
            manifest[rel] = known.get(rel) or {
                "bytes": path.stat().st_size,
                "sha256": file_digest(path),
            }
    (Path(folder) / CHECKSUMS).write_text(json.dumps(manifest, indent=1))


def checkpoint_problems(path: Path) -> list[str]:
    """Each file of a checkpoint that no longer matches its ``checksums.json``: path and reason.

    A checkpoint written before checksums were recorded has none to check (empty list).
    """
    path = Path(path)
    if not (path / CHECKSUMS).exists():
        return []
    try:
        recorded = json.loads((path / CHECKSUMS).read_text())
    except ValueError as err:
        return [f"{path / CHECKSUMS}: unreadable ({err})"]
    problems = []
    for rel, expected in recorded.items():
        problem = local_file_problem(path / rel, expected)
        if problem:
            problems.append(f"{path / rel}: {problem}")
    return problems


def latest_intact(out_dir: Path, log: Callable[[str], Any] = print) -> Path | None:
    """The newest complete checkpoint whose files match their checksums (``final/`` first).

    Each corrupt one passed over is logged with its first bad file and the checkpoint taken
    instead, so a resume from an older step is never silent.
    """
    final = Path(out_dir) / "final"
    candidates = ([final] if is_complete(final) else []) + list_checkpoints(out_dir)[::-1]
    skipped: list[tuple[Path, list[str]]] = []
    for candidate in candidates:
        problems = checkpoint_problems(candidate)
        if not problems:
            for bad, found in skipped:
                more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
                log(f"checkpoint {bad} is corrupt: {found[0]}{more}; resuming from {candidate}")
            return candidate
        skipped.append((candidate, problems))
    for bad, found in skipped:
        log(f"checkpoint {bad} is corrupt: {found[0]}; no intact checkpoint before it")
    return None


def prune_checkpoints(out_dir: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` step checkpoints and stale tmp folders (rank 0)."""
    found = list_checkpoints(out_dir)
    for old in found[: max(len(found) - keep_last, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def clean_tmp(out_dir: Path) -> None:
    """Remove partial checkpoints a crashed attempt left behind (rank 0, before training)."""
    for root in (Path(out_dir) / "checkpoints", Path(out_dir)):
        if root.exists():
            for tmp in root.glob(".tmp-*"):
                shutil.rmtree(tmp, ignore_errors=True)
