"""``zero_optimization.offload_param``: where ZeRO-3 parameter partitions live.

What is supported today, checked once when the engine is built (never silently ignored):

* ``device: cpu`` with ZeRO-3 on CPU parameters (gloo training): the partitions already live in CPU memory and
  are gathered from there; nothing moves. Parity with the run without the section is tested.
* ``device: cpu`` with accelerator parameters, and ``device: nvme``: refused with an error that names the key.
  Both need the stage-3 gather to fetch a partition from host memory / a swap file before its all-gather, which
  the stage-3 runtime does not expose yet. The optimizer states of the same model can be offloaded to NVMe
  (``offload_optimizer``), which is where most of the memory is (12 of the 16-18 bytes per parameter).
* stages 0-2: the section has no effect (as in DeepSpeed); a warning says so.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["check_offload_config", "check_optimizer_offload", "check_param_offload"]

logger = logging.getLogger("hf_zero")


def check_param_offload(zero_config, *, stage: int, param_device: torch.device) -> None:
    """Validate ``offload_param`` against what the engine can honour; see the module docstring."""
    off = zero_config.offload_param
    if not off.enabled:
        return
    if stage != 3:
        logger.warning("hf_zero: zero_optimization.offload_param (device %r) only applies to ZeRO stage 3; "
                       "stage is %d, so it has no effect", off.device, stage)
        return
    if off.device == "nvme":
        raise ValueError("hf_zero: zero_optimization.offload_param.device='nvme' is not supported yet (stage-3 "
                         "partitions are not swapped to files). Use offload_param.device 'cpu' or 'none'; "
                         "offload_optimizer.device 'nvme' is supported and moves the optimizer states (12 bytes "
                         "per parameter) to nvme_path")
    if param_device.type != "cpu":
        raise ValueError(f"hf_zero: zero_optimization.offload_param.device='cpu' with parameters on "
                         f"{param_device} is not supported yet (the stage-3 gather does not fetch partitions from "
                         "host memory). Remove offload_param, or offload the optimizer states instead "
                         "(offload_optimizer.device 'cpu' or 'nvme')")
    logger.info("hf_zero: offload_param.device='cpu': the ZeRO-3 partitions are in CPU memory (CPU training)")


def check_offload_config(zero_config, *, stage: int, param_device: torch.device, fused_adam: bool) -> None:
    """Refuse, before the model is partitioned or cast, offload sections the engine cannot honour."""
    check_param_offload(zero_config, stage=stage, param_device=param_device)
    check_optimizer_offload(zero_config, stage=stage, fused_adam=fused_adam)


def check_optimizer_offload(zero_config, *, stage: int, fused_adam: bool) -> None:
    """``offload_optimizer`` needs a partitioned optimizer (stage >= 1) and hf_zero's fused Adam."""
    off = zero_config.offload_optimizer
    if not off.enabled:
        return
    if stage == 0:
        raise ValueError("hf_zero: zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 "
                         "(stage is 0); set zero_optimization.stage")
    if not fused_adam:
        raise ValueError(f"hf_zero: zero_optimization.offload_optimizer.device={off.device!r} runs hf_zero's CPU "
                         "Adam and needs an Adam/AdamW optimizer without amsgrad/torch_adam; remove the offload "
                         "section or use Adam/AdamW")
