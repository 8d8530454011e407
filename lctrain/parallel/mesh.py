"""The job's device mesh and the process groups cut from it, made once and passed to every part that communicates.

``JobMesh.build`` makes the 4D mesh of ``ParallelDims`` (axes, outermost to innermost, ``pp``, ``dp``, ``ring``,
``ulysses``; ``lctrain.parallel.dims``) with its flattened sub-meshes, and holds what the rest of the job asks of
it: this rank's ``SequencePlace`` (its part of every sequence) and the groups each reduction runs over:

- ``dp_cp`` (dp × ring × ulysses): FSDP shards the parameters and sums their gradients over it; the loss's counts
  and the metrics are reduced over it;
- ``cp`` (ring × ulysses, None when 1): the ranks of one sequence (a mixture of experts' per-row router statistics,
  a preference pair's sums);
- ``dp``: the ranks holding different rows (the loader's skipped counts);
- ``pp`` (None when 1): the pipeline stages (the gradient norm's reduction).

``experts_mesh`` unflattens ``dp_cp`` into ``(efsdp, ep)`` for expert parallelism. Every rank must build the mesh
(the default process group initialised first), and each group carries the default group's timeout
(``train.timeout_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lctrain.attention import SequencePlace
from lctrain.parallel.dims import AXES, EXPERT_AXES, FLATTENED, ParallelDims


@dataclass(frozen=True)
class JobMesh:
    """The mesh of ``dims`` on this rank, and its groups (module docstring)."""

    dims: ParallelDims
    mesh: DeviceMesh
    place: SequencePlace  # this rank's (ring, ulysses) part of every sequence
    dp_cp: dist.ProcessGroup
    cp: dist.ProcessGroup | None
    dp: dist.ProcessGroup
    pp: dist.ProcessGroup | None

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str) -> JobMesh:
        """The 4D mesh with dims ``AXES`` plus the flattened ``cp`` and ``dp_cp`` sub-meshes, and its groups."""
        options = default_group_options(device_type)
        mesh = init_device_mesh(
            device_type,
            (dims.pp, dims.dp, dims.ring, dims.ulysses),
            mesh_dim_names=AXES,
            backend_override=dict.fromkeys(AXES, options),
        )
        flat = {name: mesh[axes]._flatten(name, backend_override=options) for name, axes in FLATTENED.items()}
        return cls(
            dims,
            mesh,
            SequencePlace.from_mesh(mesh, dims.layout),
            dp_cp=flat["dp_cp"].get_group(),
            cp=flat["cp"].get_group() if dims.cp > 1 else None,
            dp=mesh.get_group("dp"),
            pp=mesh.get_group("pp") if dims.pp > 1 else None,
        )

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp")

    def group(self, axis: str) -> dist.ProcessGroup:
        """The group of one axis of ``AXES`` (``ring``, ``ulysses``: the attention's)."""
        return self.mesh.get_group(axis)

    def sub_mesh(self, name: str) -> DeviceMesh:
        """An axis of ``AXES`` or a flattened sub-mesh (``cp``, ``dp_cp``) as a mesh (FSDP, pipeline stages)."""
        return self.mesh[FLATTENED[name]]._flatten(name) if name in FLATTENED else self.mesh[name]

    def experts_mesh(self) -> DeviceMesh:
        """The ``dp_cp`` ranks as the 2-D mesh ``(efsdp, ep)``: ``ep`` innermost (adjacent ranks: Ulysses neighbours
        first, then ring, then dp), each of its groups holding all experts between them; ``efsdp`` = dp_cp / ep, the
        ranks holding the same experts, that FSDP shards them over. Every rank must call this, once per model."""
        options = default_group_options(self.mesh.device_type)
        return self.sub_mesh("dp_cp")._unflatten(
            0, (self.dims.efsdp, self.dims.ep), EXPERT_AXES, backend_override=dict.fromkeys(EXPERT_AXES, options)
        )


def default_group_options(device_type: str) -> object:
    """Options for the mesh's groups with the default process group's timeout (``train.timeout_s``), of its
    backend's type. Without them torch creates those groups with its own default timeout (30 minutes for gloo, 10
    for NCCL), and a rank waiting on the ring or Ulysses group for a lost peer would wait that long."""
    default = dist.distributed_c10d._get_default_group()._get_backend(torch.device(device_type)).options
    options = type(default)()
    options._timeout = default._timeout
    return options
