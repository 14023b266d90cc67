"""The parallel layout of a trainer run: ``pretrain.train.parallel``.

``dp_replicate x dp_shard x tp x cp x pp`` must equal the world size; ``dp_shard: -1`` takes what
the others leave. Every check that can fail names the field and the values, and runs before any
compute: ``ParallelConfig.resolve`` checks the product, ``support.check_layout`` the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.framework.errors import ConfigError
from llmflow.tasks.framework.hashing import ADDED
from llmflow.tasks.pretrain.parallel.support import PARALLEL_FIELD, StageShape, check_layout

if TYPE_CHECKING:
    from llmflow.model.config import ModelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimension names, outermost first: PP spans nodes, TP ranks are neighbours in a node."""
EP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
"""The mesh's dimensions under expert parallelism (``ep > 1``): ``dp_shard`` split into
``dp_shard_mod_ep x ep`` (torchtitan's names); the EP ranks are the inner, neighbouring ones."""


class ParallelConfig(BaseModel):
    """Degrees of each parallelism. Their product is the world size."""

    model_config = ConfigDict(extra="forbid")

    dp_replicate: int = Field(1, ge=1, description="Data-parallel replicas (HSDP's outer dim).")
    dp_shard: int = Field(
        -1, description="FSDP2 shards per replica; -1 takes the world size the others leave."
    )
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (with sequence parallelism).")
    cp: int = Field(1, ge=1, description="Context-parallel degree (sequence sharded over ranks).")
    pp: int = Field(1, ge=1, description="Pipeline-parallel stages.")
    pp_schedule: Literal["gpipe", "1f1b"] = Field(
        "1f1b", description="Pipeline schedule: GPipe (all forwards, then all backwards) or 1F1B."
    )
    ep: int = Field(
        1,
        ge=1,
        description="Expert-parallel degree (mixture of experts): each sparse layer's experts "
        "split over ep ranks carved from dp_shard, which it must divide.",
        json_schema_extra=ADDED,  # at 1, in no hash and no card's recipe: addresses stay
    )

    def resolve(
        self,
        world_size: int,
        model: ModelConfig | None = None,
        seq_len: int | None = None,
        micro_batches: int | None = None,
        *,
        optimizer: str | None = None,
        compile: bool = False,
        field: str = PARALLEL_FIELD,
    ) -> Layout:
        """The degrees at ``world_size``, accepted by :func:`support.check_layout` for the
        model, optimizer, compile, sequence length and micro-batches given (None: unchecked).

        Raises:
            ConfigError: the degrees do not multiply to the world size, or the layout is one
                the trainer does not run (``support.check_layout``); the message names the
                field (``field``: where this layout is set).
        """
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(f"{field}.dp_shard={self.dp_shard}: must be >= 1, or -1 (the rest)")
        fixed = self.dp_replicate * self.tp * self.cp * self.pp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"{field}: dp_replicate x tp x cp x pp = {fixed} does not divide the world "
                    f"size {world_size}"
                )
            dp_shard = world_size // fixed
        if fixed * dp_shard != world_size:
            raise ConfigError(
                f"{field}: dp_replicate={self.dp_replicate} x dp_shard={dp_shard} x tp={self.tp}"
                f" x cp={self.cp} x pp={self.pp} = {fixed * dp_shard} differs from the world "
                f"size {world_size}"
            )
        layout = Layout(
            self.dp_replicate, dp_shard, self.tp, self.cp, self.pp, self.pp_schedule, self.ep
        )
        check_layout(
            layout,
            model,
            optimizer=optimizer,
            compile=compile,
            stages=[StageShape(seq_len, micro_batches)],
            field=field,
        )
        return layout


@dataclass(frozen=True)
class Layout:
    """Resolved degrees (``dp_shard`` filled in)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    ep: int = 1
    """Expert-parallel degree, carved from ``dp_shard`` (``dp_shard = dp_shard_mod_ep x ep``)."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel size: the ranks that read different sequences (sets the global batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_mod_ep(self) -> int:
        """The FSDP2 shards of each expert: ``dp_shard / ep`` (``dp_shard`` when ep is 1)."""
        return self.dp_shard // self.ep

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's sizes along :attr:`mesh_dims`."""
        if self.ep > 1:
            return (self.pp, self.dp_replicate, self.dp_shard_mod_ep, self.ep, self.cp, self.tp)
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The mesh's dimension names: :data:`MESH_DIMS`, or :data:`EP_MESH_DIMS` with EP."""
        return EP_MESH_DIMS if self.ep > 1 else MESH_DIMS

    @property
    def is_plain(self) -> bool:
        """Only data parallelism (the FSDP2 path the trainer always had)."""
        return self.tp == self.cp == self.pp == self.ep == 1 and self.dp_replicate == 1
