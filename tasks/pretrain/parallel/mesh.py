"""One named device mesh for every parallelism: ``(pp, dp_replicate, dp_shard, cp, tp)``, or
``(pp, dp_replicate, dp_shard_mod_ep, ep, cp, tp)`` under expert parallelism (``dp_shard`` split).

TP is innermost (contiguous ranks: neighbours inside a node), PP outermost. Flattened views, as
torchtitan names them:

- ``dp``: ``dp_replicate x dp_shard``, the ranks that read different sequences;
- ``dp_shard_cp``: ``dp_shard x cp``, the dimension FSDP2 shards parameters over (CP ranks hold
  the same parameters and their gradients are reduced together);
- ``dp_cp``: ``dp_replicate x dp_shard x cp``, over which the loss's token counts are summed.

Under EP, ``dp_shard`` is itself the flattened ``dp_shard_mod_ep x ep`` and the views above keep
their meaning; ``ep`` shards the experts and ``dp_shard_mod_ep`` is the experts' FSDP2 dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmflow.tasks.pretrain.parallel.config import Layout


@dataclass
class Mesh:
    """The world mesh and this rank's coordinates in it."""

    layout: Layout
    world: DeviceMesh
    flattened: dict[str, DeviceMesh] = field(default_factory=dict)

    def __getitem__(self, name: str) -> DeviceMesh:
        # NOTE: torch >= 2.11 deprecates slicing a flattened dim from the root mesh: the meshes
        # `_flatten` returned are kept here instead.
        if name in self.flattened:
            return self.flattened[name]
        return self.world[name]

    def rank(self, name: str) -> int:
        """This rank's index along a dimension (or a flattened one)."""
        return self[name].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.rank("dp")

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()


def build_mesh(device_type: str, layout: Layout) -> Mesh:
    """Make the world mesh for ``layout`` (the process group must be initialised)."""
    world = init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.mesh_dims)
    shard = ("dp_shard_mod_ep", "ep") if layout.ep > 1 else ("dp_shard",)
    flattened = {
        "dp": world[("dp_replicate", *shard)]._flatten("dp"),
        "dp_shard_cp": world[(*shard, "cp")]._flatten("dp_shard_cp"),
        "dp_cp": world[("dp_replicate", *shard, "cp")]._flatten("dp_cp"),
    }
    if layout.ep > 1:
        flattened["dp_shard"] = world[shard]._flatten("dp_shard")
    return Mesh(layout, world, flattened)
