"""The scheduled evaluation flow: each new checkpoint once, failures isolated, leaderboard kept."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "eval_conftest", Path(__file__).resolve().parents[1] / "tasks" / "evaluation" / "conftest.py"
)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
make_tiny_model = _module.make_tiny_model


def _commit(export: Path) -> Path:
    (export / "_COMMITTED").write_text("done")
    return export


def test_scheduled_flow_evaluates_new_checkpoints_once(prefect_harness, tmp_path):
    from llmflow.flows.evaluate_scheduled import ScheduledEvaluationConfig, scheduled_evaluation
    from llmflow.tasks.evaluation.config import EvalConfig

    exports = tmp_path / "export"
    first = _commit(make_tiny_model(exports / "a-1", seed=0))
    writing = make_tiny_model(exports / "b-2", seed=1)  # no _COMMITTED: still being written
    cfg = ScheduledEvaluationConfig(
        root=str(tmp_path), evaluate=EvalConfig(tasks=["cf_arith"], num_items=8, limit=8)
    )
    statuses = scheduled_evaluation(cfg)
    assert [s["checkpoint"].rstrip("/").rsplit("/", 1)[-1] for s in statuses] == ["a-1"]
    assert scheduled_evaluation(cfg) == []  # nothing new
    _commit(writing)
    truncated = _commit(Path(shutil.copytree(first, exports / "c-3")))
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(Exception, match="c-3"):
        scheduled_evaluation(cfg)
    board = (tmp_path / "evaluations" / "_leaderboard" / "leaderboard.md").read_text()
    assert "a-1" in board and "b-2" in board and "c-3" not in board
