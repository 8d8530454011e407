"""The 4D device mesh: pipeline × data × ring × Ulysses.

Axes, outermost to innermost: ``pp``, ``dp``, ``ring``, ``ulysses``. Ulysses is innermost so a Ulysses group is
made of adjacent ranks (one node, fast all-to-all); the ring spans nodes. Flattened sub-meshes:

- ``cp`` = ring × ulysses: the ranks that share one sequence (context parallelism; same batch, same parameters).
- ``dp_cp`` = dp × ring × ulysses: the ranks FSDP shards parameters over, and the ranks the loss's token count and
  the gradients are reduced over (context-parallel ranks hold the same parameters, so they take part in sharding).
"""

from __future__ import annotations

from dataclasses import dataclass

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
        mesh = init_device_mesh(device_type, (self.pp, self.dp, self.ring, self.ulysses), mesh_dim_names=AXES)
        for name in FLATTENED:
            flat_mesh(mesh, name)
        return mesh


def flat_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The flattened sub-mesh ``name`` (``cp`` or ``dp_cp``) of a mesh made by ``ParallelDims.build_mesh``."""
    return mesh[FLATTENED[name]]._flatten(name)
