"""Prefect while a step runs: the step's run names, its events and its live reports.

A step's output reports (``report_table``, ``report_markdown``) are published by the executor
with the output. A long step also reports while it runs (a training stage's live report, its
alerts as events); those calls go through here, so Prefect stays imported only in ``flows/`` and
the framework. Every function is a no-op (or says "local") outside a Prefect run.
"""

from __future__ import annotations

from typing import Any


def run_name() -> str:
    """The name of the Prefect flow run this runs in ("local" outside one)."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None:
        return context.flow_run.name
    return "local"


def in_task_run() -> bool:
    """Whether this runs inside a Prefect task run."""
    from prefect.context import TaskRunContext

    return TaskRunContext.get() is not None


def events_enabled() -> bool:
    """Whether events have somewhere to go: inside a Prefect run, or with an API configured.

    NOTE: outside both, Prefect's ``emit_event`` would start an ephemeral API server of its own
    (seconds of CPU) only to drop the events with it; a run without Prefect sends none.
    """
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.settings import PREFECT_API_URL

    in_run = FlowRunContext.get() is not None or TaskRunContext.get() is not None
    return in_run or bool(PREFECT_API_URL.value())


def run_resources() -> list[dict[str, str]]:
    """The flow run and task run this runs in, as related resources of an event."""
    from prefect.context import FlowRunContext, TaskRunContext

    related = []
    flow_run = getattr(FlowRunContext.get(), "flow_run", None)
    task_run = getattr(TaskRunContext.get(), "task_run", None)
    for kind, run in (("flow-run", flow_run), ("task-run", task_run)):
        if run is not None:
            related.append(
                {
                    "prefect.resource.id": f"prefect.{kind}.{run.id}",
                    "prefect.resource.role": kind,
                    "prefect.resource.name": run.name,
                }
            )
    return related


def emit(event: str, resource: dict[str, str], payload: dict[str, Any], id: Any) -> Any:
    """Send one Prefect event related to the current runs; the event (None when off)."""
    from prefect.events import emit_event

    return emit_event(
        event=event, resource=resource, related=run_resources(), payload=payload, id=id
    )


def publish_markdown(key: str, markdown: str, description: str = "") -> bool:
    """Publish (a new version of) a markdown artifact now, inside a task run; whether it was."""
    if not in_task_run():
        return False
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown, key=key, description=description)
    return True
