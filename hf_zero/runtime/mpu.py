"""DeepSpeed's ``mpu`` argument (Megatron's parallel-state interface): which of its groups hf_zero takes.

    initialize(model=model, config=cfg, mpu=mpu)

The run's one device mesh is built over the mpu's own group objects (``DeviceMesh.from_group``, see
:func:`hf_zero.parallel.mesh_from_groups`), so every group hf_zero then uses is the mpu's or the mesh's.

- Data parallelism only (every model-parallel size 1): ZeRO shards over ``mpu.get_data_parallel_group()``.
- Tensor parallelism with ``tensor_parallel.autotp_size`` (DeepSpeed's AutoTP training example builds its own
  TP/DP groups and passes them): hf_zero shards the model over the mpu's TP groups and runs ZeRO over its DP
  groups. The sizes must agree; DeepSpeed 0.19 does not check, it drops the mpu under AutoTP and builds groups of
  its own, so a script whose mpu says otherwise trains on groups it did not ask for.
- Anything else that splits the model (tensor parallelism without autotp_size: a model split by hand, Megatron
  style; pipeline parallelism from an mpu) is refused: the engine cannot know which parameters are split or
  duplicated.
- Ulysses sequence parallelism (the mpu ``register_with_transformers`` returns): the model is whole on every rank;
  ZeRO runs over the SP x DP block (:func:`_read_sequence_parallel_mpu`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from hf_zero.config.errors import ConfigError
from hf_zero.tensor_parallel import tp_info
from hf_zero.tensor_parallel.config import TPConfig

__all__ = ["MpuGroups", "read_mpu", "check_mpu_tensor_parallel"]


@dataclass(frozen=True)
class MpuGroups:
    dp_group: Any
    tp_size: int
    tp_group: Any | None  # None when tp_size is 1 (or the mpu has no getter for it: refused where it is needed)
    kind: str             # the mpu's class name, for errors
    sp_size: int = 1      # Ulysses sequence parallelism: dp_group then spans every rank of the SP x DP block


def _call(mpu, *names: str):
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return fn()
    return None


def read_mpu(mpu) -> MpuGroups:
    """The mpu's data-parallel group and tensor-parallel size and group; pipeline splits refused."""
    sp_size = int(_call(mpu, "get_sequence_parallel_world_size") or 1)
    if sp_size > 1:
        return _read_sequence_parallel_mpu(mpu, sp_size)
    tp_size = int(_call(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size") or 1)
    split = {kind: int(_call(mpu, getter) or 1) for kind, getter in (
        ("pipeline", "get_pipeline_model_parallel_world_size"),)}
    split = {k: v for k, v in split.items() if v > 1}
    if split:
        raise ValueError(
            f"hf_zero.initialize(mpu=...): the mpu splits the model ({', '.join(f'{k} parallel size {v}' for k, v in split.items())}); "
            "hf_zero takes data and tensor parallelism from an mpu, not these. For pipeline parallelism use "
            "hf_zero.pipe.PipelineModule")
    if not callable(getattr(mpu, "get_data_parallel_group", None)):
        raise TypeError(f"hf_zero.initialize(mpu=...): {type(mpu).__name__} has no get_data_parallel_group(); "
                        "DeepSpeed's mpu interface needs it")
    tp_group = _call(mpu, "get_tensor_model_parallel_group", "get_model_parallel_group") if tp_size > 1 else None
    return MpuGroups(mpu.get_data_parallel_group(), tp_size, tp_group, type(mpu).__name__)


def _read_sequence_parallel_mpu(mpu, sp_size: int) -> MpuGroups:
    """An mpu with Ulysses sequence parallelism (UlyssesSPAttentionHF.register_with_transformers returns one):
    the ranks of an SP group each compute part of one sample's gradient, so ZeRO reduces and partitions over the
    whole SP x DP block (``get_sequence_data_parallel_group``), and the batch arithmetic counts world / sp_size
    replicas (hf_zero.sequence_parallel.setup)."""
    tp_size = int(_call(mpu, "get_tensor_model_parallel_world_size") or 1)
    if tp_size > 1 or int(_call(mpu, "get_pipeline_model_parallel_world_size") or 1) > 1:
        raise ValueError(f"hf_zero.initialize(mpu=...): the mpu combines sequence parallelism (size {sp_size}) with "
                         "tensor or pipeline parallelism; hf_zero runs Ulysses over data parallelism only")
    if not callable(getattr(mpu, "get_sequence_data_parallel_group", None)):
        raise TypeError(f"hf_zero.initialize(mpu=...): {type(mpu).__name__} reports a sequence-parallel size of "
                        f"{sp_size} but has no get_sequence_data_parallel_group(), the group ZeRO runs over")
    return MpuGroups(mpu.get_sequence_data_parallel_group(), 1, None, type(mpu).__name__, sp_size=sp_size)


def check_mpu_tensor_parallel(groups: MpuGroups, tp_cfg: TPConfig, model: nn.Module) -> None:
    """Refuse an mpu whose tensor-parallel size disagrees with the config's (or the sharded model's), before any
    group is built; the run's mesh is then built over the mpu's groups (runtime/parallelize.py)."""
    info = tp_info(model)
    tp_size = tp_cfg.size if tp_cfg.enabled else (info.size if info is not None else 1)
    if groups.tp_size == 1 and tp_size == 1:
        return
    if groups.tp_size > 1 and tp_size == 1:
        raise ValueError(
            f"hf_zero.initialize(mpu=...): the mpu splits the model (tensor parallel size {groups.tp_size}) but "
            "tensor_parallel.autotp_size is unset, so the model would be one split by hand, whose split and "
            f"duplicated parameters the engine cannot know. Set tensor_parallel.autotp_size: {groups.tp_size} to "
            "have hf_zero shard the model over the mpu's groups (or shard it with hf_zero.tensor_parallel."
            "apply_tp / tp_model_init), or pass an mpu whose model-parallel sizes are 1")
    if groups.tp_size != tp_size:
        key = "tensor_parallel.autotp_size" if tp_cfg.enabled else "tp_model_init(tp_size)"
        raise ConfigError(key, f"{tp_size}, but the mpu passed to initialize() has a tensor-parallel size of "
                               f"{groups.tp_size} (mpu.get_model_parallel_world_size()); make them equal "
                               "(DeepSpeed 0.19 drops the mpu under AutoTP and builds groups of its own)")
    if groups.tp_group is None:
        raise TypeError(f"hf_zero.initialize(mpu=...): {groups.kind} reports a tensor-parallel size of "
                        f"{groups.tp_size} but has no get_model_parallel_group() (or get_tensor_model_parallel_group())")
