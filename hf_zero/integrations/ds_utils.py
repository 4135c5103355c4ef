"""DeepSpeed's small helpers that training scripts call directly, with DeepSpeed's signatures and results.

``deepspeed.utils``: :func:`log_dist`, :func:`print_dist` (a message on the chosen ranks, prefixed
``[Rank r]``), :class:`OnDevice` (build a module's tensors on a device, e.g. ``meta``, in a dtype).
``deepspeed.runtime.utils``: :func:`see_memory_usage`, :func:`clip_grad_norm_`, :func:`get_global_norm`.
``deepspeed.utils.module_utils`` (and its old home ``deepspeed.compression.helper``, which DeepSpeed-Chat's LoRA
module imports): :func:`recursive_getattr`, :func:`recursive_setattr`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Union

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from hf_zero.comm.accelerator import get_accelerator
from hf_zero.integrations.compat import logger
from hf_zero.profiling.memory_usage import see_memory_usage

__all__ = ["log_dist", "print_dist", "OnDevice", "see_memory_usage", "clip_grad_norm_", "get_global_norm",
           "required_torch_version", "empty_cache", "recursive_getattr", "recursive_setattr", "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable"]


# deepspeed.runtime.engine's type aliases: what initialize(optimizer=..., lr_scheduler=...) may also be given
DeepSpeedOptimizerCallable = Callable[[Union[Iterable[torch.nn.Parameter], dict]], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def recursive_getattr(model, module_name: str):
    """``model.a.b.c`` for ``module_name="a.b.c"`` (an AttributeError names the first missing part)."""
    out = model
    for part in module_name.split("."):
        out = getattr(out, part)
    return out


def recursive_setattr(model, module_name: str, module) -> None:
    """Sets ``model.a.b.c = module`` for ``module_name="a.b.c"`` (DeepSpeed-Chat swaps in its LoRA layers so)."""
    parent, _, leaf = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, leaf, module)


def empty_cache() -> None:
    """``deepspeed.runtime.utils.empty_cache``: release the accelerator's cached memory and restart its peak count."""
    acc = get_accelerator()
    acc.empty_cache()
    acc.reset_peak_memory_stats()


def required_torch_version(min_version=None, max_version=None) -> bool:
    """``deepspeed.utils.torch.required_torch_version``: whether the installed torch lies in [min, max] (versions as
    numbers or strings, "2.4" meaning 2.4.0). Scripts gate features on it."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give min_version or max_version")
    installed = TorchVersion(torch.__version__.split("+")[0])  # compares with version strings, as DeepSpeed's does
    if min_version is not None and installed < str(min_version):
        return False
    return max_version is None or installed <= str(max_version)


# ---- rank-filtered messages ---------------------------------------------------------------------------------------
def _dist_message(message, ranks: Iterable[int] | None) -> str | None:
    """``"[Rank r] message"`` when this rank should say it: always before the process group exists (rank -1), else
    when this rank is in ``ranks`` or ``ranks`` starts with -1 (every rank). None otherwise; no ranks: nobody."""
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else -1
    ranks = list(ranks or [])
    if initialized and not (ranks and (ranks[0] == -1 or rank in ranks)):
        return None
    return f"[Rank {rank}] {message}"


def log_dist(message, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on DeepSpeed's logger (hf_zero's) on the given ranks (``[-1]``: all)."""
    text = _dist_message(message, ranks)
    if text is not None:
        logger.log(level, text)


def print_dist(message, ranks: Iterable[int] | None = None) -> None:
    """:func:`log_dist`, printed to stdout whatever the log level."""
    text = _dist_message(message, ranks)
    if text is not None:
        print(text)


# ---- OnDevice -----------------------------------------------------------------------------------------------------
class OnDevice:
    """``with OnDevice(dtype=torch.float16, device="meta"): model = MyModel()``: tensors created inside land on
    ``device``, and floating-point ones default to ``dtype``.

    DeepSpeed patches ``torch.empty``/``zeros``/``ones``/``full`` and ``Tensor.__new__``; here torch's own device
    context (``with torch.device(...)``) and ``torch.set_default_dtype`` do it, restored on exit. One difference: a
    tensor created with an explicit floating ``dtype=`` keeps it (DeepSpeed converts it too). ``dtype=None`` leaves
    dtypes alone; ``enabled=False`` makes the block a no-op.
    """

    def __init__(self, dtype: torch.dtype | None, device="meta", enabled: bool = True):
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"OnDevice: dtype must be a floating-point dtype (or None), got {dtype}")
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._device_context = None
        self._saved_dtype: torch.dtype | None = None

    def __enter__(self):
        if not self.enabled:
            return self
        self._device_context = torch.device(self.device)
        self._device_context.__enter__()
        if self.dtype is not None:
            self._saved_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self._saved_dtype is not None:
            torch.set_default_dtype(self._saved_dtype)
            self._saved_dtype = None
        self._device_context.__exit__(*exc)
        self._device_context = None


# ---- gradient norms -----------------------------------------------------------------------------------------------
def _is_invalid_norm(norm) -> bool:
    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


def get_global_norm(norm_list) -> float:
    """The 2-norm of per-group 2-norms, ``sqrt(sum(n**2))``; ``inf`` if any is inf, NaN or negative."""
    if any(_is_invalid_norm(norm) for norm in norm_list):
        return float("inf")
    return math.sqrt(sum(norm**2.0 for norm in norm_list))


def _is_model_parallel(p: torch.Tensor) -> bool:
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2, mpu=None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so their total ``norm_type``-norm is at most ``max_norm``;
    returns that total norm (a tensor), as DeepSpeed's:

    - with ``mpu``, each model-parallel rank adds its share (parameters marked ``model_parallel`` /
      ``tensor_model_parallel``, the rest counted once on model-parallel rank 0) over
      ``mpu.get_model_parallel_group()``;
    - the norm is then *averaged* over the data-parallel ranks (DeepSpeed does this because MoE experts differ
      per rank; for replicated gradients it changes nothing). Without a process group there is one rank.
    - every gradient is multiplied by ``min(1, max_norm / (norm + 1e-6))``.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    if not parameters:
        raise ValueError("clip_grad_norm_: no parameter has a gradient")
    norm_type = float(norm_type)
    initialized = dist.is_available() and dist.is_initialized()
    device = get_accelerator().current_device_name()  # where the collectives below can run
    if norm_type == math.inf:
        total = torch.stack([p.grad.detach().abs().max().float() for p in parameters]).max().to(device)
        if mpu is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    else:
        norms = [p.grad.detach().float().norm(norm_type) for p in parameters
                 if mpu is None or mpu.get_model_parallel_rank() == 0 or _is_model_parallel(p)]
        # sum_i ||g_i||_p ** p, rooted after the model-parallel sum
        total = (torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros(1)).to(device)
        if mpu is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
        total = total.pow(1.0 / norm_type)
    if initialized:
        total = total / float(dist.get_world_size())
        dist.all_reduce(total)
    total = total.to(parameters[0].device)
    clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in parameters:
        p.grad.detach().mul_(clip_coef.to(p.grad.dtype))
    return total
