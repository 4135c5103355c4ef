"""Training states of ZeRO-3's units, and the one object that moves them.

A *unit* is one forward call of a module that has a group (``ModuleCall``); its backward hooks refer to it, so a
module called twice in a forward has two units with their own backward. Its state::

    FORWARD ----------.                              (started while the pass is not in backward)
                       >-- forward ends --> IDLE --> PRE_BACKWARD --> POST_BACKWARD
    RECOMPUTE --------'                     ^        (output grad)    (PostBackward / last gradient)
        |                                   |
        '-- stopped early (settled) --------'

A call is a RECOMPUTE when it starts while the pass is in backward: activation checkpointing re-running the
forward. Whether the pass is in backward is the runtime's own knowledge, not the autograd engine's: the engine's
backward prologue, a gradient hook on the root module's outputs, and every backward event of a unit (pre-backward,
post-backward, an arriving gradient) open it; ``finish_backward`` and the next iteration close it. So a
recomputation is recognised with either kind of checkpointing: reentrant checkpointing recomputes inside its
autograd Function's backward, non-reentrant inside a saved-tensor unpack, and both come after the output gradient
hook of the engine or root.

:class:`TrainingStates` owns every transition; the runtime decides what to gather and free on each.
"""

from __future__ import annotations

import enum

import torch.nn as nn

__all__ = ["TrainingState", "ModuleCall", "TrainingStates"]


class TrainingState(enum.Enum):
    IDLE = "idle"                    # its forward is over and its backward has not started (or never will)
    FORWARD = "forward"              # in its forward
    RECOMPUTE = "recompute"          # in a forward re-run during a backward pass (activation checkpointing)
    PRE_BACKWARD = "pre-backward"    # its backward has started: the group is held for it
    POST_BACKWARD = "post-backward"  # its backward is over: the group's backward hold is released


class ModuleCall:
    """One forward call of one module with a group: the unit the backward hooks refer to."""

    __slots__ = ("group", "state", "has_post_backward", "grads_pending")

    def __init__(self, group, state: TrainingState) -> None:
        self.group = group
        self.state = state
        self.has_post_backward = False  # some input required grad, so PostBackward will fire
        self.grads_pending: set[int] = set()  # without PostBackward: ds_ids whose gradients end this backward


class TrainingStates:
    """Whether the pass is in backward, and every unit's state, with the only methods that change them.

    Also the forward calls in progress: per module the stack of its open calls, and across modules the order they
    started in (innermost last), including modules without a group that are only tracked (call ``None``), so the
    innermost module in forward is known for parameter reads and error messages."""

    def __init__(self) -> None:
        self.in_backward = False
        self._open: dict[int, list[ModuleCall]] = {}  # id(module) -> stack of its calls in forward
        self._stack: list[tuple[nn.Module, ModuleCall | None]] = []  # calls in forward, innermost last

    # ---- the pass ------------------------------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """The root module's forward starts a new iteration: nothing is open, the pass is forward."""
        self.in_backward = False
        self.clear()

    def begin_backward(self) -> None:
        self.in_backward = True

    def end_backward(self) -> None:
        self.in_backward = False

    def clear(self) -> None:
        """Forget every open call (between iterations, or after an exception left some open)."""
        self._open.clear()
        self._stack.clear()

    # ---- forward -------------------------------------------------------------------------------------------------
    def start_forward(self, module: nn.Module, group) -> ModuleCall:
        call = ModuleCall(group, TrainingState.RECOMPUTE if self.in_backward else TrainingState.FORWARD)
        self._open.setdefault(id(module), []).append(call)
        self._stack.append((module, call))
        return call

    def end_forward(self, module: nn.Module) -> tuple[ModuleCall, bool] | None:
        """Close ``module``'s innermost open call: (the call, now IDLE; whether it was a recomputation). None when
        it has none open (hooks of an iteration that was reset under it, e.g. by an exception)."""
        stack = self._open.get(id(module))
        if not stack:
            return None
        call = stack.pop()
        if not stack:
            del self._open[id(module)]
        self._unstack(call)
        recomputed = call.state is TrainingState.RECOMPUTE
        call.state = TrainingState.IDLE
        return call, recomputed

    def stop_recomputations(self) -> list[ModuleCall]:
        """At a backward event no recomputation is running (it runs synchronously inside one autograd node), so
        recomputed calls still open were stopped early: non-reentrant checkpointing stops once it has every tensor
        it needs, skipping the rest of the forward and its post-forward hooks. Closes and returns them."""
        stopped: list[ModuleCall] = []
        for key in list(self._open):
            stack = self._open[key]
            for call in [c for c in stack if c.state is TrainingState.RECOMPUTE]:
                stack.remove(call)
                self._unstack(call)
                call.state = TrainingState.IDLE
                stopped.append(call)
            if not stack:
                del self._open[key]
        return stopped

    def track(self, module: nn.Module) -> None:
        """A module without a group starts its forward: only its place in the nesting is recorded."""
        self._stack.append((module, None))

    def untrack(self, module: nn.Module) -> None:
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] is module and self._stack[i][1] is None:
                del self._stack[i]
                return

    def any_open(self) -> bool:
        return bool(self._open)

    def innermost(self) -> tuple[nn.Module, ModuleCall | None] | None:
        """The innermost module in forward, and its call (None: a module without a group)."""
        return self._stack[-1] if self._stack else None

    def innermost_with_group(self) -> tuple[nn.Module, ModuleCall] | None:
        for module, call in reversed(self._stack):
            if call is not None:
                return module, call
        return None

    def _unstack(self, call: ModuleCall) -> None:
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][1] is call:
                del self._stack[i]
                return

    # ---- backward ------------------------------------------------------------------------------------------------
    def start_backward_of(self, call: ModuleCall) -> bool:
        """The first gradient of one of ``call``'s outputs arrived: its backward starts. False if it had already."""
        return self._advance(call, TrainingState.IDLE, TrainingState.PRE_BACKWARD)

    def end_backward_of(self, call: ModuleCall) -> bool:
        """``call``'s backward is over. False unless it was in PRE_BACKWARD (never started, or already ended)."""
        return self._advance(call, TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)

    def _advance(self, call: ModuleCall, source: TrainingState, target: TrainingState) -> bool:
        self.in_backward = True  # only backward events move a call out of IDLE
        if call.state is not source:
            return False
        call.state = target
        return True
