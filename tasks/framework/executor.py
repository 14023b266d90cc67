"""One executor for any graph of steps: in-process (tests, benchmarks) or on Prefect.

Each node runs through its step's store address, so a node whose output exists is skipped (and
shows as Cached in Prefect, whose cache key is the same content hash). A mapped node is one
stage output whose address is known before its shards run; it fans out over the shards of its
input, each shard committed on its own inside it; one failing shard retries alone. On
Prefect, a mapped node is one task for the whole stage, its shards on the run's backend
(``RunnerConfig``: threads, processes or Ray; ``engine.py``, ``backend.py``), so a run of
10,000 shards makes O(stages) task runs. Prefect is imported here and in ``flows/`` only.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmflow.tasks.framework.audit import unhashed_reads
from llmflow.tasks.framework.backend import active
from llmflow.tasks.framework.graph import Existing, Graph, Node, Raw
from llmflow.tasks.framework.step import Mapped, RawFiles, Shard, Step, StepResult
from llmflow.tasks.framework.store import Store

log = logging.getLogger("llmflow.executor")


@dataclass
class Outcome:
    """A run of a graph: each node's result, in run order, and the nodes that failed."""

    results: dict[Node, StepResult | Mapped]
    failed: dict[Node, BaseException]

    def __getitem__(self, node: Node) -> StepResult | Mapped:
        return self.results[node]

    def rows(self) -> list[StepResult]:
        """One summary row per node, in run order (a mapped node folds its shards)."""
        return [
            r.summary(n.step.name) if isinstance(r, Mapped) else r for n, r in self.results.items()
        ]


class Executor:
    """Runs the nodes of a graph in order, in this process (a mapped node's shards one by one,
    or on ``engine``: a thread or process pool, or Ray; see ``engine.py``)."""

    def __init__(
        self, root: str, *, keep_going: bool = False, audit: bool = False, engine: Any = None
    ):
        self.store = Store(root)
        self.keep_going = keep_going
        self.reads: dict[str, set[str]] | None = {} if audit else None
        self.engine = engine

    def run(self, graph: Graph) -> Outcome:
        """Run every node whose output is not yet in the store; return every node's result.

        With ``keep_going``, a failing node (whatever the error, bad input included: a checkpoint
        that does not load) is recorded and the nodes that do not depend on it still run
        (scheduled evaluation: one bad checkpoint must not block the others).
        """
        outcome = Outcome({}, {})
        for node in graph.nodes:
            if any(up in outcome.failed for up in node.upstream()):
                outcome.failed[node] = RuntimeError(f"upstream of {node.label} failed")
                continue
            try:
                outcome.results[node] = self._run_node(node, outcome.results)
            except Exception as err:
                if not self.keep_going:
                    raise
                log.error("%s failed: %s", node.label, err)
                outcome.failed[node] = err
        return outcome

    def _run_node(self, node: Node, done: dict[Node, Any]) -> StepResult | Mapped:
        inputs = {k: self._resolve(v, done) for k, v in node.inputs.items()}
        if node.map_over is None:
            return self.call(node.step, node.config, node.name, inputs)
        source = node.inputs[node.map_over]
        if isinstance(source, Node) and isinstance(done[source], Mapped):
            upstream = done[source]
            labels, elements, whole = upstream.labels, inputs[node.map_over], upstream.uri
        else:
            whole = inputs[node.map_over]
            labels, elements = self._shards(whole)
        per_shard = [
            (label, {**inputs, node.map_over: element})
            for label, element in zip(labels, elements, strict=True)
        ]
        stage_inputs = {**inputs, node.map_over: whole}
        return self.stage(node.step, node.config, node.name, stage_inputs, node.map_over, per_shard)

    def stage(
        self,
        step: Step,
        config: Any,
        name: str,
        inputs: dict[str, Any],
        mapped: str,
        per_shard: list[tuple[str, dict]],
    ) -> Mapped:
        """A mapped step's stage output (``Step.run_stage``), its shards run by ``map``."""

        def run_shards(uri: str, shards: list[tuple[str, dict]]) -> list[StepResult]:
            size = functools.partial(self.store.output_bytes, inputs[mapped])
            return self.map(step, config, uri, shards, size)

        return step.run_stage(
            self.store, config, name, inputs, mapped, per_shard, run_shards, self.run_info()
        )

    def run_info(self) -> dict[str, Any]:
        """Extra lineage fields of the outputs this executor commits itself (a stage's)."""
        return {}

    def _resolve(self, value: Any, done: dict[Node, Any]) -> Any:
        """An input as the step takes it: a URI, a list of URIs, or raw files."""
        if isinstance(value, list):
            return [u for v in value for u in _as_list(self._resolve(v, done))]
        if isinstance(value, Existing):
            return value.uri
        if isinstance(value, Raw):
            return RawFiles(value.files)
        result = done[value]
        return [r.uri for r in result.results] if isinstance(result, Mapped) else result.uri

    def _shards(self, uri: str) -> tuple[list[str], list[Shard]]:
        """The shard files of one output (``shards/*.parquet``), the unit a mapped step runs on."""
        shards = [s for s in self.store.listdir(uri, "shards") if s.endswith(".parquet")]
        return [s.removesuffix(".parquet") for s in shards], [Shard(uri, s) for s in shards]

    def call(self, step: Step, config: Any, name: str, inputs: dict[str, Any]) -> StepResult:
        """Run one step through the store."""
        reads = None if self.reads is None else self.reads.setdefault(step.name, set())
        if self.engine is None or not step.data_engine:
            return step.run(self.store, config, name, inputs, reads=reads)
        with active(self.engine.backend):  # the step maps its own units on the engine's backend
            return step.run(self.store, config, name, inputs, reads=reads)

    def unhashed_reads(self, graph: Graph) -> dict[str, list[str]]:
        """After an audited run: per step, the config fields read that its hash leaves out."""
        steps = {n.step.name: n.step for n in graph.nodes}
        found = {
            name: unhashed_reads(steps[name].config_type, reads, steps[name].execution)
            for name, reads in (self.reads or {}).items()
        }
        return {name: bad for name, bad in found.items() if bad}

    def map(
        self,
        step: Step,
        config: Any,
        stage: str,
        per_shard: list[tuple[str, dict]],
        input_bytes: Callable[[], int | None] | None = None,
    ) -> list[StepResult]:
        """Run one step once per shard into the stage output at ``stage`` (``input_bytes()``: the
        size of its mapped input, which may choose the engine's backend)."""
        if self.engine is not None and self.reads is None:
            from llmflow.tasks.framework.engine import Progress

            progress = Progress(f"{step.name} {Store.address_of(stage)[1]}", len(per_shard))
            root = self.store.root
            return self.engine.run_stage(
                step, config, root, stage, per_shard, progress, input_bytes
            )
        reads = None if self.reads is None else self.reads.setdefault(step.name, set())
        return [
            step.run_shard(self.store, config, stage, label, inputs, reads=reads)
            for label, inputs in per_shard
        ]


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


class NotCached(Exception):
    """A step's output is not in the store (the cached-only walk stops there)."""


class CachedOnly(Executor):
    """The walk without computing anything: every node's cached result when every output is
    already in the store; ``NotCached`` at the first that is not. No Prefect, no API."""

    def call(self, step: Step, config: Any, name: str, inputs: dict[str, Any]) -> StepResult:
        started = time.perf_counter()
        present = {k: v for k, v in inputs.items() if v is not None}
        uri, digest, _ = step.address(self.store, config, name, present)
        if not self.store.is_complete(uri):
            raise NotCached(uri)
        return step._cached(self.store, uri, digest, started)

    def map(self, step: Step, config: Any, stage: str, per_shard: list, *_: Any) -> list:
        raise NotCached(stage)  # only reached when the stage output is not complete


def all_cached(graph: Graph, root: str) -> Outcome | None:
    """Every node's result if the whole graph is in the store, else None (nothing computed)."""
    try:
        return CachedOnly(root).run(graph)
    except NotCached:
        return None


class PrefectExecutor(Executor):
    """The same walk, each step a Prefect task: retries, Cached states, events and artifacts.

    A mapped step is one task per stage running its shards on the backend of ``runner`` (a
    ``RunnerConfig``; None: its defaults, a thread pool). Steps that map their own units run
    them on that backend too (`backend.current`).
    """

    def __init__(self, root: str, *, keep_going: bool = False, runner: Any = None):
        super().__init__(root, keep_going=keep_going)
        self._tasks: dict[int, Callable] = {}
        if runner is None:
            from llmflow.tasks.config import RunnerConfig

            runner = RunnerConfig()
        self.runner = runner
        self._engine = None
        self._stage_tasks: dict[int, Callable] = {}

    def run(self, graph: Graph) -> Outcome:
        try:
            return super().run(graph)
        finally:
            if self._engine is not None:
                self._engine.close()
                self._engine = None

    def task(self, step: Step):
        if id(step) not in self._tasks:
            from llmflow.tasks.framework.prefect_task import step_task

            self._tasks[id(step)] = step_task(step)
        return self._tasks[id(step)]

    def call(self, step: Step, config: Any, name: str, inputs: dict[str, Any]) -> StepResult:
        upstream = self._upstream([inputs])
        run = self.task(step)
        if not step.data_engine:
            return run(config, inputs=inputs, root=self.store.root, name=name, upstream=upstream)
        # the step maps its own units (ingest's files) on the run's backend
        with active(self.engine_started().backend):
            return run(config, inputs=inputs, root=self.store.root, name=name, upstream=upstream)

    def run_info(self) -> dict[str, Any]:
        from llmflow.tasks.framework.prefect_task import run_info

        return run_info()

    def _upstream(self, inputs: list[dict[str, Any]]) -> list[str]:
        """The assets the inputs come from: a stage output's shards as that one stage."""
        from llmflow.tasks.framework.prefect_task import input_uris

        return list(dict.fromkeys(u for one in inputs for u in input_uris(one)))

    def stage(
        self,
        step: Step,
        config: Any,
        name: str,
        inputs: dict[str, Any],
        mapped: str,
        per_shard: list[tuple[str, dict]],
    ) -> Mapped:
        """ONE Prefect task for the stage, its shards on the runner's backend."""
        from llmflow.tasks.framework.prefect_task import stage_task

        self.engine_started()
        if id(step) not in self._stage_tasks:
            self._stage_tasks[id(step)] = stage_task(step, self._engine)
        return self._stage_tasks[id(step)](
            config,
            inputs=inputs,
            mapped=mapped,
            shards=per_shard,
            root=self.store.root,
            name=name,
            upstream=self._upstream([inputs]),
        )

    def engine_started(self) -> Any:
        """The runner's engine, started at its first use (a Ray cluster starts here)."""
        from llmflow.tasks.framework.engine import make_engine

        if self._engine is None:
            self._engine = make_engine(self.runner)
        return self._engine
