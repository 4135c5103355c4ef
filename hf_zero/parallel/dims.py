"""``ParallelDims``: how a run's ranks split into pipeline stages, data-parallel replicas and tensor-parallel shards,
and the one ``(pp, dp, tp)`` DeviceMesh every process group of the run comes from.

Ranks are laid out row-major over ``(pp, dp, tp)``, tensor parallel innermost: the ranks of one TP group are
consecutive (they exchange the most bytes, so they share a node, as in DeepSpeed and Megatron)::

    world 8 = pp 2 x dp 2 x tp 2:   mesh [[[0, 1], [2, 3]],     tp groups {0,1} {2,3} {4,5} {6,7}
                                          [[4, 5], [6, 7]]]     dp groups {0,2} {1,3} {4,6} {5,7}
                                                                pp groups {0,4} {1,5} {2,6} {3,7}

Every dimension is in the mesh even when its size is 1 (a data-parallel-only run has ``pp = tp = 1``), so
``mesh["dp"]``, ``mesh["tp"]`` and ``mesh["pp"]`` answer for every run and no caller asks whether one exists.

Building a mesh is collective: DeviceMesh calls ``new_group`` for every group of every dimension, on every rank, in
the same order (pp, dp, tp; in each, the groups in rank order). So every rank builds its mesh at the same point of
the program, with the same sizes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hf_zero.comm.collectives import barrier
from hf_zero.comm.device import accelerator_type, local_device
from hf_zero.config.errors import ConfigError

__all__ = ["MESH_DIMS", "ParallelDims", "mesh_from_groups"]

MESH_DIMS = ("pp", "dp", "tp")  # outermost first

# (device type, rank grid) -> (the default group it was built under, the mesh): see ParallelDims.build_mesh
_BUILT: dict[tuple, tuple[weakref.ref, DeviceMesh]] = {}


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the three dimensions; ``dp * pp * tp`` must be the world size.

    ``keys``: what the user set each size with (``(dp, pp, tp)``), named in errors -- a config key or an argument.
    """

    dp: int
    pp: int = 1
    tp: int = 1
    keys: tuple[str, str, str] = field(default=("data-parallel size", "pipeline stages (num_stages)",
                                                "tensor_parallel.autotp_size"), compare=False, repr=False)

    def __post_init__(self):
        for size, key in zip((self.dp, self.pp, self.tp), self.keys):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(key, f"{size!r} must be an integer >= 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @classmethod
    def for_world(cls, world_size: int, *, pp: int = 1, tp: int = 1,
                  keys: tuple[str, str, str] | None = None) -> "ParallelDims":
        """The dims of ``world_size`` ranks cut into ``pp`` stages of ``tp`` shards: data parallel over the rest."""
        keys = keys or cls.__dataclass_fields__["keys"].default
        for size, key in ((pp, keys[1]), (tp, keys[2])):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(key, f"{size!r} must be an integer >= 1")
        if world_size % (pp * tp):
            raise ConfigError(keys[2] if tp > 1 else keys[1],
                              f"{keys[1]} {pp} x {keys[2]} {tp} = {pp * tp} does not divide the world size "
                              f"{world_size}; the {keys[0]} is WORLD_SIZE / ({pp} x {tp}), so pick sizes whose "
                              "product divides the number of ranks")
        return cls(world_size // (pp * tp), pp, tp, keys=keys)

    def check_world(self, world_size: int) -> None:
        """Refuse dims whose product is not ``world_size``, naming each size and where it was set."""
        if self.world_size != world_size:
            dp_key, pp_key, tp_key = self.keys
            key = tp_key if self.tp > 1 else pp_key if self.pp > 1 else dp_key
            raise ConfigError(key, f"{dp_key} {self.dp} x {pp_key} {self.pp} x {tp_key} {self.tp} = "
                                   f"{self.world_size} ranks, but the world has {world_size} "
                                   "(WORLD_SIZE of the launcher); make the product equal the number of ranks")

    @classmethod
    def of(cls, mesh: DeviceMesh) -> "ParallelDims":
        """The dims of a mesh built here (dimension names :data:`MESH_DIMS`)."""
        if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
            raise ValueError(f"hf_zero: a run's device mesh has dimensions {MESH_DIMS}, this one "
                             f"{mesh.mesh_dim_names}; build it with ParallelDims.build_mesh")
        pp, dp, tp = mesh.shape
        return cls(dp, pp, tp)

    def build_mesh(self, device_type: str | None = None, *, ranks: list | None = None,
                   share_world_group: bool = True) -> DeviceMesh:
        """The ``(pp, dp, tp)`` mesh over the default process group (collective; see the module docstring).

        ``ranks``: the global rank at each ``[pp][dp][tp]`` coordinate, for a layout other than row-major (a
        pipeline topology whose axes come in another order); by default rank = ``(p * dp + d) * tp + t``.
        ``share_world_group``: a dimension spanning every rank takes the default group itself (torch's choice: no
        new communicator). False gives it a group of its own -- the pipeline's, whose failure path aborts its
        groups and must not abort the default group the application owns.
        """
        if not dist.is_initialized():
            raise RuntimeError(f"hf_zero: {self} needs torch.distributed initialized first (launch with torchrun / "
                               "deepspeed and call hf_zero.init_distributed())")
        world = dist.get_world_size()
        self.check_world(world)
        shape = (self.pp, self.dp, self.tp)
        grid = torch.arange(world, dtype=torch.int, device="cpu").reshape(shape) if ranks is None else \
            torch.tensor(ranks, dtype=torch.int, device="cpu")
        if tuple(grid.shape) != shape or sorted(grid.flatten().tolist()) != list(range(world)):
            raise ValueError(f"hf_zero: the rank grid of {self} must have shape {shape} and hold every rank once, "
                             f"got {grid.tolist()}")
        device_type = _mesh_device_type(device_type)
        if not share_world_group:
            # one (backend, options) per dimension: with a backend named, even a dimension spanning every rank gets
            # a group of its own. Never reused: its owner (a pipeline) may abort these groups
            return _built(DeviceMesh(device_type, grid, mesh_dim_names=MESH_DIMS,
                                     backend_override=((dist.get_backend(), None),) * 3))
        # One mesh per layout for the life of the default group: a process that calls initialize again (an
        # evaluation engine beside the training one, a test) reuses it instead of creating 2 or more groups each
        # time, which c10d keeps until the default group is destroyed.
        key = (device_type, tuple(grid.flatten().tolist()), grid.shape)
        world_ref, mesh = _BUILT.get(key, (None, None))
        if mesh is None or world_ref() is not dist.group.WORLD:
            mesh = _built(DeviceMesh(device_type, grid, mesh_dim_names=MESH_DIMS))
            _BUILT[key] = (weakref.ref(dist.group.WORLD), mesh)  # a new default group (re-initialised) misses
        return mesh


def _mesh_device_type(device_type: str | None) -> str:
    """The mesh's device type; for "cuda", this process's GPU chosen and made current first (comm.device's rule).
    torch's DeviceMesh, finding CUDA not yet initialised, calls ``set_device(LOCAL_RANK)`` itself: wrong for two
    ranks sharing one GPU and for a launcher that gives each rank one visible GPU (rank 1 has no cuda:1)."""
    device_type = device_type or accelerator_type()
    if device_type == "cuda":
        local_device()
    return device_type


def mesh_from_groups(dp_group=None, tp_group=None, *, device_type: str | None = None,
                     source: str = "mpu") -> DeviceMesh:
    """The ``(pp, dp, tp)`` mesh (``pp`` 1) over process groups the caller built (DeepSpeed's ``mpu``), keeping those
    very group objects as its ``dp`` and ``tp`` groups (``DeviceMesh.from_group``).

    ``tp_group`` None: no tensor parallelism, each rank its own TP group; ``dp_group`` None: no data parallelism.
    Collective: every rank contributes its two groups' ranks. The TP groups become the grid's rows; each rank's
    data-parallel group must then be its column, in order (rank i of the dp group holds the i-th row), or the groups
    do not form a grid and are refused, naming a rank whose groups disagree (``source`` says whose). The size-1
    dimensions get one single-rank group per rank, created on every rank in rank order.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    tp_ranks = dist.get_process_group_ranks(tp_group) if tp_group is not None else [me]
    every: list = [None] * world
    dp_ranks = dist.get_process_group_ranks(dp_group) if dp_group is not None else [me]
    dist.all_gather_object(every, (tp_ranks, dp_ranks))
    rows = sorted({tuple(tp) for tp, _ in every})
    if len({len(r) for r in rows}) != 1 or sorted(r for row in rows for r in row) != list(range(world)):
        raise ValueError(f"hf_zero: the {source}'s tensor-parallel groups {[list(r) for r in rows]} do not split the "
                         f"{world} ranks into groups of one size")
    for rank, (tp, dp) in enumerate(every):
        column = [row[tp.index(rank)] for row in rows]
        if list(dp) != column:
            raise ValueError(f"hf_zero: the {source}'s groups do not form a (data, tensor) grid: rank {rank} has "
                             f"tensor-parallel group {list(tp)} and data-parallel group {list(dp)}, where the grid "
                             f"of its tensor-parallel groups {[list(r) for r in rows]} gives {column}")
    # the size-1 dimensions, always in this order on every rank: pp, then dp, then tp
    pp_group = _own_singleton_groups()
    if dp_group is None:
        dp_group = _own_singleton_groups()
    if tp_group is None:
        tp_group = _own_singleton_groups()
    return _built(DeviceMesh.from_group([pp_group, dp_group, tp_group], _mesh_device_type(device_type),
                                        mesh=torch.tensor([rows], device="cpu"), mesh_dim_names=MESH_DIMS))


def _built(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh``, returned once every rank has built it. new_group returns on a rank as soon as its own side of the
    group's connections is up; a rank that then raises (a config error found after the mesh, which every rank finds)
    and exits can close a socket a slower rank is still handshaking on, and that rank fails with gloo's "Broken
    pipe" instead of the real error. One bounded barrier over the world makes the mesh's construction end together."""
    barrier(what="building the device mesh (every rank creates its process groups)", log_name="mesh_barrier")
    return mesh


def _own_singleton_groups():
    """This rank's group of one, after every rank created every rank's (new_group is collective, in order)."""
    mine = None
    for rank in range(dist.get_world_size()):
        group = dist.new_group([rank])
        if rank == dist.get_rank():
            mine = group
    return mine
