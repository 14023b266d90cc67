"""A step is one declared function.

```python
@step("tokenizer", version=1)
def train_tokenizer(cfg: TokenizerConfig, corpus: Path, out: Path) -> Metrics:
    ...
```

The declaration reads the signature: the first parameter is the step's typed config (a pydantic
model), ``out`` is the directory to fill, and every other parameter is a named input: ``Path``
(one upstream output), ``list[Path]`` (several), ``Path | None`` (optional) or ``RawFiles`` (raw
files outside the store, hashed by content). The output's address hashes exactly that config
(less its ``versioned: False`` fields) and those inputs' hashes, so nothing the function can
read is missing from its cache key. The executor turns a ``Step`` into a Prefect task; called
directly, it is the plain function.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from llmflow.tasks.framework import lineage
from llmflow.tasks.framework.audit import recording
from llmflow.tasks.framework.concurrency import gpu_slot
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.hashing import relative_names, step_hash
from llmflow.tasks.framework.reporting import (  # noqa: F401 (steps import the reports from here)
    _Running,
    _running,
    checkpoint_saved,
    report_markdown,
    report_table,
)
from llmflow.tasks.framework.store import SHARDS_DIR, Store, now

Metrics = dict[str, Any]
OUT = "out"


class RawFiles(tuple):
    """URIs of raw files a step reads from outside the store (each file's sha256 and its path
    relative to the files' common folder enter the hash)."""


@dataclass(frozen=True)
class InputSpec:
    """One named input of a step, read from its annotation."""

    name: str
    kind: str  # "one", "many" or "raw"
    optional: bool


@dataclass
class StepResult:
    """What the executor gets back from a step: the output's URI and how it was obtained."""

    step: str
    uri: str
    hash: str
    cached: bool
    seconds: float
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    row: dict[str, Any] | None = None  # a shard's lineage row (its stage's record gathers them)


@dataclass
class Mapped:
    """A mapped step's stage output: its shards' results, in the upstream's order.

    ``uri`` and ``hash`` are the stage output's (``{root}/{step}/{name}-{hash}``); each shard's
    result has the URI ``{uri}/shards/{label}`` and the hash ``{hash}/{label}``.
    """

    labels: list[str]
    results: list[StepResult]
    seconds: float | None = None  # the stage's wall time (None: the shards' seconds summed)
    uri: str = ""
    hash: str = ""

    def summary(self, label: str) -> StepResult:
        """One row for all shards: the stage's output, cached only if every shard was, and the
        stage's wall time (summed shard seconds overstate a parallel stage many times over)."""
        last = self.results[-1] if self.results else StepResult(label, self.uri, self.hash, True, 0)
        return replace(
            last,
            step=f"{label} ({len(self.results)} shards)",
            uri=self.uri or last.uri,
            hash=self.hash or last.hash,
            cached=all(r.cached for r in self.results),
            seconds=self.seconds
            if self.seconds is not None
            else sum(r.seconds for r in self.results),
        )


@dataclass(frozen=True, eq=False)
class Step:
    """A declared step: its name in the store, code version, config type and inputs."""

    name: str
    version: int
    fn: Callable[..., Metrics | None]
    config_type: type[BaseModel]
    inputs: tuple[InputSpec, ...]
    retries: int = 2
    gpu: bool = False
    execution: tuple[str, ...] = ()
    data_engine: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Metrics | None:
        return self.fn(*args, **kwargs)

    @property
    def doc(self) -> str:
        return (inspect.getdoc(self.fn) or "").split("\n", 1)[0]

    def address(
        self, store: Store, config: BaseModel, name: str, inputs: dict[str, Any]
    ) -> tuple[str, str, dict[str, Any]]:
        """The (uri, hash, input hashes) of this step's output for these arguments."""
        self.check_config(config)
        hashes = {key: _input_hash(store, value) for key, value in inputs.items()}
        digest = step_hash(self.name, str(self.version), config, hashes)
        return store.uri(self.name, name, digest), digest, hashes

    def check_config(self, config: BaseModel) -> None:
        if not isinstance(config, self.config_type):
            raise BadInputError(
                f"step {self.name!r} takes a {self.config_type.__name__}, "
                f"not a {type(config).__name__}"
            )

    def run(
        self,
        store: Store,
        config: BaseModel,
        name: str,
        inputs: dict[str, Any] | None = None,
        run_info: dict[str, Any] | None = None,
        reads: set[str] | None = None,
    ) -> StepResult:
        """Run through the store: skip if the output exists, else build it and commit it.

        Args:
            store: Where outputs live.
            config: The step's config (an instance of ``config_type``).
            name: The output's label, the second path component (``quickstart-stage1``).
            inputs: By input name: an upstream URI, a list of them, a ``Shard`` of an upstream
                output, or ``RawFiles``.
            run_info: Extra lineage fields (the Prefect flow-run id).
            reads: When given, the function gets a config that adds each field it reads here
                (see ``audit.py``).
        """
        inputs = {k: v for k, v in (inputs or {}).items() if v is not None}
        started = time.perf_counter()
        uri, digest, hashes = self.address(store, config, name, inputs)
        if store.is_complete(uri):
            return self._cached(store, uri, digest, started)
        with store.workdir(self.name, name, digest) as work:
            if store.is_complete(uri):  # another run finished it while we waited for the lock
                return self._cached(store, uri, digest, started)
            running = _Running(
                self.name, on_checkpoint=lambda: store.sync_partial(self.name, name, digest, work)
            )
            started_at = now()
            metrics = self._call(store, config, inputs, work, running, reads)
            record = lineage.record(
                step=self.name,
                name=name,
                digest=digest,
                uri=uri,
                version=str(self.version),
                config=config,
                inputs=_lineage_inputs(inputs, hashes),
                run=run_info or {},
                started_at=started_at,
                metrics=metrics,
            )
            (work / lineage.LINEAGE_FILE).write_text(lineage.dumps(record))
            store.commit(work, uri, self.name, name, digest)
        seconds = time.perf_counter() - started
        return StepResult(self.name, uri, digest, False, seconds, metrics, running.artifacts)

    def _call(
        self,
        store: Store,
        config: BaseModel,
        inputs: dict[str, Any],
        work: Path,
        running: _Running,
        reads: set[str] | None,
    ) -> Metrics:
        """The function itself on local views of its inputs, filling ``work`` (a gpu step holds
        its slot); its metrics."""
        slot = gpu_slot() if self.gpu else contextlib.nullcontext()
        with slot, _running(running):
            local = {k: _local(store, v) for k, v in inputs.items()}
            seen = config if reads is None else recording(config, reads)
            return self.fn(seen, **local, **{OUT: work}) or {}

    def _cached(self, store: Store, uri: str, digest: str, started: float) -> StepResult:
        metrics = store.read_lineage(uri).get("metrics", {})
        return StepResult(self.name, uri, digest, True, time.perf_counter() - started, metrics)

    def run_stage(
        self,
        store: Store,
        config: BaseModel,
        name: str,
        inputs: dict[str, Any],
        mapped: str,
        shards: list[tuple[str, dict[str, Any]]],
        run_shards: Callable[[str, list[tuple[str, dict[str, Any]]]], list[StepResult]],
        run_info: dict[str, Any] | None = None,
    ) -> Mapped:
        """A mapped step's stage output: skipped if complete, else every shard, then the commit.

        Args:
            store: Where outputs live.
            config: The step's config.
            name: The stage output's label.
            inputs: The stage's inputs, the mapped one as its whole upstream output (a stage
                output, or an output whose ``shards/*.parquet`` are the shards): they make the
                stage's address, known before any shard runs.
            mapped: The name of the mapped input.
            shards: (label, inputs) of each shard, its mapped input one element.
            run_shards: Runs ``shards`` into the stage at the given URI (``run_shard`` each, on
                an engine or one by one) and gives their results in order.
            run_info: Extra lineage fields (the Prefect flow-run id).
        """
        inputs = {k: v for k, v in inputs.items() if v is not None}
        started = time.perf_counter()
        uri, digest, hashes = self.address(store, config, name, inputs)
        if store.is_complete(uri):
            return self.cached_stage(store, uri, digest, started)
        started_at = now()
        results = run_shards(uri, shards)
        rows = [r.row or store.shard_row(r.uri) for r in results]
        files = {
            f"{SHARDS_DIR}/{row['label']}/{rel}": entry
            for row in rows
            for rel, entry in row.get(lineage.FILES_KEY, {}).items()
        }
        record = lineage.record(
            step=self.name,
            name=name,
            digest=digest,
            uri=uri,
            version=str(self.version),
            config=config,
            inputs=_lineage_inputs(inputs, hashes, mapped),
            run=run_info or {},
            started_at=started_at,
            metrics={"num_shards": len(rows), "cached_shards": sum(r.cached for r in results)},
        )
        record["shards"] = [{k: v for k, v in r.items() if k != lineage.FILES_KEY} for r in rows]
        record[lineage.FILES_KEY] = files
        store.commit_stage(uri, record)
        seconds = time.perf_counter() - started
        return Mapped([label for label, _ in shards], results, seconds, uri, digest)

    def cached_stage(self, store: Store, uri: str, digest: str, started: float) -> Mapped:
        """A complete stage output as its shards' cached results (read from its record)."""
        rows = store.read_lineage(uri).get("shards", [])
        results = [
            StepResult(
                self.name,
                Store.shard_uri(uri, row["label"]),
                f"{digest}/{row['label']}",
                True,
                0.0,
                row.get("metrics", {}),
            )
            for row in rows
        ]
        labels = [row["label"] for row in rows]
        return Mapped(labels, results, time.perf_counter() - started, uri, digest)

    def run_shard(
        self,
        store: Store,
        config: BaseModel,
        stage: str,
        label: str,
        inputs: dict[str, Any],
        reads: set[str] | None = None,
    ) -> StepResult:
        """One shard of the stage output at ``stage``, through the store: skipped if its marker
        exists, else computed in its own locked working directory and committed on its own."""
        inputs = {k: v for k, v in inputs.items() if v is not None}
        started = time.perf_counter()
        uri = Store.shard_uri(stage, label)
        digest = f"{Store.address_of(stage)[2]}/{label}"
        if store.is_complete(uri):
            return self._cached_shard(store, uri, digest, started)
        with store.shard_workdir(stage, label) as work:
            if store.is_complete(uri):  # another run finished it while we waited for the lock
                return self._cached_shard(store, uri, digest, started)
            running = _Running(self.name)
            started_at = now()
            metrics = self._call(store, config, inputs, work, running, reads)
            row = {
                "label": label,
                "inputs": {k: _input_uri(v) for k, v in inputs.items() if not isinstance(v, list)},
                "host": lineage.host_info()["hostname"],
                "started_at": started_at,
                "ended_at": now(),
                "metrics": metrics,
            }
            row = store.commit_shard(work, uri, row)
        seconds = time.perf_counter() - started
        return StepResult(self.name, uri, digest, False, seconds, metrics, running.artifacts, row)

    def _cached_shard(self, store: Store, uri: str, digest: str, started: float) -> StepResult:
        row = store.shard_row(uri)
        return StepResult(
            self.name,
            uri,
            digest,
            True,
            time.perf_counter() - started,
            row.get("metrics", {}),
            row=row,
        )


@dataclass(frozen=True)
class Shard:
    """One shard file (``shards/<name>``) of an upstream output: the unit of a mapped step."""

    uri: str
    name: str


def _input_hash(store: Store, value: Any) -> Any:
    if isinstance(value, RawFiles):
        # NOTE: each file's relative path with its bytes: a step may read meaning from a name
        # (ToxiGen's labels), so a renamed file must be another input, never a Cached output
        return {
            "raw": [
                [name, lineage.source_record(uri)["sha256"]]
                for name, uri in zip(relative_names(value), value, strict=True)
            ]
        }
    if isinstance(value, Shard):
        return f"{store.input_hash(value.uri)}/{value.name}"
    if isinstance(value, list):
        return [store.input_hash(v) for v in value]
    return store.input_hash(value)


def _local(store: Store, value: Any) -> Any:
    if isinstance(value, RawFiles):
        return value
    if isinstance(value, Shard):
        return store.local_path(value.uri) / "shards" / value.name
    if isinstance(value, list):
        return [store.local_path(v) for v in value]
    return store.local_path(value)


def _input_uri(value: Any) -> Any:
    """An input as a shard's lineage row names it: a URI, or an upstream output's file."""
    if isinstance(value, Shard):
        return {"uri": value.uri, "file": f"shards/{value.name}"}
    return list(value) if isinstance(value, RawFiles) else value


def _lineage_inputs(
    inputs: dict[str, Any], hashes: dict[str, Any], mapped: str | None = None
) -> dict[str, list[dict]]:
    """The lineage record's upstream outputs and raw sources. Shards of one stage output are
    that stage, listed once with their count (2,000 shards are one upstream, not 2,000)."""
    upstream, sources = [], []
    for key, value in inputs.items():
        if isinstance(value, RawFiles):
            sources += [lineage.source_record(uri) for uri in value]
        elif isinstance(value, list):
            upstream += _grouped(key, value, hashes[key])
        else:
            uri = value.uri if isinstance(value, Shard) else value
            entry = {"name": key, "uri": uri, "hash": hashes[key]}
            upstream.append({**entry, "mapped": True} if key == mapped else entry)
    return {"inputs": upstream, "sources": sources}


def _grouped(key: str, uris: list[str], hashes: list[str]) -> list[dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    for uri, digest in zip(uris, hashes, strict=True):
        shard = Store.split_shard(uri)
        if shard is None:
            entries[uri] = {"name": key, "uri": uri, "hash": digest}
            continue
        stage = entries.setdefault(
            shard[0], {"name": key, "uri": shard[0], "hash": digest.rsplit("/", 1)[0], "shards": 0}
        )
        stage["shards"] += 1
    return list(entries.values())


def _input_spec(name: str, annotation: Any, default: Any) -> InputSpec:
    optional = default is None
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation, optional = args[0], True
    if annotation is Path:
        return InputSpec(name, "one", optional)
    if annotation is RawFiles:
        return InputSpec(name, "raw", optional)
    if typing.get_origin(annotation) is list and typing.get_args(annotation) == (Path,):
        return InputSpec(name, "many", optional)
    raise TypeError(
        f"input {name!r}: annotate it Path, list[Path], RawFiles or one of those | None"
    )


def step(
    name: str,
    version: int = 1,
    *,
    retries: int = 2,
    gpu: bool = False,
    execution: tuple[str, ...] = (),
    data_engine: bool = False,
):
    """Declare ``fn(cfg: XConfig, <inputs>, out: Path) -> Metrics`` as the step ``name``.

    Args:
        name: The step's folder in the store (``{root}/{name}/{label}-{hash}``).
        version: Bump it when the function's output changes for the same config and inputs.
        retries: Retries on transient failure (a ``BadInputError``, which a trainer's
            deterministic failure is too, and a full disk are never retried).
        gpu: Hold a slot of the ``gpu`` global concurrency limit while running.
        execution: Config fields (dotted paths) the function reads although the hash leaves
            them out (``versioned: False``: worker counts, log intervals). They must not change
            the output; the read audit fails on any other read outside the hash.
        data_engine: The function spreads its own work over the run's backend
            (`backend.current`): the executor makes the runner's backend active while it runs
            (under ``runner.kind: ray`` the cluster starts then, not only before a mapped stage).
    """

    def declare(fn: Callable[..., Metrics | None]) -> Step:
        hints = typing.get_type_hints(fn)
        params = list(inspect.signature(fn).parameters.values())
        if len(params) < 2 or hints.get(OUT) is not Path:
            raise TypeError(f"step {name!r}: the signature must be (cfg, <inputs>..., out: Path)")
        config_type = hints.get(params[0].name)
        if not (isinstance(config_type, type) and issubclass(config_type, BaseModel)):
            raise TypeError(f"step {name!r}: the first parameter must be a pydantic config")
        named = [p for p in params[1:] if p.name != OUT]
        inputs = tuple(_input_spec(p.name, hints.get(p.name), p.default) for p in named)
        return Step(
            name, version, fn, config_type, inputs, retries, gpu, tuple(execution), data_engine
        )

    return declare
