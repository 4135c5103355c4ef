"""``deepspeed.tp_model_init(model, tp_size, dtype, config=None)``: shard a model before the engine is built.

transformers' Trainer calls it (``tensor_parallel.autotp_size > 1`` in the DeepSpeed config) before it builds the
optimizer, so the optimizer sees the sharded parameters; ``initialize`` then finds the model already sharded and
runs ZeRO over the data-parallel dimension of the same ``(dp, tp)`` mesh.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from hf_zero import comm
from hf_zero.tensor_parallel.apply import apply_tp, check_adapters_sharded, tp_info
from hf_zero.tensor_parallel.config import parse_tp_config
from hf_zero.tensor_parallel.mesh import build_mesh

__all__ = ["tp_model_init"]


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype | None = None,
                  config: Mapping[str, Any] | None = None, *, sequence_parallel: bool | None = None,
                  **kwargs: Any) -> nn.Module:
    """Shard ``model`` in place over ``tp_size`` ranks (DeepSpeed's signature); returns it.

    ``dtype`` is not applied here: the engine keeps fp32 master weights taken before it casts the model to the
    training dtype of the config's fp16 / bf16 sections, and ``initialize`` refuses a ``dtype`` that disagrees.
    ``config``: the DeepSpeed config dict; its ``tensor_parallel`` section is checked key by key.
    ``sequence_parallel`` (hf_zero's): split the residual stream along the sequence between the TP regions; the
    config's ``tensor_parallel.sequence_parallel`` decides when this is None, and must agree when both are given.
    """
    if kwargs:
        raise TypeError(f"hf_zero: tp_model_init() got unsupported arguments {sorted(kwargs)}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"hf_zero: tp_model_init(dtype=...) must be a floating torch.dtype, got {dtype!r}")
    section = config.get("tensor_parallel") if isinstance(config, Mapping) else None
    tp_cfg = parse_tp_config(section)
    if tp_cfg.enabled and tp_cfg.size != tp_size:
        raise ValueError(f"hf_zero: tp_model_init(tp_size={tp_size}) disagrees with the config's "
                         f"tensor_parallel.autotp_size={tp_cfg.size}")
    sp = tp_cfg.sequence_parallel if sequence_parallel is None else bool(sequence_parallel)
    if tp_cfg.enabled and sequence_parallel is not None and sp != tp_cfg.sequence_parallel:
        raise ValueError(f"hf_zero: tp_model_init(sequence_parallel={sequence_parallel}) disagrees with the config's "
                         f"tensor_parallel.sequence_parallel={tp_cfg.sequence_parallel}")
    existing = tp_info(model)
    if existing is not None:
        if existing.size != tp_size:
            raise ValueError(f"hf_zero: the model is already sharded over {existing.size} ranks, not {tp_size}")
        if (sequence_parallel is not None or tp_cfg.enabled) and existing.sequence_parallel != sp:
            raise ValueError(f"hf_zero: the model is already sharded with sequence_parallel="
                             f"{existing.sequence_parallel}, not {sp}")
        check_adapters_sharded(model)
        return model
    comm.init_distributed()  # as deepspeed.initialize would: from the launcher's environment, if not yet
    apply_tp(model, build_mesh(tp_size, key="tp_model_init(tp_size)"),
             vocab_parallel_head=tp_cfg.vocab_parallel_lm_head, sequence_parallel=sp, layer_specs=tp_cfg.layer_specs)
    tp_info(model).dtype = dtype
    return model
