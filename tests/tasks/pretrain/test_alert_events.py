"""Alert rows of a stage's events.jsonl become Prefect events, once each (alert_events.py).

Events are captured by Prefect's own asserting events client (the worker every ``emit_event``
goes through), not by a mock of ``emit_event``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from prefect.events.clients import AssertingEventsClient
from prefect.events.worker import EventsWorker

from llmflow.tasks.pretrain.alert_events import (
    EMITTED,
    AlertForwarder,
    emit_alert,
    forward_alerts,
)
from llmflow.tasks.pretrain.alerts import EVENTS, record_alert
from llmflow.tasks.pretrain.callbacks import append_jsonl, truncate_jsonl


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch):
    """Every event emitted in the test, as Prefect's asserting events client received it."""
    worker = EventsWorker.instance(AssertingEventsClient)
    monkeypatch.setattr(EventsWorker, "instance", lambda *_: worker)

    def events() -> list:
        worker.wait_until_empty()
        return [e for e in worker._client.events if e.event.startswith("llmflow.alert.")]

    yield events
    worker.drain()


def _forwarder(out: Path) -> AlertForwarder:
    return AlertForwarder(out, "run-a", emit_alert)


def test_each_alert_row_becomes_one_event_with_the_stage_as_resource(tmp_path, captured):
    append_jsonl(tmp_path / EVENTS, {"event": "spike", "step": 3, "loss": 9.0})  # not an alert
    record_alert(tmp_path, "throughput", 40, "stage1", "tokens/s fell 60%", cause="data wait")
    record_alert(tmp_path, "stall", 41, "stage1", "a batch waited 12.0 s")
    forwarder = _forwarder(tmp_path)
    assert [r["kind"] for r in forwarder.poll()] == ["throughput", "stall"]
    assert forwarder.poll() == []  # nothing new: nothing sent

    events = captured()
    assert [e.event for e in events] == ["llmflow.alert.throughput", "llmflow.alert.stall"]
    throughput = events[0]
    assert throughput.resource.id == "llmflow.stage.run-a.stage1"
    labels = dict(throughput.resource.root)
    assert labels["kind"] == "throughput" and labels["step"] == "40"
    assert labels["cause"] == "data wait" and labels["message"] == "tokens/s fell 60%"
    assert labels["run"] == "run-a" and labels["stage"] == "stage1"
    assert events[1].resource["cause"] == ""  # no cause: an empty label
    assert throughput.payload["alert"]["details"] == {}
    assert throughput.id != events[1].id


def test_alerts_are_sent_once_over_a_resume_and_a_truncated_log(tmp_path, captured):
    """A new process (a retry, a resume) reads the keys sent; a replayed alert stays quiet."""
    record_alert(tmp_path, "spike", 10, "stage1", "loss 9.1, z=8")
    assert len(_forwarder(tmp_path).poll()) == 1

    # the resumed trainer truncates events.jsonl to its checkpoint (step 5) and replays step 10
    truncate_jsonl(tmp_path / EVENTS, 5)
    resumed = _forwarder(tmp_path)
    assert resumed.poll() == []
    record_alert(tmp_path, "spike", 10, "stage1", "loss 9.1, z=8")
    record_alert(tmp_path, "nonfinite", 12, "stage1", "loss nan")
    assert [r["kind"] for r in resumed.poll()] == ["nonfinite"]
    assert [e.event for e in captured()] == ["llmflow.alert.spike", "llmflow.alert.nonfinite"]
    keys = [json.loads(line) for line in (tmp_path / EMITTED).read_text().splitlines()]
    assert keys == [
        {"stage": "stage1", "kind": "spike", "step": 10},
        {"stage": "stage1", "kind": "nonfinite", "step": 12},
    ]


def test_same_step_of_another_kind_or_stage_is_another_alert(tmp_path, captured):
    record_alert(tmp_path, "throughput", 7, "stage1", "slow")
    record_alert(tmp_path, "stall", 7, "stage1", "stalled")
    record_alert(tmp_path, "throughput", 7, "stage2", "slow")
    record_alert(tmp_path, "throughput", 7, "stage1", "slow again")  # the same alert
    assert len(_forwarder(tmp_path).poll()) == 3
    assert len(captured()) == 3


def test_a_line_being_written_waits_for_its_end(tmp_path, captured):
    record_alert(tmp_path, "stall", 2, "stage1", "stalled")
    with open(tmp_path / EVENTS, "a") as f:
        f.write('{"event": "alert", "kind": "spike", "st')  # the trainer is mid-write
    forwarder = _forwarder(tmp_path)
    assert [r["kind"] for r in forwarder.poll()] == ["stall"]
    with open(tmp_path / EVENTS, "a") as f:
        f.write('ep": 3, "stage": "stage1", "message": "m"}\n')
    assert [r["kind"] for r in forwarder.poll()] == ["spike"]
    assert len(captured()) == 2


def test_forward_alerts_follows_the_file_while_the_body_runs(tmp_path, captured, caplog):
    """The thread sends an alert while the trainer still runs; the last poll catches the rest."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    caplog.set_level(logging.WARNING, logger="llmflow.alert")
    # NOTE: an API URL says events have somewhere to go (the asserting worker takes them)
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        with forward_alerts(tmp_path, run="run-b", poll_s=0.05):
            record_alert(tmp_path, "stall", 5, "stage1", "a batch waited 3.0 s")
            deadline = time.monotonic() + 10
            while not (tmp_path / EMITTED).exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert (tmp_path / EMITTED).exists(), "the thread sent nothing while the body ran"
            record_alert(tmp_path, "spike", 6, "stage1", "loss 8.0")  # the body's last act
    events = captured()
    assert [e.event for e in events] == ["llmflow.alert.stall", "llmflow.alert.spike"]
    assert {e.resource.id for e in events} == {"llmflow.stage.run-b.stage1"}
    forwarded = [r.getMessage() for r in caplog.records if r.threadName == "alerts"]
    assert forwarded == ["llmflow alert [stall] stage stage1 step 5: a batch waited 3.0 s"]


def test_without_prefect_the_alerts_are_logged_not_sent(tmp_path, captured, caplog):
    """No run and no API: no event (Prefect would start a server only to drop them)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    caplog.set_level(logging.WARNING, logger="llmflow.alert")
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with forward_alerts(tmp_path, poll_s=60):
            record_alert(tmp_path, "stall", 5, "stage1", "stalled")
    assert captured() == []
    assert "llmflow alert [stall] stage stage1 step 5: stalled" in caplog.messages


@pytest.mark.slow
def test_the_stage_task_sends_the_trainers_alerts_as_it_trains(
    tmp_path, prefect_harness, captured, monkeypatch
):
    """The pretrain step under a Prefect task: an alert row written while the trainer runs is
    one event on the flow run's stage resource, related to the task run, and one line logged
    in the task run's context."""
    import threading

    from conftest import make_packed, tiny_config
    from prefect import flow, task

    from llmflow.tasks.pretrain.faults import ENV
    from llmflow.tasks.pretrain.step import StageRun, pretrain

    monkeypatch.delenv(ENV, raising=False)
    data = make_packed(tmp_path / "data", num_docs=300)
    out = tmp_path / "s1-0123abcd"
    cfg = StageRun(train=tiny_config(max_steps=8, checkpoint={"interval": 4, "keep_last": 1}))

    def plant() -> None:  # rank 0's detector, once the trainer logs its first row
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        record_alert(out, "throughput", 3, "s1", "tokens/s fell", cause="compute")

    @task(name="pretrain-s1")
    def stage() -> None:
        pretrain(cfg, data=data, out=out)

    @flow(name="alert-events-test")
    def run() -> str:
        from prefect.runtime import flow_run

        stage()
        return flow_run.name

    lines: list[tuple[str, str | None]] = []  # the forwarder's lines, with their task run

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            from prefect.context import TaskRunContext

            if record.threadName != "planter":  # not record_alert's own line
                context = TaskRunContext.get()
                lines.append((record.getMessage(), context and str(context.task_run.id)))

    handler = Lines()
    logging.getLogger("llmflow.alert").addHandler(handler)
    planter = threading.Thread(target=plant, name="planter", daemon=True)
    planter.start()
    try:
        name = run()
    finally:
        planter.join(5)
        logging.getLogger("llmflow.alert").removeHandler(handler)

    (event,) = captured()
    assert event.event == "llmflow.alert.throughput"
    assert event.resource.id == f"llmflow.stage.{name}.s1"
    assert (event.resource["step"], event.resource["cause"]) == ("3", "compute")
    roles = {r.role for r in event.related}
    assert {"flow-run", "task-run"} <= roles
    task_run = next(r.id for r in event.related if r.role == "task-run").rsplit(".", 1)[1]
    # NOTE: the task's log reaches the API through "llmflow.*" only where llmflow.flows set
    # PREFECT_LOGGING_EXTRA_LOGGERS before Prefect was imported (tests/flows/
    # test_flow_run_logging.py checks that); here: the line, logged in the task's context
    assert [(line, task) for line, task in lines if "[throughput]" in line] == [
        ("llmflow alert [throughput] stage s1 step 3: tokens/s fell", task_run)
    ]
