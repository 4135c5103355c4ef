"""Which dtype a module's floating buffers train in under bf16/fp16, as DeepSpeed 0.19.8 decides it.

Two places cast buffers, both DeepSpeed's:

- ``zero.Init`` with bf16 or fp16 enabled: DeepSpeed's wrapped tensor constructors make every floating tensor built
  inside the context 16-bit, buffers included (measured: BatchNorm's ``running_mean``/``running_var`` and Llama's
  ``rotary_emb.inv_freq`` come out bfloat16). hf_zero's ``Init`` casts each floating buffer as it is registered
  instead (a buffer-registration hook, hf_zero/zero/init.py), which gives the same dtypes without patching torch.
- ``initialize``: DeepSpeed casts parameters only; buffers keep the dtype they arrive in unless
  ``data_types.buffer_dtype`` names one (:func:`cast_module_buffers`), at every ZeRO stage.

In both, the buffers the model lists for fp32 stay (or become again) fp32: ``data_types.keep_in_fp32_modules``,
"auto" (default) meaning transformers' ``_keep_in_fp32_modules_strict`` (and ``_keep_in_fp32_modules`` under fp16)
of every submodule, a list meaning name patterns (``*`` for any characters, matched anywhere in the full buffer name),
``[]`` meaning none. Only buffers: parameters named there still train in the 16-bit dtype, as in DeepSpeed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.nn as nn

__all__ = ["KEEP_AUTO", "CASTABLE_DTYPES", "keep_in_fp32_pattern", "keep_buffers_in_fp32", "cast_module_buffers",
           "cast_floating", "unusable_norms"]

KEEP_AUTO = "auto"

# the floating dtypes DeepSpeed's engine casts (its CASTABLE_DTYPES); fp8 and complex buffers are left alone
CASTABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def keep_in_fp32_pattern(module: nn.Module, setting: str | Sequence[str] | None,
                         dtype: torch.dtype | None) -> re.Pattern | None:
    """The compiled pattern for the buffer names of ``module`` kept in fp32 while training in ``dtype``, or None
    when there are none (fp32 training keeps nothing: nothing is cast)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    patterns: set[str] = set()
    if setting is None or setting == KEEP_AUTO:
        for module_name, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or ())
            if dtype == torch.float16:  # the non-strict list is there for fp16's narrow range only
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or ())
            for name in names:
                pattern = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(module_name)}\..*{pattern}" if module_name else pattern)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    if not patterns:
        return None
    return re.compile("|".join(sorted(patterns)))  # re.search, as transformers matches these lists


def _kept(module: nn.Module, pattern: re.Pattern | None) -> list[tuple[nn.Module, str]]:
    if pattern is None:
        return []
    out = []
    for module_name, owner in module.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, buf in owner._buffers.items():
            if buf is not None and buf.is_floating_point() and pattern.search(prefix + name):
                out.append((owner, name))
    return out


def keep_buffers_in_fp32(module: nn.Module, pattern: re.Pattern | None) -> int:
    """Put the floating buffers of ``module`` that ``pattern`` names back in fp32; returns how many changed."""
    changed = 0
    for owner, name in _kept(module, pattern):
        buf = owner._buffers[name]
        if buf.dtype != torch.float32:
            buf.data = buf.data.float()
            changed += 1
    return changed


def cast_floating(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``buf`` in ``dtype`` when it is a castable floating tensor; itself otherwise (integer counters, masks)."""
    if buf.dtype in CASTABLE_DTYPES and buf.dtype != dtype:
        buf.data = buf.data.to(dtype)  # the same tensor object: whoever kept a reference sees the new dtype
    return buf


def cast_module_buffers(module: nn.Module, *, param_dtype: torch.dtype | None, buffer_dtype: torch.dtype | None,
                        keep: str | Sequence[str] | None = KEEP_AUTO) -> None:
    """``initialize``'s buffer rule (DeepSpeed's ``_cast_module_mixed_precision``): with 16-bit training
    (``param_dtype``), buffers named by ``keep`` become fp32 and, when ``buffer_dtype`` is set, every other castable
    floating buffer becomes ``buffer_dtype``. Nothing happens under fp32 training."""
    if param_dtype not in (torch.float16, torch.bfloat16):
        return
    pattern = keep_in_fp32_pattern(module, keep, param_dtype)
    kept = {(id(owner), name) for owner, name in _kept(module, pattern)}
    keep_buffers_in_fp32(module, pattern)
    if buffer_dtype is None:
        return
    for owner in module.modules():
        for name, buf in owner._buffers.items():
            if buf is not None and (id(owner), name) not in kept:
                cast_floating(buf, buffer_dtype)


def unusable_norms(module: nn.Module, param_dtype: torch.dtype) -> list[str]:
    """Names of the batch-norm layers whose forward cannot run once the floating parameters are ``param_dtype``
    (the buffers as they are now): 16-bit affine weights beside running
    statistics in another floating dtype. torch's batch_norm (CPU and CUDA) takes 16-bit input with fp32 weights
    *and* statistics (its mixed-type path), or everything in one dtype, nothing in between; DeepSpeed 0.19.8 leaves
    such a model as it is and fails in the first forward ("expected scalar type BFloat16 but found Float"). A
    subclass with its own forward is not judged."""
    from torch.nn.modules.batchnorm import _BatchNorm

    out = []
    for name, m in module.named_modules():
        if not isinstance(m, _BatchNorm) or type(m).forward is not _BatchNorm.forward:
            continue
        weight, stats = m.weight, m.running_mean
        if weight is None or stats is None or not stats.is_floating_point() or not weight.is_floating_point():
            continue
        if param_dtype in (torch.float16, torch.bfloat16) and stats.dtype != param_dtype:
            out.append(f"'{name or type(m).__name__}' ({type(m).__name__}: {param_dtype} weight, {stats.dtype} "
                       f"running statistics)")
    return out
