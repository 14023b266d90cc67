"""Run a helper script against this tree or a checkout of an earlier commit, for tests that
show a change moved no output address (the helper prints JSON on stdout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def helper_output(helper: Path, package_parent: Path | None = None, timeout: int = 600):
    """The JSON ``helper`` prints, importing ``llmflow`` from ``package_parent`` (a folder
    holding a checkout as ``llmflow``) or, when None, the installed one."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if package_parent is not None:  # import that checkout's llmflow, not the installed one
        env["PYTHONPATH"] = str(package_parent)
    out = subprocess.run(
        [sys.executable, str(helper)], env=env, cwd=package_parent or ROOT,
        capture_output=True, text=True, timeout=timeout, check=True,
    ).stdout  # fmt: skip
    return json.loads(out)


def helper_output_at(commit: str, helper: Path, tmp_path: Path, timeout: int = 600):
    """`helper_output` in a worktree of ``commit`` (removed after); skips when the clone lacks
    the commit (a shallow one)."""
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"])
    if known.returncode != 0:
        pytest.skip(f"commit {commit[:7]} is not in this clone (shallow?)")
    tree = tmp_path / "pkg" / "llmflow"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        return helper_output(helper, tmp_path / "pkg", timeout)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
