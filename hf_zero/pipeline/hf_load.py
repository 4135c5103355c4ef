"""``from_pretrained(path, num_stages)``: a Hugging Face checkpoint cut into pipeline stages, each rank building and
reading only its own stage's weights.

    pipe = hf_zero.pipeline.from_pretrained("path/to/llama", num_stages=4)   # then hf_zero.initialize(model=pipe)

The model is built from its config with parameters on the meta device (accelerate's ``init_empty_weights``; buffers
such as the rotary ``inv_freq`` are computed for real), cut by :func:`hf_zero.pipeline.wrap`, and this stage's
parameters are then read one by one from the ``safetensors`` files (``model.safetensors`` or the shards named by
``model.safetensors.index.json``), memory-mapped: no rank ever holds the whole model. A tied LM head on the last
stage is read from the embedding's key.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from hf_zero.pipeline.module import PipelineError

__all__ = ["from_pretrained"]

_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"


def _weight_map(path: str) -> dict[str, str]:
    """checkpoint key -> safetensors file holding it."""
    index = os.path.join(path, _INDEX)
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, _SINGLE)
    if os.path.exists(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise PipelineError(f"hf_zero.pipeline.from_pretrained: {path!r} has no {_SINGLE} or {_INDEX}; save the model "
                        f"with save_pretrained(safe_serialization=True), or load it whole and use wrap()")


def _stage_loader(path: str, dtype: torch.dtype | None):
    """The function HFPipelineModule calls on its pruned, still-meta stage: reads the stage's tensors; returns
    the checkpoint keys it read."""

    def load(stage: nn.Module) -> list[str]:
        from safetensors import safe_open

        where = _weight_map(path)
        head_key = f"{stage.family.head}.weight"
        embed_key = f"{stage.family.base}.{stage.family.embed}.weight"
        wanted: dict[str, list[tuple[nn.Module, str]]] = {}
        by_id: dict[int, str] = {}
        for name, param in stage.named_parameters(remove_duplicate=False):
            owner_name, _, attr = name.rpartition(".")
            owner = stage.get_submodule(owner_name)
            key = by_id.setdefault(id(param), name)  # a tied weight held twice on one stage is read once
            if key == head_key and key not in where and stage.tied:
                key = by_id[id(param)] = embed_key  # tied checkpoints store the head once, as the embedding
            wanted.setdefault(key, []).append((owner, attr))
        missing = sorted(k for k in wanted if k not in where)
        if missing:
            raise PipelineError(f"hf_zero.pipeline.from_pretrained: {path!r} lacks {missing[:5]}"
                                f"{' ...' if len(missing) > 5 else ''} that pipeline stage {stage.stage_id} owns")
        files: dict[str, Any] = {}

        def read(key: str) -> torch.Tensor:  # memory-mapped: only this tensor's bytes are read
            if where[key] not in files:
                files[where[key]] = safe_open(where[key], framework="pt")
            return files[where[key]].get_tensor(key)

        for key, places in wanted.items():
            tensor = read(key)
            param = nn.Parameter(tensor.to(dtype) if dtype is not None else tensor,
                                 requires_grad=getattr(places[0][0], places[0][1]).requires_grad)
            for owner, attr in places:
                owner._parameters[attr] = param
        for name, buf in stage.named_buffers():
            if name in where:  # persistent buffers saved with the model
                buf.copy_(read(name))
        files.clear()
        still_meta = [n for n, p in stage.named_parameters() if p.is_meta]
        if still_meta:
            raise PipelineError(f"hf_zero.pipeline.from_pretrained: parameters {still_meta[:5]} of stage "
                                f"{stage.stage_id} were not loaded")
        return sorted(wanted)

    return load


def from_pretrained(path: str, num_stages: int | None = None, *, topology=None, virtual_stages: int = 1,
                    layers_per_stage: list[int] | None = None, torch_dtype: torch.dtype | None = None,
                    **config_kwargs):
    """A local ``save_pretrained`` directory cut into pipeline stages (see the module docstring); arguments as
    :func:`hf_zero.pipeline.wrap`, plus ``torch_dtype`` (default: the dtype stored in the checkpoint) and
    config overrides (``attn_implementation="eager"``, ...)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_zero.pipeline.hf import HFPipelineModule

    if not os.path.isdir(path):
        raise PipelineError(f"hf_zero.pipeline.from_pretrained: {path!r} is not a directory; download the model "
                            f"first (huggingface_hub.snapshot_download) and pass its local path")
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # from_config leaves meta parameters untied; wrap() recognises a tied head by identity
    return HFPipelineModule(model, num_stages=num_stages, topology=topology, virtual_stages=virtual_stages,
                            layers_per_stage=layers_per_stage, load_weights=_stage_loader(path, torch_dtype))
