"""``deepspeed.init_inference``'s configuration, parsed once into a frozen :class:`InferenceConfig`.

The sections declare every field of DeepSpeed 0.19.8's ``DeepSpeedInferenceConfig`` (names, aliases, defaults) and
are read by the training config's parser (hf_zero/config/schema.py). Each field's metadata ``status`` says what
hf_zero does with it, so nothing set is silently dropped: none, honoured; ``SPEED``, DeepSpeed's fused kernels / CUDA
graphs (one warning names them; the model runs with its own modules); ``NO_EFFECT``, read only by DeepSpeed's injected
kernels (a value other than the default warns, naming it); ``REFUSED``, changes the weights or the numbers and is not
implemented (a value other than the default is an error naming it). Explicit code keeps DeepSpeed's dtype spellings
(int8 refused), ``moe``'s bool form and the deprecated flat names, which move to their sections as DeepSpeed moves
them (``mp_size`` -> ``tensor_parallel.tp_size``, ...; giving both is refused, as DeepSpeed does).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hf_zero.config.errors import ConfigError
from hf_zero.config.schema import AUTO, Auto, json_fields, parse, spec, to_dict

__all__ = ["InferenceConfig", "TPInferenceConfig", "parse_inference_config", "merge_inference_config",
           "DeepSpeedInferenceConfig", "SPEED_ONLY"]

# DeepSpeed's dtype spellings (its DtypeEnum), each to the torch dtype it means
_DTYPES = {
    torch.float16: ("torch.float16", "fp16", "float16", "half"),
    torch.float32: ("torch.float32", "fp32", "float32", "float"),
    torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16", "bfloat"),
    torch.int8: ("torch.int8", "int8"),
}
SPEED, NO_EFFECT, REFUSED = "speed", "no_effect", "refused"  # a field's metadata "status"; honoured fields have none
_NO_EFFECT_WHY = "it is read only by DeepSpeed's injected inference kernels; the model runs with its own modules"
_LOAD_FIRST = ("is not implemented by hf_zero; load the weights into the model first (from_pretrained, "
               "load_state_dict or hf_zero's engine.load_checkpoint), then call init_inference without it")
_CHECKPOINT = f"DeepSpeed's inference checkpoint loading (a checkpoint JSON / mp_rank_* files) {_LOAD_FIRST}"
# deprecated flat name -> (section, its key there), moved as DeepSpeed moves them
_DEPRECATED = {"mp_size": ("tensor_parallel", "tp_size"), "mpu": ("tensor_parallel", "mpu"),
               "ep_size": ("moe", "ep_size"), "ep_group": ("moe", "ep_group"), "expert_group": ("moe", "ep_group"),
               "ep_mp_group": ("moe", "ep_mp_group"), "expert_mp_group": ("moe", "ep_mp_group"),
               "moe_experts": ("moe", "moe_experts"), "moe_type": ("moe", "type")}


@dataclass(frozen=True, kw_only=True)
class TPInferenceConfig:
    """``tensor_parallel``: ``tp_size`` ranks share each layer (hf_zero's tensor parallelism); ``mpu``: the caller's
    model-parallel unit, whose groups then decide the layout."""

    no_effect_why: ClassVar[str] = ("DeepSpeed's AutoTP shards by tp_size whatever tensor_parallel.enabled says, and "
                                    "hf_zero splits layers evenly (no tp_grain_size rounding)")

    tp_size: int = spec(1, minimum=1, help="Ranks that share each layer.")
    mpu: Any = spec(None, help="Model-parallel unit (get_model_parallel_group / get_data_parallel_group).")
    enabled: bool = spec(True, status=NO_EFFECT, help="DeepSpeed's AutoTP switch.")
    tp_grain_size: int = spec(64, minimum=1, status=NO_EFFECT, help="DeepSpeed's AutoTP shard rounding.")
    tp_group: Any = spec(None, status=REFUSED, help="A tensor-parallel process group.", refused=(
        "a bare process group does not say the data-parallel layout; pass tensor_parallel.mpu (an object with "
        "get_model_parallel_group / get_data_parallel_group) or tp_size"))


@dataclass(frozen=True, kw_only=True)
class MoEInferenceConfig:
    """``moe`` (or a bool, its ``enabled``): DeepSpeed's expert-parallel groups for its injected MoE kernels."""

    no_effect_why: ClassVar[str] = "the model's MoE layers keep the expert groups they were built with"

    enabled: bool = spec(True, status=NO_EFFECT, help="The model is a mixture of experts.")
    ep_size: int = spec(1, status=NO_EFFECT, help="Expert-parallel ranks.")
    moe_experts: tuple[int, ...] = spec((1,), aliases=("num_experts",), status=NO_EFFECT, help="Experts per layer.")
    type: str | None = spec("standard", status=NO_EFFECT, help="'standard' or 'residual' (None: standard).")
    ep_mp_group: Any = spec(None, status=NO_EFFECT, help="Expert model-parallel process group.")
    ep_group: Any = spec(None, aliases=("expert_group",), status=NO_EFFECT, help="Expert-parallel process group.")


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    """The parsed inference config; attribute names are DeepSpeed's, so ``engine._config.dtype`` and
    ``engine._config.tensor_parallel.tp_size`` read as they do there."""

    _strict_keys: ClassVar[bool] = True  # DeepSpeed's inference config refuses unknown keys, top level included

    dtype: Any = spec(torch.float16, help="The model's dtype: a torch.dtype or a DeepSpeed spelling ('fp16', ...).")
    tensor_parallel: TPInferenceConfig = spec(default_factory=TPInferenceConfig, aliases=("tp",),
                                              help="Tensor parallelism over the ranks.")
    keep_module_on_host: bool = spec(False, help="Leave the model where it is instead of moving it to the device.")
    max_out_tokens: int = spec(1024, aliases=("max_tokens",), minimum=1, help="Longest input generate() takes.")
    injection_policy: Mapping | None = spec(None, aliases=("injection_dict",),
                                            help="{module class: (its row-parallel linears' names...)}: the plan.")
    config: Mapping | None = spec(None, aliases=("args",), help="Replaces the model's config as engine.config.")
    replace_with_kernel_inject: bool = spec(False, aliases=("kernel_inject",), status=SPEED,
                                            help="DeepSpeed's fused inference kernels.")
    enable_cuda_graph: bool = spec(False, status=SPEED, help="Capture and replay CUDA graphs.")
    use_triton: bool = spec(False, status=SPEED, help="DeepSpeed's Triton kernels.")
    triton_autotune: bool = spec(False, status=SPEED, help="Autotune DeepSpeed's Triton kernels.")
    zero: Mapping = spec(default_factory=dict, status=NO_EFFECT, help="ZeRO settings of DeepSpeed's injected engine.")
    moe: MoEInferenceConfig = spec(default_factory=MoEInferenceConfig, help="Mixture-of-experts settings.")
    triangular_masking: bool = spec(True, aliases=("tm",), status=NO_EFFECT, help="Causal masking in the kernels.")
    return_tuple: bool = spec(True, status=NO_EFFECT, help="Injected layers return a tuple.")
    min_out_tokens: int = spec(1, aliases=("min_tokens",), status=NO_EFFECT, help="Tokens the kernels reserve.")
    transposed_mode: bool = spec(False, status=NO_EFFECT, help="Transposed weights in the kernels.")
    injection_policy_tuple: Any = spec(None, status=NO_EFFECT, help="DeepSpeed's internal form of injection_policy.")
    replace_method: str | Auto = spec(AUTO, auto=True, status=NO_EFFECT, help="Deprecated in DeepSpeed.")
    quant: Mapping = spec(default_factory=dict, status=REFUSED, refused=f"int8 quantization {_LOAD_FIRST}",
                          help="int8 weight quantization.")
    checkpoint: str | Mapping | None = spec(None, status=REFUSED, refused=_CHECKPOINT,
                                            help="A DeepSpeed checkpoint, or a JSON naming its files.")
    base_dir: str = spec("", status=REFUSED, refused=_CHECKPOINT, help="The checkpoint files' directory.")
    set_empty_params: bool = spec(False, status=REFUSED, help="Build the model on the meta device.",
                                  refused=f"meta-device modules filled by DeepSpeed's kernel injection {_LOAD_FIRST}")
    save_mp_checkpoint_path: str | None = spec(None, status=REFUSED, refused=_CHECKPOINT,
                                               help="Save the loaded checkpoint resharded.")
    checkpoint_config: Mapping = spec(default_factory=dict, aliases=("ckpt_config",), status=REFUSED,
                                      refused=_CHECKPOINT, help="How the checkpoint is loaded.")
    training_mp_size: int = spec(1, status=REFUSED, refused=_CHECKPOINT, help="The checkpoint's model-parallel size.")

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype(self.dtype))
        for key in ("injection_policy", "config"):  # plain dicts, as DeepSpeed's engine holds them
            if getattr(self, key) is not None:
                object.__setattr__(self, key, dict(getattr(self, key)))
        for path, f, value in _set_fields(self):
            minimum = f.metadata.get("minimum")
            if minimum is not None and value < minimum:
                raise ConfigError(path, f"expected an integer >= {minimum}, got {value!r}")
            if f.metadata.get("status") == REFUSED:
                raise ConfigError(path, f"{to_dict(value)!r}: {f.metadata['refused']}")

    @property
    def speed_only_set(self) -> tuple[str, ...]:  # the speed-only fields set, for the one warning
        return _set_paths(self, SPEED)

    @property
    def no_effect_set(self) -> tuple[str, ...]:  # the no-effect fields (key paths) given a non-default value
        return _set_paths(self, NO_EFFECT)


SPEED_ONLY = tuple(f.name for f in json_fields(InferenceConfig) if f.metadata.get("status") == SPEED)


def _set_fields(obj: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(key path, field, value) for each field of ``obj`` and of its sections whose value is not the default
    (``None`` counts as the default: DeepSpeed's ``moe_type=None`` is its standard type)."""
    for f in json_fields(type(obj)):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _set_fields(value, f"{prefix}{f.name}.")
        elif value not in (f.default if f.default_factory is dataclasses.MISSING else f.default_factory(), None):
            yield f"{prefix}{f.name}", f, value


def _set_paths(obj: Any, status: str) -> tuple[str, ...]:
    return tuple(path for path, f, _ in _set_fields(obj) if f.metadata.get("status") == status)


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


def _names(cls: type, name: str) -> tuple[str, ...]:
    """The keys a field of ``cls`` is given under: its name and its aliases."""
    return (name, *cls.__dataclass_fields__[name].metadata["aliases"])


def _move_deprecated(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with ``moe``'s bool form as its ``enabled`` and each deprecated flat name moved into its section
    (warned); a flat name whose new key is given too is refused."""
    out = dict(raw)
    if isinstance(out.get("moe"), bool):
        out["moe"] = {"enabled": out["moe"]}
    for key in [k for k in out if k in _DEPRECATED]:
        section, sub = _DEPRECATED[key]
        value = out.pop(key)
        name = next((n for n in _names(InferenceConfig, section) if n in out), section)
        given = out.get(name, {})
        if not isinstance(given, Mapping):
            continue  # parsing names the section's wrong type
        if any(n in given for n in _names(InferenceConfig.__dataclass_fields__[section].default_factory, sub)):
            raise ConfigError(key, f"is deprecated and replaced by {section}.{sub}; give one of them, not both")
        warnings.warn(f"hf_zero: inference config key {key!r} is deprecated; use {section}.{sub}", FutureWarning,
                      stacklevel=4)
        out[name] = {**given, sub: value}
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
    config = parse(InferenceConfig, _move_deprecated(raw or {}))
    no_effect = config.no_effect_set
    if no_effect:
        sections = dict.fromkeys(path.split(".")[0] for path in no_effect if "." in path)
        why = [_NO_EFFECT_WHY, *(getattr(config, section).no_effect_why for section in sections)]
        warnings.warn(f"hf_zero: inference config {', '.join(no_effect)} set but has no effect: {'; '.join(why)}",
                      UserWarning, stacklevel=3)
    speed = config.speed_only_set
    if speed:
        warnings.warn(f"hf_zero: {', '.join(speed)} asks for DeepSpeed's fused inference kernels / CUDA graphs, which "
                      "hf_zero does not have; the model runs with its own modules (same results, without those "
                      "kernels' speed)", UserWarning, stacklevel=3)
    return config


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
