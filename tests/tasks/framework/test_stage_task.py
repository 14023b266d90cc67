"""The stage task (``prefect_task.stage_task``) after a crash between a stage's last shard commit
and its own: every shard is in, the stage output is not, so this run commits it. The task is
Completed (not Cached) and the stage's asset event is emitted."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
from pydantic import BaseModel

from llmflow.tasks.config import RunnerConfig
from llmflow.tasks.framework import prefect_task
from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.lineage import LINEAGE_FILE
from llmflow.tasks.framework.stage_overhead import OverheadShards, overhead_shards
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.framework.store import COMMIT_MARKER

MATERIALIZED = "prefect.asset.materialization.succeeded"


class Times(BaseModel):
    factor: int = 3


@step("stage-task-times")
def times(cfg: Times, shard: Path, out: Path) -> Metrics:
    """The shard's number times ``factor``."""
    (i,) = pq.read_table(shard).column("i").to_pylist()
    (out / "value.json").write_text(json.dumps(i * cfg.factor))
    return {"value": i * cfg.factor}


def _graph() -> tuple[Graph, object]:
    graph = Graph()
    source = graph.add(overhead_shards, OverheadShards(num_shards=4), "n")
    return graph, graph.add(times, Times(), "n", map_over="shard", shard=source)


def _stage_states(flow_run_id) -> list[str]:
    """The state names of the flow run's stage task runs (recorded by the API soon after)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    mine = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=mine)
            names = [r.state.name for r in runs if r.name.startswith(times.name) and r.state]
            if (names and names[0] != "Running") or time.monotonic() > deadline:
                return names
            time.sleep(1)


def test_a_stage_committed_after_all_its_shards_is_completed_with_its_asset_event(
    prefect_harness, tmp_path, monkeypatch
):
    from prefect import flow

    from llmflow.tasks.framework.executor import PrefectExecutor

    root = tmp_path / "store"
    graph, node = _graph()
    stage = Path(Executor(str(root)).run(graph)[node].uri)
    # the crash: every shard committed, the stage's record and marker never written
    (stage / COMMIT_MARKER).unlink()
    (stage / LINEAGE_FILE).unlink()
    events: list[dict] = []
    monkeypatch.setattr(prefect_task, "emit_event", lambda **event: events.append(event))

    @flow(name="stage-task-recommit")
    def run():
        from prefect.runtime import flow_run

        executor = PrefectExecutor(str(root), runner=RunnerConfig(max_workers=2))
        return executor.run(graph)[node], flow_run.id

    mapped, flow_run_id = run()
    assert (stage / COMMIT_MARKER).exists() and mapped.uri == str(stage)
    assert _stage_states(flow_run_id) == ["Completed"]
    stage_events = [
        e
        for e in events
        if e["event"] == MATERIALIZED
        and e["resource"]["prefect.resource.id"] == prefect_task.asset_key(str(stage))
    ]
    assert len(stage_events) == 1, events
    assert stage_events[0]["payload"]["num_cached"] == 4  # every shard was in already

    events.clear()
    mapped, flow_run_id = run()  # now the stage output is complete: Cached, no event
    assert _stage_states(flow_run_id) == ["Cached"]
    assert not [e for e in events if e["resource"]["prefect.resource.name"] == times.name]
