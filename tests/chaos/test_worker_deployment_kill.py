"""A lost node under the orchestrator: a process worker is SIGKILLed while its flow run trains.

A real Prefect server, the deployments of deployments/prefect.yaml (``prefect deploy --all``) and
a ``prefect worker start`` process worker, as in tests/integration/test_server.py. The ``pretrain``
deployment is triggered as the UI does; once the first pretraining stage has committed a trainer
checkpoint, the worker's process group and the flow-run process it spawned (Prefect starts it in a
session of its own) are SIGKILLed together: nothing of the node runs any more. The trainer must
die with its launcher; a new worker then runs the deployment again with the same parameters. The
re-run recomputes no committed step, resumes the stage from the checkpoint the killed run
committed, and ends with weights bit-identical to a fault-free run of the same config.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from llmflow.tasks.framework.store import COMMIT_MARKER
from tests.chaos.test_worker_kill import _trainers
from tests.integration.conftest import prefect_server  # noqa: F401  (the fixture)
from tests.integration.servers import BIN, PrefectServer, flow_run_logs, stop, wait_until
from tests.integration.test_server import SMALL, _subflow_run, _task_runs, deployed  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="Linux only")]

DEPLOYMENT = "llmflow/pretrain"  # the recipe up to and including the three pretraining stages
STAGE1_STEPS, INTERVAL = 30, 5  # 8 x 256 tokens a step; a checkpoint every 5 steps
OVERRIDES = [
    *SMALL,
    "tokenizer.vocab_size=512",
    f"pretrain.stages.0.mixture.num_tokens={STAGE1_STEPS * 8 * 256}",
    "pretrain.stages.1.mixture.num_tokens=4096",  # 2 steps each
    "pretrain.stages.2.mixture.num_tokens=4096",
    f"pretrain.train.checkpoint.interval={INTERVAL}",
    "pretrain.train.schedule.warmup_steps=2",
    "pretrain.train.log_interval=1",
]
STEP_LINE = re.compile(r"^step (\d+) loss ")
RUN_TIMEOUT_S = 420
# NOTE: the flow-run process's environment, as the UI's job variables set it: one BLAS thread
# (two on two busy cores made a step 5x slower), the same in every run, for bit-exact weights.
JOB_VARIABLES = {"env": {"OMP_NUM_THREADS": "1"}}


def _worker(server: PrefectServer, log_name: str):
    """A ``prefect worker start`` process worker of the llmflow-local pool (its own session)."""
    argv = [str(BIN / "prefect"), "worker", "start", "--pool", "llmflow-local"]
    return server.start(argv, log_name, {**server.env, "PREFECT_WORKER_QUERY_SECONDS": "2"})


def _parameters(root: Path) -> dict:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(DEPLOYMENT)
    return {"run": {**deployment.parameters["run"], "root": str(root), "overrides": OVERRIDES}}


def _trigger(root: Path, timeout_s: float = RUN_TIMEOUT_S):
    """Run the deployment on ``root`` as the UI's Run button does; wait ``timeout_s`` for it."""
    from prefect.deployments import run_deployment

    return run_deployment(
        DEPLOYMENT,
        parameters=_parameters(root),
        job_variables=JOB_VARIABLES,
        timeout=timeout_s,
        poll_interval=2,
    )


def _flow_run_processes(flow_run_id) -> list[int]:
    """Pids of the live processes whose environment names this flow run (Prefect sets it)."""
    marker = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError):
            continue
        if marker in environ and state != "Z":
            found.append(int(entry.name))
    return found


def _parent(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def _committed(root: Path) -> dict[str, str]:
    """Each committed output (``step/name-hash``) with its commit marker's text (a timestamp)."""
    return {
        f"{marker.parent.parent.name}/{marker.parent.name}": marker.read_text()
        for marker in root.glob(f"*/*/{COMMIT_MARKER}")
    }


def _work_dir(root: Path) -> Path | None:
    found = sorted((root / "pretrain" / ".partial").glob("*-stage1-*[0-9a-f]"))
    return found[0] if found else None


def _checkpoint_notices(work: Path | None) -> list[dict]:
    path = None if work is None else work / "checkpoints.jsonl"
    if path is None or not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [n for n in map(json.loads, lines) if "step" in n and not n.get("final")]


def _weights(root: Path) -> dict[str, bytes]:
    return {
        p.parent.parent.name: p.read_bytes()
        for p in sorted((root / "pretrain").glob("*-stage*/final/model.safetensors"))
    }


def test_a_killed_worker_s_deployment_resumes_from_its_checkpoint_on_a_new_worker(
    deployed: PrefectServer,  # noqa: F811
    tmp_path: Path,
):
    from prefect.client.orchestration import get_client

    from llmflow.tasks.pretrain.checkpoint import latest_checkpoint

    (worker,) = [p for p in deployed.processes if p.poll() is None]
    root = tmp_path / "runs"
    started = time.monotonic()
    first = _trigger(root, timeout_s=0)
    runs = [first]
    try:
        wait_until(
            lambda: _checkpoint_notices(_work_dir(root)),
            300,
            "the first pretraining stage's first checkpoint",
            interval_s=0.2,
        )
        work = _work_dir(root)
        before_kill = _committed(root)
        trainers = _trainers(work)
        flow_run = [pid for pid in _flow_run_processes(first.id) if pid not in trainers]
        assert len(trainers) == 1 and len(flow_run) == 1, (trainers, flow_run)
        assert _parent(flow_run[0]) == worker.pid  # the worker's child, in a session of its own
        assert os.getsid(flow_run[0]) != os.getsid(worker.pid)
        os.killpg(worker.pid, signal.SIGKILL)  # the node is lost: nothing of it runs any more
        os.kill(flow_run[0], signal.SIGKILL)
        worker.wait(10)
        killed_at = time.monotonic()
        while (
            _trainers(work) or _flow_run_processes(first.id)
        ) and time.monotonic() - killed_at < 10:
            time.sleep(0.1)
        assert not _trainers(work), f"still training into {work} after its launcher was killed"
        assert not _flow_run_processes(first.id)
        print(f"killed {time.monotonic() - started:.0f} s after the trigger")

        # What the kill left: the work dir with its checkpoints, nothing that looks complete.
        resume_from = latest_checkpoint(work)
        assert resume_from is not None and resume_from.parent.name == "checkpoints", resume_from
        step = int(resume_from.name.removeprefix("step-"))
        assert 0 < step < STAGE1_STEPS and step % INTERVAL == 0, step
        assert _committed(root) == before_kill
        assert not any(key.startswith("pretrain/") for key in before_kill), before_kill
        assert {k.split("/")[0] for k in before_kill} >= {"sample", "tokenize", "mixture"}
        with get_client(sync_client=True) as client:
            killed_state = client.read_flow_run(first.id).state
        # NOTE: nothing reports a SIGKILLed worker's run: it stays Running on the server (Prefect
        # 3.8.8 marks a run Crashed on missed heartbeats only through an automation one sets up).
        print(f"the killed flow run is {killed_state.name} on the server")
        assert not killed_state.is_final(), killed_state

        _worker(deployed, "worker-2.log")
        rerun = _trigger(root)
        runs.append(rerun)
        assert rerun.state.is_completed(), f"{rerun.state}\n{deployed.log('worker-2.log')[-4000:]}"
        pipeline_run = _subflow_run(rerun.id)
        assert pipeline_run.state.is_completed(), pipeline_run.state
        messages = flow_run_logs(pipeline_run.id)
        resumed = f"resumed from {resume_from} at step {step}"
        assert resumed in messages, "\n".join(messages[-60:])
        stage1_steps = sorted(
            int(m.group(1))
            for m in map(STEP_LINE.match, messages)
            if m and int(m.group(1)) <= STAGE1_STEPS
        )
        assert stage1_steps == list(range(step + 1, STAGE1_STEPS + 1)), stage1_steps  # none redone
        task_runs = _task_runs(pipeline_run.id)
        assert all(t.state.is_completed() for t in task_runs), [
            (t.name, t.state) for t in task_runs
        ]
        ran = sorted(t.name for t in task_runs if t.state.name != "Cached")
        assert ran == [f"pretrain-quickstart-stage{i}" for i in (1, 2, 3)], ran
        after = _committed(root)
        assert {k: after[k] for k in before_kill} == before_kill  # untouched: not recomputed
        assert not work.exists()  # committed: the work dir became the output
        print(f"re-run done {time.monotonic() - started:.0f} s after the first trigger")

        # A fault-free run of the same parameters in a fresh root: the same outputs, the same bytes.
        reference = tmp_path / "reference"
        fault_free = _trigger(reference)
        runs.append(fault_free)
        assert fault_free.state.is_completed(), (
            f"{fault_free.state}\n{deployed.log('worker-2.log')[-4000:]}"
        )
        resumed_weights, reference_weights = _weights(root), _weights(reference)
        assert len(reference_weights) == 3 and resumed_weights.keys() == reference_weights.keys()
        for name, data in reference_weights.items():
            assert resumed_weights[name] == data, f"{name}: the resumed run's weights differ"
        assert set(_committed(reference)) == set(after)
    finally:  # only when the test failed: what its flow runs left (their own sessions)
        for pid in {p for run in runs for p in _flow_run_processes(run.id)}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    stop(deployed.processes[-1])
    print(f"test done in {time.monotonic() - started:.0f} s")
