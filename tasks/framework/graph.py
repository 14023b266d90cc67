"""The recipe as data: a graph of steps, in the manner of Marin's executor.

A ``Node`` is one step applied to one config and to its upstream nodes. Nodes are added in
dependency order, so ``Graph.nodes`` is already a valid run order. Partial runs (``--until``),
ablations and scheduled evaluation are queries on a graph or new graphs, not control flow; one
executor (``executor.py``) runs any graph, on Prefect or in-process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Step


@dataclass(frozen=True)
class Existing:
    """A leaf: an output already committed in the store (a checkpoint to evaluate, say)."""

    uri: str


@dataclass(frozen=True)
class Raw:
    """A leaf: raw files outside the store (listed when the recipe is built, hashed when run)."""

    files: tuple[str, ...]


@dataclass(eq=False)
class Node:
    """One step on one config, with its upstream nodes by input name."""

    step: Step
    config: BaseModel
    name: str
    inputs: dict[str, Any] = field(default_factory=dict)
    phase: str = ""
    map_over: str | None = None

    @property
    def label(self) -> str:
        """How summaries name this node: the step and the output label."""
        return f"{self.step.name}:{self.name}"

    def upstream(self) -> list[Node]:
        found = []
        for value in self.inputs.values():
            found += [
                v for v in (value if isinstance(value, list) else [value]) if isinstance(v, Node)
            ]
        return found


class Graph:
    """Nodes in run order; ``phases`` orders the named parts that ``until`` cuts at."""

    def __init__(self, phases: tuple[str, ...] = (), nodes: list[Node] | None = None):
        self.phases = phases
        self.nodes: list[Node] = list(nodes or [])

    def add(
        self,
        step: Step,
        config: BaseModel,
        name: str,
        *,
        phase: str | None = None,
        map_over: str | None = None,
        **inputs: Any,
    ) -> Node:
        """Append ``step`` on ``config`` fed by ``inputs`` (nodes, lists of nodes, leaves).

        ``map_over`` names the input to fan out over: one run per shard of that upstream
        output (or per element, when it is itself mapped). Input names are checked against
        the step's signature here, before anything runs.
        """
        step.check_config(config)
        inputs = {k: v for k, v in inputs.items() if v is not None}
        declared = {spec.name: spec for spec in step.inputs}
        unknown = sorted(set(inputs) - set(declared))
        missing = sorted(k for k, spec in declared.items() if not spec.optional and k not in inputs)
        if unknown or missing:
            raise BadInputError(
                f"step {step.name!r}: unknown inputs {unknown}, missing inputs {missing}"
            )
        if map_over is not None and map_over not in inputs:
            raise BadInputError(f"step {step.name!r}: cannot map over absent input {map_over!r}")
        phase = phase or step.name
        if self.phases and phase not in self.phases:
            raise BadInputError(f"step {step.name!r}: phase {phase!r} is not one of {self.phases}")
        node = Node(step, config, name, inputs, phase, map_over)
        self.nodes.append(node)
        return node

    def find(self, step: str | None = None, phase: str | None = None) -> list[Node]:
        """Nodes of one step name and/or one phase, in run order."""
        return [
            n
            for n in self.nodes
            if (step is None or n.step.name == step) and (phase is None or n.phase == phase)
        ]

    def until(self, phase: str) -> Graph:
        """The nodes of ``phase`` and of every phase before it (with what they need)."""
        if phase not in self.phases:
            raise BadInputError(
                f"until={phase!r} is not a phase; allowed: {', '.join(self.phases)}"
            )
        last = self.phases.index(phase)
        keep = [n for n in self.nodes if self.phases.index(n.phase) <= last]
        return self.closure(keep)

    def closure(self, targets: list[Node]) -> Graph:
        """The sub-graph that produces ``targets``: them and everything upstream, in run order."""
        needed: set[int] = set()
        stack = list(targets)
        while stack:
            node = stack.pop()
            if id(node) not in needed:
                needed.add(id(node))
                stack += node.upstream()
        return Graph(self.phases, [n for n in self.nodes if id(n) in needed])
