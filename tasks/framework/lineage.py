"""The lineage record written beside every output, and walking it upstream."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

LINEAGE_FILE = "lineage.json"
SOURCE_DIR = Path(__file__).resolve().parents[2]  # the checkout, when llmflow runs from one
TRACKED_PACKAGES = (
    "llmflow",
    "torch",
    "prefect",
    "transformers",
    "tokenizers",
    "datasets",
    "accelerate",
    "lm-eval",
    "trl",
    "numpy",
    "pyarrow",
    "pydantic",
    "fsspec",
    "s3fs",
    "safetensors",
)
# NOTE: credentials must never reach lineage.json; any key that looks like one is masked.
_SECRET_MARKERS = ("secret", "password", "token_value", "access_key", "session_token", "api_key")


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """Git sha and dirty flag of the llmflow checkout (None outside a git checkout)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=SOURCE_DIR, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_sha": sha, "dirty": bool(status) if status is not None else None}


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str | None]:
    """Versions of the packages that decide what an output contains."""
    versions: dict[str, str | None] = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def host_info() -> dict[str, Any]:
    """Where the step ran."""
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
    }


def mask_secrets(value: Any) -> Any:
    """Replace values under secret-looking keys with '***'."""
    if isinstance(value, dict):
        return {
            k: "***" if any(m in str(k).lower() for m in _SECRET_MARKERS) else mask_secrets(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [mask_secrets(v) for v in value]
    return value


def format_tree(uri: str, read_lineage, max_depth: int = 50) -> str:
    """Render the upstream tree of an output, one line per output, raw sources at the leaves.

    Args:
        uri: The output to start from.
        read_lineage: Callable mapping an output URI to its parsed lineage.json.
        max_depth: Guard against cycles (which content addressing makes impossible anyway).
    """
    lines: list[str] = []

    def visit(node_uri: str, prefix: str, is_last: bool, depth: int, role: str | None) -> None:
        branch = "" if depth == 0 else ("└── " if is_last else "├── ")
        try:
            record = read_lineage(node_uri)
        except FileNotFoundError:
            lines.append(f"{prefix}{branch}{node_uri}  [missing lineage]")
            return
        label = f"{role}: " if role else ""
        headline = _headline(record)
        lines.append(
            f"{prefix}{branch}{label}{record['step']} {node_uri}"
            + (f"  ({headline})" if headline else "")
        )
        child_prefix = prefix + ("" if depth == 0 else ("    " if is_last else "│   "))
        children = [("input", i) for i in record.get("inputs", [])]
        children += [("source", s) for s in record.get("sources", [])]
        for index, (kind, child) in enumerate(children):
            last = index == len(children) - 1
            if kind == "input" and depth < max_depth:
                visit(child["uri"], child_prefix, last, depth + 1, child.get("name"))
            else:
                mark = "└── " if last else "├── "
                sha = (child.get("sha256") or "")[:12]
                lines.append(f"{child_prefix}{mark}raw: {child['uri']}  sha256={sha}")

    visit(uri, "", True, 0, None)
    return "\n".join(lines)


def _headline(record: dict[str, Any]) -> str:
    """The record's first three metrics as ``k=v`` pairs ("" without metrics)."""
    metrics = record.get("metrics") or {}
    return ", ".join(f"{k}={v}" for k, v in list(metrics.items())[:3])


def record(
    *,
    step: str,
    name: str,
    digest: str,
    uri: str,
    version: str,
    config: Any,
    inputs: dict[str, list[dict[str, Any]]],
    run: dict[str, Any],
    started_at: str,
    metrics: dict[str, Any],
) -> dict[str, Any]:
    """The lineage record of one output: what made it, from what, where and when."""
    from datetime import datetime, timezone

    return {
        "step": step,
        "name": name,
        "hash": digest,
        "uri": uri,
        "version": version,
        "config": config.model_dump(mode="json"),
        **inputs,
        "code": {**code_version(), "step_version": version},
        "packages": package_versions(),
        "host": host_info(),
        "run": run,
        "started_at": started_at,
        "ended_at": datetime.now(timezone.utc).isoformat(),
        "metrics": metrics,
    }


def source_record(uri: str) -> dict[str, Any]:
    """A raw file's URI, sha256 and size (hashed once per process while it is unchanged)."""
    from llmflow.tasks.framework.s3config import filesystem

    fs, path = filesystem(uri)
    info = fs.info(path)
    stamp = (info.get("size"), info.get("mtime") or info.get("LastModified") or info.get("ETag"))
    return _source_record(uri, str(stamp))


@functools.lru_cache(maxsize=4096)
def _source_record(uri: str, stamp: str) -> dict[str, Any]:
    import hashlib

    from llmflow.tasks.framework.s3config import filesystem

    fs, path = filesystem(uri)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"uri": uri, "sha256": digest.hexdigest(), "bytes": fs.size(path)}


FILES_KEY = "files"


def file_digest(path: Path) -> str:
    """sha256 of one file, read in 1 MiB blocks."""
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_manifest(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``folder`` (relative POSIX paths, sorted).

    ``lineage.json`` itself and the names in ``skip`` (at the top level) are left out.
    """
    folder = Path(folder)
    manifest: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if not path.is_file() or rel == LINEAGE_FILE or rel in skip:
            continue
        manifest[rel] = {"bytes": path.stat().st_size, "sha256": file_digest(path)}
    return manifest


def add_file_manifest(folder: Path, skip: tuple[str, ...] = ()) -> bool:
    """Record the size and sha256 of each file of ``folder`` in its ``lineage.json``.

    Called when an output is committed, so ``llmflow verify`` can later tell a truncated, changed
    or missing file. Returns False (nothing written) when the folder has no lineage record.
    """
    path = Path(folder) / LINEAGE_FILE
    if not path.exists():
        return False
    record = json.loads(path.read_text())
    record[FILES_KEY] = file_manifest(folder, skip)
    path.write_text(dumps(record))
    return True


def dumps(record: dict[str, Any]) -> str:
    """Serialize a lineage record, masking anything that looks like a credential."""
    return json.dumps(mask_secrets(record), indent=2, sort_keys=False, default=str)
