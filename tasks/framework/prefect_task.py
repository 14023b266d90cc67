"""The one thin layer between declared steps and Prefect: ``step_task`` makes a step a task.

The task's cache key is the output's content hash (only once that output is complete, so a
deleted output is rebuilt rather than served stale). When the store already holds the output,
the task finishes in a ``Cached`` state. Retries cover transient failures (I/O, a killed worker),
never bad input. Each materialized output emits a Prefect asset event with its upstream outputs.
"""

from __future__ import annotations

import hashlib
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import FlowRunContext, TaskRunContext
from prefect.events import emit_event
from prefect.states import Completed, State

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Shard, Step, StepResult
from llmflow.tasks.framework.store import Store


def asset_key(uri: str) -> str:
    """Prefect asset keys are URIs; local paths become file:// URIs."""
    return uri if "://" in uri else f"file://{uri}"


def _retry_transient(task_obj, task_run, state) -> bool:
    """Retry unless the failure is bad input (a retry would fail the same way)."""
    try:
        state.result()
    except BadInputError:
        return False
    except Exception:
        return True
    return True


def _run_info() -> dict[str, Any]:
    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    return {
        "orchestrator": "prefect",
        "flow_run_id": str(flow_ctx.flow_run.id) if flow_ctx and flow_ctx.flow_run else None,
        "flow_name": flow_ctx.flow.name if flow_ctx else None,
        "task_run_id": str(task_ctx.task_run.id) if task_ctx else None,
    }


def _publish(result: StepResult, inputs: dict[str, str | list[str]]) -> None:
    upstream = []
    for value in inputs.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, (str, Shard)):
                upstream.append(item.uri if isinstance(item, Shard) else item)
    emit_event(
        event="prefect.asset.materialization.succeeded",
        resource={
            "prefect.resource.id": asset_key(result.uri),
            "prefect.resource.name": result.step,
        },
        related=[
            {"prefect.resource.id": asset_key(u), "prefect.resource.role": "asset"}
            for u in upstream
        ],
        payload={"hash": result.hash, "metrics": result.metrics},
    )
    for art in result.artifacts:
        key = art["key"].lower().replace("_", "-")
        if art["kind"] == "table":
            create_table_artifact(art["rows"], key=key, description=art.get("description") or None)
        else:
            create_markdown_artifact(
                art["markdown"], key=key, description=art.get("description") or None
            )


def step_task(step: Step):
    """Wrap a declared step as a Prefect task that goes through the store.

    The returned callable is called as ``t(config, inputs={...}, root=..., name=...)`` (or
    ``t.submit(...)``) and gives the ``StepResult`` whose ``uri`` the next step takes.
    """

    def cache_key(_context, parameters: dict[str, Any]) -> str | None:
        store = Store(parameters["root"])
        inputs = parameters.get("inputs") or {}
        try:
            uri, digest, _ = step.address(store, parameters["config"], parameters["name"], inputs)
        except FileNotFoundError:
            return None
        if not store.is_complete(uri):
            return None
        # NOTE: the output's full address, root included: keyed by the content hash alone, a
        # root was served another root's persisted result (whose files may be gone).
        where = hashlib.sha256(str(uri).encode()).hexdigest()[:16]
        return f"llmflow-{step.name}-{digest}-{where}"

    def run(
        config: Any, inputs: dict[str, Any] | None = None, root: str = "./runs", name: str = "run"
    ):
        result = step.run(Store(root), config, name, inputs, _run_info())
        if result.cached:
            return Completed(message=f"output exists: {result.uri}", name="Cached", data=result)
        _publish(result, inputs or {})
        return result

    return _StepTask(
        task(
            run,
            name=step.name,
            description=step.doc,
            task_run_name=f"{step.name}-{{name}}",
            retries=step.retries,
            retry_delay_seconds=[2, 10],
            retry_condition_fn=_retry_transient,
            cache_key_fn=cache_key,
            persist_result=True,
            # NOTE: steps log through "llmflow.*"; captured prints would also catch libraries'
            # stdout, e.g. dill's dis.dis() while datasets hashes a function (pages of bytecode).
            log_prints=False,
            tags=["gpu"] if step.gpu else [],
        )
    )


class _StepTask:
    """A Prefect task whose direct call always gives the ``StepResult`` (also when Cached)."""

    def __init__(self, prefect_task):
        self.task = prefect_task

    def __call__(self, *args, **kwargs) -> StepResult:
        out = self.task(*args, **kwargs)
        # NOTE: Prefect hands a task's raw return value back to a direct caller; ours is a
        # State when the output was cached, so unwrap it here, once, for every flow.
        return out.result() if isinstance(out, State) else out

    def __getattr__(self, name: str):
        return getattr(self.task, name)
