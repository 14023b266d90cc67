"""Scheduled evaluation: committed checkpoints only, each exactly once, failures isolated."""

import json
import shutil
from pathlib import Path

import fsspec
import pytest

from llmflow.tasks.evaluation.checkpoints import (
    CheckpointEvalError,
    evaluate_checkpoints,
    find_checkpoints,
    find_unevaluated,
    raise_for_failures,
)
from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.leaderboard import update_leaderboard
from llmflow.tasks.evaluation.suite import build_suite, read_manifest

CFG = EvalConfig(tasks=["cf_arith", "mcf_facts"], limit=4, num_items=4, device="cpu")


def _checkpoint(root: Path, name: str, model: Path, *, hf_subdir: bool, committed: bool = True):
    ckpt = root / name
    shutil.copytree(model, ckpt / "hf" if hf_subdir else ckpt)
    if committed:
        (ckpt / "_COMMITTED").write_text("ok")
    return ckpt


@pytest.fixture
def checkpoint_root(tmp_path, tiny_model) -> Path:
    root = tmp_path / "ckpts"
    a = _checkpoint(root, "run/step-000100", tiny_model, hf_subdir=True)
    lineage = {"metrics": {"tokens_seen": 1000}, "config": {"train": {"seed": 7}}}
    (a / "lineage.json").write_text(json.dumps(lineage))
    b = _checkpoint(root, "run/step-000200", tiny_model, hf_subdir=False)
    (b / "trainer_state.json").write_text(json.dumps({"tokens_seen": 2000, "step": 200, "seed": 3}))
    broken = _checkpoint(root, "run/step-000300", tiny_model, hf_subdir=True)
    weights = broken / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    _checkpoint(root, "run/step-000400", tiny_model, hf_subdir=True, committed=False)
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "_COMMITTED").write_text("ok")  # committed, but no HF model
    return root


def test_find_checkpoints_reads_progress(checkpoint_root):
    found = {c.key: c for c in find_checkpoints(str(checkpoint_root))}
    assert sorted(found) == ["run__step-000100", "run__step-000200", "run__step-000300"]
    assert found["run__step-000100"].hf_uri.endswith("step-000100/hf")
    assert (found["run__step-000100"].tokens_seen, found["run__step-000100"].seed) == (1000, 7)
    assert found["run__step-000200"].seed == 3
    assert found["run__step-000200"].hf_uri.endswith("step-000200")
    assert (found["run__step-000200"].tokens_seen, found["run__step-000200"].step) == (2000, 200)
    assert (found["run__step-000300"].tokens_seen, found["run__step-000300"].step) == (None, 300)


def test_evaluate_each_once_and_isolate_failures(tmp_path, checkpoint_root):
    results = str(tmp_path / "results")
    statuses = evaluate_checkpoints(CFG, str(checkpoint_root), results)
    by_key = {s["key"]: s for s in statuses}
    assert sorted(by_key) == ["run__step-000100", "run__step-000200", "run__step-000300"]
    assert by_key["run__step-000100"]["status"] == "ok"
    assert by_key["run__step-000200"]["status"] == "ok"
    assert 0.0 <= by_key["run__step-000200"]["cf_arith/acc"] <= 1.0
    failed = by_key["run__step-000300"]
    assert failed["status"] == "failed" and "step-000300" in failed["error"]
    with pytest.raises(CheckpointEvalError, match="step-000300"):
        raise_for_failures(statuses)

    suite_key = by_key["run__step-000100"]["suite_key"]
    record = json.loads(Path(by_key["run__step-000100"]["results"], "results.json").read_text())
    assert record["checkpoint"]["tokens_seen"] == 1000 and record["suite_key"] == suite_key
    assert find_unevaluated(str(checkpoint_root), results, suite_key) == []
    assert evaluate_checkpoints(CFG, str(checkpoint_root), results) == []
    retried = find_unevaluated(str(checkpoint_root), results, suite_key, retry_failed=True)
    assert retried == [str(checkpoint_root / "run" / "step-000300")]

    board = tmp_path / "board"
    board.mkdir()
    summary = update_leaderboard(results, board)
    assert summary["num_checkpoints"] == 2
    lines = (board / "leaderboard.csv").read_text().splitlines()
    assert lines[0].startswith("checkpoint,suite_key,step,tokens_seen,seed,cf_arith/acc")
    assert [line.split(",")[0] for line in lines[1:]] == ["run__step-000100", "run__step-000200"]
    assert (board / "plots" / "cf_arith__acc.png").stat().st_size > 1000


def test_new_suite_or_new_checkpoint_is_found(tmp_path, checkpoint_root, tiny_model):
    results = str(tmp_path / "results")
    key = read_manifest(build_suite(CFG, None, tmp_path / "suite"))["suite_key"]
    assert len(find_unevaluated(str(checkpoint_root), results, key)) == 3
    (checkpoint_root / "run" / "step-000400" / "_COMMITTED").write_text("ok")  # finished now
    assert len(find_unevaluated(str(checkpoint_root), results, key)) == 4


def test_fsspec_roots(tmp_path, tiny_model):
    fs = fsspec.filesystem("memory")
    fs.put(f"{tiny_model}/", "/llmflow-test/ckpts/step-000010/hf/", recursive=True)
    fs.pipe("/llmflow-test/ckpts/step-000010/_COMMITTED", b"ok")
    try:
        statuses = evaluate_checkpoints(
            CFG, "memory://llmflow-test/ckpts", "memory://llmflow-test/results"
        )
        assert [s["status"] for s in statuses] == ["ok"]
        assert statuses[0]["checkpoint"] == "memory://llmflow-test/ckpts/step-000010"
        key = statuses[0]["suite_key"]
        assert fs.exists(f"/llmflow-test/results/step-000010/{key}/_COMMITTED")
        assert (
            find_unevaluated("memory://llmflow-test/ckpts", "memory://llmflow-test/results", key)
            == []
        )
        board = tmp_path / "board"
        board.mkdir()
        assert update_leaderboard("memory://llmflow-test/results", board)["num_checkpoints"] == 1
    finally:
        fs.rm("/llmflow-test", recursive=True)
