"""DeepSpeed's op builders for the Adam ops (``deepspeed.ops.op_builder.CPUAdamBuilder`` / ``FusedAdamBuilder``).

DeepSpeed JIT-compiles an op at ``Builder().load()`` and returns its extension module; scripts and test suites call
``is_compatible()`` to gate on an op, ``load()`` to pre-build it, and -- rarely -- the loaded module's functions
directly (``create_adam``/``adam_update`` of cpu_adam, ``multi_tensor_adam`` of fused_adam, which DeepSpeed's own
optimizers call). hf_zero's Adam kernel is built at install (hf_zero/ops/adam.py, with a pure-PyTorch reference
when the native library is missing), so ``load()`` compiles nothing: it returns a module whose functions take
DeepSpeed's arguments and run :func:`hf_zero.ops.adam.adam_step_`.
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["CPUAdamBuilder", "FusedAdamBuilder", "NotImplementedBuilder", "UNAVAILABLE_OP_NAMES"]


class _Builder:
    NAME = ""

    def __init__(self, name: str | None = None):
        self.name = self.NAME if name is None else name

    def is_compatible(self, verbose: bool = False) -> bool:
        return True  # built with hf_zero; the reference runs where the native library is missing

    def absolute_name(self) -> str:
        return f"deepspeed.ops.adam.{self.NAME}_op"

    def load(self, verbose: bool = True) -> types.ModuleType:
        raise NotImplementedError


class NotImplementedBuilder(_Builder):
    """What DeepSpeed's accelerator returns for a builder name it has none for: ``load()`` raises."""

    NAME = "deepspeed_not_implemented"

    def is_compatible(self, verbose: bool = False) -> bool:
        return False

    def absolute_name(self) -> str:
        return f"deepspeed.ops.comm.{self.NAME}_op"

    def load(self, verbose: bool = True):
        raise ValueError(f"hf_zero has no op {self.name!r} (DeepSpeed's NotImplementedBuilder)")


# ---- cpu_adam: DeepSpeedCPUAdam's op, keyed by optimizer id -------------------------------------------------------
_CPU_ADAMS: dict[int, dict[str, Any]] = {}


def _create_adam(opt_id: int, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, should_log: bool = False) -> int:
    _CPU_ADAMS[opt_id] = {"adamw_mode": bool(adamw_mode)}
    return 0


def _adam_update(opt_id: int, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 bias_correction: bool, params, grads, exp_avg, exp_avg_sq) -> int:
    """One step on ``params`` (in place, with its states), DeepSpeed's cpu_adam argument order. The optimizer's
    ``adamw_mode`` is the one given to ``create_adam``, as in DeepSpeed."""
    from hf_zero.ops.adam import adam_step_

    if opt_id not in _CPU_ADAMS:
        raise ValueError(f"cpu_adam: optimizer id {opt_id} was not created (call create_adam first)")
    adam_step_(params, grads, exp_avg, exp_avg_sq, step=int(step), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
               weight_decay=weight_decay, adamw_mode=_CPU_ADAMS[opt_id]["adamw_mode"],
               bias_correction=bool(bias_correction))
    return 0


def _destroy_adam(opt_id: int) -> int:
    _CPU_ADAMS.pop(opt_id, None)
    return 0


_CPU_ADAM_OP = types.ModuleType("cpu_adam_op", "DeepSpeed's cpu_adam op functions over hf_zero's Adam kernel")
_CPU_ADAM_OP.create_adam = _create_adam
_CPU_ADAM_OP.adam_update = _adam_update
_CPU_ADAM_OP.destroy_adam = _destroy_adam


# ---- fused_adam: FusedAdam's multi-tensor entry point -------------------------------------------------------------
def _multi_tensor_adam(chunk_size: int, noop_flag, tensor_lists, lr: float, beta1: float, beta2: float, eps: float,
                       step: int, mode: int, bias_correction: int, weight_decay: float) -> None:
    """``tensor_lists`` = [grads, params, exp_avgs, exp_avg_sqs]; ``mode`` 1 = AdamW (decoupled decay), 0 = Adam
    with L2. ``chunk_size`` and ``noop_flag`` steer CUDA launches in DeepSpeed and change no value."""
    from hf_zero.ops.adam import adam_step_

    grads, params, exp_avgs, exp_avg_sqs = tensor_lists
    for g, p, m, v in zip(grads, params, exp_avgs, exp_avg_sqs):
        adam_step_(p, g, m, v, step=int(step), lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                   adamw_mode=bool(mode), bias_correction=bool(bias_correction))


_FUSED_ADAM_OP = types.ModuleType("fused_adam_op", "DeepSpeed's fused_adam op over hf_zero's Adam kernel")
_FUSED_ADAM_OP.multi_tensor_adam = _multi_tensor_adam


class CPUAdamBuilder(_Builder):
    NAME = "cpu_adam"

    def load(self, verbose: bool = True) -> types.ModuleType:
        return _CPU_ADAM_OP


class FusedAdamBuilder(_Builder):
    NAME = "fused_adam"

    def load(self, verbose: bool = True) -> types.ModuleType:
        return _FUSED_ADAM_OP


# DeepSpeed's other builders (0.19.8, CUDA and CPU accelerators), by class name -> op name. hf_zero builds none of
# these ops: each is DeepSpeed's answer for an op the accelerator lacks (``is_compatible()`` False, ``load()``
# raises naming it), so ``from deepspeed.ops.op_builder import FusedLambBuilder`` works and a script or test that
# gates on ``is_compatible()`` takes its other path, as it would on DeepSpeed without that op.
UNAVAILABLE_OP_NAMES = {
    "FusedLambBuilder": "fused_lamb", "FusedLionBuilder": "fused_lion",
    "TransformerBuilder": "transformer", "StochasticTransformerBuilder": "stochastic_transformer",
    "InferenceBuilder": "transformer_inference", "InferenceCoreBuilder": "inference_core_ops",
    "InferenceCutlassBuilder": "cutlass_ops", "RaggedOpsBuilder": "ragged_device_ops",
    "RaggedUtilsBuilder": "ragged_ops", "QuantizerBuilder": "quantizer", "FPQuantizerBuilder": "fp_quantizer",
    "RandomLTDBuilder": "random_ltd", "SpatialInferenceBuilder": "spatial_inference",
    "EvoformerAttnBuilder": "evoformer_attn", "GDSBuilder": "gds", "DeepCompileBuilder": "dc",
    "PinMemoryBuilder": "pin_memory", "UtilsBuilder": "utils",
    "CCLCommBuilder": "deepspeed_ccl_comm", "ShareMemCommBuilder": "deepspeed_shm_comm",
}
globals().update({cls: type(cls, (NotImplementedBuilder,), {"NAME": op, "__module__": __name__,
                                                           "__doc__": f"DeepSpeed's {op} op: not built by hf_zero."})
                  for cls, op in UNAVAILABLE_OP_NAMES.items()})
