"""The 4D device mesh: pipeline × data × ring × Ulysses.

Axes, outermost to innermost: ``pp``, ``dp``, ``ring``, ``ulysses``. Ulysses is innermost so a Ulysses group is
made of adjacent ranks (one node, fast all-to-all); the ring spans nodes. Flattened sub-meshes:

- ``cp`` = ring × ulysses: the ranks that share one sequence (context parallelism; same batch, same parameters).
- ``dp_cp`` = dp × ring × ulysses: the ranks FSDP shards parameters over, and the ranks the loss's token count and
  the gradients are reduced over (context-parallel ranks hold the same parameters, so they take part in sharding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp", "ring", "ulysses")
FLATTENED = {"cp": ("ring", "ulysses"), "dp_cp": ("dp", "ring", "ulysses")}


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees; their product must equal the world size."""

    pp: int = 1
    dp: int = 1
    ring: int = 1
    ulysses: int = 1

    def check(self, world_size: int) -> None:
        """Raise one clear error for degrees that cannot run on ``world_size`` processes: call it before any process
        group work."""
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"parallel.{axis}={getattr(self, axis)} must be >= 1")
        product = self.pp * self.dp * self.ring * self.ulysses
        if product != world_size:
            raise ValueError(
                f"pp x dp x ring x ulysses = {self.pp} x {self.dp} x {self.ring} x {self.ulysses} = {product}, but "
                f"the job has {world_size} processes: make the degrees multiply to the world size"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The 4D mesh with dims ``AXES`` plus the flattened ``cp`` and ``dp_cp`` sub-meshes (module docstring).

        The default process group must be initialised; every rank must call this.
        """
        options = default_group_options(device_type)
        mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp, self.ring, self.ulysses),
            mesh_dim_names=AXES,
            backend_override=dict.fromkeys(AXES, options),
        )
        for name in FLATTENED:
            mesh[FLATTENED[name]]._flatten(name, backend_override=options)
        return mesh


def default_group_options(device_type: str) -> object:
    """Options for the mesh's groups with the default process group's timeout (``train.timeout_s``), of its
    backend's type. Without them torch creates those groups with its own default timeout (30 minutes for gloo, 10
    for NCCL), and a rank waiting on the ring or Ulysses group for a lost peer would wait that long."""
    default = dist.distributed_c10d._get_default_group()._get_backend(torch.device(device_type)).options
    options = type(default)()
    options._timeout = default._timeout
    return options


def flat_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The flattened sub-mesh ``name`` (``cp`` or ``dp_cp``) of a mesh made by ``ParallelDims.build_mesh``."""
    return mesh[FLATTENED[name]]._flatten(name)
