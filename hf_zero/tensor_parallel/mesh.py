"""The device mesh tensor parallelism runs on, and the process groups taken from it.

Ranks are laid out ``(dp, tp)`` row-major, tensor parallel innermost: the ranks of one TP group are consecutive
(``tp`` ranks of one node share the heaviest traffic, as in DeepSpeed and Megatron), and each data-parallel group
holds one rank of every TP group::

    world 4, tp 2:   mesh [[0, 1],      tp groups {0,1} {2,3}     dp groups {0,2} {1,3}
                           [2, 3]]

Nothing here assumes global rank 0 is in a group: every group comes from the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hf_zero.comm.device import accelerator_type

__all__ = ["TPMesh", "build_mesh", "mesh_from_groups"]


@dataclass(frozen=True)
class TPMesh:
    """A ``(dp, tp)`` device mesh and what callers need from it."""

    mesh: DeviceMesh  # dims named ("dp", "tp"), or ("pp", "dp", "tp") under pipeline stages (3D)

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
    """A ``(world_size // tp_size, tp_size)`` mesh over the default process group (which must be initialized).

    ``key`` names the setting ``tp_size`` came from, for the error when it does not divide the world.
    """
    if not dist.is_initialized():
        raise RuntimeError(f"hf_zero: {key}={tp_size} needs torch.distributed initialized first "
                           "(launch with torchrun / deepspeed and call deepspeed.init_distributed())")
    world = dist.get_world_size()
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"hf_zero: {key}={tp_size} must be >= 1 and divide the world size {world} "
                         f"(the data-parallel size is world_size / {key})")
    if device_type is None:
        device_type = accelerator_type()
    mesh = init_device_mesh(device_type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    return TPMesh(mesh)


def mesh_from_groups(dp_group, tp_group, *, device_type: str | None = None, source: str = "mpu") -> TPMesh:
    """The ``(dp, tp)`` mesh over process groups the caller built (DeepSpeed's ``mpu``), reusing those groups.

    Collective: every rank contributes its two groups' ranks. The TP groups become the mesh's rows; each rank's
    data-parallel group must then be its column, in order (rank i of the dp group holds the i-th row), or the
    groups do not form a grid and are refused, naming a rank whose groups disagree (``source`` says whose).
    """
    if device_type is None:
        device_type = accelerator_type()
    mine = (dist.get_process_group_ranks(tp_group), dist.get_process_group_ranks(dp_group))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    rows = sorted({tuple(tp) for tp, _ in every})
    if len({len(r) for r in rows}) != 1 or sorted(r for row in rows for r in row) != list(range(len(every))):
        raise ValueError(f"hf_zero: the {source}'s tensor-parallel groups {[list(r) for r in rows]} do not split the "
                         f"{len(every)} ranks into groups of one size")
    for rank, (tp, dp) in enumerate(every):
        column = [row[tp.index(rank)] for row in rows]
        if list(dp) != column:
            raise ValueError(f"hf_zero: the {source}'s groups do not form a (data, tensor) grid: rank {rank} has "
                             f"tensor-parallel group {list(tp)} and data-parallel group {list(dp)}, where the grid "
                             f"of its tensor-parallel groups {[list(r) for r in rows]} gives {column}")
    mesh = DeviceMesh.from_group([dp_group, tp_group], device_type, mesh=torch.tensor(rows),
                                 mesh_dim_names=("dp", "tp"))
    return TPMesh(mesh)
