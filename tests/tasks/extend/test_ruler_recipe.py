"""The ruler step in the recipe: after the extension stages, one node scoring every stage's
checkpoint, feeding the extended model's card and the leaderboard; no other address moves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmflow.flows.recipe import recipe
from llmflow.tasks.config import load_config
from llmflow.tasks.framework.errors import ConfigError
from tests.tasks.extend.ruler_addresses import addresses

ROOT = Path(__file__).resolve().parents[3]
BEFORE = "678682d"  # main before the ruler step
HELPER = Path(__file__).with_name("ruler_addresses.py")


def test_the_quickstart_scores_ruler_on_every_extension_stage_beside_longctx():
    graph = recipe(load_config(None, []))
    (node,) = graph.find(step="ruler")
    stages = graph.find(step="pretrain", phase="extend")
    assert node.phase == "extend" and node.inputs["models"] == stages
    assert node.config.labels == ["ctx512", "ctx1024"] and node.config.lengths == [512, 1024]
    assert node.inputs["longctx"] is graph.find(step="longctx")[0]
    assert graph.nodes.index(node) > graph.nodes.index(stages[-1])
    assert node.config.ruler.samples == 2 and node.config.board_label == "extended"
    cards = {n.name: n for n in graph.find(step="card")}
    assert cards["quickstart-extended"].inputs["long_context"] is node
    assert all(
        "long_context" not in c.inputs for k, c in cards.items() if k != "quickstart-extended"
    )
    assert graph.find(step="leaderboard")[0].inputs["long_context"] == [node]
    # ``--until extend`` runs it.
    assert node in graph.until("extend").nodes


def test_ruler_lengths_and_tasks_are_checked_before_any_compute():
    lengths = load_config(None, ["extend.ruler.lengths=[256,2048]"]).extend.ruler_lengths()
    assert lengths == [256, 2048]
    with pytest.raises(ConfigError, match=r"extend\.ruler\.lengths: \[64\]"):
        load_config(None, ["extend.ruler.lengths=[64]"])
    with pytest.raises(ConfigError, match=r"extend\.ruler\.tasks: \['qa_squad'\]"):
        load_config(None, ["extend.ruler.tasks=[qa_squad]"])


def _moved(first: dict[str, str], second: dict[str, str]) -> set[str]:
    """Nodes of both whose address differs, cards left out: a card holds the resolved pipeline
    config (YAML), so any setting moves every card."""
    return {k for k in first if k in second and first[k] != second[k] and not k.startswith("card:")}


def test_ruler_off_adds_no_node_and_moves_no_other_address():
    on, off = addresses([]), addresses(["extend.ruler.enabled=false"])
    assert set(on) - set(off) == {"ruler:quickstart"} and set(off) <= set(on)
    assert _moved(on, off) == {"leaderboard:quickstart"}
    # Its settings are hashed by the ruler step only: longctx keeps its address.
    more = addresses(["extend.ruler.samples=5"])
    assert _moved(on, more) == {"ruler:quickstart", "leaderboard:quickstart"}
    assert on["longctx:quickstart"] == off["longctx:quickstart"] == more["longctx:quickstart"]


def _addresses_at(package_parent: Path | None, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if package_parent is not None:  # import that checkout's llmflow, not the installed one
        env["PYTHONPATH"] = str(package_parent)
    out = subprocess.run(
        [sys.executable, str(HELPER), *args], env=env, cwd=package_parent or ROOT,
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    return json.loads(out)


@pytest.mark.slow
def test_no_address_of_the_quickstart_before_the_ruler_step_moves(tmp_path):
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BEFORE}^{{commit}}"])
    if known.returncode != 0:
        pytest.skip(f"commit {BEFORE} is not in this clone (shallow?)")
    tree = tmp_path / "before"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), BEFORE],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / "llmflow").symlink_to(tree)
        before = _addresses_at(tmp_path / "pkg")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
    for now in (_addresses_at(None), _addresses_at(None, "--ruler-off")):
        assert set(before) <= set(now)
        moved = {k for k in before if now[k] != before[k]}
        # NOTE: a card holds the resolved pipeline config (YAML), which now has extend.ruler:
        # every card moves, as with any new config field, and the leaderboard that links them.
        assert moved == {k for k in before if k.startswith("card:")} | {"leaderboard:quickstart"}
