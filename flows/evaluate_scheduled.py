"""PLACEHOLDER (the lead replaces it): the scheduled evaluation flow's name and parameters.

It only lists the complete checkpoints the real flow will score, so the ``scheduled-evaluation``
deployments and their tests have a flow to run. Keep the flow's name and entrypoint
(``flows/evaluate_scheduled.py:scheduled_evaluation``) when writing the real one.
"""

from __future__ import annotations  # noqa: I001  (flows must be imported before prefect)

import flows  # noqa: F401  (sets Prefect env defaults before prefect is imported)
from prefect import flow, task
from pydantic import BaseModel, ConfigDict, Field

from tasks.store import Store


class ScheduledEvaluationConfig(BaseModel):
    """Which outputs a scheduled evaluation looks at."""

    model_config = ConfigDict(extra="forbid")

    root: str = Field("./runs", description="Artifact root: a folder or s3://bucket/prefix.")
    steps: list[str] = Field(
        default_factory=lambda: ["pretrain", "extend", "sft", "dpo"],
        description="Steps whose complete outputs (checkpoints) are evaluated.",
    )


@task(name="find-checkpoints", retries=2, retry_delay_seconds=5)
def find_checkpoints(root: str, step: str) -> list[str]:
    """Complete outputs of one step, newest first."""
    return Store(root).list_outputs(step)


@flow(name="llmflow-scheduled-evaluation", log_prints=True)
def scheduled_evaluation(
    config: ScheduledEvaluationConfig = ScheduledEvaluationConfig(),  # noqa: B008
) -> list[str]:
    """Find every checkpoint under the root (placeholder: the real flow also evaluates them)."""
    found = [uri for step in config.steps for uri in find_checkpoints(config.root, step)]
    print(f"{len(found)} checkpoints under {config.root}")
    return found
