"""DeepSpeed's ``optimizer.parameter_offload`` as scripts reach into it, answered by the ZeRO-3 runtime.

TRL's trainers that generate during training (GRPO, RLOO, online DPO, distillation) wrap ``generate`` in their own
``unwrap_model_for_generation``: inside ``zero.GatheredParameters(engine.parameters())`` they take DeepSpeed's
ZeRO-3 module hooks off -- clearing every parameter's ``ds_active_sub_modules``, calling ``remove()`` on each
handle in ``parameter_offload.forward_hooks`` / ``backward_hooks`` and emptying both lists -- generate, then put
them back with ``parameter_offload._register_deepspeed_module(parameter_offload.module)`` after invalidating
``parameter_offload.param_coordinator``'s trace. Those are DeepSpeed-internal objects; :class:`ParameterOffloadView`
gives the same names their meaning here: the hook "handles" suspend :class:`~.runtime.Stage3Runtime`'s module hooks,
``_register_deepspeed_module`` resumes them, and the coordinator's trace is the runtime's gather trace. hf_zero's
own ``unwrap_model_for_generation`` (zero/gathered.py) does the same through the runtime directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

if TYPE_CHECKING:
    from .runtime import Stage3Runtime

__all__ = ["ParameterOffloadView"]


class _ModuleHooksHandle:
    """Stands for every module hook of the runtime: ``remove()`` takes them all off (once)."""

    def __init__(self, runtime: "Stage3Runtime") -> None:
        self._runtime = runtime

    def remove(self) -> None:
        if not self._runtime.hooks_suspended:
            self._runtime.suspend_module_hooks()


class _ParamCoordinatorView:
    """DeepSpeed's ``PartitionedParameterCoordinator`` as far as its trace goes: the runtime's recorded gather
    order (prefetch.py), forgotten by ``_invalidate_trace`` and recorded again at the next forward."""

    def __init__(self, runtime: "Stage3Runtime") -> None:
        self._runtime = runtime

    def is_invalid_trace(self) -> bool:
        return not self._runtime.trace.recorded

    def _invalidate_trace(self) -> None:
        self._runtime.trace.forget()


class ParameterOffloadView:
    """``engine.optimizer.parameter_offload`` under ZeRO-3 (see the module docstring)."""

    def __init__(self, runtime: "Stage3Runtime") -> None:
        self._runtime = runtime
        self.param_coordinator = _ParamCoordinatorView(runtime)

    @property
    def module(self) -> nn.Module:
        return self._runtime.module

    def get_param_coordinator(self) -> _ParamCoordinatorView:
        return self.param_coordinator

    @property
    def forward_hooks(self) -> list[_ModuleHooksHandle]:
        return [] if self._runtime.hooks_suspended else [_ModuleHooksHandle(self._runtime)]

    @forward_hooks.setter
    def forward_hooks(self, hooks: list) -> None:
        # emptied after the handles were removed; a list of DeepSpeed handles hf_zero never made cannot be adopted
        if hooks:
            raise ValueError("hf_zero ZeRO-3: parameter_offload.forward_hooks can only be emptied (its hooks are "
                             "the runtime's; _register_deepspeed_module(module) puts them back)")

    @property
    def backward_hooks(self) -> list:
        # hf_zero's backward work hangs on the forward's outputs and on the parameters' gradient hooks, which
        # generation without gradients never reaches: nothing to take off
        return []

    @backward_hooks.setter
    def backward_hooks(self, hooks: list) -> None:
        if hooks:
            raise ValueError("hf_zero ZeRO-3: parameter_offload.backward_hooks can only be emptied")

    def _register_deepspeed_module(self, module: nn.Module, count=None) -> None:
        """DeepSpeed re-registers its hooks from ``module`` down; here the runtime's hooks come back on its model."""
        if module is not self._runtime.module:
            raise ValueError("hf_zero ZeRO-3: _register_deepspeed_module is only supported on the engine's own "
                             f"module, got a {type(module).__name__}")
        self.param_coordinator._invalidate_trace()
        if self._runtime.hooks_suspended:
            self._runtime.resume_module_hooks()
