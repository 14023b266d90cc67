"""Evaluation of a running stage: holds keep a checkpoint being read from pruning (and expire
when their holder is gone), the reference curve's interpolation and the regression rule, and,
slow, quickstart-shaped stage-1 runs: a planted bug (learning rate cut 10x) alerts within two
evaluated checkpoints while it trains, a clean run with another seed does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flows import running_fixtures as rf


def _checkpoints(out: Path, steps: list[int]) -> list[Path]:
    """Complete-looking step checkpoints (a marker each), as the trainer leaves them."""
    made = []
    for step in steps:
        folder = out / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "COMPLETE").write_text("ok\n")
        made.append(folder)
    return made


def _left(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))


def test_a_checkpoint_being_read_is_not_pruned(tmp_path):
    from llmflow.tasks.evaluation.running import hold
    from llmflow.tasks.pretrain.checkpointer import prune

    oldest, *_ = _checkpoints(tmp_path, [4, 8, 12])
    with hold(oldest) as present:
        assert present
        prune(tmp_path, keep_last=1)  # what the trainer runs after each save
        assert _left(tmp_path) == ["step-000004", "step-000012"]
    prune(tmp_path, keep_last=1)  # released: the next save prunes it
    assert _left(tmp_path) == ["step-000012"]
    with hold(oldest) as present:  # already pruned: the reader is told, nothing to read
        assert not present


def test_a_stale_hold_expires(tmp_path):
    from llmflow.tasks.pretrain.checkpointer import HOLDS, prune

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    first, second, third, _ = _checkpoints(tmp_path, [4, 8, 12, 16])
    holds = tmp_path / "checkpoints" / HOLDS
    holds.mkdir(exist_ok=True)
    host = os.uname().nodename
    # a crashed reader on this host, a hung one elsewhere (not refreshed), a live one elsewhere
    (holds / f"{first.name}.{host}.{dead.pid}.1").write_text(
        json.dumps({"pid": dead.pid, "host": host, "ttl_s": 600})
    )
    hung = holds / f"{second.name}.elsewhere.1.1"
    hung.write_text(json.dumps({"pid": 1, "host": "elsewhere", "ttl_s": 60}))
    os.utime(hung, (time.time() - 120, time.time() - 120))
    (holds / f"{third.name}.elsewhere.2.1").write_text(
        json.dumps({"pid": 2, "host": "elsewhere", "ttl_s": 60})
    )
    prune(tmp_path, keep_last=1)
    assert _left(tmp_path) == ["step-000012", "step-000016"]


def test_the_hold_is_refreshed_while_held(tmp_path):
    from llmflow.tasks.evaluation.running import hold
    from llmflow.tasks.pretrain.checkpointer import HOLDS, is_held

    (checkpoint,) = _checkpoints(tmp_path, [4])
    with hold(checkpoint, ttl_s=0.6):
        time.sleep(1.0)  # past the ttl: alive only because the holder refreshes it
        assert is_held(checkpoint)
    assert not is_held(checkpoint)
    assert not list((tmp_path / "checkpoints" / HOLDS).glob("step-*"))


def test_reference_is_interpolated_on_the_token_axis():
    from llmflow.tasks.evaluation.running import interpolate, regressions

    curve = [
        {"tokens_seen": 1000, "metrics": {"heldout_loss": 4.0, "cf_arith/acc": 0.2}},
        {"tokens_seen": 3000, "metrics": {"heldout_loss": 3.0, "cf_arith/acc": 0.4}},
    ]
    assert interpolate(curve, 2000, "heldout_loss") == pytest.approx(3.5)
    assert interpolate(curve, 1000, "heldout_loss") == 4.0
    assert interpolate(curve, 4000, "heldout_loss") is None  # no extrapolation
    bands = {"heldout_loss": 0.2, "cf_arith/acc": 0.05}
    point = {"tokens_seen": 2000, "metrics": {"heldout_loss": 3.75, "cf_arith/acc": 0.31}}
    (found,) = regressions(point, curve, bands)  # loss 0.25 worse; acc 0.01 below: noise
    assert found["metric"] == "heldout_loss" and found["gap"] == pytest.approx(0.25)
    point["metrics"] = {"heldout_loss": 3.6, "cf_arith/acc": 0.2}  # acc is higher-is-better
    assert [f["metric"] for f in regressions(point, curve, bands)] == ["cf_arith/acc"]


def test_config_errors_name_the_field():
    from pydantic import ValidationError

    from llmflow.flows.evaluate_running import RunningEvaluationConfig

    with pytest.raises(ValidationError, match="noise_band=.*must be >= 0"):
        RunningEvaluationConfig(noise_band={"heldout_loss": -1})
    with pytest.raises(ValidationError, match="threads=0 must be >= 1"):
        RunningEvaluationConfig(threads=0)
    hub = "hf://models/HuggingFaceTB/SmolLM3-3B-checkpoints@stage1-step-40000"
    with pytest.raises(ValidationError, match="source='hf://.*tokens_seen=None"):
        RunningEvaluationConfig(reference={"checkpoints": [hub]})
    config = RunningEvaluationConfig(
        reference={"checkpoints": [{"source": hub, "tokens_seen": 160_000_000_000}, "/a/folder"]}
    )
    assert [p.tokens_seen for p in config.reference.checkpoints] == [160_000_000_000, None]


# -- slow: quickstart-shaped stage-1 runs ----------------------------------------------------
@pytest.fixture(scope="session")
def stage1(tmp_path_factory) -> dict[str, Path]:
    """One reference run of the quickstart's stage 1 (shrunk, every checkpoint kept), its
    training data, held-out sequences and tokenizer."""
    root = tmp_path_factory.mktemp("running-eval")
    data = rf.write_packed_text(root / "train", 600, seed=0)
    found = {
        "root": root,
        "data": data,
        "heldout": rf.write_packed_text(root / "heldout", 120, seed=99),
        "tokenizer": rf.write_tokenizer(root / "tokenizer"),
    }
    found["reference"] = rf.train(rf.stage1_config(seed=0, keep_last=10), data, root / "ref")
    return found


def _config(stage1: dict[str, Path], stage: Path, **changes):
    from llmflow.flows.evaluate_running import RunningEvaluationConfig

    base = {
        "root": str(stage1["root"]),
        "stages": [str(stage)],
        "scoring": {
            "heldout": str(stage1["heldout"]),
            "tokenizer": str(stage1["tokenizer"]),
            "suite": {"tasks": ["cf_arith"], "num_items": 40, "batch_size": 16},
        },
        "reference": {"stages": [str(stage1["reference"])]},
        "niceness": 0,  # NOTE: niceness stays with the test process
    }
    return RunningEvaluationConfig.model_validate({**base, **changes})


@pytest.mark.slow
def test_a_planted_lr_bug_alerts_within_two_evaluated_checkpoints(
    prefect_harness, stage1, tmp_path
):
    from llmflow.flows.evaluate_running import evaluate_running

    run = tmp_path / "buggy"
    trainer = rf.start_trainer(
        rf.stage1_config(seed=0, lr_scale=0.1, keep_last=2), stage1["data"], run
    )
    try:
        rows = evaluate_running(_config(stage1, run, follow=True, poll_s=0.2, max_wait_s=240))
    finally:
        out, _ = trainer.communicate(timeout=240)
    assert trainer.returncode == 0, out[-3000:]
    alerts = rf.read_alerts(run)
    assert alerts, rows
    evaluated = sorted(r["step"] for r in rows)
    first = min(a["step"] for a in alerts)
    assert first in evaluated[:2], (evaluated, alerts)
    alert = next(a for a in alerts if a["step"] == first)
    assert alert["kind"] == "eval_regression" and alert["cause"] == "heldout_loss"
    assert alert["stage"] == "buggy" and alert["details"]["gap"] > alert["details"]["band"]
    assert rows[0]["cf_arith/acc"] is not None  # the suite ran on the converted checkpoint
    assert len({a["step"] for a in alerts}) == len(alerts)  # each checkpoint alerts once


@pytest.mark.slow
def test_a_clean_run_with_another_seed_does_not_alert_and_is_scored_once(
    prefect_harness, stage1, tmp_path
):
    from llmflow.flows.evaluate_running import evaluate_running

    run = rf.train(rf.stage1_config(seed=1, keep_last=10), stage1["data"], tmp_path / "clean")
    rows = evaluate_running(_config(stage1, run))
    assert [r["step"] for r in rows] == [4, 8, 12, 16]
    assert rf.read_alerts(run) == [], rows
    assert not any(r["cached"] for r in rows)
    again = evaluate_running(_config(stage1, run))
    assert all(r["cached"] for r in again) and rf.read_alerts(run) == []
    # the reference as a series of checkpoint folders: the same curve (read from the cache)
    ref = stage1["reference"]
    folders = [str(p) for p in sorted((ref / "checkpoints").glob("step-*"))] + [str(ref / "final")]
    as_folders = evaluate_running(_config(stage1, run, reference={"checkpoints": folders}))
    assert as_folders == again and rf.read_alerts(run) == []
    assert not (ref / "checkpoints" / ".holds").exists()  # a finished run is read unheld


@pytest.mark.slow
def test_the_trainer_keeps_a_checkpoint_held_by_a_reader(stage1, tmp_path):
    from llmflow.tasks.evaluation.running import hold

    run = tmp_path / "held"
    cfg = rf.stage1_config(seed=2, keep_last=2)  # step-4 is pruned at the step-12 save
    trainer = rf.start_trainer(cfg, stage1["data"], run)
    first = run / "checkpoints" / "step-000004"
    try:
        while not (first / "COMPLETE").exists() and trainer.poll() is None:
            time.sleep(0.02)
        with hold(first) as present:
            assert present and not (run / "checkpoints" / "step-000012").exists()
            out, _ = trainer.communicate(timeout=240)
            assert trainer.returncode == 0, out[-3000:]
            assert _left(run) == ["step-000004", "step-000008", "step-000012"]
    finally:
        if trainer.poll() is None:
            trainer.kill()


def test_the_deployment_runs_every_ten_minutes_one_at_a_time():
    from llmflow.flows.deploy import local_deployments

    (deployment,) = local_deployments(["running-evaluation"])
    (schedule,) = deployment.schedules
    assert schedule.schedule.cron == "*/10 * * * *" and schedule.active
    assert deployment.concurrency_limit == 1


def test_a_root_without_running_stages_scores_nothing(prefect_harness, tmp_path):
    from llmflow.flows.evaluate_running import RunningEvaluationConfig, evaluate_running

    assert evaluate_running(RunningEvaluationConfig(root=str(tmp_path), niceness=0)) == []


def test_nothing_to_score_is_a_config_error(prefect_harness, tmp_path):
    from llmflow.flows.evaluate_running import RunningEvaluationConfig, evaluate_running
    from llmflow.tasks.framework.errors import ConfigError

    _checkpoints(tmp_path / "pretrain" / ".partial" / "stage1-0123456789abcdef", [4])
    with pytest.raises(ConfigError, match="scoring.heldout=None and scoring.tokenizer=None"):
        evaluate_running(RunningEvaluationConfig(root=str(tmp_path), niceness=0))


def test_following_ends_when_every_stage_has_written_final(tmp_path):
    from llmflow.flows.evaluate_running import RunningEvaluationConfig, finished

    stage = tmp_path / "pretrain" / ".partial" / "stage1-0123456789abcdef"
    _checkpoints(stage, [4])
    found = RunningEvaluationConfig(root=str(tmp_path))
    named = RunningEvaluationConfig(root=str(tmp_path), stages=[str(tmp_path / "not-yet")])
    assert not finished(found) and not finished(named)  # training; not started yet
    (stage / "final").mkdir()
    (stage / "final" / "COMPLETE").write_text("ok\n")
    assert finished(found)


def test_a_checkpoint_gone_while_read_is_skipped_and_a_broken_one_fails(tmp_path):
    import shutil

    from llmflow.flows.evaluate_running import RunningEvaluationConfig, evaluate_pass

    stage = tmp_path / "stage1"
    gone, broken = _checkpoints(stage, [4, 8])

    class Scorer:
        def score(self, label, folder):
            if folder == gone:  # pruned (or the stage moved) under the reader
                shutil.rmtree(folder)
            raise OSError(f"cannot read {folder}")

    config = RunningEvaluationConfig(stages=[str(stage)], scoring={"heldout": str(tmp_path)})
    with pytest.raises(OSError, match="step-000008"):
        evaluate_pass(config, Scorer(), [])
    assert not gone.exists() and broken.exists()


def test_a_checkpoint_pruned_before_the_stage_finished_is_not_read(tmp_path):
    from llmflow.tasks.evaluation.running import Scorer, ScoringConfig

    stage = tmp_path / "stage1"
    (stage / "final").mkdir(parents=True)
    (stage / "final" / "COMPLETE").write_text("ok\n")  # finished: read without a hold
    scorer = Scorer(ScoringConfig(heldout=str(tmp_path)), tmp_path / "scores")
    # listed while the stage trained, pruned before the reader got to it
    assert scorer.score("stage1", stage / "checkpoints" / "step-000168") is None
