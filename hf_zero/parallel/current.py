"""The mesh of the run the process last initialized, for code that asks for "the" groups without an engine in hand.

DeepSpeed keeps its AutoTP and data-parallel groups in module globals (``deepspeed.utils.groups``), set by
``deepspeed.initialize``; scripts read them to shard their own data (``groups.get_tensor_model_parallel_group()``,
as DeepSpeed's AutoTP guide says). hf_zero's groups all come from the run's one DeviceMesh (``RunLayout.mesh``);
``initialize`` records it here once the engine exists, and the latest initialize wins, as DeepSpeed's globals do.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["run_group", "run_mesh", "set_run_mesh"]

_MESH: DeviceMesh | None = None


def set_run_mesh(mesh: DeviceMesh | None) -> None:
    global _MESH
    _MESH = mesh


def run_mesh() -> DeviceMesh | None:
    return _MESH


def run_group(dim: str) -> dist.ProcessGroup | None:
    """The process group of mesh dimension ``dim`` ("dp", "tp", "pp") of the last initialized run; None when no
    run was initialized or its mesh has no such dimension."""
    if _MESH is None or dim not in (_MESH.mesh_dim_names or ()):
        return None
    return _MESH.get_group(dim)
