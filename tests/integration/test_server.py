"""A real Prefect server: work pools, `prefect deploy --all`, a worker, runs triggered as the UI does.

Order matters in this module: the worker tests use the deployments `prefect deploy` registered;
the last test re-registers the local ones through ``serve()`` (which takes them off the pool).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from uuid import UUID

import pytest

from .servers import REPO, PrefectServer, stop, wait_until

pytestmark = pytest.mark.integration
TEMPLATE = REPO / "deployments" / "kubernetes" / "gpu-job-template.json"
SMALL = [
    "sample.num_code_files=4", "sample.num_math_docs=30", "sample.num_exact_duplicates=4",
    "sample.num_near_duplicates=4", "sample.num_junk=3",
]  # fmt: skip
RUN_TIMEOUT_S = 300
_EVAL = "llmflow-scheduled-evaluation/scheduled-evaluation"


@pytest.fixture(scope="module")
def deployed(prefect_server: PrefectServer) -> PrefectServer:
    """Both work pools, every deployment in deployments/prefect.yaml, a process worker."""
    steps = [
        ("work-pool", "create", "llmflow-local", "--type", "process"),
        ("work-pool", "create", "llmflow-gpu", "--type", "kubernetes",
         "--base-job-template", str(TEMPLATE)),
        ("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"),
    ]  # fmt: skip
    for args in steps:
        out = prefect_server.cli(*args)
        assert out.returncode == 0, (
            f"prefect {' '.join(args)}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    worker_env = {**prefect_server.env, "PREFECT_WORKER_QUERY_SECONDS": "2"}
    prefect_server.start(
        [
            str(Path(sys.executable).parent / "prefect"),
            "worker",
            "start",
            "--pool",
            "llmflow-local",
        ],
        "worker.log",
        worker_env,
    )
    return prefect_server


def _task_runs(flow_run_id: UUID):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        return client.read_task_runs(flow_run_filter=flow_runs)


def _subflow_run(flow_run_id: UUID):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        parent = FlowRunFilterParentFlowRunId(any_=[flow_run_id])
        (child,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=parent))
    return child


def _wait_for_log(flow_run_id: UUID, text: str) -> None:
    """Wait until a flow run's logs (shipped to the API in batches) contain ``text``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    def messages() -> str:
        with get_client(sync_client=True) as client:
            flow_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            return "\n".join(log.message for log in client.read_logs(flow_run))

    wait_until(lambda: text in messages(), 60, f"{text!r} in the flow run's logs", interval_s=2)


def _run(server: PrefectServer, name: str, parameters: dict, log: str = "worker.log"):
    """Trigger a deployment through the API, as the UI's Run button does, and wait for it."""
    from prefect.deployments import run_deployment

    run = run_deployment(name, parameters=parameters, timeout=RUN_TIMEOUT_S, poll_interval=2)
    assert run.state is not None and run.state.is_completed(), (
        f"{name}: {run.state}\n{server.log(log)[-4000:]}"
    )
    return run


def _rendered_job(pool_template: dict, job_variables: dict) -> dict:
    """The Kubernetes job the worker would submit: the template with defaults and job variables."""
    from prefect.utilities.templating import apply_values

    props = pool_template["variables"]["properties"]
    values = {k: v["default"] for k, v in props.items() if "default" in v} | job_variables
    return apply_values(pool_template["job_configuration"], values)["job_manifest"]


def test_kubernetes_pool_accepts_the_gpu_template(deployed: PrefectServer, tmp_path: Path):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("llmflow-gpu")
        deployment = client.read_deployment_by_name("llmflow/cluster")
    assert pool.type == "kubernetes"
    assert pool.base_job_template == json.loads(TEMPLATE.read_text())
    job = _rendered_job(pool.base_job_template, deployment.job_variables)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]
    assert container["envFrom"] == [{"secretRef": {"name": "llmflow-artifacts"}}]
    assert deployment.pull_steps[0]["prefect.deployments.steps.set_working_directory"] == {
        "directory": "/opt/llmflow"
    }
    # The server really validates templates: one using an undeclared variable is refused.
    broken = json.loads(TEMPLATE.read_text())
    del broken["variables"]["properties"]["gpu_count"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    out = deployed.cli(
        "work-pool", "create", "broken", "--type", "kubernetes",
        "--base-job-template", str(tmp_path / "broken.json"),
    )  # fmt: skip
    assert out.returncode != 0 and "gpu_count" in out.stdout + out.stderr


def test_pipeline_deployment_runs_on_a_worker_with_all_its_task_runs(
    deployed: PrefectServer, tmp_path_factory: pytest.TempPathFactory
):
    from prefect.client.orchestration import get_client

    root = tmp_path_factory.mktemp("runs", numbered=False)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("llmflow/quickstart")
    assert "PipelineRun" in deployment.parameter_openapi_schema["definitions"]  # the UI form
    run = {**deployment.parameters["run"], "root": str(root), "until": "ingest", "overrides": SMALL}
    parent = _run(deployed, "llmflow/quickstart", {"run": run})
    pipeline_run = _subflow_run(parent.id)
    assert pipeline_run.state.is_completed()
    task_runs = _task_runs(pipeline_run.id)
    assert sorted(t.name for t in task_runs) == ["ingest-quickstart", "sample-quickstart"]
    assert all(t.state.is_completed() for t in task_runs)
    for step in ("sample", "ingest"):
        (output,) = (root / step).glob("quickstart-*")
        assert (output / "_COMMITTED").exists()
        record = json.loads((output / "lineage.json").read_text())
        assert record["run"]["flow_run_id"] == str(pipeline_run.id)


def test_scheduled_evaluation_deployment_has_a_cron_and_runs(
    deployed: PrefectServer, tmp_path_factory: pytest.TempPathFactory
):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(_EVAL)
    (schedule,) = deployment.schedules
    assert schedule.active and schedule.schedule.cron == "0 */6 * * *"
    root = tmp_path_factory.mktemp("evaluation-root")
    (root / "export").mkdir()  # no checkpoint exported yet: an empty graph, not an error
    run = _run(deployed, _EVAL, {"config": {"root": str(root)}})
    assert _task_runs(run.id) == []
    _wait_for_log(run.id, "0 model(s): 0 evaluated now, 0 failure(s)")


def test_gpu_slot_holds_the_gpu_limit_and_is_a_no_op_without_it(deployed: PrefectServer):
    from prefect import flow
    from prefect.client.orchestration import get_client

    from llmflow.tasks.framework.concurrency import gpu_slot

    out = deployed.cli("global-concurrency-limit", "create", "gpu", "--limit", "2")
    assert out.returncode == 0, out.stdout + out.stderr

    def active_slots() -> int:
        with get_client(sync_client=True) as client:
            return client.read_global_concurrency_limit_by_name("gpu").active_slots

    @flow
    def uses_gpus() -> tuple[bool, int, bool]:
        with gpu_slot(occupy=2) as held:
            during = active_slots()
        with gpu_slot(name="no-such-limit") as missing:
            pass
        return held, during, missing

    with gpu_slot() as outside_a_run:
        assert outside_a_run is False
    assert uses_gpus() == (True, 2, False)
    assert active_slots() == 0


def test_serve_runs_the_local_deployments_without_a_worker(deployed: PrefectServer, tmp_path: Path):
    for worker in deployed.processes:  # so that only serve() can run what follows
        stop(worker)
    # NOTE: serve() over a deployment that `prefect deploy` made keeps some of its pool-only
    # fields and crashes the runs; switching a deployment to serve() means deleting it first.
    out = deployed.cli("deployment", "delete", _EVAL)
    assert out.returncode == 0, out.stdout + out.stderr
    code = "from llmflow.flows.deploy import serve; serve(['scheduled-evaluation'])"
    env = {**deployed.env, "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    deployed.start([sys.executable, "-c", code], "serve.log", env)
    wait_until(
        lambda: "being served" in deployed.log("serve.log"), 180, "serve() to start", interval_s=2
    )
    (tmp_path / "export").mkdir()
    run = _run(deployed, _EVAL, {"config": {"root": str(tmp_path)}}, "serve.log")
    _wait_for_log(run.id, "0 model(s): 0 evaluated now, 0 failure(s)")
