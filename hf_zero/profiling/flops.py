"""FLOPs counted at the dispatcher: torch's FLOP formulas (``torch.utils.flop_counter``) plus hf_zero's own.

Counting aten ops (not patching Python functions) sees every matmul exactly once with the shapes the kernels
receive: ZeRO-3's gathered weights, operator arithmetic, backward, activation-checkpoint recompute.

The dispatch mode is hf_zero's (:class:`_CountingMode`), the formulas are ``FlopCounterMode``'s registry. The
difference from ``FlopCounterMode`` itself: it runs every op exactly as it would run unprofiled. ``FlopCounterMode``
decomposes ops it has no formula for into their composite implementation, which changes kernels and summation
order (``embedding_dense_backward`` becomes an ``index_put``), so gradients under it are not bit-identical to a run
without it; a profiler must not change the training it measures.

torch's registry has holes; hf_zero fills them with its own formulas (:data:`HF_ZERO_FORMULAS`):

- ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward -- the kernel ``F.scaled_dot_product_
  attention`` runs on CPU by default, which torch 2.13 counts as zero FLOPs.

Two figures are reported, and the difference is named:

- **hardware FLOPs** (for HFU): everything the dispatcher ran, forward + backward, including recompute;
- **model FLOPs** (for MFU): hardware minus recompute, i.e. what the math of one training step needs. Recompute
  is (a) the score matrix ``Q K^T`` that flash-style attention backward kernels rebuild and (b) forward ops re-run
  inside backward by activation checkpointing (ops dispatched while a module's forward runs during backward).

Convention: attention is counted as the full ``S x S`` square, causal or not (as torch and DeepSpeed do).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.module_tracker import ModuleTracker

__all__ = ["FlopCounter", "FlopReport", "count_flops", "HF_ZERO_FORMULAS", "ATTENTION_CONVENTION"]

ATTENTION_CONVENTION = "attention counted as the full S x S square (causal masking not subtracted)"

aten = torch.ops.aten


def _cpu_sdpa_forward(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_sdpa_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    # the CPU flash backward rebuilds the scores from logsumexp: the same five matmuls torch counts on GPU
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


HF_ZERO_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}

# Attention kernels, forward and backward (args start ``query, key, value`` / ``grad_out, query, key, value``).
_ATTENTION_FORWARD = {aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
                      aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
                      aten._flash_attention_forward, aten._efficient_attention_forward}
_ATTENTION_BACKWARD = {aten._scaled_dot_product_flash_attention_for_cpu_backward,
                       aten._scaled_dot_product_flash_attention_backward,
                       aten._scaled_dot_product_efficient_attention_backward,
                       aten._scaled_dot_product_cudnn_attention_backward,
                       aten._flash_attention_backward, aten._efficient_attention_backward}


def _recomputed_scores(count: int, query: torch.Tensor, value: torch.Tensor) -> int:
    """The ``Q K^T`` share of an attention backward count: five matmuls, 3 of inner size d_q and 2 of d_v."""
    d_q, d_v = query.shape[-1], value.shape[-1]
    return count * d_q // (3 * d_q + 2 * d_v)


@dataclass
class FlopReport:
    """What one or more counted windows saw. All figures are FLOPs (a multiply-add is 2)."""

    forward: int = 0
    backward: int = 0
    recompute: int = 0               # part of forward+backward that re-does work (see the module docstring)
    attention_forward: int = 0       # FLOPs of fused attention kernels in forward (part of ``forward``)
    by_module: dict[str, int] = field(default_factory=dict)          # forward FLOPs per module (ancestors included)
    module_seconds: dict[str, float] = field(default_factory=dict)   # forward wall time per module
    by_op: dict[str, int] = field(default_factory=dict)

    @property
    def hardware(self) -> int:
        return self.forward + self.backward

    @property
    def model(self) -> int:
        return self.hardware - self.recompute

    @property
    def macs(self) -> int:
        return self.hardware // 2


class _CountingMode(TorchDispatchMode):
    """Runs each op unchanged, then hands the ones with a formula to ``count(packet, args, kwargs, out)``."""

    supports_higher_order_operators = True

    def __init__(self, formulas: dict[Any, Callable[..., int]], count: Callable[..., None]):
        super().__init__()
        self.formulas = formulas
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func if isinstance(func, HigherOrderOperator) else func._overloadpacket
        formula = self.formulas.get(packet)
        if formula is not None:
            self.count(packet, int(formula(*args, **kwargs, out_val=out)), args)
        return out


class FlopCounter:
    """Counts FLOPs in windows, each marked forward or backward; totals add up over windows.

        counter = FlopCounter(model)
        with counter.window("forward"):
            loss = model(**batch).loss
        with counter.window("backward"):
            loss.backward()
        counter.report.model, counter.report.hardware

    Inside a window the counting dispatch mode is active and two global module hooks (forward pre/post) track
    which module is running; both are removed when the window closes. Nothing about the computation changes.
    """

    def __init__(self, root: nn.Module | None = None, time_modules: bool = False):
        self._names: dict[int, str] = {}
        if root is not None:
            self._names = {id(m): (name or type(root).__name__) for name, m in root.named_modules()}
        self.time_modules = time_modules
        self.report = FlopReport(by_module=defaultdict(int), module_seconds=defaultdict(float), by_op=Counter())
        self._phase = "forward"
        self._tracker: ModuleTracker | None = None
        self._stack: list[tuple[str, float]] = []

    @staticmethod
    def _formulas() -> dict[Any, Callable[..., int]]:
        """torch's registry plus hf_zero's; each is called ``f(*args, out_val=out, **kwargs)`` with the tensors."""
        table = dict(flop_registry)
        # overrides torch's own entry if a later torch adds one: never counted twice
        table.update(HF_ZERO_FORMULAS)
        return table

    def _add(self, packet, n: int, args: tuple) -> None:
        r = self.report
        r.by_op[str(packet)] += n
        phase = self._phase
        if phase == "auto":
            phase = "backward" if self._tracker is not None and self._tracker.is_bw else "forward"
        if phase == "forward":
            r.forward += n
            if packet in _ATTENTION_FORWARD:
                r.attention_forward += n
            for name in {name for name, _ in self._stack}:
                r.by_module[name] += n
            return
        r.backward += n
        if self._stack:  # a module's forward running inside backward: activation-checkpoint recompute
            r.recompute += n
        elif packet in _ATTENTION_BACKWARD:
            r.recompute += _recomputed_scores(n, args[1], args[3])

    # ---- module tracking (global hooks, only while a window is open) ------------------------------------------
    def _pre(self, module, args):
        name = self._names.get(id(module), type(module).__name__)
        if self.time_modules:
            _sync()
        self._stack.append((name, time.perf_counter()))

    def _post(self, module, args, output):
        if not self._stack:
            return
        name, start = self._stack.pop()
        if self.time_modules and self._phase != "backward":
            _sync()
            self.report.module_seconds[name] += time.perf_counter() - start

    @contextmanager
    def window(self, phase: str) -> Iterator["FlopCounter"]:
        """Count inside the block as ``phase``: "forward", "backward", or "auto" (backward from the moment
        autograd reaches a module's outputs, as torch's ModuleTracker sees it)."""
        if phase not in ("forward", "backward", "auto"):
            raise ValueError(f"FlopCounter.window: phase must be 'forward', 'backward' or 'auto', got {phase!r}")
        self._phase = phase
        self._stack.clear()
        hooks = [nn.modules.module.register_module_forward_pre_hook(self._pre),
                 nn.modules.module.register_module_forward_hook(self._post, always_call=True)]
        try:
            with ExitStack() as stack:
                # torch.compile'd code runs eagerly inside the window: a dispatch mode active when dynamo first
                # meets a frame makes it skip that code for the rest of the process (no module of that class would
                # ever be compiled), and compiled kernels would not be counted anyway. Compiled from the next call.
                stack.enter_context(torch.compiler.set_stance("force_eager"))
                if phase == "auto":
                    self._tracker = stack.enter_context(ModuleTracker())
                stack.enter_context(_CountingMode(self._formulas(), self._add))
                yield self
        finally:
            self._tracker = None
            for h in hooks:
                h.remove()
            self._stack.clear()


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _loss_of(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor):
        loss = output if output.numel() == 1 else output.float().sum()
    if loss is None:
        raise ValueError("count_flops: the model's output has no .loss and is not a tensor; pass loss_fn= to turn "
                         "the output into a scalar loss, or backward=False to count the forward pass only")
    return loss


def count_flops(model: nn.Module, *args, backward: bool = True, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                time_modules: bool = False, **kwargs) -> FlopReport:
    """Count one forward (and, by default, one backward) of ``model(*args, **kwargs)``.

    The backward runs ``loss.backward()`` on ``loss_fn(output)`` (default: ``output.loss``, or the output itself
    when it is a tensor); gradients accumulate into the model as in any backward.
    """
    counter = FlopCounter(model, time_modules=time_modules)
    with counter.window("forward"):
        output = model(*args, **kwargs)
        loss = loss_fn(output) if loss_fn is not None else (_loss_of(output) if backward else None)
    if backward:
        with counter.window("backward"):
            loss.backward()
    return counter.report
