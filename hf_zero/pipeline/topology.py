"""Process topologies: which global rank holds which (pipe, data[, model]) coordinate, and the groups of the run's
device mesh laid out from it.

Same classes and rank arithmetic as DeepSpeed's ``deepspeed.runtime.pipe.topology``: axes are listed outermost
first, the last axis varies fastest. ``PipeDataParallelTopology(num_pp=2, num_dp=2)`` puts ranks 0,1 on stage 0 and
ranks 2,3 on stage 1, so data-parallel reductions stay between neighbouring ranks. The topology's pipe, data and
model axes are the pp, dp and tp dimensions of the run's one mesh (:class:`hf_zero.parallel.ParallelDims`).
"""

from __future__ import annotations

import itertools
from collections import namedtuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hf_zero.parallel import ParallelDims

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid"]


class ProcessTopology:
    """A cartesian mapping of ``axes`` (names) with sizes ``dims`` onto ranks ``0 .. prod(dims)-1``."""

    def __init__(self, axes: list[str], dims: list[int]):
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axes {axes} and dims {dims} must be equally long, names unique")
        if any(int(d) < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dimension must be >= 1, got {dims}")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping = {}
        for rank, coord in enumerate(itertools.product(*[range(d) for d in self.dims])):
            self.mapping[self.ProcessCoord(*coord)] = rank

    def get_rank(self, **coord_kwargs) -> int:
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank needs every axis of {self.axes}, got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank: coordinate {coord_kwargs} is outside dims {self.dims}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-") -> str:
        coord = self.get_coord(rank)
        return outer_sep.join(f"{ax}{inner_sep}{getattr(coord, ax):02d}" for ax in self.axes if ax not in omit_axes)

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int):
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} is not in a topology of {self.world_size()} ranks")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Rank lists that differ only along ``axis`` (one communicator each)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for other in itertools.product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, other))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs) -> list[int]:
        return [r for c, r in self.mapping.items() if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        return sorted(r for c, r in self.mapping.items() if getattr(c, axis) == idx)

    def world_size(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism, data innermost (DeepSpeed's default for a PipelineModule)."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x tensor ("model") parallelism, tensor innermost: the 3D layout BLOOM trained with."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


# the topology's axes, as the mesh's dimensions
_AXIS_DIMS = {"pipe": "pp", "data": "dp", "model": "tp"}


class PipelineParallelGrid:
    """The process groups of a topology, answering DeepSpeed's ``mpu`` queries.

    The topology is laid out on the run's one ``(pp, dp, tp)`` device mesh (``device_mesh``; an axis the topology
    lacks is a dimension of size 1), and every group is the mesh's: the pipe, data and tensor ("model") groups are
    its dimensions, so the DTensor shards of tensor parallelism (3D) and the groups ZeRO and the schedule use agree
    by construction. "Model parallel" means DeepSpeed's: the pipe x model ranks of one data-parallel replica -- the
    ranks whose gradients together make one model's -- the mesh's ``pp`` x ``tp`` dimensions flattened.

    Every group is one of its own, never the default group (``share_world_group=False``): the pipeline's failure
    path aborts these groups, and must not abort the application's default group.
    """

    def __init__(self, topology: ProcessTopology, process_group=None):
        if not dist.is_initialized():
            raise RuntimeError("PipelineParallelGrid needs torch.distributed initialized (hf_zero.init_distributed())")
        self._topo = topology
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if topology.world_size() != self.world_size:
            shape = dict(zip(topology.axes, topology.dims))
            raise ValueError(f"the pipeline topology has {topology.world_size()} ranks ({shape}) but the world has "
                             f"{self.world_size}; set num_stages (or the topology) so that stages x data-parallel "
                             f"replicas = WORLD_SIZE")
        unknown = [a for a in topology.axes if a not in _AXIS_DIMS]
        if unknown:
            raise ValueError(f"the pipeline topology's axes {topology.axes} include {unknown}; hf_zero lays out the "
                             f"axes {list(_AXIS_DIMS)} (pipeline stages, data-parallel replicas, tensor parallelism)")
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        coord = topology.get_coord(self.global_rank)
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.ds_model_rank = getattr(coord, "model", 0)
        self.dims = ParallelDims(self.data_parallel_size, self.pipe_parallel_size, self.model_parallel_size,
                                 keys=("the topology's 'data' axis", "the topology's 'pipe' axis (num_stages)",
                                       "the topology's 'model' axis (tp_size)"))
        self.device_mesh: DeviceMesh = self.dims.build_mesh(ranks=self._rank_grid(), share_world_group=False)
        self.dp_group, self.dp_proc_group = self._mesh_group("data", "dp")
        self.pp_group, self.pp_proc_group = self._mesh_group("pipe", "pp")
        self.slice_group, self.slice_proc_group = self._mesh_group("model", "tp")
        # the pipe x model ranks of this replica: with one of the two of size 1 it is the other's group; else the
        # two dimensions flattened (a group of the mesh, created on every rank like the others)
        self.model_group = topology.filter_match(data=self.data_parallel_id) if "data" in topology.axes else \
            list(range(self.world_size))
        if self.model_parallel_size == 1:
            self.model_proc_group = self.pp_proc_group
        elif self.pipe_parallel_size == 1:
            self.model_proc_group = self.slice_proc_group
        else:
            # torch's only way to a group over two mesh dimensions (torchtitan's dp_shard_cp is made the same way)
            flat = self.device_mesh["pp", "tp"]._flatten("pp_tp", backend_override=dist.get_backend())
            self.model_proc_group = flat.get_group()
        if sorted(dist.get_process_group_ranks(self.model_proc_group)) != sorted(self.model_group):
            raise RuntimeError(f"hf_zero: the device mesh's pipe x model group "
                               f"{dist.get_process_group_ranks(self.model_proc_group)} differs from the topology's "
                               f"replica {self.model_group}")

    def _rank_grid(self) -> list:
        """``[pp][dp][tp]`` -> the topology's global rank at that coordinate (its axes may come in any order)."""
        sizes = {"pipe": self.pipe_parallel_size, "data": self.data_parallel_size, "model": self.model_parallel_size}
        axes = self._topo.axes

        def rank(p: int, d: int, t: int) -> int:
            at = {"pipe": p, "data": d, "model": t}
            return self._topo.get_rank(**{a: at[a] for a in axes})

        return [[[rank(p, d, t) for t in range(sizes["model"])] for d in range(sizes["data"])]
                for p in range(sizes["pipe"])]

    def _mesh_group(self, axis: str, dim: str):
        """This rank's group along ``dim`` of the device mesh, and its ranks (the topology's, checked against it)."""
        group = self.device_mesh.get_group(dim)
        lists = self._topo.get_axis_comm_lists(axis)
        ranks = next(r for r in lists if self.global_rank in r) if lists else [self.global_rank]
        if dist.get_process_group_ranks(group) != ranks:
            raise RuntimeError(f"hf_zero: the device mesh's {dim!r} group {dist.get_process_group_ranks(group)} "
                               f"differs from the topology's {axis!r} ranks {ranks}")
        return ranks, group

    def stage_copies_group(self, owner_stages: list[int]) -> tuple[list[int], object] | None:
        """``(ranks, group)`` joining this rank's copies of a weight the stages ``owner_stages`` each hold (a tied
        embedding), one group per (data, model) coordinate; None when this rank's stage holds no copy.

        Collective: every rank calls it with the same stages at the same point. When every stage holds a copy the
        groups are the mesh's pp groups themselves; otherwise they are parts of them, which no mesh dimension
        describes, created here on every rank in rank order.
        """
        owners = sorted(owner_stages)
        if owners == list(range(self.pipe_parallel_size)):
            return (self.pp_group, self.pp_proc_group) if self.stage_id in owners else None
        mine = None
        for stage_ranks in self._topo.get_axis_comm_lists("pipe") or [[self.global_rank]]:
            ranks = [stage_ranks[s] for s in owners]
            group = dist.new_group(ranks)
            if self.global_rank in ranks:
                mine = (ranks, group)
        return mine

    # ---- DeepSpeed's mpu interface ---------------------------------------------------------------------------------
    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        coord = self._topo.get_coord(self.global_rank)._asdict()
        coord.update(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord)

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_group)

    def get_model_parallel_rank(self) -> int:
        return self.model_group.index(self.global_rank)

    def get_model_parallel_world_size(self) -> int:
        return len(self.model_group)

    def get_model_parallel_group(self):
        return self.model_proc_group

    def get_slice_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_slice_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_slice_parallel_group(self):
        return self.slice_proc_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group
