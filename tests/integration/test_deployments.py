"""Fast checks of the deployment definitions (no server): they run in the default test job."""

from __future__ import annotations

import yaml

from llmflow.flows.deploy import PREFECT_FILE, load_flow, local_deployments
from llmflow.tasks.config import PipelineConfig


def test_every_deployment_parameter_resolves_to_a_valid_config():
    """A renamed field or preset fails here, not in the UI."""
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    for deployment in spec["deployments"]:
        flow = load_flow(deployment["entrypoint"])
        params = flow.validate_parameters(deployment.get("parameters") or {})
        if "run" in params:
            assert isinstance(params["run"].config(), PipelineConfig)


def test_serve_builds_every_local_deployment_with_its_schedule():
    deployments = {d.name: d for d in local_deployments()}
    assert set(deployments) == {
        "quickstart",
        "data",
        "pretrain",
        "scheduled-evaluation",
        "running-evaluation",
        "evaluate-models",
    }
    assert deployments["quickstart"].parameters == {"run": {"preset": "quickstart"}}
    (schedule,) = deployments["scheduled-evaluation"].schedules
    assert schedule.schedule.cron == "0 */6 * * *" and schedule.active


def test_multinode_job_gives_each_node_its_rank_and_a_shared_rendezvous():
    path = PREFECT_FILE.parent / "kubernetes" / "multinode-pretrain.yaml"
    service, job = yaml.safe_load_all(path.read_text())
    assert service["spec"]["clusterIP"] == "None"
    assert job["spec"]["completionMode"] == "Indexed"
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    command = pod["containers"][0]["args"][0]
    assert "--machine_rank $JOB_COMPLETION_INDEX" in command
    assert f"--main_process_ip {job['metadata']['name']}-0.{pod['subdomain']}" in command
    config = command.split("--config_file ")[1].split()[0]
    assert (PREFECT_FILE.parents[1] / config).exists()


def test_prefect_file_validates_and_scheduled_evaluations_run_one_at_a_time():
    """``prefect deploy`` reads the file with this model; overlapping scheduled runs wait."""
    from prefect.cli.deploy._models import PrefectYamlModel

    model = PrefectYamlModel.model_validate(yaml.safe_load(PREFECT_FILE.read_text()))
    limits = {d.name: d.concurrency_limit for d in model.deployments}
    assert limits["scheduled-evaluation"] == 1 and limits["cluster-evaluation"] == 1
