"""The scheduled evaluation flow on Prefect: each committed model output scored once, a corrupt
one failing alone, the leaderboard built over the others."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "eval_fixtures",
    Path(__file__).resolve().parents[1] / "tasks" / "evaluation" / "eval_fixtures.py",
)
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)


def _export(store, tokenizer: str, label: str, seed: int) -> str:
    from llmflow.tasks.evaluation.export import ExportConfig, export

    progress = fx.CheckpointFixture(seed=seed, total_tokens_seen=1000 * (seed + 1))
    checkpoint = fx.fixture_checkpoint.run(store, progress, label).uri
    inputs = {"checkpoint": checkpoint, "tokenizer": tokenizer}
    return export.run(store, ExportConfig(label=label), label, inputs).uri


def _task_states(flow_run_id, expected: int, timeout: float = 60.0) -> list[str]:
    """State names of a flow run's task runs (the API records them shortly after the run)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
            names = sorted(r.state.name for r in runs if r.state is not None)
            if len(names) >= expected and "Running" not in names or time.monotonic() > deadline:
                return names
            time.sleep(0.5)


def test_fresh_root_is_zero_checkpoints(prefect_harness, tmp_path):
    from llmflow.flows.evaluate_scheduled import ScheduledEvaluationConfig, scheduled_evaluation

    assert scheduled_evaluation(ScheduledEvaluationConfig(root=str(tmp_path / "fresh"))) == []


def test_scheduled_flow_scores_once_and_isolates_a_corrupt_checkpoint(prefect_harness, tmp_path):
    from llmflow.flows.evaluate_scheduled import ScheduledEvaluationConfig, scheduled_evaluation
    from llmflow.tasks.evaluation.config import EvalConfig
    from llmflow.tasks.framework.store import Store

    store = Store(tmp_path)
    tokenizer = fx.fixture_tokenizer.run(store, fx.TokenizerFixture(), "tiny").uri
    heldout = fx.fixture_tokenize.run(store, fx.TokenizerFixture(), "tiny").uri
    a, b = _export(store, tokenizer, "a", 0), _export(store, tokenizer, "b", 1)
    writing = tmp_path / "export" / "w-0123456789abcdef" / "hf"  # no _COMMITTED: being written
    writing.mkdir(parents=True)
    cfg = ScheduledEvaluationConfig(
        root=str(tmp_path),
        heldout=heldout,
        evaluate=EvalConfig(tasks=["cf_arith", "heldout_ppl"], num_items=8, limit=8),
    )

    first = scheduled_evaluation(cfg)
    assert sorted((r["checkpoint"], r["status"], r["cached"]) for r in first) == [
        (a, "ok", False),
        (b, "ok", False),
    ]
    evaluations = store.list_outputs("evaluate")
    assert len(evaluations) == 2
    scores = store.read_lineage(evaluations[0])["metrics"]
    assert scores["ppl_prose/word_perplexity"] > 1.0  # held-out docs from the tokenize output

    again = scheduled_evaluation(cfg, return_state=True)
    assert [r["cached"] for r in again.result()] == [True, True]
    states = _task_states(again.state_details.flow_run_id, expected=5)
    assert states == ["Cached"] * 5  # two evaluations, their two cards and the leaderboard

    corrupt, new = _export(store, tokenizer, "c", 2), _export(store, tokenizer, "d", 3)
    weights = Path(corrupt) / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    failed = scheduled_evaluation(cfg, return_state=True)
    assert failed.is_failed()
    with pytest.raises(Exception, match="c-[0-9a-f]{16}") as err:
        failed.result()
    assert "1 checkpoint(s) failed" in str(err.value) and f"{new}:" not in str(err.value)
    assert len(store.list_outputs("evaluate")) == 3  # d scored; a and b not again; c failed
    boards = store.list_outputs("leaderboard")  # newest first
    assert len(boards) == 2
    board = (Path(boards[0]) / "leaderboard.md").read_text()
    assert all(f"| {label} |" in board for label in "abd") and "| c |" not in board


def test_labels_match_the_pipelines_evaluation_names():
    from llmflow.flows.evaluate_scheduled import label_of

    assert label_of("/r/export/quickstart-base-0123456789abcdef") == "quickstart-base"
    assert label_of("s3://b/r/sft/quickstart-0123456789abcdef/") == "quickstart-sft"
    assert label_of("/r/dpo/quickstart-dpo-0123456789abcdef") == "quickstart-dpo"
