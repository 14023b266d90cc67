"""The end-to-end flow: build the recipe's graph, cut it at ``until``, run it on Prefect.

Steps whose content-addressed output exists show as Cached; the flow run ends with a table of
every output, in run order.
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from llmflow.flows.recipe import planned
from llmflow.tasks.config import PipelineConfig
from llmflow.tasks.framework.executor import PrefectExecutor
from llmflow.tasks.framework.step import StepResult


@flow(name="llmflow-pipeline", log_prints=True)
def pipeline(config: PipelineConfig) -> list[StepResult]:
    """Run every step of the recipe that is not already in the store."""
    rows = PrefectExecutor(config.root, runner=config.runner).run(planned(config)).rows()
    create_table_artifact(
        [
            {
                "step": r.step,
                "status": "cached" if r.cached else "ran",
                "seconds": round(r.seconds, 2),
                "uri": r.uri,
            }
            for r in rows
        ],
        key="llmflow-outputs",
        description="Outputs of this run, in DAG order",
    )
    return rows


def run_pipeline(config: PipelineConfig) -> list[StepResult]:
    """Check the graph builds (no Prefect yet), then run it.

    A mapped stage is one task whose shards run on the runner's backend (``config.runner``), so
    the flow's own task runner only ever holds a few tasks."""
    planned(config)
    return pipeline.with_options(task_runner=ThreadPoolTaskRunner(max_workers=4))(config)
