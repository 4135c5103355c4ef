"""Tensor parallelism's view of the run's device mesh, and the process groups taken from it.

The mesh is the run's one ``(pp, dp, tp)`` mesh (:class:`hf_zero.parallel.ParallelDims`), tensor parallel
innermost: the ranks of one TP group are consecutive (``tp`` ranks of one node share the heaviest traffic, as in
DeepSpeed and Megatron), and each data-parallel group holds one rank of every TP group::

    world 4, tp 2:   mesh [[[0, 1],      tp groups {0,1} {2,3}     dp groups {0,2} {1,3}
                            [2, 3]]]

Nothing here assumes global rank 0 is in a group: every group comes from the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hf_zero.parallel import ParallelDims
from hf_zero.parallel import mesh_from_groups as _mesh_from_groups

__all__ = ["TPMesh", "build_mesh", "mesh_from_groups"]


@dataclass(frozen=True)
class TPMesh:
    """The run's device mesh as tensor parallelism sees it: its ``tp`` and ``dp`` dimensions."""

    mesh: DeviceMesh  # dims named ("pp", "dp", "tp") (hf_zero.parallel); a caller's own ("dp", "tp") mesh works too

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def tp_size(self) -> int:
        return self.mesh["tp"].size()

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def tp_group(self):
        return self.mesh.get_group("tp")

    @property
    def dp_group(self):
        return self.mesh.get_group("dp")


def build_mesh(tp_size: int, *, device_type: str | None = None, key: str = "tensor_parallel.autotp_size") -> TPMesh:
    """The run's ``(1, world_size // tp_size, tp_size)`` mesh over the default process group (which must be
    initialized), as a :class:`TPMesh`.

    ``key`` names the setting ``tp_size`` came from, for the error when it does not divide the world.
    """
    if not dist.is_initialized():
        raise RuntimeError(f"hf_zero: {key}={tp_size} needs torch.distributed initialized first "
                           "(launch with torchrun / deepspeed and call deepspeed.init_distributed())")
    world = dist.get_world_size()
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"hf_zero: {key}={tp_size} must be >= 1 and divide the world size {world} "
                         f"(the data-parallel size is world_size / {key})")
    dims = ParallelDims.for_world(world, tp=int(tp_size), keys=("data-parallel size", "pipeline stages", key))
    return TPMesh(dims.build_mesh(device_type))


def mesh_from_groups(dp_group, tp_group, *, device_type: str | None = None, source: str = "mpu") -> TPMesh:
    """The run's mesh over process groups the caller built (DeepSpeed's ``mpu``), reusing those very groups as its
    ``dp`` and ``tp`` dimensions; refused, naming a rank, when they do not form a (data, tensor) grid. Collective.
    See :func:`hf_zero.parallel.mesh_from_groups`."""
    return TPMesh(_mesh_from_groups(dp_group, tp_group, device_type=device_type, source=source))
