"""The ``tensor_parallel`` section of a DeepSpeed-format config, parsed once into a frozen dataclass.

    "tensor_parallel": {"autotp_size": 2}

Every key DeepSpeed documents for AutoTP training is either honoured or refused here with a ConfigError naming it:

    autotp_size              honoured: TP degree (0 or 1: off); must divide the world size
    tp.tp_size               honoured as an alias; must agree with autotp_size when both are given
    dtype                    checked: must match the engine's compute dtype (fp16/bf16 sections decide it; the
                             fp32 masters are taken before the cast, so the model is not cast here)
    vocab_parallel_lm_head   honoured: true (hf_zero's default) shards the LM head over the vocabulary with the
                             vocabulary-parallel loss; false keeps DeepSpeed's default, full logits gathered on
                             every rank
    vocab_parallel_ce_backend "torch" only ("liger" refused: not installed with hf_zero)
    tp_overlap_comm          warned: DTensor's collectives run synchronously; the key changes nothing
    tp.tp_grain_size         1 only (uneven partitions follow torch.chunk)
    sequence_parallel (also sequence_parallel_size, enable_sequence_parallel, sp_size, and under tp)
                             honoured: true (or a size equal to autotp_size) splits norms, residual adds and
                             dropout along the sequence over the TP group (sequence.py); false / 0 / 1: off; another
                             size, or asked without autotp_size > 1, refused. The sequence length must then be a
                             multiple of autotp_size (checked at each forward)
    partition_config, preset_model
                             honoured: DeepSpeed's configurable AutoTP layer specs (regular expressions over
                             parameter names -> column / row / skip, fused sub-parameter shapes) and its built-in
                             presets, translated once in layer_specs.py; they replace the model's own plan
    injection_policy_tuple, tp.mpu, tp.tp_group, keep_module_on_host, replace_with_kernel_inject, quantize_*, ...
                             refused: they belong to DeepSpeed's inference engine (a custom plan in code:
                             hf_zero.tensor_parallel.apply_tp(model, mesh, plan=...))
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from hf_zero.config.errors import ConfigError, unknown_key
from hf_zero.tensor_parallel.layer_specs import LayerSpecs, parse_layer_specs

__all__ = ["TPConfig", "parse_tp_config"]

logger = logging.getLogger("hf_zero")

SECTION = "tensor_parallel"
_KNOWN = ("autotp_size", "tp", "dtype", "vocab_parallel_lm_head", "vocab_parallel_ce_backend", "tp_overlap_comm",
          "partition_config", "preset_model")
_REFUSED = ("injection_policy_tuple", "keep_module_on_host", "replace_with_kernel_inject", "quantize_config",
            "quantize_groups", "quantize_bits", "checkpoint", "base_dir", "enabled")
# Megatron / transformers / DeepSpeed spellings of "split the norms and residual stream along the sequence between
# the TP regions" (sequence.py); a size must be the TP size: this sequence parallelism runs over the TP group
_SEQUENCE_PARALLEL = ("sequence_parallel", "sequence_parallel_size", "enable_sequence_parallel", "sp_size")
_DTYPES = {"fp32": "fp32", "float32": "fp32", "torch.float32": "fp32", "fp16": "fp16", "float16": "fp16",
           "torch.float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16"}


@dataclass(frozen=True)
class TPConfig:
    size: int = 1                       # 1: no tensor parallelism
    dtype: str | None = None            # "fp32" | "fp16" | "bf16" when the section names one
    vocab_parallel_lm_head: bool = True
    sequence_parallel: bool = False     # residual stream split along the sequence over the TP group
    layer_specs: LayerSpecs | None = None  # partition_config / preset_model: they decide the plan

    @property
    def enabled(self) -> bool:
        return self.size > 1


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{SECTION}.{key}", f"must be a non-negative integer, got {value!r}")
    return value


def _sequence_parallel(key: str, value: Any, size: int) -> bool:
    """Whether ``key: value`` asks for sequence parallelism (true, or a size equal to the TP size)."""
    if value is None or value is False or value in (0, 1) and not isinstance(value, bool):
        return False
    if value is True:
        return True
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{SECTION}.{key}", f"must be true / false or a size, got {value!r}")
    if value != size:
        raise ConfigError(f"{SECTION}.{key}", f"{value}: sequence parallelism with tensor parallelism splits the "
                                              f"sequence over the tensor-parallel group, so its size is the TP size "
                                              f"({SECTION}.autotp_size={size}); use true or {size}")
    return True


def parse_tp_config(section: Mapping[str, Any] | None) -> TPConfig:
    """Parse the raw ``tensor_parallel`` mapping (None: the section is absent)."""
    if not section:
        return TPConfig()
    if not isinstance(section, Mapping):
        raise ConfigError(SECTION, f"must be an object, got {type(section).__name__}")
    sp_keys = []  # (key, value): checked once the TP size is known
    for key in section:
        if key in _SEQUENCE_PARALLEL:
            sp_keys.append((key, section[key]))
            continue
        if key in _REFUSED:
            raise ConfigError(f"{SECTION}.{key}", "is not supported by hf_zero's tensor parallelism (it belongs to "
                                                  "DeepSpeed's inference engine; custom layer splits: "
                                                  f"{SECTION}.partition_config); remove it")
        if key not in _KNOWN:
            raise unknown_key(key, _KNOWN, f"{SECTION}.{key}")
    size = _int("autotp_size", section.get("autotp_size", 0))
    tp = section.get("tp") or {}
    if not isinstance(tp, Mapping):
        raise ConfigError(f"{SECTION}.tp", f"must be an object, got {type(tp).__name__}")
    for key in tp:
        if key in _SEQUENCE_PARALLEL:
            sp_keys.append((f"tp.{key}", tp[key]))
        elif key not in ("tp_size", "tp_grain_size"):
            raise ConfigError(f"{SECTION}.tp.{key}", "is not supported (process groups come from hf_zero's device "
                                                     "mesh; tp_size and tp_grain_size are the accepted keys)")
    if "tp_size" in tp:
        alias = _int("tp.tp_size", tp["tp_size"])
        if size and alias and alias != size:
            raise ConfigError(f"{SECTION}.tp.tp_size", f"{alias} disagrees with {SECTION}.autotp_size={size}")
        size = size or alias
    if _int("tp.tp_grain_size", tp.get("tp_grain_size", 1)) != 1:
        raise ConfigError(f"{SECTION}.tp.tp_grain_size", "only 1 is supported (uneven vocabulary / MLP splits follow "
                                                         "torch.chunk)")
    dtype = section.get("dtype")
    if dtype is not None:
        name = str(dtype)
        if name not in _DTYPES:
            raise ConfigError(f"{SECTION}.dtype", f"{dtype!r} is not one of fp32, fp16, bf16")
        dtype = _DTYPES[name]
    backend = section.get("vocab_parallel_ce_backend", "torch")
    if backend != "torch":
        raise ConfigError(f"{SECTION}.vocab_parallel_ce_backend", f"{backend!r} is not supported; use \"torch\"")
    vocab = section.get("vocab_parallel_lm_head", True)
    if not isinstance(vocab, bool):
        raise ConfigError(f"{SECTION}.vocab_parallel_lm_head", f"must be true or false, got {vocab!r}")
    if section.get("tp_overlap_comm"):
        logger.warning("hf_zero: %s.tp_overlap_comm=true changes nothing: DTensor's tensor-parallel collectives "
                       "run synchronously", SECTION)
    size = max(size, 1)
    asked = [key for key, value in sp_keys if _sequence_parallel(key, value, size)]
    if asked and size == 1:
        raise ConfigError(f"{SECTION}.{asked[0]}", "sequence parallelism splits the sequence over the tensor-parallel "
                                                   f"group, but tensor parallelism is off; set {SECTION}.autotp_size "
                                                   "> 1 or remove it")
    specs = parse_layer_specs(section.get("partition_config"), section.get("preset_model"), size)
    if specs is not None and size == 1:
        logger.warning("hf_zero: %s.%s changes nothing: tensor parallelism is off (%s.autotp_size is not > 1)",
                       SECTION, "partition_config" if "partition_config" in section else "preset_model", SECTION)
        specs = None
    if specs is not None and asked:
        raise ConfigError(f"{SECTION}.{asked[0]}", "sequence parallelism with partition_config / preset_model is "
                                                   "not supported (its norms and residual splits come from the "
                                                   "model family's plan); use one or the other")
    return TPConfig(size=size, dtype=dtype, vocab_parallel_lm_head=vocab, sequence_parallel=bool(asked),
                    layer_specs=specs)
