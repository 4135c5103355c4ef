"""The optimizer users see as ``engine.optimizer``: a torch Optimizer over this rank's fp32 master shards.

``param_groups`` and ``state`` are real torch structures (LR schedulers, accelerate and Trainer read and write
them); the tensors in them are the master shards of :class:`~hf_zero.zero.sharded_group.ShardedGroup`, so the
state each rank holds is 1/N of the full optimizer state.

One ``step()``:
  1. global gradient norm: sum of squares of the local gradient shards, all-reduced once (each element lives on
     exactly one rank, so this is the true norm of the full gradient, not a local one; a shard several ranks hold
     -- stage 0, or MoE experts replicated over their expert-data-parallel group -- counts once: divided by its
     number of holders, as DeepSpeed's ZeRO counts every expert once);
  2. fp16 overflow decision from that norm -- identical on every rank because the norm is; skip the step if so;
  3. one combined divisor = loss scale / clip coefficient, applied inside the update;
  4. the update, by the one optimizer back-end (optimizer_backend.py): the fused Adam kernel (one pass reads
     grad/param/moments, writes param, moments and the 16-bit copy), the wrapped torch optimizer for anything
     but Adam, or the CPU / NVMe optimizer offload;
  5. publication: 16-bit shards all-gathered back into the model's parameters (stages 1/2), or copied (stage 0).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Sequence

import torch

from hf_zero.comm import all_reduce_
from hf_zero.offload.swapper import wait_all
from hf_zero.ops.adam import AdamHyper, zeros_state
from hf_zero.zero.checkpoint_state import ShardReader
from hf_zero.zero.layout import ShardLayout
from hf_zero.zero.loss_scaler import LossScaler
from hf_zero.zero.optimizer_backend import FusedAdamBackend, OptimizerBackend, TorchOptimizerBackend
from hf_zero.zero.saved_pieces import group_prefix
from hf_zero.zero.sharded_group import ShardedGroup, comm_group, holders

__all__ = ["ZeroOptimizer", "UpdateRule"]

logger = logging.getLogger("hf_zero")

UpdateRule = Callable[[torch.optim.Optimizer, float], None]  # (optimizer, grad_divisor) -> None


class ZeroOptimizer(torch.optim.Optimizer):
    """Partitioned optimizer. Built by the engine; ``inner`` is the torch optimizer doing the math (or None)."""

    def __init__(self, groups: Sequence[ShardedGroup], hyperparams: Sequence[dict], *,
                 param_group_of: Sequence[int] | None = None, inner_cls: type[torch.optim.Optimizer],
                 inner_defaults: dict, fused_adam: bool,
                 loss_scaler: LossScaler | None, clip_norm: float, publish_bucket_numel: int,
                 check_overflow: bool, process_group=None, model_parallel_group=None, compute_norm: bool = True,
                 publisher: Callable[[], None] | None = None, offload=None,
                 state_dtype: torch.dtype = torch.float32, zero_stage: int = 0):
        self.groups = list(groups)
        self.zero_stage = zero_stage  # the engine's ZeRO stage (DeepSpeed has one optimizer class per stage)
        # param_groups[param_group_of[i]] holds groups[i]'s master: one param group per group, or several groups in
        # one (a client's stage-0 group mixing MoE experts with other parameters, split by the process group
        # reducing them, stays the one group its scheduler holds); its hyperparameters are its first group's
        self._param_group_of = list(param_group_of) if param_group_of is not None else list(range(len(self.groups)))
        masters: list[dict] = []
        for g, h, pg in zip(self.groups, hyperparams, self._param_group_of):
            if pg == len(masters):
                masters.append({**h, "params": []})
            masters[pg]["params"].append(g.master)
        self.inner = inner_cls(masters, **inner_defaults)
        super().__init__(self.inner.param_groups, self.inner.defaults)
        # one set of param_groups / state, shared with the inner optimizer: schedulers see what is stepped
        self.inner.param_groups = self.param_groups
        self.inner.state = self.state
        # Where masters and states live and what updates them, chosen once: the optimizer offload
        # (hf_zero.offload.OptimizerOffload, which has moved each group's master and moments out already), the
        # fused Adam kernel, or the torch optimizer
        self.backend: OptimizerBackend = (offload if offload is not None else
                                          FusedAdamBackend(self.groups, state_dtype) if fused_adam else
                                          TorchOptimizerBackend(self.groups, self.inner))
        self.fused_adam = fused_adam
        self.loss_scaler = loss_scaler
        self.clip_norm = clip_norm
        self.publish_bucket_numel = publish_bucket_numel
        self.check_overflow = check_overflow
        self.compute_norm = compute_norm
        self.process_group = process_group
        # other parts of the same replica (pipeline stages, tensor-parallel shards): their squared norms are added,
        # so clipping and the overflow decision are those of the unsplit model
        self.model_parallel_group = model_parallel_group
        # or, set by an engine that knows a cheaper way (the pipeline's stages finish one after the other): a
        # function summing this rank's squared norm over the replica's other parts in place of that all-reduce
        self.model_parallel_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        # indices into ``groups`` whose gradients duplicate a group counted on another rank of the model-parallel
        # group (a tied embedding's second copy): left out of the norm so each element is counted once
        self.norm_excluded_groups: set[int] = set()
        # {group index: sorted [(lo, hi)] ranges of its shard} duplicated the same way (tensor-parallel replicated
        # parameters inside a group of sharded ones): left out of the norm on every TP rank but one
        self.norm_excluded_spans: dict[int, list[tuple[int, int]]] = {}
        self._publisher = publisher
        self.state_dtype = state_dtype  # Adam moments: fp32, or bf16 with bf16.bf16_optimizer_states
        self.overflow = False  # read by accelerate (step_was_skipped)
        self.global_grad_norm: float | None = None
        self.skipped_steps = 0
        # ZenFlow (zero/zenflow.py) sets the Adam step count of the next step (DeepSpeed steps its offloaded Adam
        # with the micro-step number, not the number of updates); None: count steps
        self.adam_step_override: int | None = None
        from hf_zero.zero.tensor_fragment import track

        track(self)  # safe_get_full_grad(param) and friends find the parameter's shards through this

    # torch.optim.Optimizer API ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("hf_zero: ZeroOptimizer.step(closure) is not supported: call engine.backward(loss) "
                             "then engine.step()")
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        for g in self.groups:
            g.ensure_grad()  # a step without any backward sees zero gradients
        # zero_optimization.compute_grad_norm false: no norm unless fp16's overflow check (or the pipeline's loss,
        # which rides the norm's reduction) needs the reduction anyway; clipping is off then (config check)
        needed = self.compute_norm or self.check_overflow or self.model_parallel_sum is not None
        norm = self._global_norm() / scale if needed else 0.0
        self.global_grad_norm = norm if self.compute_norm else None
        self.overflow = self.check_overflow and not math.isfinite(norm)
        if self.overflow:
            self.skipped_steps += 1
            if self.loss_scaler is not None:
                old = self.loss_scaler.scale
                self.loss_scaler.update(overflow=True)
                logger.info("hf_zero: gradient overflow, step skipped; loss scale %g -> %g", old,
                            self.loss_scaler.scale)
            self._zero_grad_shards()
            return None
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        clip_coef = 1.0
        if self.clip_norm > 0 and math.isfinite(norm):
            clip_coef = min(1.0, self.clip_norm / (norm + 1e-6))
        divisor = scale / clip_coef
        if self.backend.uses_adam_hyper:
            states = [self.state[g.master] for g in self.groups]
            self.backend.step(states, self._next_adam_hypers(states), divisor)
        else:
            self.backend.step(None, None, divisor)
        self._zero_grad_shards()
        self.publish()
        return None

    @property
    def offload(self):
        """The back-end when it is an optimizer offload (its masters and states out of the groups), else None."""
        return self.backend if self.backend.offloaded else None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """DeepSpeed's ZeRO optimizer attribute: the torch optimizer over this rank's fp32 master partitions (its
        ``param_groups`` are this optimizer's, its ``state`` the moments). Under an optimizer offload the moments
        live in the offload, not there, so a ``state_dict()`` of it would silently miss them: refused, naming what
        reads them."""
        if self.offload is not None:
            raise AttributeError("hf_zero: optimizer.optimizer (the inner torch optimizer) is not offered with "
                                 "zero_optimization.offload_optimizer: the moments live in the offload, so its "
                                 "state would be incomplete; save with engine.save_checkpoint() or read states with "
                                 "deepspeed.utils.safe_get_full_optimizer_state / safe_get_local_optimizer_state")
        return self.inner

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's ZeRO optimizer attribute (also ``loss_scale``): the current fp16 loss scale; 1.0 without
        loss scaling (bf16, fp32), as DeepSpeed's static scaler reads there. Setting it sets the scale the next
        backward multiplies by (DeepSpeed's setter); without fp16 only 1.0 can be set."""
        return float(self.loss_scaler.scale) if self.loss_scaler is not None else 1.0

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        if self.loss_scaler is None:
            if float(value) != 1.0:
                raise ValueError(f"optimizer.cur_scale = {value!r}: this run has no loss scaling (fp16.enabled is "
                                 "false), so its scale is 1.0 and cannot be changed")
            return
        self.loss_scaler.scale = float(value)

    loss_scale = cur_scale

    def get_lr(self) -> list[float]:
        """DeepSpeed's ZeRO optimizer getter: each parameter group's learning rate."""
        return [g["lr"] for g in self.param_groups]

    def set_lr(self, lr: float) -> None:
        """DeepSpeed's ZeRO optimizer setter: one learning rate for every parameter group (the next step's)."""
        for g in self.param_groups:
            g["lr"] = lr

    def refresh_fp32_params(self) -> None:
        """DeepSpeed's: after a script wrote the model's weights itself (outside the optimizer), the fp32 masters
        take them, so the next step continues from the written values instead of overwriting them. Elements the
        write left unchanged keep their fp32 precision (DeepSpeed copies every 16-bit value back, losing it)."""
        from hf_zero.zero.full_weights import adopt_module_weights

        adopt_module_weights(p for g in self.groups for p in g.params)

    def needs_scaler(self) -> bool:
        """DeepSpeed's: whether a backward the script runs itself must go through ``engine.scale(loss)`` -- with
        fp16's loss scaling (hf_zero refuses an unscaled one then); bf16 and fp32 need none."""
        return self.loss_scaler is not None

    @property
    def dynamic_loss_scale(self) -> bool:
        """DeepSpeed's ZeRO optimizer attribute: whether the fp16 loss scale adapts (False without fp16)."""
        return self.loss_scaler is not None and self.loss_scaler.dynamic

    @property
    def single_partition_of_fp32_groups(self) -> list[torch.Tensor]:
        """DeepSpeed's ZeRO-1/2 optimizer attribute: this rank's fp32 master partition of each group (transformers'
        DeepSpeed tests read it to check the masters stay fp32 under bf16). Under an optimizer offload, read back
        whole from where the offload keeps them."""
        if self.offload is not None:
            return [self.offload.state_tensors(gi)["master"] for gi in range(len(self.groups))]
        return [g.master for g in self.groups]

    def quantize_nontrainable_params(self) -> None:
        """DeepSpeed ZeRO-3's: with ``zero_quantized_nontrainable_weights``, quantize the shards of parameters made
        frozen after partitioning (LoRA). DeepSpeed-Chat's ``--enable_mixed_precision_lora`` calls it after
        ``initialize``. hf_zero stores frozen weights unquantized (that key warns at initialize as not
        implemented), so this logs the same and changes nothing -- what DeepSpeed does with the key off."""
        logger.warning("hf_zero: optimizer.quantize_nontrainable_params() changes nothing: hf_zero keeps frozen "
                       "weights in the training dtype (zero_optimization.zero_quantized_nontrainable_weights is not "
                       "implemented)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the model's gradients; the gradient shards are cleared by step() itself."""
        for g in self.groups:
            for p in g.params:
                p.grad = None

    def publish(self) -> None:
        """Copy the updated weights into the model's parameters on every rank."""
        if self._publisher is not None:
            self._publisher()
            return
        for g in self.groups:
            g.publish(self.publish_bucket_numel, group=comm_group(g, self.process_group))

    # internals ---------------------------------------------------------------------------------------------------
    def _global_norm(self) -> float:
        # The compiled sum of squares, not vector_norm: torch converts bf16 element by element on CPUs without
        # AVX512-BF16 (~15x slower over an offloaded shard). inf / nan in a gradient propagate into sq.
        from hf_zero.ops.reduce import sum_of_squares

        # accumulated where the gradient shards are (the GPU: one .item() below is the step's only sync for it)
        sq = torch.zeros((), dtype=torch.float32, device=self.groups[0].grad.device if self.groups else "cpu")
        world = torch.distributed.get_world_size(self.process_group) if torch.distributed.is_initialized() else 1
        # every group replicated on the whole data-parallel world (stage 0 without expert parallelism): the local
        # sum is the norm; otherwise each rank adds its shards' squares divided by their number of holders
        replicated = all(holders(g, world) == world for g in self.groups)
        for i, g in enumerate(self.groups):
            if not g.grad.numel() or i in self.norm_excluded_groups:
                continue
            part = torch.zeros_like(sq)
            start = 0
            for lo, hi in self.norm_excluded_spans.get(i, ()):
                if lo > start:
                    part += sum_of_squares(g.grad[start:lo])
                start = hi
            if start < g.grad.numel():
                part += sum_of_squares(g.grad[start:])
            copies = holders(g, world)
            sq += part if replicated or copies == 1 else part / copies
        if not replicated:
            all_reduce_(sq, group=self.process_group, what="the gradient-norm all-reduce of the optimizer step")
        if self.model_parallel_sum is not None:
            sq = self.model_parallel_sum(sq)
        elif self.model_parallel_group is not None:
            all_reduce_(sq, group=self.model_parallel_group, what="the model-parallel gradient-norm all-reduce")
        total = sq.item()
        return math.sqrt(total) if math.isfinite(total) else float("inf")

    def _zero_grad_shards(self) -> None:
        for g in self.groups:
            g.clear_grad()
            g.master.grad = None

    def _next_adam_hypers(self, states: list[dict]) -> list[AdamHyper]:
        """Count this step in each group's state and freeze its Adam hyper-parameters for it (once per group)."""
        hyper = []
        for state, pg in zip(states, self._param_group_of):
            group = self.param_groups[pg]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
            if self.adam_step_override is not None:
                state["step"].fill_(self.adam_step_override)
            else:
                state["step"] += 1
            hyper.append(AdamHyper.of_group(group, int(state["step"].item())))
        return hyper

    @property
    def param_group_of(self) -> list[int]:
        """For each sharded group, the index of the ``param_groups`` entry holding its master."""
        return list(self._param_group_of)

    # state -------------------------------------------------------------------------------------------------------
    def state_dict(self):
        """torch's optimizer state over this rank's master shards, plus the skipped-step count (the loss scaler
        saves its own state, once: ``engine.loss_scaler.state_dict()``)."""
        sd = super().state_dict()
        sd["hf_zero"] = {"skipped_steps": self.skipped_steps}
        return sd

    # checkpoint state (hf_zero/checkpoint/engine.py chooses the files; these say what the state is) ------------
    def shard_state(self, dense: bool = True, experts: bool = True) -> dict[str, torch.Tensor]:
        """This rank's flat shards, by name: ``<prefix>master`` and each per-element optimizer state
        ``<prefix>state.<name>`` (Adam's moments once stepped), read back whole from where the back-end keeps them
        (CPU memory, NVMe). Cut by :meth:`shard_layouts`. ``dense``: include the groups of ordinary parameters;
        ``experts``: the expert-parallel groups' pieces this rank is the writer of (the first of their holders)."""
        out: dict[str, torch.Tensor] = {}
        for gi, g in enumerate(self.groups):
            include = (experts and _writes_piece(g)) if getattr(g, "expert", None) is not None else dense
            if not include:
                continue
            prefix = _prefix(gi, g)
            state = self.state.get(g.master, {})
            if self.offload is not None:
                full = self.offload.state_tensors(gi)
                out[f"{prefix}master"] = full["master"]
                if state:  # moments exist once the optimizer has stepped
                    out.update({f"{prefix}state.{k}": full[k] for k in ("exp_avg", "exp_avg_sq")})
                continue
            out[f"{prefix}master"] = g.master
            out.update({f"{prefix}state.{k}": v for k, v in state.items() if _per_element(v, g.master)})
        return out

    def shard_layouts(self) -> list[tuple[str, ShardLayout, int, torch.dtype]]:
        """``(name prefix, layout, rank, master dtype)`` of each group: every shard named ``<prefix>...`` is cut by
        that layout and this rank holds piece ``rank``. An expert-parallel group's prefix names its EP rank
        (``group<i>.ep<e>.``): ranks of different EP ranks hold different experts under the same parameter names,
        and its pieces are those of its EDP group (``scalar_state()["groups"][i]["expert"]["piece_ranks"]``)."""
        return [(_prefix(gi, g), g.layout, g.rank, g.master.dtype) for gi, g in enumerate(self.groups)]

    def scalar_state(self) -> dict:
        """The JSON-able rest: per-group parameter names and numels (what the shards are cut from), per-group
        scalar optimizer state (Adam's step), the param_groups' hyper-parameters, the skipped-step count."""
        return {
            "groups": [{"names": list(g.names), "numels": list(g.layout.numels), **_expert_info(g)}
                       for g in self.groups],
            # the ordinary groups' (an expert-parallel group's own is in its "expert" entry)
            "shard_world_size": next((g.world_size for g in self.groups if getattr(g, "expert", None) is None), 1),
            "optimizer_scalar_state": [
                {k: (v.item() if torch.is_tensor(v) else v) for k, v in self.state.get(g.master, {}).items()
                 if not _per_element(v, g.master)} for g in self.groups],
            "param_groups": [{k: v for k, v in pg.items() if k != "params" and isinstance(v, _PLAIN)}
                             for pg in self.param_groups],
            "skipped_steps": self.skipped_steps,
        }

    def load_shard_state(self, reader: ShardReader, *, optimizer_states: bool) -> None:
        """Masters (and, with ``optimizer_states``, every saved per-element state) from ``reader``, re-cut for this
        rank's layout; the 16-bit copies are refreshed from the loaded masters (publish with :meth:`publish`)."""
        keys = reader.keys()
        for gi, g in enumerate(self.groups):
            prefix = _prefix(gi, g)
            loaded = {k[len(prefix):]: reader.shard(k, g.layout, g.rank) for k in sorted(keys)
                      if k.startswith(prefix) and (optimizer_states or k == prefix + "master")}
            if self.offload is not None:
                # full copies of the group's offloaded states, the loaded ones replaced, written back whole
                full = self.offload.state_tensors(gi)
                full.update({name.rsplit(".", 1)[-1]: t for name, t in loaded.items()})
                self.offload.load_state_tensors(gi, full)  # also refreshes param16
                continue
            with torch.no_grad():
                for name, t in loaded.items():
                    if name == "master":
                        g.master.copy_(t)
                        continue
                    state = self.state.setdefault(g.master, {})
                    key = name.split(".", 1)[1]
                    if key in state:
                        state[key].copy_(t)
                    else:  # a fresh optimizer: the configured state dtype (fp32, or bf16 states), whatever was saved
                        dtype = self.state_dtype if self.fused_adam else g.master.dtype
                        state[key] = zeros_state(t.shape, dtype, g.master.device)  # as the backend allocates
                        state[key].copy_(t)
            wait_all(g.write_param16(0, g.shard_numel, g.master))

    def load_scalar_state(self, saved: dict) -> None:
        """Inverse of :meth:`scalar_state` for the optimizer's own scalars (the groups were checked by the caller)."""
        for g, scalars in zip(self.groups, saved["optimizer_scalar_state"]):
            for k, v in scalars.items():
                self.state.setdefault(g.master, {})[k] = torch.tensor(float(v))
        for pg, hyper in zip(self.param_groups, saved["param_groups"]):
            pg.update({k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()})
        self.skipped_steps = int(saved["skipped_steps"])


_PLAIN = (int, float, bool, str, list, tuple, type(None))


def _prefix(gi: int, g: ShardedGroup) -> str:
    expert = getattr(g, "expert", None)  # (a Stage3Group has none)
    return group_prefix(gi, expert.ep_rank if expert is not None else None)


def _writes_piece(g: ShardedGroup) -> bool:
    """Whether this rank writes its piece of expert group ``g``: the first of the ranks holding it (stage 0: the
    EDP group's first rank; stages 1/2: every rank holds a piece of its own)."""
    return g.world_size > 1 or g.expert.edp_ranks[0] == torch.distributed.get_rank()


def _expert_info(g: ShardedGroup) -> dict:
    """An expert-parallel group's layout for the checkpoint: its ep_size, and per EP rank the global ranks whose
    files hold its pieces, in piece order (stage 0: one piece, written by the EDP group's first rank)."""
    if getattr(g, "expert", None) is None:
        return {}
    pieces = [list(ranks) if g.world_size > 1 else [ranks[0]] for ranks in g.expert.all_edp_ranks]
    return {"expert": {"group_name": g.expert.name, "ep_size": g.expert.ep_size, "piece_ranks": pieces}}


def _per_element(value, master: torch.Tensor) -> bool:
    """A state tensor cut like the master (exp_avg, ...): 1-d, one value per master element -- also for a group
    with no trainable parameter (a LoRA run's no-decay group: 0 elements); 0-d tensors (step) are scalars."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == master.numel()
