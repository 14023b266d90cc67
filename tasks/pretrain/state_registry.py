"""What a checkpoint holds besides the model and optimizer tensors: a registry of named parts.

A part is any object with ``state_dict()`` and ``load_state_dict(state)`` (``Stateful``). It is
kept in one of two places of a checkpoint folder (``checkpoint.py``):

    trainer_state.json   rank 0's parts, one JSON entry each (run counters, guard, detectors)
    rank-NNNNN.pt        each rank's own parts (RNG, data-loader position)

The model and optimizer are the one DCP part (``checkpoint.py`` writes them sharded, in canonical
tensor-parallel order); everything else is registered here, and one save and one load walk the
registry, synchronous or asynchronous, at every layout.

A trainer component takes part by declaring a ``state_key`` (and ``state_per_rank = True`` when
each rank's state differs); the trainer registers it, nothing else changes. A checkpoint taken
at a step's end holds what the components before the checkpointer (in ``Trainer._components``'s
hook order) made of that step. A checkpoint that lacks a part (written before the part existed)
leaves that part's state as it is.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np
import torch


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class Info:
    """A value recorded in ``trainer_state.json`` for readers of the checkpoint (the optimizer's
    name, the world size); loading it changes nothing."""

    value: Callable[[], Any]

    def state_dict(self) -> Any:
        return self.value()

    def load_state_dict(self, state: Any) -> None:
        """Nothing to restore: the run's own value stands."""


class RngState:
    """This rank's Python, NumPy, torch (and CUDA) generators."""

    def state_dict(self) -> dict[str, Any]:
        state = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


@dataclasses.dataclass
class StateRegistry:
    """Named checkpointed parts: rank 0's (``main``) and each rank's own (``per_rank``)."""

    main: dict[str, Stateful] = dataclasses.field(default_factory=dict)
    per_rank: dict[str, Stateful] = dataclasses.field(default_factory=dict)

    def register(self, name: str, part: Stateful, per_rank: bool = False) -> None:
        """Add ``part`` under ``name`` (unique across both places)."""
        if name in self.main or name in self.per_rank:
            raise ValueError(f"checkpoint state {name!r} is registered twice")
        (self.per_rank if per_rank else self.main)[name] = part

    def register_components(self, components: Iterable[Any]) -> None:
        """Every component that declares a ``state_key``, in hook order."""
        for component in components:
            name = getattr(component, "state_key", None)
            if name:
                self.register(name, component, getattr(component, "state_per_rank", False))

    def main_state(self) -> dict[str, Any]:
        """What rank 0 writes to ``trainer_state.json``."""
        return {name: part.state_dict() for name, part in self.main.items()}

    def rank_state(self) -> dict[str, Any]:
        """What this rank writes to its ``rank-NNNNN.pt``."""
        return {name: part.state_dict() for name, part in self.per_rank.items()}

    def load(
        self,
        main: dict[str, Any],
        rank: dict[str, Any] | None,
        names: Iterable[str] | None = None,
    ) -> list[str]:
        """Restore the parts named (all when None) that the checkpoint holds; the names loaded.

        ``rank`` is None when this rank has no state of its own in the checkpoint (another
        world size wrote it): the per-rank parts keep theirs.
        """
        # NOTE: checkpoints written before the registry kept components under "components".
        main = {**main.get("components", {}), **main}
        wanted = set(self.main) | set(self.per_rank) if names is None else set(names)
        loaded = []
        for states, parts in ((main, self.main), (rank or {}, self.per_rank)):
            for name, part in parts.items():
                if name in wanted and name in states:
                    part.load_state_dict(states[name])
                    loaded.append(name)
        return loaded
