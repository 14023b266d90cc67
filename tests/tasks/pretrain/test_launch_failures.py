"""Which trainer failures are retried: only those a retry can pass.

A configuration error, bad input, a full disk or an exception before the first step fails the
same way again: each rank writes why to ``failures/rank-NNNNN.json`` and the launcher raises
``TrainingRejected`` (a ``BadInputError``: the step's Prefect task is never retried). A rank
killed by a signal (a lost node), a preemption or an I/O error is retried. The slow tests run the
real trainer under torchrun (which replaces the ranks' exit codes) inside a Prefect flow.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from pathlib import Path

import pytest
from conftest import make_packed, tiny_config
from pydantic import BaseModel

from llmflow.tasks.framework import prefect_task
from llmflow.tasks.framework.errors import BadInputError, ConfigError
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.framework.store import NoSpaceError
from llmflow.tasks.pretrain import launch
from llmflow.tasks.pretrain.faults import ENV
from llmflow.tasks.pretrain.launch import (
    FAILURES,
    TrainingFailed,
    TrainingRejected,
    classify_failure,
    launch_training,
    trainer_failure,
)
from llmflow.tasks.pretrain.step import StageRun, pretrain

# torchrun's summary when rank 1 was SIGKILLed and torchrun then stopped rank 0 (torch 2.13)
TORCHRUN_RANK_1_KILLED = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
llmflow.tasks.pretrain.train FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-27_12:43:13
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 14549)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 14549
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_12:43:13
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 14550)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 14550
=======================================================""".splitlines()


RETRY_VERDICTS = ("retrying: ", "not retried: ")


def _report(run: Path, rank: int, retry: bool, cause: str, error: str) -> None:
    (run / FAILURES).mkdir(parents=True, exist_ok=True)
    report = {"rank": rank, "retry": retry, "cause": cause, "error": error}
    (run / FAILURES / f"rank-{rank:05d}.json").write_text(json.dumps(report))


def test_the_trainer_classifies_what_ended_it():
    full = OSError(errno.ENOSPC, "No space left on device")
    lost = RuntimeError("[../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert trainer_failure(ConfigError("parallel.tp=3 ..."), stepped=True) == (
        False,
        "a configuration error in the trainer",
    )
    assert trainer_failure(BadInputError("no meta.json"), stepped=False)[0] is False
    assert trainer_failure(full, stepped=True)[0] is False  # a full disk stays full
    assert (
        trainer_failure(NoSpaceError(errno.ENOSPC, "no space to write"), stepped=True)[0] is False
    )
    assert trainer_failure(ValueError("bad shape"), stepped=False) == (
        False,
        "an error in the trainer before its first step",
    )
    assert trainer_failure(ValueError("bad shape"), stepped=True)[0] is True
    assert trainer_failure(OSError(errno.EIO, "I/O error"), stepped=False)[0] is True
    assert trainer_failure(lost, stepped=False) == (True, "a lost rank or connection")


def test_the_launcher_names_a_killed_rank_over_what_the_others_reported(tmp_path):
    _report(tmp_path, 0, True, "a lost rank or connection", "RuntimeError: Connection closed")
    err = classify_failure(TrainingFailed("x", 1, TORCHRUN_RANK_1_KILLED), tmp_path)
    assert type(err) is TrainingFailed and not isinstance(err, BadInputError)
    assert err.cause == "rank 1 was killed by SIGKILL"
    assert str(err).splitlines()[0] == "trainer failed, retryable: rank 1 was killed by SIGKILL"
    killed = classify_failure(TrainingFailed("x", -9, []), tmp_path / "none")
    assert killed.cause == "the trainer was killed by SIGKILL"


def test_the_launcher_rejects_what_a_rank_reported_deterministic(tmp_path):
    _report(tmp_path, 1, False, "a configuration error in the trainer", "ConfigError: tp=3")
    err = classify_failure(TrainingFailed("x", 1, ["Traceback ..."]), tmp_path)
    assert isinstance(err, TrainingRejected) and isinstance(err, BadInputError)
    assert str(err).splitlines()[0] == (
        "not retried: a configuration error in the trainer (rank 1): ConfigError: tp=3"
    )
    # no report (it could not be written) but the output names a full disk
    nothing = tmp_path / "nothing"
    tail = ["OSError: [Errno 28] No space left on device"]
    assert isinstance(classify_failure(TrainingFailed("x", 1, tail), nothing), TrainingRejected)
    unknown = classify_failure(TrainingFailed("x", 3, ["crashing"]), nothing)
    assert type(unknown) is TrainingFailed and unknown.cause == "the trainer exited with code 3"


def test_the_retry_condition_says_which_in_one_line(caplog):
    from prefect.states import Failed

    rejected = TrainingRejected("not retried: ...", 1, [], "a configuration error in the trainer")
    killed = TrainingFailed("trainer failed, ...", 1, [], "rank 1 was killed by SIGKILL")
    with caplog.at_level(logging.WARNING, logger=prefect_task.log.name):
        assert prefect_task._retry_transient(None, None, Failed(data=rejected)) is False
        assert prefect_task._retry_transient(None, None, Failed(data=killed)) is True
        full = NoSpaceError(errno.ENOSPC, "no space to write step 'x'")
        assert prefect_task._retry_transient(None, None, Failed(data=full)) is False
    assert [r.getMessage() for r in caplog.records] == [
        "not retried: a configuration error in the trainer",
        "retrying: rank 1 was killed by SIGKILL",
        "not retried: NoSpaceError: no space to write step 'x'",
    ]


def test_a_config_error_inside_the_trainer_is_rejected_after_one_run(
    tmp_path, train_data, monkeypatch
):
    """The launcher's checks pass; the trainer raises a ConfigError before its first step."""
    started: list[list[str]] = []
    real = launch.run_streaming
    monkeypatch.setattr(
        launch, "run_streaming", lambda cmd, **kw: started.append(cmd) or real(cmd, **kw)
    )
    monkeypatch.setenv(ENV, json.dumps({"error_at_start": "config"}))
    run = tmp_path / "run"
    _report(run, 5, False, "bad input to the trainer", "BadInputError: a previous attempt's")
    with pytest.raises(TrainingRejected) as caught:
        launch_training(tiny_config(max_steps=2), train_data, run, on_line=lambda _: None)
    first = str(caught.value).splitlines()[0]
    assert first.startswith("not retried: a configuration error in the trainer (rank 0): ")
    assert "ConfigError: fault injection" in first
    assert len(started) == 1
    assert [p.name for p in (run / FAILURES).iterdir()] == ["rank-00000.json"]  # this attempt's


# -- the pretrain step under Prefect, on two torchrun ranks (slow) --------------------------------


class DataSpec(BaseModel):
    num_docs: int = 120


@step("failures-packed")
def packed(cfg: DataSpec, out: Path) -> Metrics:
    """The packed training data of the runs."""
    make_packed(out, num_docs=cfg.num_docs)
    return {}


def _graph(**train) -> tuple[Graph, object]:
    graph = Graph()
    data = graph.add(packed, DataSpec(), "train")
    cfg = tiny_config(max_steps=6, checkpoint={"interval": 2, "keep_last": 2}, **train)
    return graph, graph.add(pretrain, StageRun(train=cfg, num_processes=2), "s1", data=data)


def _pretrain_run(flow_run_id):
    """The flow run's pretrain task run, once the API has recorded its final state."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.events.worker import EventsWorker

    # task-run states reach the API as events: send what the events worker still holds
    EventsWorker.drain_all()
    mine = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    deadline = time.monotonic() + 240
    with get_client(sync_client=True) as client:
        while True:
            runs = [r for r in client.read_task_runs(flow_run_filter=mine) if "pretrain" in r.name]
            if runs and runs[0].state.is_final():
                return runs[0]
            if time.monotonic() > deadline:
                pytest.fail(f"the API recorded no final pretrain task run in 240 s: {runs}")
            time.sleep(1)


def _run_flow(root: Path, graph, node):
    from prefect import flow

    from llmflow.tasks.framework.executor import PrefectExecutor

    @flow(name="launch-failures")
    def run():
        from prefect.runtime import flow_run

        try:
            return PrefectExecutor(str(root)).run(graph)[node], flow_run.id
        except Exception as exc:
            return exc, flow_run.id

    return run()


@pytest.fixture()
def retry_lines(caplog):
    """The retry condition's lines (on the task run's logger)."""
    caplog.set_level(logging.WARNING, logger="prefect.task_runs")
    return lambda: [
        r.getMessage() for r in caplog.records if r.getMessage().startswith(RETRY_VERDICTS)
    ]


@pytest.mark.slow
def test_a_config_error_in_the_trainer_fails_the_prefect_task_after_one_attempt(
    prefect_harness, tmp_path, monkeypatch, retry_lines
):
    started: list[list[str]] = []
    real = launch.run_streaming
    monkeypatch.setattr(
        launch, "run_streaming", lambda cmd, **kw: started.append(cmd) or real(cmd, **kw)
    )
    monkeypatch.setenv(ENV, json.dumps({"error_at_start": "config", "ranks": [1]}))
    graph, node = _graph()
    outcome, flow_run_id = _run_flow(tmp_path / "store", graph, node)

    assert isinstance(outcome, TrainingRejected), outcome
    assert "(rank 1): ConfigError: fault injection" in str(outcome).splitlines()[0]
    assert len(started) == 1  # torchrun started once, not three times
    task_run = _pretrain_run(flow_run_id)
    assert task_run.state.is_failed() and task_run.run_count == 1
    assert retry_lines() == [f"not retried: {outcome.cause}"]


@pytest.mark.slow
def test_a_sigkilled_rank_is_retried_and_the_retry_completes(
    prefect_harness, tmp_path, monkeypatch, retry_lines
):
    monkeypatch.setenv(ENV, json.dumps({"sigkill_after_step": 2, "ranks": [1]}))
    graph, node = _graph()
    result, flow_run_id = _run_flow(tmp_path / "store", graph, node)

    assert not isinstance(result, Exception), result
    assert result.metrics["steps"] == 6
    task_run = _pretrain_run(flow_run_id)
    assert task_run.state.is_completed() and task_run.run_count == 2  # killed, then resumed
    assert retry_lines() == ["retrying: rank 1 was killed by SIGKILL"]
