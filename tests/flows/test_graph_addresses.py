"""The data backend's redesign (one Backend, ``runner.fan_out: shard`` and ``kind: dask``
removed) and the planner's split moved no output: every address of the quickstart's graph is
the one the commit before them gave, computed by the same code in a checkout of that commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BEFORE = "0cd082204fada9a8ecf30893f64d817e6eb73719"  # main before the backend redesign
HELPER = Path(__file__).with_name("graph_addresses.py")


def _addresses(package_parent: Path | None) -> list:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if package_parent is not None:  # import that checkout's llmflow, not the installed one
        env["PYTHONPATH"] = str(package_parent)
    out = subprocess.run(
        [sys.executable, str(HELPER)], env=env, cwd=package_parent or ROOT,
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    return json.loads(out)


@pytest.mark.slow
def test_no_quickstart_address_moves(tmp_path):
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BEFORE}^{{commit}}"])
    if known.returncode != 0:
        pytest.skip(f"commit {BEFORE[:7]} is not in this clone (shallow?)")
    tree = tmp_path / "pkg" / "llmflow"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), BEFORE],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        before = _addresses(tmp_path / "pkg")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
    now = _addresses(None)
    assert len(now) > 50 and {step for step, _, _ in now} >= {"ingest", "pretrain", "card"}
    assert now == before
