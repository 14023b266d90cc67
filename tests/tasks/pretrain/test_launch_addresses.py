"""The Launcher protocol moved no output: every pretrain stage of the quickstart
under each launch setting, and the multi-GPU recipes' stage runs, keep the address (and world
size) that the commit before it gave, computed by the same code in a checkout of that commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BEFORE = "1089d02f85b67e7d08ea9d98b3c1562b6b43ee17"  # main before the Launcher protocol
HELPER = Path(__file__).with_name("launch_addresses.py")


def _addresses(package_parent: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if package_parent is not None:  # import that checkout's llmflow, not the installed one
        env["PYTHONPATH"] = str(package_parent)
    out = subprocess.run(
        [sys.executable, str(HELPER)], env=env, cwd=package_parent or ROOT,
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    return json.loads(out)


@pytest.mark.slow
def test_no_pretrain_address_moves(tmp_path):
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BEFORE}^{{commit}}"])
    if known.returncode != 0:
        pytest.skip(f"commit {BEFORE[:7]} is not in this clone (shallow?)")
    tree = tmp_path / "before"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), BEFORE],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / "llmflow").symlink_to(tree)
        before = _addresses(tmp_path / "pkg")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
    now = _addresses(None)
    assert now == before
    # The settings do reach the address: 1, 2, 4 and 8 ranks give four different ones.
    firsts = {
        now[k][0][1]: now[k][0][2] for k in ("quickstart", "torchrun-2", "ray-4", "accelerate-8")
    }
    assert sorted(firsts) == [1, 2, 4, 8] and len(set(firsts.values())) == 4
