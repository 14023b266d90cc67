"""A fresh quickstart root verifies: every committed output still holds the bytes it recorded.

The card step links each model's ``hf/`` files into its own folder; mergekit's output carries a
README.md of its own, so a card written through that link changed the merge output after it was
committed (``llmflow verify``: ``merge/...: CORRUPT``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.flows.test_quickstart_e2e import REPO, SMALL

# the quickstart's GRPO and safety settings are sized for a demo, not a test
FASTER = [
    "grpo.max_steps=2",
    "grpo.num_quickstart_examples=32",
    "grpo.num_heldout=8",
    "safety.eval.crows_limit=8",
]
CARD_FILES = ("hf/README.md", "hf/llmflow_config.yaml")  # what the card step writes


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmflow.flows.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"},
    )


@pytest.mark.slow  # the whole shrunk quickstart: 418 s at load 5 on 2 cores
@pytest.mark.timeout(3600)  # over 15 minutes at load 12
def test_llmflow_verify_finds_every_output_of_a_fresh_quickstart_ok(tmp_path):
    root = tmp_path / "runs"
    overrides = [arg for o in SMALL + FASTER for arg in ("--set", o)]
    ran = _cli("run", "--root", str(root), *overrides)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert_verifies_with_no_shared_written_file(root)


def assert_verifies_with_no_shared_written_file(root: Path) -> None:
    """``llmflow verify`` finds every output ok; files two outputs share (hard links) are files
    no step wrote after linking: the cards' own files share no inode, and a shared file's bytes
    are what both outputs recorded."""
    from llmflow.tasks.framework.store import Store
    from llmflow.tasks.framework.verify import committed_outputs

    merged = [p for p in (root / "merge").iterdir() if not p.name.startswith(".")]
    assert merged and all((p / "hf" / "README.md").is_file() for p in merged)  # mergekit's

    verified = _cli("verify", str(root))
    assert verified.returncode == 0, verified.stdout[-4000:]
    assert "CORRUPT" not in verified.stdout and ", 0 corrupt, 0 unchecked" in verified.stdout

    holders: dict[int, list[tuple[str, str, str]]] = defaultdict(list)
    outputs = list(committed_outputs(Store(str(root))))
    cards = [uri for uri in outputs if "/card/" in uri]
    assert len(cards) >= 2
    for uri in outputs:
        manifest = json.loads((Path(uri) / "lineage.json").read_text())["files"]
        for rel, entry in manifest.items():
            holders[os.stat(Path(uri) / rel).st_ino].append((uri, rel, entry["sha256"]))
    shared = {ino: found for ino, found in holders.items() if len({u for u, _, _ in found}) > 1}
    assert shared  # the cards' links to the models' weights
    for found in shared.values():
        assert len({sha for _, _, sha in found}) == 1, found
        written = [(u, rel) for u, rel, _ in found if u in cards and rel in CARD_FILES]
        assert not written, found
