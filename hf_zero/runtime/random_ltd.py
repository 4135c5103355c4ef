"""Random layer-token drop (random-LTD): ``data_efficiency.data_routing.random_ltd``, DeepSpeed's data routing.

A script wraps its transformer layers with :func:`convert_to_random_ltd` (``deepspeed.runtime.data_pipeline.
data_routing.helper``, the same call); the engine then hands the configured layers (``random_ltd_layer_id``) the
schedule. While training, each of those layers computes only ``reserved_length`` of the sequence's tokens -- a
random, order-preserving subset per sample, drawn once per forward for all of them (``torch.multinomial`` without
replacement, then sorted, as DeepSpeed) -- and the other tokens pass it unchanged::

    out = hidden.clone();  out[b, kept[l, b]] = layer(hidden[b, kept[l, b]])        (batch_seq_dim)

``reserved_length`` follows ``random_ltd_schedule`` (``fixed_linear``): from ``min_value`` it grows linearly to
``max_value`` over ``require_steps`` optimizer steps, rounded down to a multiple of ``seq_per_step``; the engine
moves it at each training forward from its ``global_steps``. A decoder's mask (``model_mask_name``) is cut to the
first ``reserved_length`` rows and columns, an encoder's to the kept tokens' rows and columns (DeepSpeed's
``gpt_sample_tokens`` / ``bert_sample_tokens``). In evaluation, or when the whole sequence is kept, the layer runs
unchanged. The gather and scatter are plain differentiable indexing, so autograd gives each kept token its
gradient through the layer and each skipped token its gradient around it -- DeepSpeed's ``GatherTokens`` /
``ScatterTokens`` CUDA kernels compute the same (they need a GPU; this runs anywhere).

Like DeepSpeed's, the wrapped layer gets the mask and its other keyword arguments unchanged: layers whose other
arguments are per token (rotary ``position_embeddings``) cannot be wrapped.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_zero.config.errors import ConfigError, check_keys

__all__ = ["RandomLTDPolicy", "RandomLTDScheduler", "RandomLayerTokenDrop", "random_ltd_policy",
           "convert_to_random_ltd", "save_without_random_ltd", "remove_random_ltd_state_dict", "sample_tokens"]

_SECTION = "data_efficiency.data_routing.random_ltd"
_KEYS = {"enabled", "total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_mask_name",
         "model_type", "hidden_state_order", "random_ltd_schedule", "layer_token_lr_schedule"}


@dataclass(frozen=True)
class RandomLTDPolicy:
    total_layer_num: int
    layer_ids: tuple[int, ...]  # sorted
    mask_name: str | None
    model_type: str             # "decoder" or "encoder"
    batch_first: bool           # hidden_state_order "batch_seq_dim" (else "seq_batch_dim")
    min_value: int
    max_value: int
    require_steps: int
    seq_per_step: int


def _need(section: Mapping, key: str, where: str) -> Any:
    if key not in section:
        raise ConfigError(f"{where}.{key}", "is required")
    return section[key]


def random_ltd_policy(data_efficiency: Mapping | None) -> RandomLTDPolicy | None:
    """The policy of ``data_efficiency.data_routing.random_ltd``, or None where it is off (DeepSpeed's switches:
    the section's, ``data_routing``'s and ``data_efficiency``'s ``enabled``)."""
    de = data_efficiency or {}
    routing = de.get("data_routing") or {}
    section = routing.get("random_ltd") or {}
    if not (de.get("enabled") and routing.get("enabled") and section.get("enabled")):
        return None
    check_keys(section, sorted(_KEYS), _SECTION)
    ids = _need(section, "random_ltd_layer_id", _SECTION)
    num = int(_need(section, "random_ltd_layer_num", _SECTION))
    if not isinstance(ids, (list, tuple)) or len(ids) != num:
        raise ConfigError(f"{_SECTION}.random_ltd_layer_num", f"{num} must equal the number of random_ltd_layer_id "
                                                               f"entries {ids!r} (DeepSpeed's rule)")
    model_type = section.get("model_type", "decoder")
    if model_type not in ("decoder", "encoder"):
        raise ConfigError(f"{_SECTION}.model_type", f"{model_type!r}: 'decoder' or 'encoder' (DeepSpeed's two)")
    order = section.get("hidden_state_order", "batch_seq_dim")
    if order not in ("batch_seq_dim", "seq_batch_dim"):
        raise ConfigError(f"{_SECTION}.hidden_state_order", f"{order!r}: 'batch_seq_dim' or 'seq_batch_dim'")
    if (section.get("layer_token_lr_schedule") or {}).get("enabled"):
        raise ConfigError(f"{_SECTION}.layer_token_lr_schedule.enabled", "true is not implemented (DeepSpeed 0.19.8 "
                                                                        "raises NotImplementedError for it too)")
    sched = _need(section, "random_ltd_schedule", _SECTION)
    where = f"{_SECTION}.random_ltd_schedule"
    if sched.get("schedule_type", "fixed_linear") != "fixed_linear":
        raise ConfigError(f"{where}.schedule_type", f"{sched.get('schedule_type')!r}: only 'fixed_linear' "
                                                    "(DeepSpeed's only one)")
    conf = _need(sched, "schedule_config", where)
    lo, hi = int(_need(sched, "min_value", where)), int(_need(sched, "max_value", where))
    if not 0 < lo <= hi:
        raise ConfigError(f"{where}.min_value", f"{lo} must be > 0 and <= max_value {hi}")
    steps, per = int(_need(conf, "require_steps", f"{where}.schedule_config")), int(
        _need(conf, "seq_per_step", f"{where}.schedule_config"))
    if steps <= 0 or per <= 0:
        raise ConfigError(f"{where}.schedule_config", f"require_steps {steps} and seq_per_step {per} must be > 0")
    return RandomLTDPolicy(total_layer_num=int(_need(section, "total_layer_num", _SECTION)),
                           layer_ids=tuple(sorted(int(i) for i in ids)), mask_name=section.get("model_mask_name"),
                           model_type=model_type, batch_first=order == "batch_seq_dim", min_value=lo, max_value=hi,
                           require_steps=steps, seq_per_step=per)


class RandomLTDScheduler:
    """The reserved length, and the layer tokens consumed, step by step (DeepSpeed's ``RandomLTDScheduler``: the
    same ``state`` keys and methods, which scripts read)."""

    def __init__(self, policy: RandomLTDPolicy, global_batch_size: int) -> None:
        self.policy = policy
        self.model_layer_num = policy.total_layer_num
        self.random_ltd_layer_num = len(policy.layer_ids)
        self.global_batch_size = int(global_batch_size)
        self.state: dict[str, Any] = {"min_value": policy.min_value, "max_value": policy.max_value,
                                      "current_value": policy.min_value, "consumed_layer_tokens": 0,
                                      "current_steps": -1}
        self.sample: tuple[torch.Tensor, Any] | None = None  # this forward's kept tokens (first layer draws them)

    def value_at(self, global_steps: int) -> int:
        p = self.policy
        seq = math.floor(float(global_steps) / p.require_steps * (p.max_value - p.min_value) + p.min_value)
        return min(seq - seq % p.seq_per_step, p.max_value)

    def update_seq(self, global_steps: int) -> None:
        s = self.state
        if s["current_value"] < s["max_value"]:
            s["current_value"] = self.value_at(global_steps)
        if global_steps != s["current_steps"]:
            s["consumed_layer_tokens"] += self.global_batch_size * (
                s["current_value"] * self.random_ltd_layer_num
                + s["max_value"] * (self.model_layer_num - self.random_ltd_layer_num))
            s["current_steps"] = global_steps

    def get_current_seq(self) -> int:
        return self.state["current_value"]

    def set_current_seq(self, seq_length: int) -> None:
        self.state["current_value"] = int(seq_length)

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_total_layer_tokens(self, train_iters: int) -> int:
        for step in range(train_iters):
            self.update_seq(step)
        return self.state["consumed_layer_tokens"]

    def state_dict(self) -> dict[str, int]:
        return {k: self.state[k] for k in ("consumed_layer_tokens", "current_steps", "current_value", "min_value",
                                           "max_value")}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.state.update({k: int(v) for k, v in state.items()})


def sample_tokens(reserved: int, seq: int, batch: int, layers: int, device, mask: torch.Tensor | None,
                  model_type: str) -> tuple[torch.Tensor, Any]:
    """``(layers, batch, reserved)`` sorted token indices, uniform without replacement, and the mask each layer
    gets: a decoder's cut to its first ``reserved`` rows and columns (one for all layers), an encoder's to each
    layer's kept rows and columns (a list)."""
    draws = torch.multinomial(torch.ones(layers * batch, seq, device=device), reserved)
    kept = draws.reshape(layers, batch, reserved).sort(dim=-1).values
    if mask is None:
        return kept, None
    if model_type == "decoder":
        return kept, mask[:, :, :reserved, :reserved]
    masks = []
    for l_kept in kept:  # (batch, reserved): mask rows then columns of each sample's kept tokens
        rows = torch.stack([mask[b, :, k, :] for b, k in enumerate(l_kept)])
        masks.append(torch.stack([rows[b][:, :, k] for b, k in enumerate(l_kept)]))
    return kept, masks


class RandomLayerTokenDrop(nn.Module):
    """A layer computing only the kept tokens while training (see the module docstring). The wrapped layer is
    ``random_ltd_layer``, DeepSpeed's attribute name (state-dict keys gain ``.random_ltd_layer``, which
    :func:`remove_random_ltd_state_dict` takes out)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: RandomLTDScheduler | None = None
        self.random_ltd_layer_id = -1
        self.reserved_length = -1

    def init_config(self, scheduler: RandomLTDScheduler, layer_id: int) -> None:
        """Called by the engine (``random_ltd_initialize``): this is the ``layer_id``-th configured layer."""
        self.random_ltd_scheduler, self.random_ltd_layer_id = scheduler, layer_id

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        sched = self.random_ltd_scheduler
        if sched is None or not self.training:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        p = sched.policy
        seq_dim = 1 if p.batch_first else 0
        seq, batch = hidden_states.size(seq_dim), hidden_states.size(1 - seq_dim)
        self.reserved_length = sched.get_current_seq()
        if self.reserved_length >= seq:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        if self.random_ltd_layer_id == 0 or sched.sample is None:  # the first configured layer draws for all
            mask = kwargs.get(p.mask_name) if p.mask_name else None
            sched.sample = sample_tokens(self.reserved_length, seq, batch, sched.random_ltd_layer_num,
                                         hidden_states.device, mask, p.model_type)
        kept, masks = sched.sample
        kept = kept[self.random_ltd_layer_id]
        if p.mask_name and masks is not None:
            kwargs[p.mask_name] = masks if p.model_type == "decoder" else masks[self.random_ltd_layer_id]
        x = hidden_states if p.batch_first else hidden_states.transpose(0, 1)
        index = kept.unsqueeze(-1).expand(-1, -1, x.size(-1))
        part = x.gather(1, index)
        if not p.batch_first:
            part = part.transpose(0, 1)
        outputs = self.random_ltd_layer(part, *args, **kwargs)
        first = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
        if not isinstance(first, torch.Tensor):
            raise TypeError(f"hf_zero random-LTD: {type(self.random_ltd_layer).__name__} returned "
                            f"{type(outputs).__name__}; a tensor or a tuple starting with one is expected")
        first = first if p.batch_first else first.transpose(0, 1)
        out = x.scatter(1, index, first)
        if not p.batch_first:
            out = out.transpose(0, 1)
        if isinstance(outputs, (tuple, list)):
            return [out, *outputs[1:]] if isinstance(outputs, list) else (out, *outputs[1:])
        return out


def convert_to_random_ltd(model, convert_type):
    """Wrap every ``convert_type`` module of ``model`` (an engine or a module) in :class:`RandomLayerTokenDrop`;
    with an engine, hand the configured layers the schedule (``engine.random_ltd_initialize()``). Returns
    ``model``."""
    root = model.module if hasattr(model, "module") else model
    for name, module in list(root.named_modules()):
        if name and isinstance(module, convert_type) and not isinstance(module, RandomLayerTokenDrop):
            parent_name, _, child = name.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            setattr(parent, child, RandomLayerTokenDrop(module))
    if hasattr(model, "random_ltd_initialize"):
        model.random_ltd_initialize()
    return model


def remove_random_ltd_state_dict(state_dict: Mapping) -> OrderedDict:
    """The state dict with the wrappers' ``.random_ltd_layer`` infix taken out of the keys (the plain model's)."""
    return OrderedDict((k.replace(".random_ltd_layer", ""), v) for k, v in state_dict.items())


def save_without_random_ltd(model) -> OrderedDict:
    root = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(root.state_dict())
