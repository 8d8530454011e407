"""The parallel layout of a job, in one object: the degrees of the 4D mesh (pipeline × data × ring × Ulysses) and
the sequence layout, made from ``parallel.*`` (``ParallelConfig.dims()``) and checked when made.

Axes, outermost to innermost: ``pp``, ``dp``, ``ring``, ``ulysses``. Ulysses is innermost so a Ulysses group is
made of adjacent ranks (one node, fast all-to-all); the ring spans nodes. Flattened sub-meshes:

- ``cp`` = ring × ulysses: the ranks that share one sequence (context parallelism; same batch, same parameters).
- ``dp_cp`` = dp × ring × ulysses: the ranks FSDP shards parameters over, and the ranks the loss's token count and
  the gradients are reduced over (context-parallel ranks hold the same parameters, so they take part in sharding).

Expert parallelism (``ep``, mixtures of experts) draws its ranks from ``dp_cp``, innermost first:
``JobMesh.experts_mesh`` unflattens ``dp_cp`` into ``(efsdp, ep)``; each ``ep`` group holds all the experts between
its ranks, and FSDP shards the experts over ``efsdp`` (the ranks holding the same ones) instead of ``dp_cp``.

The rules (sequence divisibility, Ulysses inside a node) and their wording are ``lctrain.rules``'. Importing this
module loads neither torch nor transformers (the planner's layouts are ``ParallelDims``); the mesh itself is
``lctrain.parallel.mesh.JobMesh``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lctrain.rules import (
    check_expert_parallel,
    check_layout,
    check_sequence_length,
    check_ulysses_inside_nodes,
    sequence_divisor,
)

AXES = ("pp", "dp", "ring", "ulysses")
FLATTENED = {"cp": ("ring", "ulysses"), "dp_cp": ("dp", "ring", "ulysses")}
EXPERT_AXES = ("efsdp", "ep")  # dp_cp unflattened for the experts (build_expert_mesh)


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees (each >= 1; their product is the job's world size) and the sequence layout."""

    pp: int = 1
    dp: int = 1
    ring: int = 1
    ulysses: int = 1
    # how a sequence is cut over (ring, ulysses): zigzag or contiguous (lctrain.attention.shard_sequence)
    layout: str = field(default="zigzag", kw_only=True)
    # expert parallelism: the experts spread over ep ranks drawn from dp_cp, innermost first (lctrain.parallel.expert)
    ep: int = field(default=1, kw_only=True)

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"parallel.{axis}={getattr(self, axis)} must be >= 1")
        check_layout(self.layout, setting="parallel.layout")
        check_expert_parallel(self.ep, self.dp_cp)

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
    def efsdp(self) -> int:
        """The ranks FSDP shards the experts over: those of ``dp_cp`` holding the same experts, dp_cp / ep."""
        return self.dp_cp // self.ep

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
