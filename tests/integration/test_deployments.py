"""Fast checks of the deployment definitions (no server): they run in the default test job."""

from __future__ import annotations

import yaml

from flows.deploy import PREFECT_FILE, load_flow, local_deployments
from tasks.config import PipelineConfig


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
    assert set(deployments) == {"quickstart", "data", "pretrain", "scheduled-evaluation"}
    assert deployments["quickstart"].parameters == {"run": {"preset": "quickstart"}}
    (schedule,) = deployments["scheduled-evaluation"].schedules
    assert schedule.schedule.cron == "0 */6 * * *" and schedule.active
