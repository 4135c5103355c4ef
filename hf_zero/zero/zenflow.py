"""ZenFlow (``zero_optimization.zenflow``): selective device updates between offloaded-optimizer steps.

With ZeRO-1/2/3 and ``offload_optimizer``, every micro-step ``t`` (0-based, the engine's ``micro_steps``)::

    t <  W                       warm-up: a full offloaded-optimizer step every micro-step
    t >= W                       the micro-step's averaged gradient of the *selected* columns of every 2-D weight,
                                 and of every 1-D parameter whole, is applied at once on the device by a selective
                                 AdamW (own moments, 16-bit like the weights); the full gradient accumulates
    update boundary              (t+1-W) % U == 0, or (t+1) % S == 0: the offloaded optimizer steps on the
                                 accumulated gradient (Adam step count t+1), the 16-bit weights are published from
                                 its masters, then the selected columns and 1-D parameters get back their values
                                 from before that step plus this micro-step's selective update -- the offloaded
                                 step moves only the unselected columns
    select boundary              t == W, or t % S == 0 (t >= W): before backward the masters are re-read from the
                                 weights (they hold the selective updates) and the selective moments are zeroed
                                 (their step counts are kept); after backward the top-k columns are chosen by
                                 the sum of |gradient| over each column (input feature) of the averaged gradient

    W = full_warm_up_rounds, U = update_interval (it also replaces gradient_accumulation_steps: the loss is divided
    by U), S = select_interval in micro-steps (select_strategy 'epoch'/'auto': epochs of the initialize()
    dataloader; 0: selected once)

overlap_step (DeepSpeed's asynchronous offloaded step): from the first update after warm-up on, an update boundary
shows the weights of the previous update (the first one after warm-up -- with no warm-up also the very first -- is
never shown), and the Adam moments come in two sets used alternately by the parity of ``t // U`` (of ``t`` in
warm-up). hf_zero computes that step in order: the same numbers, without the speed-up.

The learning rate schedule steps every micro-step (update or not); the selective optimizer takes the scheduler's
learning rate at each ``engine.step()`` (the selective update during micro-step t's backward uses the one of step
t-1, the config's before the first step). Its other hyper-parameters are the config optimizer's, with torch AdamW's
defaults (weight_decay 0.01) where the config has none. Columns are chosen per rank's slice of DeepSpeed's flat
ZeRO-1/2 partition (``k = max(1, int(columns * topk_ratio))`` per slice, a column cut by a partition boundary is in
neither), so the selection at N ranks is DeepSpeed's.

This is DeepSpeed 0.19.8's algorithm (``runtime/zenflow``, ``ops/adam/zenflow_*``) without two of its layout
defects, which ``tests/test_zenflow.py`` reproduces in its reference to match DeepSpeed's recorded numbers: its
flat ZeRO buffer holds 2-D weights transposed but the weights are viewed from it untransposed (each weight starts
as ``W.T.reshape(W.shape)`` and the offloaded update lands on transposed positions), and its column sums are read
from the reduce bucket at an offset that skips the 1-D parameters before the weight (on N ranks from the owner's
bucket, where other partitions hold its unreduced gradient).

Stage 3 (DeepSpeed's ``runtime/zenflow/engine_stage3.py``): each rank updates the elements of its own shard that
lie in the selected columns (and its piece of each 1-D parameter); the moments cover those elements only. Columns
are chosen as DeepSpeed's stage 3 chooses them: one top-k per weight over every rank's *complete* columns of its
partition of the weight stored transposed (``k = max(1, int(complete columns * topk_ratio))``; a column cut by a
partition boundary is never chosen), the same columns on every rank (:func:`deepspeed_stage3_columns`). Its numbers
equal DeepSpeed 0.19.8's stage-3 runs on 1 and 2 ranks (``tests/test_zenflow.py``), whose stage 3 has neither layout
defect. After a selective update the persistent parameters' full copies are re-gathered.

Gradients are taken with tensor hooks (the micro-step's gradient of each parameter, before it is accumulated or
reduced); one all-reduce per micro-step averages the selected columns (the whole weights at a select boundary).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from hf_zero.comm import all_reduce_
from hf_zero.config.errors import ConfigError
from hf_zero.config.policies import ZenFlowPolicy
from hf_zero.zero.local import local_tensor

__all__ = ["ZenFlowSchedule", "ZenFlow", "selective_adamw_", "deepspeed_column_slices", "deepspeed_stage3_columns"]

logger = logging.getLogger("hf_zero")

_ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


@dataclass(frozen=True, kw_only=True)
class ZenFlowSchedule:
    """The schedule in micro-steps."""

    topk_ratio: float
    update_interval: int
    select_interval: int  # 0: the columns chosen at the first selective step are kept
    full_warm_up_rounds: int

    @classmethod
    def resolve(cls, policy: ZenFlowPolicy, steps_per_epoch: int | None) -> "ZenFlowSchedule":
        """``steps_per_epoch``: length of the initialize() dataloader (None without one: an epoch-based selection
        then happens once, as in DeepSpeed)."""
        interval = policy.select_interval
        if policy.select_per_epoch:
            interval = interval * steps_per_epoch if steps_per_epoch else 0
        update = policy.update_interval
        if interval != 0 and interval < update:
            raise ConfigError("zero_optimization.zenflow.select_interval",
                              f"{interval} steps ({'epoch' if policy.select_per_epoch else 'step'}) is less than "
                              f"update_interval {update}; it must be greater or equal (DeepSpeed's rule)")
        return cls(topk_ratio=policy.topk_ratio, update_interval=update, select_interval=interval,
                   full_warm_up_rounds=policy.full_warm_up_rounds)

    def is_update_boundary(self, t: int) -> bool:
        w, s = self.full_warm_up_rounds, self.select_interval
        if t + 1 < w:
            return True
        return (t + 1 - w) % self.update_interval == 0 or (s != 0 and (t + 1) % s == 0)

    def is_select_boundary(self, t: int) -> bool:
        w, s = self.full_warm_up_rounds, self.select_interval
        return t >= w and (t == w or (s != 0 and t % s == 0))

    def is_selective(self, t: int) -> bool:
        return t >= self.full_warm_up_rounds


def deepspeed_column_slices(shapes: Sequence[torch.Size], world_size: int) -> list[list[tuple[int, int]]]:
    """For each parameter of one group, the column ranges ``[start, end)`` of every rank's slice of DeepSpeed's
    ZeRO-1/2 flat partition (2-D weights stored transposed, the group padded to a multiple of 2 * world_size, cut
    in equal parts); ``[]`` for a 1-D parameter. A column cut by a partition boundary belongs to no slice."""
    numels = [int(torch.Size(s).numel()) for s in shapes]
    total = sum(numels)
    align = 2 * world_size
    padded = -(-total // align) * align
    part = padded // world_size
    out, start = [], 0
    for shape, n in zip(shapes, numels):
        slices = []
        if len(shape) == 2:
            rows = int(shape[0])
            for r in range(world_size):
                lo, hi = max(start, r * part), min(start + n, (r + 1) * part)
                if lo >= hi:
                    continue
                offset, numel = lo - start, hi - lo
                first = 0 if not offset else (offset - 1) // rows + 1
                slices.append((first, (offset + numel) // rows))
        out.append(slices)
        start += n
    return out


def deepspeed_stage3_columns(shape: torch.Size, world_size: int) -> list[int]:
    """The columns (input features) of a 2-D weight that DeepSpeed's stage-3 ZenFlow can choose: those whole inside
    one rank's partition of the weight stored transposed (each rank ``ceil(numel / world_size)`` elements), in order.
    """
    rows, cols = int(shape[0]), int(shape[1])
    numel = rows * cols
    part = -(-numel // world_size)
    out: list[int] = []
    for r in range(world_size):
        start, end = part * r, min(part * (r + 1), numel)
        if start >= numel:
            break
        out.extend(range(-(-start // rows), end // rows))
    return out


@torch.no_grad()
def selective_adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                     step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """torch's single-tensor AdamW, in the tensors' own dtype (16-bit weights: 16-bit arithmetic, as DeepSpeed's
    selective optimizer runs), in place."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


@dataclass
class _Selective:
    """One parameter's selective state. At stages 1-2 the values it updates are the weight's selected columns (the
    whole of a 1-D parameter); at stage 3 (``sp`` set) the elements of this rank's shard in them, at flat positions
    ``flat_idx`` of the shard, fed by elements ``grad_idx`` of the flattened selected-column gradient."""

    param: nn.Parameter
    group: int                           # param_groups index (its learning rate)
    slices: list[tuple[int, int]]        # stages 1-2, 2-D: DeepSpeed's column slices; [] for 1-D
    shape: torch.Size = torch.Size()     # the parameter's full shape
    sp: object = None                    # stage 3: its ShardedParam (hf_zero/zero/stage3/param.py)
    columns: torch.Tensor | None = None  # 2-D: selected columns, sorted
    flat_idx: torch.Tensor | None = None  # stage 3, 2-D: positions in the shard of the selected elements
    grad_idx: torch.Tensor | None = None  # stage 3, 2-D: their positions in grad[:, columns].reshape(-1)
    step: int = 0
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    local: torch.Tensor | None = None    # this micro-step's local gradient (selected columns, or whole)
    grad: torch.Tensor | None = None     # its average over the data-parallel ranks
    before: torch.Tensor | None = None   # values before the offloaded step (update boundary)

    @property
    def is_2d(self) -> bool:
        return len(self.shape) == 2

    def _shard(self) -> torch.Tensor:
        return self.sp.shard_values()

    def _owned(self) -> tuple[int, int]:
        """Stage 3: the elements ``[lo, hi)`` of the flattened parameter this rank's shard holds."""
        return self.sp.layout.owned_range(0, self.sp.rank)

    def choose(self, columns: torch.Tensor) -> None:
        self.columns = columns
        if self.sp is None:
            return
        lo, hi = self._owned()
        rows, cols = self.shape
        flat = (torch.arange(rows, device=columns.device)[:, None] * cols + columns[None, :]).reshape(-1)
        self.grad_idx = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)
        self.flat_idx = flat[self.grad_idx] - lo

    def values_of(self, grad: torch.Tensor) -> torch.Tensor:
        """The averaged gradient (the selected columns of a 2-D weight, a 1-D parameter whole) cut to :meth:`view`."""
        if self.sp is None:
            return grad
        if not self.is_2d:
            lo, hi = self._owned()
            return grad[lo:hi]
        return grad.reshape(-1)[self.grad_idx]

    def _positions(self, device: torch.device):
        """Stage 3: where the elements :meth:`view` returns sit in a shard on ``device`` (the shard may live in host
        memory, with offload_param, while the indices are on the GPU)."""
        if self.is_2d:
            return self.flat_idx.to(device)
        lo, hi = self._owned()
        return slice(0, hi - lo)

    def from_shard(self, shard: torch.Tensor) -> torch.Tensor:
        """Stage 3: this rank's selected elements of a shard-sized tensor."""
        return shard[self._positions(shard.device)]

    def into_shard(self, shard: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Stage 3: ``values`` (one per element :meth:`view` returns) written to their places in ``shard``."""
        shard[self._positions(shard.device)] = values.to(shard.device)
        return shard

    def view(self) -> torch.Tensor:
        if self.sp is not None:
            return self.from_shard(self._shard())
        p = local_tensor(self.param).data
        return p if self.columns is None else p[:, self.columns]

    def write(self, values: torch.Tensor) -> None:
        if self.sp is not None:
            shard = self.into_shard(self._shard(), values)
            if self.sp.swapped:  # shard_values() read a copy back
                self.sp.store_shard(shard)
            return
        p = local_tensor(self.param).data
        if self.columns is None:
            p.copy_(values)
        else:
            p[:, self.columns] = values

    @property
    def writes_back(self) -> bool:
        """Whether :meth:`view` may be a copy (an update applied to it must be written)."""
        return self.sp is not None or self.columns is not None

    def all_values(self) -> torch.Tensor:
        """Everything of the parameter this rank updates (stage 3: its shard), as a copy."""
        return (self._shard() if self.sp is not None else local_tensor(self.param)).detach().clone()

    def set_all(self, values: torch.Tensor) -> None:
        if self.sp is not None:
            self.sp.store_shard(values)
        else:
            local_tensor(self.param).data.copy_(values)


class ZenFlow:
    """Owns the selective optimizer, the gradient hooks and the schedule of one engine.

    The engine calls ``begin_backward(t)`` / ``end_backward(t, boundary)`` around each backward, ``sync_lr()`` at
    the start of each ``step()``, and ``before_offloaded_step(t)`` / ``after_offloaded_step()`` around the
    offloaded optimizer's step; ``remove()`` takes the gradient hooks off (engine.destroy()).
    """

    def __init__(self, policy: ZenFlowPolicy, groups: Sequence, optimizer, param_group_of: Sequence[int],
                 hyper: dict, *, steps_per_epoch: Callable[[], int | None], process_group=None,
                 world_size: int = 1, stage3=None, loss_scaler=None) -> None:
        """``groups``: the engine's ShardedGroups (Stage3Groups at stage 3); ``hyper``: the config optimizer's
        params (lr, betas, eps, weight_decay), torch AdamW's defaults for the missing ones; ``steps_per_epoch``:
        read at the first backward (the initialize() dataloader exists by then); ``stage3``: the ZeRO-3 runtime
        (hf_zero/zero/stage3/runtime.py), told when a selective update changed the shards; ``loss_scaler``: fp16's
        (hf_zero/zero/loss_scaler.py), whose scale the selective gradients are divided by."""
        self._policy = policy
        self._steps_per_epoch = steps_per_epoch
        self.schedule: ZenFlowSchedule | None = None
        self._optimizer = optimizer
        self._process_group = process_group
        self._world_size = world_size
        self._hyper = {k: hyper.get(k, v) for k, v in _ADAMW_DEFAULTS.items()}
        betas = self._hyper["betas"]
        self._hyper["betas"] = (float(betas[0]), float(betas[1]))
        self._lr = [float(self._hyper["lr"])] * len(optimizer.param_groups)  # synced from the scheduler at step()
        self._groups = list(groups)
        self._stage3 = stage3
        self._loss_scaler = loss_scaler
        self.skipped_updates = 0  # fp16: selective updates skipped for a gradient that was not finite
        self.params: list[_Selective] = []
        for g, pg in zip(self._groups, param_group_of):
            if getattr(g, "expert", None) is not None:
                raise ConfigError("zero_optimization.zenflow", "with expert-parallel MoE parameters is not "
                                                               "implemented in hf_zero")
            sps = list(g.sps) if stage3 is not None else [None] * len(g.params)
            shapes = [sp.shape if sp is not None else local_tensor(p).shape for p, sp in zip(g.params, sps)]
            for name, shape in zip(g.names, shapes):
                if len(shape) not in (1, 2):
                    raise ConfigError("zero_optimization.zenflow", f"parameter '{name}' has shape {tuple(shape)}: "
                                      "ZenFlow updates 1-D and 2-D parameters only (DeepSpeed's too)")
            slices = deepspeed_column_slices(shapes, world_size) if stage3 is None else [[]] * len(shapes)
            for p, sl, shape, sp in zip(g.params, slices, shapes, sps):
                self.params.append(_Selective(p, pg, sl, torch.Size(shape), sp))
        self._capturing = False
        self._select = False
        self._pending = False  # selective gradients waiting for the offloaded step (update boundary)
        # overlap_step: the moment set loaded in the offload (by window parity) and the other one, per group; the
        # weights an update published, to be shown one update later; weights before the step
        self._parity = 0
        self._moments: list[list[dict | None]] = [[None] * len(self._groups), [None] * len(self._groups)]
        self._stale: list[torch.Tensor] | None = None
        self._lagging = True
        self._pre_step: list[torch.Tensor] | None = None
        self._shown: list[torch.Tensor] | None = None  # weights read from a checkpoint, until restore_weights
        # overlap_step: the masters, kept here: an update is shown one window late, so the weights are not the
        # masters; and an fp32 CPU run's offload keeps its masters in the weights' own memory
        offload = optimizer.offload
        self._masters = ([offload.state_tensors(gi)["master"] for gi in range(len(self._groups))]
                         if policy.overlap_step else None)
        # the gradient of each parameter as autograd computes it (before accumulation into .grad or reduction)
        self._handles = [s.param.register_hook(self._hook(s)) for s in self.params]

    # schedule ------------------------------------------------------------------------------------------------------
    def _resolved(self) -> ZenFlowSchedule:
        if self.schedule is None:
            self.schedule = ZenFlowSchedule.resolve(self._policy, self._steps_per_epoch())
        return self.schedule

    @property
    def gradient_accumulation_steps(self) -> int:
        """DeepSpeed replaces gradient_accumulation_steps by update_interval (the loss is divided by it)."""
        return self._policy.update_interval

    def is_update_boundary(self, t: int) -> bool:
        return self._resolved().is_update_boundary(t)

    # backward ------------------------------------------------------------------------------------------------------
    def begin_backward(self, t: int) -> None:
        policy = self._resolved()
        self._capturing = policy.is_selective(t)
        # a run resumed from a checkpoint without ZenFlow's state has no columns yet: it chooses them now
        unchosen = any(s.columns is None and s.is_2d for s in self.params)
        self._select = policy.is_select_boundary(t) or (self._capturing and unchosen)
        if self._select:
            if t != 0:
                self._sync_masters()
            for s in self.params:
                if s.exp_avg is not None:
                    s.exp_avg.zero_()
                    s.exp_avg_sq.zero_()
        for s in self.params:
            s.local = None

    def _hook(self, s: _Selective):
        def capture(grad: torch.Tensor) -> None:
            if not self._capturing:
                return None
            g = local_tensor(grad).detach()
            if g.dim() == 2 and not self._select:
                g = g[:, s.columns]
            else:
                g = g.clone()
            s.local = g if s.local is None else s.local + g
            return None

        return capture

    def end_backward(self, t: int, boundary: bool) -> None:
        """After the backward's gradients are reduced: average the captured gradients, select columns at a select
        boundary, and update the selected columns now (or, at an update boundary, after the offloaded step)."""
        if not self._capturing:
            return
        self._capturing = False
        if not self._average():  # fp16 overflow: no selective update this micro-step (and no new columns)
            self.skipped_updates += 1
            for s in self.params:
                s.grad = None
            return
        if self._select:
            self._choose_columns()
        for s in self.params:
            s.grad = s.values_of(s.grad if s.grad.dim() == 1 or not self._select else s.grad[:, s.columns])
        if boundary:
            for s in self.params:
                s.before = s.view().clone()
            self._pending = True
        else:
            self._apply()
            self._shards_changed()

    def _average(self) -> bool:
        """One all-reduce of every captured gradient, pre-divided by the world size (DeepSpeed's order); with fp16,
        divided by the loss scale of this backward too, in fp32 (DeepSpeed 0.19.8 feeds its 16-bit selective AdamW
        the scaled gradient -- Adam's step barely depends on the scale -- and turns the weights to NaN on an
        overflow). False when the averaged gradient is not finite (an fp16 overflow, the same on every rank after
        the all-reduce)."""
        locals_ = []
        for s in self.params:
            if s.local is None:  # no gradient this pass: zeros, as the reducer flushes for unused parameters
                shape = s.shape if s.sp is not None else local_tensor(s.param).shape
                if len(shape) == 2 and not self._select:
                    shape = (shape[0], len(s.columns))
                s.local = torch.zeros(shape, dtype=s.param.dtype, device=s.param.device)
            locals_.append(s.local)
        flat = torch.cat([x.reshape(-1) for x in locals_])
        if self._world_size > 1:
            flat.div_(self._world_size)
            all_reduce_(flat, group=self._process_group, what="ZenFlow's selected-gradient all-reduce")
        if self._loss_scaler is not None:
            if not bool(torch.isfinite(flat).all()):
                for s in self.params:
                    s.local = None
                return False
            flat = flat.float().div_(self._loss_scaler.scale)  # fp32 from here (see _apply)
        at = 0
        for s in self.params:
            n = s.local.numel()
            s.grad = flat[at:at + n].view(s.local.shape)
            s.local = None
            at += n
        return True

    def _choose_columns(self) -> None:
        ratio = self._resolved().topk_ratio
        for s in self.params:
            if s.grad.dim() != 2:
                continue
            sums = s.grad.abs().sum(dim=0)  # (columns,): |gradient| summed over each input feature
            if s.sp is not None:  # stage 3: one top-k over every rank's complete columns (DeepSpeed's stage 3)
                candidates = torch.tensor(deepspeed_stage3_columns(s.shape, self._world_size), dtype=torch.long,
                                          device=sums.device)
                k = min(max(1, int(candidates.numel() * ratio)), candidates.numel())
                s.choose(candidates[torch.topk(sums[candidates], k).indices].sort()[0])
                continue
            chosen = []
            for first, end in s.slices:
                if end <= first:
                    continue
                k = max(1, int((end - first) * ratio))
                chosen.append(torch.topk(sums[first:end], k).indices.sort()[0] + first)
            s.choose(torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.long, device=s.grad.device))

    # step ----------------------------------------------------------------------------------------------------------
    def sync_lr(self) -> None:
        """At each engine.step(): the selective optimizer takes the scheduler's current learning rates."""
        self._lr = [float(g["lr"]) for g in self._optimizer.param_groups]

    def before_offloaded_step(self, t: int) -> None:
        """overlap_step: load this window's set of Adam moments into the offload, and keep the weights as they are
        now (a late update leaves them so)."""
        if not self._policy.overlap_step:
            return
        w, u = self._policy.full_warm_up_rounds, self._policy.update_interval
        parity = t & 1 if t < w else (t // u) & 1
        offload = self._optimizer.offload
        self._pre_step = [s.all_values() for s in self.params] if t >= w else None
        for gi, master in enumerate(self._masters):
            offload.load_state_tensors(gi, {"master": master})
        if parity != self._parity:
            for gi in range(len(self._groups)):
                now = offload.state_tensors(gi)
                self._moments[self._parity][gi] = {k: now[k] for k in ("exp_avg", "exp_avg_sq")}
                other = self._moments[parity][gi]
                if other is None:
                    other = {k: torch.zeros_like(now[k]) for k in ("exp_avg", "exp_avg_sq")}
                offload.load_state_tensors(gi, other)
            self._parity = parity

    def _late_update(self) -> None:
        """overlap_step, after the offloaded step published its result: from the first update after warm-up on, the
        weights get the previous update's result instead (DeepSpeed waits for the step it submitted one window
        before; its first wait after warm-up, and a wait with nothing submitted yet, publish nothing)."""
        if not self._policy.overlap_step:
            return
        result = [s.all_values() for s in self.params]
        offload = self._optimizer.offload
        self._masters = [offload.state_tensors(gi)["master"] for gi in range(len(self._groups))]
        if self._pre_step is not None:
            publish = self._stale if (self._stale is not None and not self._lagging) else self._pre_step
            self._lagging = self._lagging and self._stale is None
            for s, values in zip(self.params, publish):
                s.set_all(values)
            self._pre_step = None
        self._stale = result

    def after_offloaded_step(self) -> None:
        """The offloaded step has published its weights (overlap_step: the previous one's): the selected columns get
        back their values from before it, plus this micro-step's selective update."""
        self._late_update()
        wrote = self._policy.overlap_step
        if self._pending:
            self._pending, wrote = False, True
            for s in self.params:
                s.write(s.before)
                s.before = None
            self._apply()
        if wrote:  # after the runtime's own re-gather of the step's result
            self._shards_changed()

    def _shards_changed(self) -> None:
        """Stage 3: the selective update wrote shards; the runtime re-gathers what it keeps whole."""
        if self._stage3 is not None:
            self._stage3.shards_changed()

    def _apply(self) -> None:
        h = self._hyper
        for s in self.params:
            values = s.view()
            # fp16: the update and its moments in fp32 -- the unscaled gradient's square underflows fp16 (and eps is
            # 0 there), so a 16-bit AdamW would divide by zero
            work = values.float() if self._loss_scaler is not None else values
            # zenflow.offload: the moments wait in CPU memory between updates (DeepSpeed's; the same values)
            home = torch.device("cpu") if self._policy.offload_moments else values.device
            if s.exp_avg is None or s.exp_avg.shape != values.shape:
                s.exp_avg = torch.zeros_like(work, device=home)
                s.exp_avg_sq = torch.zeros_like(work, device=home)
            exp_avg, exp_avg_sq = s.exp_avg.to(values.device), s.exp_avg_sq.to(values.device)
            s.step += 1
            # (a stage-3 shard in host memory with offload_param: the update runs there, the gradient comes to it)
            selective_adamw_(work, s.grad.to(work.device, work.dtype), exp_avg, exp_avg_sq, step=s.step,
                             lr=self._lr[s.group], beta1=h["betas"][0], beta2=h["betas"][1], eps=float(h["eps"]),
                             weight_decay=float(h["weight_decay"]))
            if work is not values:
                values.copy_(work)
            if exp_avg is not s.exp_avg:
                s.exp_avg.copy_(exp_avg)
                s.exp_avg_sq.copy_(exp_avg_sq)
            if s.writes_back:
                s.write(values)
            s.grad = None

    def _sync_masters(self) -> None:
        """The offloaded masters <- this rank's shards of the current weights (which hold the selective updates)."""
        offload = self._optimizer.offload
        for gi, g in enumerate(self._groups):
            master = torch.zeros(g.shard_numel, dtype=torch.float32)
            for i, p in enumerate(g.params):
                piece = master[g.layout.offsets[i]:g.layout.offsets[i + 1]]
                if self._stage3 is not None:  # the shard is this rank's piece already
                    piece.copy_(g.sps[i].shard_values())
                else:
                    g.layout.shard_of(local_tensor(p).detach().reshape(-1).float().cpu(), i, g.rank, piece)
            offload.load_state_tensors(gi, {"master": master})
            if self._masters is not None:
                self._masters[gi] = master

    # checkpoint ------------------------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What a resumed run needs to continue as if never stopped (written into every rank's checkpoint file,
        between steps): each parameter's chosen columns, selective moments and step count, the learning rates the
        next selective update uses (the scheduler has moved on since they were synced) and, with overlap_step, the
        other set of Adam moments and this rank's masters (shards), the update waiting to be shown and its flags.
        DeepSpeed 0.19.8 saves none of it: its resumed run starts the selective optimizer afresh.

        At stage 3 what a rank holds of a parameter is saved as a full shard of it (the shard's values; the
        moments spread to their positions in it, zeros elsewhere), so a load on another number of ranks re-cuts it
        like the optimizer's shards."""
        out: dict[str, torch.Tensor] = {"zenflow.lr": torch.tensor(self._lr, dtype=torch.float64)}
        for i, s in enumerate(self.params):
            out[f"zenflow.{i}.step"] = torch.tensor([s.step], dtype=torch.int64)
            # the weights where they are not the masters: the selected columns and 1-D parameters carry selective
            # updates the masters get only at the next selection; with overlap_step the weights show the previous
            # update. A load publishes the masters, then puts these back (restore_weights)
            shown = s.all_values() if self._policy.overlap_step or s.sp is not None else s.view()
            out[f"zenflow.{i}.shown"] = shown.cpu()
            if s.columns is not None:
                out[f"zenflow.{i}.columns"] = s.columns.cpu()
            if s.exp_avg is not None:
                # stage 3: spread to their places in a shard-sized tensor (zeros elsewhere), re-cut like the shards
                out[f"zenflow.{i}.exp_avg"], out[f"zenflow.{i}.exp_avg_sq"] = (
                    (m if s.sp is None else s.into_shard(m.new_zeros(s.sp.shard_numel), m)).cpu()
                    for m in (s.exp_avg, s.exp_avg_sq))
        if self._policy.overlap_step:
            out["zenflow.overlap.flags"] = torch.tensor([self._parity, int(self._lagging)], dtype=torch.int64)
            for gi in range(len(self._groups)):
                out[f"zenflow.overlap.{gi}.master"] = self._masters[gi]
                other = self._moments[1 - self._parity][gi]
                if other is not None:
                    out[f"zenflow.overlap.{gi}.exp_avg"] = other["exp_avg"]
                    out[f"zenflow.overlap.{gi}.exp_avg_sq"] = other["exp_avg_sq"]
            for i, t in enumerate(self._stale or ()):
                out[f"zenflow.overlap.stale.{i}"] = t.cpu()
        return out

    @staticmethod
    def _read(reader, key: str, s: _Selective) -> torch.Tensor:
        """A per-parameter tensor: whole at stages 1-2 (every rank saved the same), this rank's re-cut shard at 3."""
        return reader.whole(key) if s.sp is None else reader.shard(key, s.sp.layout, s.sp.rank)

    def load_state(self, reader) -> bool:
        """Restore :meth:`state_tensors` from a checkpoint's ``reader`` (a ShardReader: ``whole(key)`` for what every
        rank holds the same, ``shard(key, layout, rank)`` re-cut for this rank's piece). False when the checkpoint
        has none (saved without ZenFlow): the selective optimizer then starts afresh and chooses columns at the next
        backward."""
        keys = reader.keys()
        if "zenflow.lr" not in keys:
            return False
        if len([k for k in keys if k.endswith(".step") and k.startswith("zenflow.")]) != len(self.params):
            raise ValueError("hf_zero: the checkpoint's ZenFlow state is for another set of parameters "
                             f"({len(self.params)} here); load it into the model it was saved from")
        self._lr = [float(x) for x in reader.whole("zenflow.lr")]
        self._shown = [self._read(reader, f"zenflow.{i}.shown", s) for i, s in enumerate(self.params)]
        for i, s in enumerate(self.params):
            device = s.param.device
            s.step = int(reader.whole(f"zenflow.{i}.step")[0])
            s.columns = s.flat_idx = s.grad_idx = None
            if f"zenflow.{i}.columns" in keys:
                s.choose(reader.whole(f"zenflow.{i}.columns").to(device))
            s.exp_avg = s.exp_avg_sq = None
            if f"zenflow.{i}.exp_avg" in keys:
                home = torch.device("cpu") if self._policy.offload_moments else device
                s.exp_avg, s.exp_avg_sq = (
                    (m if s.sp is None else s.from_shard(m)).to(home)
                    for m in (self._read(reader, f"zenflow.{i}.{k}", s) for k in ("exp_avg", "exp_avg_sq")))
        if self._policy.overlap_step and "zenflow.overlap.flags" in keys:
            parity, lagging = (int(x) for x in reader.whole("zenflow.overlap.flags"))
            self._parity, self._lagging = parity, bool(lagging)
            self._moments = [[None] * len(self._groups), [None] * len(self._groups)]
            for gi, g in enumerate(self._groups):
                self._masters[gi] = reader.shard(f"zenflow.overlap.{gi}.master", g.layout, g.rank)
                if f"zenflow.overlap.{gi}.exp_avg" in keys:
                    self._moments[1 - parity][gi] = {
                        k: reader.shard(f"zenflow.overlap.{gi}.{k}", g.layout, g.rank) for k in ("exp_avg",
                                                                                                "exp_avg_sq")}
            stale = [f"zenflow.overlap.stale.{i}" for i in range(len(self.params))]
            self._stale = ([self._read(reader, k, s).to(s.param.device) for k, s in zip(stale, self.params)]
                           if stale[0] in keys else None)
        return True

    def restore_weights(self) -> None:
        """After a load published the masters into the weights: the weights ZenFlow showed when it was saved."""
        shown, self._shown = self._shown, None
        if shown is None:
            return
        with torch.no_grad():
            for s, values in zip(self.params, shown):
                values = values.to(s.param.device, s.param.dtype)
                if self._policy.overlap_step or s.sp is not None:
                    s.set_all(values)
                else:
                    s.write(values)
        self._shards_changed()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
