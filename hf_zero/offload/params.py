"""``zero_optimization.offload_param``: where ZeRO-3 parameter shards live.

What is supported, checked once when the engine is built (never silently ignored):

* ``device: cpu`` with ZeRO-3 on CPU parameters (gloo training): the shards already live in CPU memory and
  are gathered from there; nothing moves. Parity with the run without the section is tested.
* ``device: nvme`` with ZeRO-3 on CPU parameters: every shard that is not persistent lives in a per-rank swap
  file under ``nvme_path`` and is read for its gather (ahead of time, following the recorded module order); the
  optimizer writes the updated values back. See :mod:`hf_zero.offload.param_swap`. ``zero.Init`` with the same
  config swaps shards out while the model is built, so the model is never whole in memory.
* either device when training on a GPU (ZeRO-Infinity's placement): the shards stay in pinned host memory or swap
  files, each gather stages them through pinned host memory onto the GPU, the reduced gradient shards are copied
  back to host memory, and the optimizer steps the host shards on the CPU (compiled CPU Adam).
* stages 0-2: the section has no effect (as in DeepSpeed); a warning says so.
"""

from __future__ import annotations

import logging

import torch

from hf_zero.config.policies import ZeroPolicy

__all__ = ["check_offload_config", "check_optimizer_offload", "check_param_offload"]

logger = logging.getLogger("hf_zero")


def check_param_offload(zero: ZeroPolicy, *, param_device: torch.device) -> None:
    """Validate ``offload_param`` against what the engine can honour; see the module docstring."""
    off, stage = zero.offload_param, zero.stage
    if off is None:
        return
    if stage != 3:
        logger.warning("hf_zero: zero_optimization.offload_param (device %r) only applies to ZeRO stage 3; "
                       "stage is %d, so it has no effect", off.device, stage)
        return
    if param_device.type != "cpu":
        logger.info("hf_zero: offload_param.device=%r: ZeRO-3 shards in %s, each module's parameters gathered to "
                    "%s when it runs; the optimizer steps the host shards on the CPU", off.device,
                    ("pinned " if off.pin_memory else "") + "host memory" if off.device == "cpu" else
                    "swap files under nvme_path", param_device)
        return
    if off.device == "cpu":
        logger.info("hf_zero: offload_param.device='cpu': the ZeRO-3 shards are in CPU memory (CPU training)")
    if off.pin_memory:
        # Honoured on a GPU (page-locked host shards, zero/stage3_groups.py). On a CPU run there is nothing to pin
        # for -- DeepSpeed's own documented meaning (page-locked memory for accelerator transfers) has no object
        # there, and DeepSpeed says nothing -- so this is an info line beside the others, not a warning (a warning
        # here was the first one accelerate's zero3-inference test read, ahead of its own)
        logger.info("hf_zero: zero_optimization.offload_param.pin_memory=true: training on the CPU, there is no "
                    "accelerator to copy the partitions to, so host memory stays pageable")


def check_offload_config(zero: ZeroPolicy, *, param_device: torch.device, fused_adam: bool,
                         torch_adam: bool = False) -> None:
    """Refuse, before the model is partitioned or cast, offload sections the engine cannot honour."""
    check_param_offload(zero, param_device=param_device)
    check_optimizer_offload(zero, fused_adam=fused_adam, torch_adam=torch_adam)


def check_optimizer_offload(zero: ZeroPolicy, *, fused_adam: bool, torch_adam: bool = False) -> None:
    """``offload_optimizer`` needs a partitioned optimizer (stage >= 1) and an Adam/AdamW without amsgrad: hf_zero's
    fused Adam, or (``torch_adam: true``) torch's AdamW arithmetic on the offloaded fp32 states, as DeepSpeed runs."""
    off = zero.offload_optimizer
    if off is None:
        return
    if zero.stage == 0:
        raise ValueError("hf_zero: zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 "
                         "(stage is 0); set zero_optimization.stage")
    if not (fused_adam or torch_adam):
        raise ValueError(f"hf_zero: zero_optimization.offload_optimizer.device={off.device!r} runs Adam on the "
                         "offloaded states and needs an Adam/AdamW optimizer without amsgrad; remove the offload "
                         "section or use Adam/AdamW")
