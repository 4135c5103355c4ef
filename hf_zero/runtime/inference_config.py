"""``deepspeed.init_inference``'s configuration, parsed once into a frozen :class:`InferenceConfig`.

Every field DeepSpeed 0.19.8's ``DeepSpeedInferenceConfig`` accepts, under its name and its aliases, has one status
here (``FIELDS``), so nothing set is silently dropped:

- honoured: ``dtype``, ``tensor_parallel`` (``tp_size``, ``mpu``), ``keep_module_on_host``, ``max_out_tokens``,
  ``injection_policy``, ``config``;
- speed only (DeepSpeed's fused kernels; the model runs with its own modules, one warning names them):
  ``replace_with_kernel_inject``, ``enable_cuda_graph``, ``use_triton``, ``triton_autotune``;
- no effect (read only by DeepSpeed's injected kernels, its checkpoint-free engine ignores them too; a value other
  than the default warns, naming the field): ``triangular_masking``, ``return_tuple``, ``min_out_tokens``,
  ``transposed_mode``, ``zero``, ``moe`` and its deprecated flat forms, ``tensor_parallel.enabled`` /
  ``tp_grain_size``, ``injection_policy_tuple``, ``replace_method``;
- refused (they change the weights or the numbers and are not implemented; an error names the field): ``int8``
  dtype and ``quant``, ``checkpoint`` and what goes with it (``base_dir``, ``checkpoint_config``,
  ``save_mp_checkpoint_path``, ``training_mp_size``), ``set_empty_params``, ``tensor_parallel.tp_group``.

Deprecated flat names move to their sections as DeepSpeed moves them (``mp_size`` -> ``tensor_parallel.tp_size``,
``mpu`` -> ``tensor_parallel.mpu``, ``ep_size`` -> ``moe.ep_size``, ...); giving both is refused, as DeepSpeed does.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from hf_zero.config.errors import ConfigError, closest

__all__ = ["InferenceConfig", "TPInferenceConfig", "parse_inference_config", "merge_inference_config",
           "DeepSpeedInferenceConfig", "SPEED_ONLY"]

# DeepSpeed's dtype spellings (its DtypeEnum), each to the torch dtype it means
_DTYPES = {
    torch.float16: ("torch.float16", "fp16", "float16", "half"),
    torch.float32: ("torch.float32", "fp32", "float32", "float"),
    torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16", "bfloat"),
    torch.int8: ("torch.int8", "int8"),
}
SPEED_ONLY = ("replace_with_kernel_inject", "enable_cuda_graph", "use_triton", "triton_autotune")

# field -> (default, status); statuses as in the module docstring
FIELDS: dict[str, tuple[Any, str]] = {
    "replace_with_kernel_inject": (False, "speed"),
    "dtype": (torch.float16, "honoured"),
    "tensor_parallel": ({}, "honoured"),
    "enable_cuda_graph": (False, "speed"),
    "use_triton": (False, "speed"),
    "triton_autotune": (False, "speed"),
    "zero": ({}, "no_effect"),
    "triangular_masking": (True, "no_effect"),
    "moe": ({}, "no_effect"),
    "keep_module_on_host": (False, "honoured"),
    "quant": ({}, "refused"),
    "checkpoint": (None, "refused"),
    "base_dir": ("", "refused"),
    "set_empty_params": (False, "refused"),
    "save_mp_checkpoint_path": (None, "refused"),
    "checkpoint_config": ({}, "refused"),
    "return_tuple": (True, "no_effect"),
    "training_mp_size": (1, "refused"),
    "replace_method": ("auto", "no_effect"),
    "injection_policy": (None, "honoured"),
    "injection_policy_tuple": (None, "no_effect"),
    "config": (None, "honoured"),
    "max_out_tokens": (1024, "honoured"),
    "min_out_tokens": (1, "no_effect"),
    "transposed_mode": (False, "no_effect"),
}
_ALIASES = {"kernel_inject": "replace_with_kernel_inject", "tp": "tensor_parallel", "tm": "triangular_masking",
            "ckpt_config": "checkpoint_config", "injection_dict": "injection_policy", "args": "config",
            "max_tokens": "max_out_tokens", "min_tokens": "min_out_tokens"}
# deprecated flat name -> (section, key in it, default), moved as DeepSpeed moves them
_DEPRECATED = {"mp_size": ("tensor_parallel", "tp_size", 1), "mpu": ("tensor_parallel", "mpu", None),
               "ep_size": ("moe", "ep_size", 1), "ep_group": ("moe", "ep_group", None),
               "expert_group": ("moe", "ep_group", None), "ep_mp_group": ("moe", "ep_mp_group", None),
               "expert_mp_group": ("moe", "ep_mp_group", None), "moe_experts": ("moe", "moe_experts", [1]),
               "moe_type": ("moe", "type", "standard")}
_TP_FIELDS = {"enabled": True, "tp_size": 1, "tp_grain_size": 64, "mpu": None, "tp_group": None}
_MOE_FIELDS = {"enabled": True, "ep_size": 1, "moe_experts": [1], "type": "standard", "ep_mp_group": None,
               "ep_group": None}
_MOE_ALIASES = {"num_experts": "moe_experts", "expert_group": "ep_group"}
_NO_EFFECT_WHY = "it is read only by DeepSpeed's injected inference kernels; the model runs with its own modules"


@dataclass(frozen=True)
class TPInferenceConfig:
    """``tensor_parallel``: ``tp_size`` ranks share each layer (hf_zero's tensor parallelism); ``mpu``: the caller's
    model-parallel unit, whose groups then decide the layout."""

    tp_size: int = 1
    mpu: Any = None
    enabled: bool = True
    tp_grain_size: int = 64
    tp_group: Any = None


@dataclass(frozen=True)
class InferenceConfig:
    """The parsed inference config; attribute names are DeepSpeed's, so ``engine._config.dtype`` and
    ``engine._config.tensor_parallel.tp_size`` read as they do there."""

    dtype: torch.dtype = torch.float16
    tensor_parallel: TPInferenceConfig = field(default_factory=TPInferenceConfig)
    keep_module_on_host: bool = False
    max_out_tokens: int = 1024
    injection_policy: dict | None = None
    config: dict | None = None                 # replaces the model's config as ``engine.config`` when given
    replace_with_kernel_inject: bool = False   # speed only: warned, the model's own modules run
    enable_cuda_graph: bool = False
    use_triton: bool = False
    triton_autotune: bool = False
    speed_only_set: tuple[str, ...] = ()       # the speed-only fields set, for the one warning
    no_effect_set: tuple[str, ...] = ()        # the no-effect fields given a non-default value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"expected true or false, got {value!r}")
    return value


def _int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, f"expected an integer >= {minimum}, got {value!r}")
    return value


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, str):
        found = next((d for d, names in _DTYPES.items() if value in names), None)
        if found is None:
            spellings = [n for names in _DTYPES.values() for n in names]
            raise ConfigError("dtype", f"{value!r} is not a dtype DeepSpeed names; one of {spellings}")
        value = found
    if not isinstance(value, torch.dtype):
        raise ConfigError("dtype", f"expected a torch.dtype or a string such as 'fp16' or 'bf16', got {value!r}")
    if value is torch.int8:
        raise ConfigError("dtype", "int8 (DeepSpeed's weight quantization for its injected kernels) is not "
                                   "implemented by hf_zero; use torch.float16, torch.bfloat16 or torch.float32")
    if value not in (torch.float16, torch.bfloat16, torch.float32):
        raise ConfigError("dtype", f"{value} is not an inference dtype; use torch.float16, torch.bfloat16 or "
                                   "torch.float32")
    return value


def _section(name: str, value: Any, fields: Mapping[str, Any], aliases: Mapping[str, str] = {}) -> dict:
    if not isinstance(value, Mapping):
        raise ConfigError(name, f"expected a dict of {sorted(fields)}, got {type(value).__name__}")
    out = {}
    for key, v in value.items():
        real = aliases.get(key, key)
        if real not in fields:
            hint = closest(key, fields)
            raise ConfigError(f"{name}.{key}", "unknown key" + (f" (did you mean {hint!r}?)" if hint else "") +
                              f"; accepted: {sorted(fields)}")
        out[real] = v
    return out


def merge_inference_config(config: str | Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> dict:
    """``init_inference(model, config, **kwargs)``'s one dict: ``config`` (a dict or a JSON file's path) with the
    keyword arguments over it; a key in both with different values is refused, as DeepSpeed refuses it."""
    if config is None:
        config = {}
    if isinstance(config, str):
        with open(config) as f:
            config = json.load(f)
    elif not isinstance(config, Mapping):
        raise ValueError(f"'config' argument expected string or dictionary, got {type(config)}")
    merged = dict(config)
    for key, value in kwargs.items():
        if key in merged and merged[key] != value:
            raise ValueError(f"Conflicting argument '{key}' in 'config':{merged[key]} and kwargs:{value}")
        merged[key] = value
    return merged


def parse_inference_config(raw: Mapping[str, Any] | None = None) -> InferenceConfig:
    """Check every key of ``raw`` (DeepSpeed's inference config) and return the :class:`InferenceConfig`.

    Raises :class:`ConfigError` naming the key for an unknown key, a wrong type, or a refused field; warns once
    for speed-only fields that are on, and once for no-effect fields given a non-default value."""
    fields: dict[str, Any] = {}
    deprecated: list[tuple[str, Any]] = []
    for key, value in (raw or {}).items():
        real = _ALIASES.get(key, key)
        if real in _DEPRECATED:
            deprecated.append((key, value))
        elif real in FIELDS:
            if real in fields:
                raise ConfigError(key, f"given twice (as {real!r} and its alias)")
            fields[real] = value
        else:
            hint = closest(key, [*FIELDS, *_ALIASES, *_DEPRECATED])
            raise ConfigError(key, "unknown inference config key" + (f" (did you mean {hint!r}?)" if hint else ""))
    tp = _section("tensor_parallel", fields.get("tensor_parallel", {}), _TP_FIELDS)
    moe_value = fields.get("moe", {})
    moe = {"enabled": _bool("moe", moe_value)} if isinstance(moe_value, bool) else \
        _section("moe", moe_value, _MOE_FIELDS, _MOE_ALIASES)
    for key, value in deprecated:
        section, sub, _ = _DEPRECATED[key]
        target = tp if section == "tensor_parallel" else moe
        if sub in target:
            raise ConfigError(key, f"is deprecated and replaced by {section}.{sub}; give one of them, not both")
        warnings.warn(f"hf_zero: inference config key {key!r} is deprecated; use {section}.{sub}", FutureWarning,
                      stacklevel=3)
        target[sub] = value

    refused = {k: v for k, v in fields.items() if FIELDS[k][1] == "refused" and v != FIELDS[k][0]}
    if refused:
        key = next(iter(refused))
        what = ("int8 quantization" if key == "quant" else
                "meta-device modules filled by DeepSpeed's kernel injection" if key == "set_empty_params" else
                "DeepSpeed's inference checkpoint loading (a checkpoint JSON / mp_rank_* files)")
        raise ConfigError(key, f"{refused[key]!r}: {what} is not implemented by hf_zero; load the weights into the "
                               "model first (from_pretrained, load_state_dict or hf_zero's engine.load_checkpoint), "
                               "then call init_inference without it")
    if tp.get("tp_group") is not None:
        raise ConfigError("tensor_parallel.tp_group", "a bare process group does not say the data-parallel "
                                                      "layout; pass tensor_parallel.mpu (an object with "
                                                      "get_model_parallel_group / get_data_parallel_group) or "
                                                      "tp_size")

    no_effect = [k for k, v in fields.items() if FIELDS[k][1] == "no_effect" and v != FIELDS[k][0]
                 and k != "moe"]
    no_effect += [f"tensor_parallel.{k}" for k in ("enabled", "tp_grain_size") if k in tp and tp[k] !=
                  _TP_FIELDS[k]]
    no_effect += [f"moe.{k}" for k, v in moe.items() if v != _MOE_FIELDS[k] and not (k == "type" and v in
                                                                                     ("standard", None))]
    if no_effect:
        why = [_NO_EFFECT_WHY]
        if any(k.startswith("tensor_parallel.") for k in no_effect):
            why.append("DeepSpeed's AutoTP shards by tp_size whatever tensor_parallel.enabled says, and hf_zero "
                       "splits layers evenly (no tp_grain_size rounding)")
        if any(k.startswith("moe") for k in no_effect):
            why.append("the model's MoE layers keep the expert groups they were built with")
        warnings.warn(f"hf_zero: inference config {', '.join(no_effect)} set but has no effect: {'; '.join(why)}",
                      UserWarning, stacklevel=3)
    speed = tuple(k for k in SPEED_ONLY if _bool(k, fields.get(k, False)))
    if speed:
        warnings.warn(f"hf_zero: {', '.join(speed)} asks for DeepSpeed's fused inference kernels / CUDA graphs, which "
                      "hf_zero does not have; the model runs with its own modules (same results, without those "
                      "kernels' speed)", UserWarning, stacklevel=3)

    policy = fields.get("injection_policy")
    if policy is not None and not isinstance(policy, Mapping):
        raise ConfigError("injection_policy", f"expected {{module class: (linear names...)}}, got {policy!r}")
    model_config = fields.get("config")
    if model_config is not None and not isinstance(model_config, Mapping):
        raise ConfigError("config", f"expected a dict, got {type(model_config).__name__}")
    return InferenceConfig(
        dtype=_dtype(fields.get("dtype", torch.float16)),
        tensor_parallel=TPInferenceConfig(tp_size=_int("tensor_parallel.tp_size", tp.get("tp_size", 1), 1),
                                          mpu=tp.get("mpu"),
                                          enabled=_bool("tensor_parallel.enabled", tp.get("enabled", True)),
                                          tp_grain_size=_int("tensor_parallel.tp_grain_size",
                                                             tp.get("tp_grain_size", 64), 1)),
        keep_module_on_host=_bool("keep_module_on_host", fields.get("keep_module_on_host", False)),
        max_out_tokens=_int("max_out_tokens", fields.get("max_out_tokens", 1024), 1),
        injection_policy=dict(policy) if policy is not None else None,
        config=dict(model_config) if model_config is not None else None,
        **{k: k in speed for k in SPEED_ONLY},
        speed_only_set=speed, no_effect_set=tuple(no_effect))


class _DeepSpeedInferenceConfigType(type):
    """Calling the class parses (one parser, one config type); ``isinstance(x, DeepSpeedInferenceConfig)`` holds for
    every parsed :class:`InferenceConfig`, as scripts check it against DeepSpeed's pydantic class."""

    def __call__(cls, **fields: Any) -> InferenceConfig:
        return parse_inference_config(fields)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, InferenceConfig)


class DeepSpeedInferenceConfig(metaclass=_DeepSpeedInferenceConfigType):
    """DeepSpeed's ``DeepSpeedInferenceConfig(**fields)``: the parsed :class:`InferenceConfig`, which
    ``InferenceEngine(model, config=...)`` takes."""
