"""``engine.load_module_state_dict``: DeepSpeed's load of a module state dict into the engine's model, with the
optimizer's masters following it (see :meth:`DeepSpeedEngineAPI.load_module_state_dict` for the contract).

How each case loads:

* stages 0-2 -- ``module.load_state_dict`` (or the script's ``custom_load_fn``) on the full parameters, as DeepSpeed;
  then the trained parameters' fp32 masters and 16-bit shards are set from the state dict's own tensors (keys
  matching a parameter's name) or, for anything written another way, adopt the model's new 16-bit values
  (``hf_zero/zero/full_weights.py``);
* stage 3 without ``custom_load_fn`` -- per parameter, nothing gathered: the keys and shapes are checked first
  (a refused load changes nothing), then each parameter's shard, master and any gathered copy are written from
  the full tensor, buffers are copied;
* stage 3 with ``custom_load_fn`` -- as DeepSpeed: the parameters named by ``fetch_z3_params`` /
  ``z3_params_to_fetch`` are gathered around the call, rank 0's edits become the shards; then the masters adopt
  the new shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Callable

import torch

from hf_zero.tensor_parallel import tp_info
from hf_zero.zero.full_weights import adopt_module_weights, full_shape, set_full_weights, state_dict_names
from hf_zero.zero.tensor_fragment import fragment_of

__all__ = ["load_module_state_dict"]

FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"  # DeepSpeed's checkpoint key for frozen parameters


def load_module_state_dict(engine, checkpoint: Mapping, *, strict: bool, custom_load_fn: Callable | None,
                           fetch_z3_params: bool, z3_params_to_fetch, allowed_missing_keys) -> None:
    module = engine.module
    if tp_info(module) is not None:
        raise NotImplementedError(
            "hf_zero: engine.load_module_state_dict on a tensor-parallel model: its parameters are DTensor shards "
            "whose masters this load cannot cut from full tensors; use engine.load_checkpoint (which re-shards "
            "hf_zero and DeepSpeed checkpoints), or hf_zero.tensor_parallel.state.load_full_state_dict before "
            "initialize")
    if "module" not in checkpoint:
        raise KeyError(f"hf_zero: engine.load_module_state_dict(checkpoint) reads checkpoint['module'] (the module "
                       f"state dict, as in DeepSpeed's mp_rank_00_model_states.pt); the checkpoint has the keys "
                       f"{sorted(checkpoint)[:8]}")
    state = checkpoint["module"]
    if custom_load_fn is not None:
        _load_custom(engine, state, custom_load_fn, fetch_z3_params, z3_params_to_fetch)
    elif engine.stage3 is not None:
        _load_per_param(module, state, strict, allowed_missing_keys)
    else:
        _load_whole(module, state, strict, allowed_missing_keys)
    frozen = checkpoint.get(FROZEN_PARAM_FRAGMENTS)
    if frozen is not None:
        _load_frozen(module, frozen)


def _trained(module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if fragment_of(p) is not None]


def _load_whole(module, state: Mapping, strict: bool, allowed_missing_keys) -> None:
    """Stages 0-2: torch's load (hooks, strict checks and messages are torch's), then the masters."""
    trained = _trained(module)
    try:
        result = module.load_state_dict(state, strict=strict and allowed_missing_keys is None)
    finally:  # torch raises after copying what matched: the masters follow whatever was loaded
        exact = [(p, state[n]) for n, p in trained
                 if n in state and torch.is_tensor(state[n]) and state[n].shape == p.shape]
        set_full_weights(exact)
        done = {id(p) for p, _ in exact}
        adopt_module_weights(p for _, p in trained if id(p) not in done)  # keys renamed by load hooks
    if strict and allowed_missing_keys is not None:
        _check_allowed(result.missing_keys, result.unexpected_keys, allowed_missing_keys)


def _load_per_param(module, state: Mapping, strict: bool, allowed_missing_keys) -> None:
    """Stage 3: nothing is gathered; every check runs before the first write."""
    param_keys, buffer_keys, extra_keys = state_dict_names(module)
    expected = param_keys + buffer_keys + extra_keys
    known = set(expected)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in known]
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    mismatched = []
    for key in param_keys + buffer_keys:
        if key not in state:
            continue
        value = state[key]
        shape = full_shape(params[key]) if key in params else buffers[key].shape
        if not torch.is_tensor(value):
            mismatched.append(f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like '
                              f"object from checkpoint but received {type(value)}")
        elif value.shape != shape:
            mismatched.append(f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                              f"the shape in current model is {shape}.")
    errors = list(mismatched)
    if strict and allowed_missing_keys is None:
        if unexpected:
            errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(type(module).__name__,
                                                                                "\n\t".join(errors)))
    if strict and allowed_missing_keys is not None:
        _check_allowed(missing, unexpected, allowed_missing_keys)
    seen: set[int] = set()
    items = []
    for key in param_keys:  # a tied parameter once, from its first key present
        param = params[key]
        if key in state and id(param) not in seen:
            seen.add(id(param))
            items.append((param, state[key]))
    set_full_weights(items)
    with torch.no_grad():
        for key in buffer_keys:
            if key in state:
                buffers[key].copy_(state[key])
    modules = dict(module.named_modules(remove_duplicate=False))
    for key in extra_keys:
        if key in state:
            modules[key.rpartition(".")[0]].set_extra_state(state[key])


def _load_custom(engine, state: Mapping, custom_load_fn: Callable, fetch_z3_params: bool, z3_params_to_fetch) -> None:
    module = engine.module
    block = contextlib.nullcontext()
    if engine.stage3 is not None and (z3_params_to_fetch is not None or fetch_z3_params):
        from hf_zero.zero.gathered import GatheredParameters

        fetch = list(z3_params_to_fetch) if z3_params_to_fetch is not None else list(module.parameters())
        block = GatheredParameters(fetch, modifier_rank=0)  # as DeepSpeed: rank 0's edits become the shards
    trained = [p for _, p in _trained(module)]
    try:
        with block:
            custom_load_fn(src=state, dst=module)
    finally:
        adopt_module_weights(trained)


def _load_frozen(module, fragments: Mapping) -> None:
    """DeepSpeed's ``frozen_param_fragments``: the full values of parameters the optimizer does not train."""
    items = []
    for name, param in module.named_parameters():
        if fragment_of(param) is not None:
            continue
        if name not in fragments:
            raise KeyError(f"hf_zero: checkpoint['{FROZEN_PARAM_FRAGMENTS}'] has no entry for the frozen parameter "
                           f"{name!r}")
        value = fragments[name]
        if value.numel() != full_shape(param).numel():
            raise ValueError(f"hf_zero: checkpoint['{FROZEN_PARAM_FRAGMENTS}'][{name!r}] has {value.numel()} "
                             f"elements, the parameter {tuple(full_shape(param))}: hf_zero loads full frozen "
                             f"values (DeepSpeed's ZeRO-1/2 layout), not ZeRO-3 shards")
        items.append((param, value))
    set_full_weights(items)


def _check_allowed(missing, unexpected, allowed_missing_keys) -> None:
    """DeepSpeed's rule for a strict load with ``allowed_missing_keys``: only those keys may be missing."""
    unexpected_missing = sorted(set(missing) - set(allowed_missing_keys))
    if unexpected_missing or unexpected:
        raise RuntimeError(f"hf_zero: the module state dict does not match the model beyond allowed_missing_keys: "
                           f"missing={unexpected_missing}, unexpected={sorted(unexpected)}")
