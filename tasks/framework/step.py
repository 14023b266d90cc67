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
import contextvars
import inspect
import time
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from llmflow.tasks.framework import lineage
from llmflow.tasks.framework.audit import recording
from llmflow.tasks.framework.concurrency import gpu_slot
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.hashing import relative_names, step_hash
from llmflow.tasks.framework.store import Store, now

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


@dataclass
class _Running:
    """The step being run here: where its reports and checkpoint notices go."""

    step: str
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    on_checkpoint: Callable[[], None] = lambda: None


_CURRENT: contextvars.ContextVar[_Running | None] = contextvars.ContextVar("step", default=None)


def report_table(key: str, rows: list[dict[str, Any]], description: str = "") -> None:
    """Publish a table with the step's output (a Prefect table artifact under the executor)."""
    running = _CURRENT.get()
    if running is not None:
        running.artifacts.append(
            {"kind": "table", "key": key, "rows": rows, "description": description}
        )


def report_markdown(key: str, markdown: str, description: str = "") -> None:
    """Publish a markdown report with the step's output."""
    running = _CURRENT.get()
    if running is not None:
        running.artifacts.append(
            {"kind": "markdown", "key": key, "markdown": markdown, "description": description}
        )


def checkpoint_saved() -> None:
    """Tell the store a resumable checkpoint is in the working directory (mirrored on S3)."""
    running = _CURRENT.get()
    if running is not None:
        running.on_checkpoint()


@contextmanager
def _running(running: _Running) -> Iterator[_Running]:
    token = _CURRENT.set(running)
    try:
        yield running
    finally:
        _CURRENT.reset(token)


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
            slot = gpu_slot() if self.gpu else contextlib.nullcontext()
            with slot, _running(running):
                local = {k: _local(store, v) for k, v in inputs.items()}
                seen = config if reads is None else recording(config, reads)
                metrics = self.fn(seen, **local, **{OUT: work}) or {}
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

    def _cached(self, store: Store, uri: str, digest: str, started: float) -> StepResult:
        metrics = store.read_lineage(uri).get("metrics", {})
        return StepResult(self.name, uri, digest, True, time.perf_counter() - started, metrics)


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


def _lineage_inputs(inputs: dict[str, Any], hashes: dict[str, Any]) -> dict[str, list[dict]]:
    """The lineage record's upstream outputs and raw sources."""
    upstream, sources = [], []
    for key, value in inputs.items():
        if isinstance(value, RawFiles):
            sources += [lineage.source_record(uri) for uri in value]
        elif isinstance(value, list):
            upstream += [
                {"name": key, "uri": u, "hash": h} for u, h in zip(value, hashes[key], strict=True)
            ]
        else:
            uri = value.uri if isinstance(value, Shard) else value
            upstream.append({"name": key, "uri": uri, "hash": hashes[key]})
    return {"inputs": upstream, "sources": sources}


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
        retries: Retries on transient failure (a ``BadInputError`` is never retried).
        gpu: Hold a slot of the ``gpu`` global concurrency limit while running.
        execution: Config fields (dotted paths) the function reads although the hash leaves
            them out (``versioned: False``: worker counts, log intervals). They must not change
            the output; the read audit fails on any other read outside the hash.
        data_engine: The function spreads its own work over the data engine when this process
            is connected to one (``distributed_dedup.data_map``): under ``runner.kind: ray`` the
            executor starts the cluster before it runs, not only before a mapped stage.
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
