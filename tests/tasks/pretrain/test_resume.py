"""Exact resume: a run killed after step k and restarted in a new process continues bitwise."""

from __future__ import annotations

import json

from conftest import losses_by_step, read_jsonl, run_trainer, tiny_config

from tests.tasks.pretrain.notices import read_notices


def test_resume_after_crash_is_bitwise_exact(tmp_path, train_data, val_data):
    cfg = tiny_config(max_steps=12, checkpoint={"interval": 4, "keep_last": 2})
    full = tmp_path / "full"
    run_trainer(cfg, train_data, full, val_dir=val_data)

    resumed = tmp_path / "resumed"
    crash = {"crash_after_step": 6}
    proc = run_trainer(cfg, train_data, resumed, val_dir=val_data, check=False, faults=crash)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert not (resumed / "final").exists()
    # The crash came after step 6: metrics for steps 5-6 exist but the last checkpoint is 4.
    assert max(losses_by_step(resumed)) == 6
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step-000004"]

    proc = run_trainer(cfg, train_data, resumed, val_dir=val_data)  # same out_dir: resumes
    assert "resumed from" in proc.stdout and "step 4" in proc.stdout

    expected, got = losses_by_step(full), losses_by_step(resumed)
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step] == expected[step], f"step {step}: {got[step]!r} != {expected[step]!r}"
    rows = [r for r in read_jsonl(resumed / "metrics.jsonl") if r["step"] in (5, 6)]
    assert len(rows) == 2, "rows of steps replayed after the resume must not be duplicated"

    summary_full = json.loads((full / "summary.json").read_text())
    summary_resumed = json.loads((resumed / "summary.json").read_text())
    for key in ("final_loss", "val_loss", "steps", "tokens_seen"):
        assert summary_resumed[key] == summary_full[key], key
    # keep_last=2: only the two newest step checkpoints survive, plus final/
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == [
        "step-000004",
        "step-000008",
    ]
    assert (full / "final" / "model.safetensors").exists()
    # Each complete checkpoint was announced once, the crashed attempt's included.
    expected_notices = [(4, False), (8, False), (12, True)]
    for run in (full, resumed):
        assert [(n["step"], n["final"]) for n in read_notices(run)] == expected_notices


def test_rerun_of_a_finished_run_is_a_no_op(tmp_path, train_data):
    cfg = tiny_config(max_steps=3, checkpoint={"interval": 2, "keep_last": 1})
    out = tmp_path / "run"
    run_trainer(cfg, train_data, out)
    before = json.loads((out / "summary.json").read_text())
    proc = run_trainer(cfg, train_data, out)
    assert "resumed from" in proc.stdout and "final" in proc.stdout
    assert json.loads((out / "summary.json").read_text())["final_loss"] == before["final_loss"]
