"""The one thin layer between declared steps and Prefect: ``step_task`` makes a step a task.

The task's cache key is the output's content hash (only once that output is complete, so a
deleted output is rebuilt rather than served stale). When the store already holds the output,
the task finishes in a ``Cached`` state. Retries cover transient failures (I/O, a killed worker),
never bad input nor a full disk. Each materialized output emits a Prefect asset event with its upstream outputs.

``stage_task`` makes a mapped step one task for the whole stage output: its shards run on an
engine (``engine.py``), and the stage is one asset, linked as one (a Prefect event takes at most
100 related resources: a global step over 2,000 shards links their stage, not each shard).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext, TaskRunContext
from prefect.events import emit_event
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger
from prefect.states import Completed, State

from llmflow.tasks.framework.disk import disk_error
from llmflow.tasks.framework.engine import Progress, ShardCall, StageEngine
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Mapped, Shard, Step, StepResult
from llmflow.tasks.framework.store import Store

MAX_RELATED = 100  # Prefect rejects an event with more related resources
log = logging.getLogger("llmflow.executor")


def asset_key(uri: str) -> str:
    """Prefect asset keys are URIs; local paths become file:// URIs."""
    return uri if "://" in uri else f"file://{uri}"


def _retry_transient(task_obj, task_run, state) -> bool:
    """Retry unless a retry would fail the same way: bad input (a ``BadInputError``, which a
    trainer's deterministic failure is too) or a full disk. Says which, and why, in one line."""
    try:
        state.result()
    except Exception as exc:
        retry = not isinstance(exc, BadInputError) and disk_error(exc) is None
        cause = getattr(exc, "cause", None) or _first_line(exc)
        _run_logger().warning("%s: %s", "retrying" if retry else "not retried", cause)
        return retry
    return True


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The task run's logger (its lines reach the Prefect UI), else this module's."""
    try:
        return get_run_logger()
    except MissingContextError:
        return log


def run_info() -> dict[str, Any]:
    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    return {
        "orchestrator": "prefect",
        "flow_run_id": str(flow_ctx.flow_run.id) if flow_ctx and flow_ctx.flow_run else None,
        "flow_name": flow_ctx.flow.name if flow_ctx else None,
        "task_run_id": str(task_ctx.task_run.id) if task_ctx else None,
    }


def input_uris(inputs: dict[str, Any]) -> list[str]:
    """The upstream outputs among a step's inputs, once each (a shard is its stage output)."""
    upstream = []
    for value in inputs.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, Shard):
                upstream.append(item.uri)
            elif isinstance(item, str):
                shard = Store.split_shard(item)
                upstream.append(item if shard is None else shard[0])
    return list(dict.fromkeys(upstream))


def _related(upstream: list[str]) -> list[dict[str, str]]:
    keys = list(dict.fromkeys(asset_key(u) for u in upstream))
    if len(keys) > MAX_RELATED:  # NOTE: shards not linked as their stage: their steps' folders
        keys = list(dict.fromkeys(k.rstrip("/").rsplit("/", 1)[0] for k in keys))[:MAX_RELATED]
    return [{"prefect.resource.id": k, "prefect.resource.role": "asset"} for k in keys]


def _publish(
    result: StepResult, inputs: dict[str, str | list[str]], upstream: list[str] | None = None
) -> None:
    emit_event(
        event="prefect.asset.materialization.succeeded",
        resource={
            "prefect.resource.id": asset_key(result.uri),
            "prefect.resource.name": result.step,
        },
        related=_related(upstream if upstream is not None else input_uris(inputs)),
        payload={"hash": result.hash, "metrics": result.metrics},
    )
    _publish_artifacts(result.artifacts)


def _publish_artifacts(artifacts: list[dict[str, Any]]) -> None:
    for art in artifacts:
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
        config: Any,
        inputs: dict[str, Any] | None = None,
        root: str = "./runs",
        name: str = "run",
        upstream: list[str] | None = None,
    ):
        result = step.run(Store(root), config, name, inputs, run_info())
        if result.cached:
            return Completed(message=f"output exists: {result.uri}", name="Cached", data=result)
        _publish(result, inputs or {}, upstream)
        return result

    return _step_task(step, run, cache_key_fn=cache_key, persist_result=True)


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


def stage_task(step: Step, engine: StageEngine):
    """Wrap a mapped step as ONE Prefect task for its whole stage output, shards on ``engine``.

    Called as ``t(config, inputs={...}, mapped=NAME, shards=[(label, inputs), ...], root=...,
    name=..., upstream=[...])``; gives the stage's ``Mapped`` (every shard's result in order).
    The task is ``Cached`` when the stage output was complete; a stage committed now is
    Completed with its asset event, even when all its shards were in already. A retry redoes
    only the shards without a commit marker, then commits the stage.
    """

    def run(
        config: Any,
        inputs: dict[str, Any],
        mapped: str,
        shards: list[ShardCall],
        root: str = "./runs",
        name: str = "run",
        upstream: list[str] | None = None,
    ):
        label = f"{step.name} {name}"
        report = _progress_artifact(step.name, name, len(shards))
        ran: list[str] = []

        store = Store(root)

        def run_shards(stage: str, todo: list[ShardCall]) -> list[StepResult]:
            ran.append(stage)
            progress = Progress(label, len(todo), report)
            size = functools.partial(store.output_bytes, inputs[mapped])
            return engine.run_stage(step, config, root, stage, todo, progress, size)

        result = step.run_stage(store, config, name, inputs, mapped, shards, run_shards, run_info())
        # NOTE: run_stage runs the shards only for a stage output that was not complete, and
        # then commits it. Every shard may have been in already (a crash between the last
        # shard's commit and the stage's): the stage output is still new, and its asset too.
        if not ran:
            message = f"stage output exists: {result.uri}"
            return Completed(message=message, name="Cached", data=result)
        _publish_stage(step.name, result, upstream or [])
        return result

    # NOTE: the stage output is checked in the store first thing: no Prefect cache key needed
    return _step_task(step, run, cache_policy=NO_CACHE, persist_result=False)


def _step_task(step: Step, run, label: str = "name", **caching: Any) -> _StepTask:
    """``run`` as the Prefect task of ``step``: its name, retries on transient errors, tags."""
    return _StepTask(
        task(
            run,
            name=step.name,
            description=step.doc,
            task_run_name=f"{step.name}-{{{label}}}",
            retries=step.retries,
            retry_delay_seconds=[2, 10],
            retry_condition_fn=_retry_transient,
            # NOTE: steps log through "llmflow.*"; captured prints would also catch libraries'
            # stdout, e.g. dill's dis.dis() while datasets hashes a function (pages of bytecode).
            log_prints=False,
            tags=["gpu"] if step.gpu else [],
            **caching,
        )
    )


def _progress_artifact(step: str, name: str, total: int) -> Callable[[float], None] | None:
    """A Prefect progress artifact (percent of shards done) and its updater; None outside a task."""
    if TaskRunContext.get() is None:
        return None
    key = f"{step}-{name}-shards".lower().replace("_", "-").replace(".", "-")
    artifact = create_progress_artifact(0.0, key=key, description=f"{step}: {total} shards")

    def report(fraction: float) -> None:
        update_progress_artifact(artifact, 100 * fraction)

    return report


def _publish_stage(step: str, stage: Mapped, upstream: list[str]) -> None:
    """One asset event for the stage output, and each artifact key once."""
    results = stage.results
    emit_event(
        event="prefect.asset.materialization.succeeded",
        resource={"prefect.resource.id": asset_key(stage.uri), "prefect.resource.name": step},
        related=_related(upstream),
        payload={
            "hash": stage.hash,
            "num_shards": len(results),
            "num_cached": sum(r.cached for r in results),
        },
    )
    latest = {a["key"]: a for r in results for a in r.artifacts}  # the last shard's per key
    if len(latest) > MAX_RELATED:
        log.warning("%s: %d artifact keys; publishing the first %d", step, len(latest), MAX_RELATED)
    _publish_artifacts(list(latest.values())[:MAX_RELATED])
