"""A curate run over 2,000 shards against a real ``prefect server``: O(stages) task runs (one per
mapped stage), counted through the server's API, where one task per shard makes O(shards)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.conftest import prefect_server  # noqa: F401  (the session's server)
from tests.integration.servers import BIN, flow_run_logs

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
NUM_NODES = 10  # sample, ingest, 4 mapped stages, 4 global ones (graph.until("curate"))


def curate(server, root: Path, num_math_docs: int, docs_per_shard: int = 1) -> str:
    """Run the quickstart's curation as a user does (``llmflow run``, its own process, talking to
    the server); the flow run's id.

    NOTE: not in this process: after the session's ephemeral API, this process's Prefect event
    worker still sent to it, and the server recorded no task run from the events.
    """
    overrides = [
        f"ingest.docs_per_shard={docs_per_shard}",
        f"sample.num_math_docs={num_math_docs}",
        "runner.kind=threads",
        "runner.max_workers=2",
    ]
    sets = [arg for value in overrides for arg in ("--set", value)]
    argv = [str(BIN / "llmflow"), "run", str(REPO / "configs" / "quickstart.yaml"),
            "--root", str(root), "--until", "curate", *sets]  # fmt: skip
    done = subprocess.run(argv, cwd=root.parent, env=server.env, capture_output=True,
                          text=True, timeout=1500)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (lineage,) = root.glob("curate/*/lineage.json")
    return json.loads(lineage.read_text())["run"]["flow_run_id"]


def task_runs(flow_run_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    runs: list = []
    with get_client(sync_client=True) as client:
        flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        while True:
            page = client.read_task_runs(flow_run_filter=flow_runs, limit=200, offset=len(runs))
            runs += page
            if len(page) < 200:
                return runs


def settled_task_runs(flow_run_id: str, at_least: int, timeout_s: float = 180) -> list:
    """The flow run's task runs once the server has recorded ``at_least`` of them and the count
    holds for a few seconds (the server records task runs from events, after the flow ends)."""
    deadline = time.monotonic() + timeout_s
    runs = task_runs(flow_run_id)
    while time.monotonic() < deadline:
        time.sleep(5)
        again = task_runs(flow_run_id)
        if len(again) >= at_least and len(again) == len(runs):
            return again
        runs = again
    return runs


def progress_artifacts(flow_run_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterType,
    )

    mine = ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
        type=ArtifactFilterType(any_=["progress"]),
    )
    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=mine)


def shards(root: Path) -> int:
    return len(list(root.glob("curate-normalize/*/shards/*/_COMMITTED")))


def test_2000_shard_curate_makes_one_task_run_per_stage(prefect_server, tmp_path):  # noqa: F811
    staged = tmp_path / "staged"
    flow_run = curate(prefect_server, staged, num_math_docs=1700)
    assert shards(staged) >= 2000
    runs = settled_task_runs(flow_run, NUM_NODES)
    assert len(runs) == NUM_NODES, sorted(r.name for r in runs)
    assert all(r.state.is_completed() for r in runs)
    assert len(flow_run_logs(flow_run)) < 40 * NUM_NODES  # grows with stages, not shards
    progress = progress_artifacts(flow_run)  # one per mapped stage, at 100% of its shards
    assert len(progress) == 4 and all(float(a.data) == 100.0 for a in progress)
