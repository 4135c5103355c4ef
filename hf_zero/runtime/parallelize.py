"""The run's parallel layout, decided once, and the techniques applied on it in one fixed order.

:func:`resolve_layout` finds the run's one ``(pp, dp, tp)`` device mesh (:class:`hf_zero.parallel.ParallelDims`):

- a pipeline model (a :class:`~hf_zero.pipeline.PipelineModule` or :func:`hf_zero.pipeline.wrap`'s module, by
  type) was laid out when it was cut: its grid's mesh;
- a model sharded before ``initialize`` (``tp_model_init`` / ``apply_tp``): the mesh it was sharded on;
- an ``mpu``: a mesh over the mpu's own groups (``DeviceMesh.from_group``), sizes checked against the config;
- otherwise one built for the world and ``tensor_parallel.autotp_size`` (data parallel over the rest).

:func:`parallelize` then applies, in this order, what the layout asks; :func:`make_engine` picks the engine from the
layout (a pipeline layout runs the pipeline engine), never from attributes of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hf_zero.config.errors import ConfigError
from hf_zero.parallel import ParallelDims, mesh_from_groups
from hf_zero.pipeline.config import parse_pipeline_config
from hf_zero.runtime.mpu import MpuGroups, check_mpu_tensor_parallel
from hf_zero.runtime.tp_setup import TPLayout, setup_tensor_parallel
from hf_zero.tensor_parallel import tp_info
from hf_zero.tensor_parallel.config import TPConfig
from hf_zero.tensor_parallel.mesh import TPMesh

__all__ = ["RunLayout", "is_pipeline_model", "resolve_layout", "parallelize", "make_engine"]


@dataclass(frozen=True)
class RunLayout:
    """The run's dims and its one mesh; ``pipeline``: the grid of a model cut into stages, else None."""

    dims: ParallelDims
    mesh: DeviceMesh
    source: str                # "pipeline", "model" (sharded before initialize), "mpu" or "config"
    pipeline: Any = None       # hf_zero.pipeline.topology.PipelineParallelGrid

    @property
    def dp_size(self) -> int:
        return self.mesh.size(self.mesh.mesh_dim_names.index("dp"))

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")


def is_pipeline_model(model: nn.Module) -> bool:
    """A model cut into pipeline stages: a PipelineModule or a wrapped Hugging Face model, by type."""
    from hf_zero.pipeline.hf import HFPipelineModule
    from hf_zero.pipeline.module import PipelineModule

    return isinstance(model, (PipelineModule, HFPipelineModule))


def resolve_layout(model: nn.Module, tp_cfg: TPConfig, mpu: MpuGroups | None) -> RunLayout:
    """The run's layout (module docstring). Collective where it builds a mesh: every rank calls it at once."""
    if is_pipeline_model(model):
        if mpu is not None and mpu.tp_size > 1:
            raise ValueError(f"hf_zero.initialize(mpu=...): the mpu has a tensor-parallel size of {mpu.tp_size} "
                             "and the model is a pipeline; a pipeline takes its groups from its topology "
                             "(hf_zero.pipeline.wrap(model, num_stages, tp_size=N)), not from an mpu")
        grid = model.grid
        return RunLayout(grid.dims, grid.device_mesh, "pipeline", grid)
    if mpu is not None:
        check_mpu_tensor_parallel(mpu, tp_cfg, model)  # sizes first: refused before any group is built
    info = tp_info(model)
    if info is not None:
        return _sharded_model_layout(info, mpu)
    if mpu is not None:
        mesh = mesh_from_groups(mpu.dp_group, mpu.tp_group if mpu.tp_size > 1 else None)
        return RunLayout(ParallelDims.of(mesh), mesh, "mpu")
    tp = tp_cfg.size if tp_cfg.enabled else 1
    if tp > 1 and dist.get_world_size() % tp:  # the message tensor parallelism always gave
        raise ValueError(f"hf_zero: tensor_parallel.autotp_size={tp} must be >= 1 and divide the world size "
                         f"{dist.get_world_size()} (the data-parallel size is world_size / "
                         "tensor_parallel.autotp_size)")
    dims = ParallelDims.for_world(dist.get_world_size(), tp=tp)
    return RunLayout(dims, dims.build_mesh(), "config")


def _sharded_model_layout(info, mpu: MpuGroups | None) -> RunLayout:
    """The mesh a model sharded before ``initialize`` lives on (checked against an mpu's groups)."""
    if info.layout is not None:
        mesh = info.layout.mesh
        if mpu is not None and mpu.tp_size > 1:
            have = dist.get_process_group_ranks(info.group)
            want = dist.get_process_group_ranks(mpu.tp_group)
            if have != want:
                raise ValueError(f"hf_zero.initialize(mpu=...): the model was sharded (tp_model_init / apply_tp) "
                                 f"over the tensor-parallel ranks {have}, the mpu's group of this rank is {want}; "
                                 "shard it over the mpu's groups (apply_tp(model, mesh_from_groups(dp_group, "
                                 "tp_group))) or leave it to tensor_parallel.autotp_size")
        dims = ParallelDims.of(mesh) if mesh.mesh_dim_names == ("pp", "dp", "tp") else \
            ParallelDims(mesh.size(mesh.mesh_dim_names.index("dp")), 1, info.size)  # a caller's own (dp, tp) mesh
        return RunLayout(dims, mesh, "model")
    # sharded over a bare 1-D mesh: it must span the world, and its group becomes the mesh's tp dimension
    if info.size != dist.get_world_size():
        raise ValueError("hf_zero: the model was sharded with apply_tp over a 1-D mesh smaller than the world; "
                         "pass the TPMesh from hf_zero.tensor_parallel.build_mesh so the engine knows the "
                         "data-parallel groups")
    mesh = mesh_from_groups(None, info.group, source="apply_tp mesh")
    return RunLayout(ParallelDims.of(mesh), mesh, "model")


def parallelize(model: nn.Module, layout: RunLayout, tp_cfg: TPConfig,
                pipeline_section: Mapping[str, Any] | None = None) -> TPLayout | None:
    """Apply the parallel techniques to ``model`` on ``layout.mesh``, always in this order:

    1. Tensor parallelism (``mesh["tp"]``): split parameters become DTensors. First, because everything after
       reads the parameters: the optimizer's groups, ZeRO's flat shards, and the batch arithmetic, which counts
       data-parallel replicas (the ranks of one TP group are one replica).
    2. The pipeline cut (``mesh["pp"]``): a pipeline model was cut into stages when it was built (its layers per
       stage are fixed before any weights exist); step 1 then shards each stage's modules (3D).
    3. Activation checkpointing: the config's ``pipeline.activation_checkpoint_interval`` and ``use_reentrant``
       (``pipeline_section``) are set on a PipelineModule's stages, which recompute whole layers whatever step 1
       did to them; other models checkpoint through their own ``gradient_checkpointing_enable()`` (the
       ``activation_checkpointing`` section is DeepSpeed's API for Megatron models: config/status.py).
    4. Data parallelism and ZeRO (``mesh["dp"]``): the engine (:func:`make_engine`) shards optimizer state,
       gradients and, at stage 3, parameters over the data-parallel group -- last, over what steps 1-3 left.

    Returns the tensor-parallel layout, or None without tensor parallelism.
    """
    tp = setup_tensor_parallel(model, tp_cfg, world_size=dist.get_world_size(), pipeline_grid=layout.pipeline,
                               mesh=None if layout.pipeline is not None else TPMesh(layout.mesh))  # steps 1, 2
    if layout.pipeline is not None:  # step 3
        pcfg = parse_pipeline_config(pipeline_section, model_parallel_size=layout.dims.tp)
        if pcfg.activation_checkpoint_interval is not None:
            if not hasattr(model, "activation_checkpoint_interval"):
                raise ConfigError("pipeline.activation_checkpoint_interval", "this model type has no layer list to "
                                                                             "checkpoint")
            model.activation_checkpoint_interval = pcfg.activation_checkpoint_interval
        if pcfg.use_reentrant is not None and hasattr(model, "activation_checkpoint_func"):
            from hf_zero.runtime.activation_checkpointing import checkpoint, non_reentrant_checkpoint

            if not pcfg.use_reentrant:  # DeepSpeed swaps in its non-reentrant function, whatever the module had
                model.activation_checkpoint_func = non_reentrant_checkpoint
            elif model.activation_checkpoint_func is None:  # DeepSpeed's PipelineModule default: reentrant
                model.activation_checkpoint_func = checkpoint
    return tp  # step 4 is the engine's (make_engine)


def make_engine(model: nn.Module, layout: RunLayout, tp: TPLayout | None, cfg, plan, lr_scheduler):
    """The engine the layout asks for; every group it is handed is one of ``layout.mesh``'s."""
    from hf_zero.runtime.engine import HfZeroEngine

    if layout.pipeline is not None:  # a model cut into stages: the pipeline engine reads its groups off the grid
        from hf_zero.runtime.pipe_engine import PipelineEngine

        return PipelineEngine(model, cfg, plan, lr_scheduler=lr_scheduler)
    if tp is not None:
        return HfZeroEngine(model, cfg, plan, lr_scheduler=lr_scheduler, process_group=tp.dp_group,
                            model_parallel_group=tp.tp_group)
    dp_group = layout.mesh.get_group("dp")
    # data parallel only, on a mesh hf_zero built: its dp dimension spans every rank and is the default group
    # itself; None says so to the engine (a default group the application created keeps its own timeout:
    # comm.faults.configure_from). An mpu's group is passed as given.
    if layout.source == "config" and dp_group is dist.group.WORLD:
        dp_group = None
    return HfZeroEngine(model, cfg, plan, lr_scheduler=lr_scheduler, process_group=dp_group)
