"""Trainer preemption: SIGTERM, as Kubernetes and Slurm send it, then the step's own retry.

The trainer saves a checkpoint at the end of the step it was signalled in and exits with code 75;
the launcher raises ``TrainingPreempted`` (retryable); the pretrain step's Prefect retry resumes
from that checkpoint, and the committed weights equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.pretrain.faults import ENV
from llmflow.tasks.pretrain.launch import TrainingPreempted, launch_training
from llmflow.tasks.pretrain.preemption import PREEMPTED_EXIT_CODE
from llmflow.tasks.pretrain.step import StageRun, pretrain
from tests.chaos.conftest import TINY_MODEL, file_digests, make_packed, tiny_train_config
from tests.tasks.pretrain.notices import read_notices

pytestmark = pytest.mark.slow


class DataSpec(BaseModel):
    num_docs: int = 120


@step("chaos-packed")
def packed(cfg: DataSpec, out: Path) -> Metrics:
    """The packed training data of the preemption runs."""
    make_packed(out, num_docs=cfg.num_docs)
    return {}


def _graph() -> tuple[Graph, object]:
    graph = Graph()
    data = graph.add(packed, DataSpec(), "train")
    overrides = {k: v for k, v in TINY_MODEL.items() if k != "vocab_size"}
    train = tiny_train_config(
        model={"preset": "debug", "overrides": overrides},
        checkpoint={"interval": 4, "keep_last": 2},
    )
    return graph, graph.add(pretrain, StageRun(train=train), "s1", data=data)


def test_sigterm_saves_exits_75_and_the_prefect_retry_resumes_exactly(
    tmp_path, monkeypatch, prefect_harness
):
    from prefect import flow
    from prefect.client.orchestration import get_client

    from llmflow.tasks.framework.executor import PrefectExecutor

    monkeypatch.delenv(ENV, raising=False)
    graph, stage = _graph()
    reference = Executor(str(tmp_path / "reference")).run(graph)[stage]

    monkeypatch.setenv(ENV, json.dumps({"sigterm_after_step": 4}))

    @flow
    def preempted_run():
        return PrefectExecutor(str(tmp_path / "preempted")).run(graph)

    result = preempted_run()[stage]
    run = Path(result.uri)
    events = [n for n in read_notices(run) if n.get("event") == "preempted"]
    # Signalled after step 4 (the cadence's checkpoint), it saved step 5 of its own and stopped.
    assert [(e["step"], Path(e["path"]).name) for e in events] == [(5, "step-000005")]
    assert [(n.get("step"), n.get("final")) for n in read_notices(run) if "event" not in n] == [
        (4, False),
        (5, False),
        (8, True),
    ]
    task_run_id = json.loads((run / "lineage.json").read_text())["run"]["task_run_id"]
    with get_client(sync_client=True) as client:
        assert client.read_task_run(task_run_id).run_count == 2  # one preempted, one resumed
    assert result.metrics["steps"] == 8
    weights = "final/model.safetensors"
    assert file_digests(run, weights) == file_digests(Path(reference.uri), weights)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))


def test_two_ranks_both_signalled_stop_at_one_step_and_resume_exactly(
    tmp_path, chaos_train_data, monkeypatch
):
    """Slurm signals every process of the step: both gloo ranks, under torchrun (which replaces
    the ranks' exit code with its own, so the launcher reads the preempted event instead)."""
    cfg = tiny_train_config(checkpoint={"interval": 4, "keep_last": 2})
    monkeypatch.delenv(ENV, raising=False)
    reference = tmp_path / "reference"
    launch_training(cfg, chaos_train_data, reference, num_processes=2, on_line=lambda _: None)

    run = tmp_path / "preempted"
    monkeypatch.setenv(ENV, json.dumps({"sigterm_after_step": 2}))
    lines: list[str] = []
    with pytest.raises(TrainingPreempted, match="preempted .SIGTERM. at step 3") as caught:
        launch_training(cfg, chaos_train_data, run, num_processes=2, on_line=lines.append)
    assert caught.value.returncode != 0
    stopped = [x for x in lines if "preempted at step 3: checkpoint step-000003 saved" in x]
    assert len(stopped) == 1 and f"exiting with code {PREEMPTED_EXIT_CODE}" in stopped[0], lines
    monkeypatch.delenv(ENV)
    launch_training(cfg, chaos_train_data, run, num_processes=2, on_line=lines.append)
    assert any("resumed from" in x and "at step 3" in x for x in lines), lines
    weights = "final/model.safetensors"
    assert file_digests(run, weights) == file_digests(reference, weights)


def test_a_save_slower_than_the_grace_exits_75_at_the_deadline(
    tmp_path, chaos_train_data, reference_run
):
    """The step-2 checkpoint's write hangs (slow storage); SIGTERM after step 2: the trainer
    waits for it only until preempt_grace_s, exits 75 without a checkpoint, and the re-run
    starts over to the fault-free weights."""
    import time

    from tests.chaos.conftest import run_trainer

    cfg = tiny_train_config(checkpoint={"interval": 2, "keep_last": 3, "async_save": True})
    grace = cfg.replaced(**{"checkpoint.preempt_grace_s": 2.0})
    faults = {
        "slow_storage_after_step": 1,
        "checkpoint_write_delay_s": 120,
        "sigterm_after_step": 2,
    }
    run = tmp_path / "run"
    started = time.monotonic()
    proc = run_trainer(grace, chaos_train_data, run, faults=faults)
    assert proc.returncode == PREEMPTED_EXIT_CODE, proc.stdout + proc.stderr
    assert time.monotonic() - started < 100, "it must not wait for the 120 s write"
    assert "preemption grace of 2 s ran out before a checkpoint was saved" in proc.stdout
    assert not list(run.glob("**/COMPLETE"))

    assert run_trainer(cfg, chaos_train_data, run).returncode == 0
    weights = "final/model.safetensors"
    assert file_digests(run, weights) == file_digests(reference_run, weights)
