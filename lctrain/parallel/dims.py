"""The parallel layout of a job, in one object: the degrees of the 4D mesh (pipeline × data × ring × Ulysses) and
the sequence layout, made from ``parallel.*`` (``ParallelConfig.dims()``) and checked when made.

Axes, outermost to innermost: ``pp``, ``dp``, ``ring``, ``ulysses``. Ulysses is innermost so a Ulysses group is
made of adjacent ranks (one node, fast all-to-all); the ring spans nodes. Flattened sub-meshes:

- ``cp`` = ring × ulysses: the ranks that share one sequence (context parallelism; same batch, same parameters).
- ``dp_cp`` = dp × ring × ulysses: the ranks FSDP shards parameters over, and the ranks the loss's token count and
  the gradients are reduced over (context-parallel ranks hold the same parameters, so they take part in sharding).

The rules (sequence divisibility, Ulysses inside a node) and their wording are ``lctrain.rules``'. Importing this
module loads neither torch nor transformers (the planner's layouts are ``ParallelDims``); ``build_mesh`` imports
torch when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lctrain.rules import check_layout, check_sequence_length, check_ulysses_inside_nodes, sequence_divisor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


AXES = ("pp", "dp", "ring", "ulysses")
FLATTENED = {"cp": ("ring", "ulysses"), "dp_cp": ("dp", "ring", "ulysses")}


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees (each >= 1; their product is the job's world size) and the sequence layout."""

    pp: int = 1
    dp: int = 1
    ring: int = 1
    ulysses: int = 1
    # how a sequence is cut over (ring, ulysses): zigzag or contiguous (lctrain.attention.shard_sequence)
    layout: str = field(default="zigzag", kw_only=True)

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"parallel.{axis}={getattr(self, axis)} must be >= 1")
        check_layout(self.layout, setting="parallel.layout")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ring * self.ulysses

    @property
    def cp(self) -> int:
        """The context-parallel ranks of one sequence: ring × ulysses."""
        return self.ring * self.ulysses

    @property
    def dp_cp(self) -> int:
        """The ranks FSDP shards parameters over: dp × ring × ulysses."""
        return self.dp * self.cp

    @property
    def sequence_divisor(self) -> int:
        """What every global sequence length must be a multiple of (``lctrain.rules.sequence_divisor``)."""
        return sequence_divisor(self.layout, self.ring, self.ulysses)

    def degrees(self) -> dict[str, int]:
        """``{"pp": .., "dp": .., "ring": .., "ulysses": ..}``: the mesh a checkpoint records."""
        return {axis: getattr(self, axis) for axis in AXES}

    def __str__(self) -> str:
        return " ".join(f"{axis}={degree}" for axis, degree in self.degrees().items())

    def check_world_size(self, world_size: int) -> None:
        """Raise one clear error for degrees that cannot run on ``world_size`` processes: call it before any process
        group work."""
        if self.world_size != world_size:
            raise ValueError(
                f"pp x dp x ring x ulysses = {self.pp} x {self.dp} x {self.ring} x {self.ulysses} = "
                f"{self.world_size}, but the job has {world_size} processes: make the degrees multiply to the world "
                f"size"
            )

    def check_sequence_length(self, length: int, *, setting: str = "data.seq_len") -> None:
        """``length`` (spelled ``setting`` in the message) is cut whole over the context-parallel ranks."""
        check_sequence_length(length, layout=self.layout, ring=self.ring, ulysses=self.ulysses, setting=setting)

    def check_ulysses_inside_nodes(self, ranks_per_node: int, *, ranks: str = "processes") -> None:
        """Every Ulysses group lies inside one node of ``ranks_per_node`` ranks (``ranks`` names them)."""
        check_ulysses_inside_nodes(self.ulysses, ranks_per_node, ranks=ranks)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The 4D mesh with dims ``AXES`` plus the flattened ``cp`` and ``dp_cp`` sub-meshes (module docstring).

        The default process group must be initialised; every rank must call this.
        """
        from torch.distributed.device_mesh import init_device_mesh

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
    import torch
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()._get_backend(torch.device(device_type)).options
    options = type(default)()
    options._timeout = default._timeout
    return options


def flat_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The flattened sub-mesh ``name`` (``cp`` or ``dp_cp``) of a mesh made by ``ParallelDims.build_mesh``."""
    return mesh[FLATTENED[name]]._flatten(name)
