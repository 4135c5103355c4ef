"""Which update rule the partitioned optimizer runs: from the config's ``optimizer`` section or a client optimizer.

The result is an :class:`OptimizerPlan`: the torch optimizer class and defaults that own ``param_groups``/``state``
(so schedulers and checkpoints see torch's structures), whether the fused Adam kernel does the math, and each
parameter group's hyperparameters. The engine applies the plan to the master shards; the client's own optimizer
object is never stepped (its parameters are the full model's, ZeRO steps the shards), but its ``param_groups``
become the engine optimizer's (:func:`adopt_client_groups`), so a scheduler built on it drives the training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from hf_zero.config.errors import ConfigError

__all__ = ["OptimizerPlan", "UntestedOptimizerError", "plan_from_config", "plan_from_client", "adopt_client_groups"]

# torch's own keys in param_groups that are not hyperparameters to carry over
_TORCH_GROUP_KEYS = {"params", "foreach", "maximize", "capturable", "differentiable", "fused", "initial_lr",
                     "decoupled_weight_decay"}


class UntestedOptimizerError(ConfigError, AssertionError):
    """A client optimizer ZeRO does not know to be element-wise, without ``zero_allow_untested_optimizer``. Also an
    AssertionError: DeepSpeed asserts there, and scripts (DeepSpeed's own tests among them) catch that type."""


@dataclass
class OptimizerPlan:
    inner_cls: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    fused_adam: bool
    # per parameter group: (the model parameters in it, extra hyperparameters overriding defaults)
    groups: list[tuple[list[torch.nn.Parameter], dict[str, Any]]] = field(default_factory=list)
    # optimizer.params.torch_adam: torch's Adam(W) arithmetic, not hf_zero's fused kernel (amsgrad excluded)
    torch_adam: bool = False
    # the client's torch optimizer the plan was read from (plan_from_client), whose param_groups the engine's
    # optimizer takes over (adopt_client_groups)
    client: torch.optim.Optimizer | None = None


def _fused_adam_available() -> bool:
    try:
        from hf_zero.ops.adam import adam_step_  # noqa: F401
    except ImportError:
        return False
    return True


def _param_groups(model_parameters: Sequence) -> list[tuple[list, dict]]:
    """``model_parameters`` as DeepSpeed takes it: parameters, or dicts with "params" plus hyperparameters."""
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [(list(g["params"]), {k: v for k, v in g.items() if k != "params"}) for g in items]
    return [(items, {})]


def plan_from_config(opt_cfg, model_parameters: Sequence) -> OptimizerPlan:
    """The ``optimizer`` section (type + params) applied to ``model_parameters``."""
    name = opt_cfg.type.lower()
    params = dict(opt_cfg.params)
    groups = _param_groups(model_parameters)
    if name in ("adam", "adamw"):
        adamw_mode = True if name == "adamw" else bool(params.pop("adam_w_mode", True))
        params.pop("adam_w_mode", None)
        torch_adam = bool(params.pop("torch_adam", False))
        fused_flag = params.pop("fused", None)
        amsgrad = bool(params.get("amsgrad", False))
        defaults = {"lr": params.get("lr", 1e-3), "betas": tuple(params.get("betas", (0.9, 0.999))),
                    "eps": params.get("eps", 1e-8), "weight_decay": params.get("weight_decay", 0.0),
                    "amsgrad": amsgrad}
        bias_correction = bool(params.get("bias_correction", True))
        fused = not torch_adam and not amsgrad and _fused_adam_available()
        if not bias_correction and not fused:
            raise ConfigError("optimizer.params.bias_correction",
                              "false needs hf_zero's fused Adam kernel (torch's Adam always corrects bias); "
                              "remove torch_adam/amsgrad or set bias_correction true")
        if torch_adam and fused_flag:
            defaults["fused"] = True
        inner = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        extra = {"adamw_mode": adamw_mode, "bias_correction": bias_correction}
        return OptimizerPlan(inner, defaults, fused, [(ps, {**extra, **h}) for ps, h in groups],
                             torch_adam=torch_adam and not amsgrad)
    if name == "sgd":
        defaults = {k: params[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov") if k in params}
        defaults.setdefault("lr", 1e-3)
        return OptimizerPlan(torch.optim.SGD, defaults, False, groups)
    if name == "adagrad":
        defaults = {k: params[k] for k in ("lr", "eps", "weight_decay") if k in params}
        return OptimizerPlan(torch.optim.Adagrad, defaults, False, groups)
    raise ConfigError("optimizer.type", f"{opt_cfg.type!r} is accepted by the config but not built by hf_zero yet; "
                                        "use Adam, AdamW, SGD or Adagrad, or pass your own torch optimizer to "
                                        "initialize(optimizer=...)")


def plan_from_client(optimizer: torch.optim.Optimizer, *, allow_untested: bool) -> OptimizerPlan:
    """A torch optimizer the user built over the model's parameters, re-applied to the master shards.

    Element-wise optimizers (Adam, AdamW, SGD, Adagrad, RMSprop, ...) give the same result on a shard as on the
    full tensor. Ones that look at whole tensors (LAMB's trust ratio, Adafactor's factored moments) would not, so
    anything outside the known list needs ``zero_allow_untested_optimizer: true``, as in DeepSpeed.
    """
    if any(optimizer.state.values()):
        raise ValueError("hf_zero.initialize(optimizer=...): the optimizer already has state (it was stepped); "
                         "pass a freshly built optimizer, or load its state with engine.load_checkpoint")
    cls = type(optimizer)
    known_elementwise = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad,
                         torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)
    groups = [(list(g["params"]), {k: v for k, v in g.items() if k not in _TORCH_GROUP_KEYS})
              for g in optimizer.param_groups]
    defaults = {k: v for k, v in optimizer.defaults.items() if k not in _TORCH_GROUP_KEYS - {"fused", "foreach"}}
    adam_like = getattr(cls, "hf_zero_adam", None)  # hf_zero.ops.adam.CPUAdam / FusedAdam set this
    if adam_like is not None or cls in (torch.optim.Adam, torch.optim.AdamW):
        adamw_mode = bool(optimizer.defaults.get("adamw_mode", cls is torch.optim.AdamW))
        if cls is torch.optim.Adam and optimizer.defaults.get("decoupled_weight_decay"):
            adamw_mode = True
        amsgrad = bool(optimizer.defaults.get("amsgrad", False))
        bias_correction = bool(optimizer.defaults.get("bias_correction", True))
        inner = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        defaults = {k: optimizer.defaults[k] for k in ("lr", "betas", "eps", "weight_decay") if k in optimizer.defaults}
        defaults["amsgrad"] = amsgrad
        extra = {"adamw_mode": adamw_mode, "bias_correction": bias_correction}
        groups = [(ps, {**extra, **{k: v for k, v in h.items() if k in ("lr", "betas", "eps", "weight_decay")}})
                  for ps, h in groups]
        return OptimizerPlan(inner, defaults, (not amsgrad) and _fused_adam_available(), groups, client=optimizer)
    # hf_zero's CPUAdagrad / CPULion (DeepSpeedCPUAdagrad / DeepSpeedCPULion) declare themselves element-wise
    elementwise = issubclass(cls, known_elementwise) or getattr(cls, "hf_zero_elementwise", False)
    if not elementwise and not allow_untested:
        raise UntestedOptimizerError(
            "zero_allow_untested_optimizer", f"the client optimizer {cls.__module__}.{cls.__name__} is not known to "
            "give the same result on a shard as on the full tensor; set \"zero_allow_untested_optimizer\": true to "
            "use it anyway")
    defaults.pop("fused", None)
    return OptimizerPlan(cls, defaults, False, groups, client=optimizer)


def adopt_client_groups(client: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> bool:
    """Make the client optimizer's ``param_groups`` the list the engine's optimizer steps with, as DeepSpeed does
    (its ZeRO optimizer swaps the client's groups' parameters for the flat shards and steps the client's
    optimizer): an LR scheduler the script built on its own optimizer before ``initialize`` -- torch's,
    transformers' ``get_*_schedule_with_warmup``, accelerate's ``prepare(model, optimizer, scheduler)`` -- then
    sets the learning rate that is trained with, and the script's ``optimizer.param_groups[0]["lr"]`` reads it.

    Each group keeps what the client's scheduler stored in it (``initial_lr``, OneCycleLR's ``max_lr``...); the
    engine's own keys win. Returns False, changing nothing, where the engine's groups are not one per client
    group in order (a pipeline stage holds some groups only)."""
    ours = optimizer.param_groups
    if len(ours) != len(client.param_groups):
        return False
    for theirs, mine in zip(client.param_groups, ours):
        for key, value in theirs.items():
            if key != "params":
                mine.setdefault(key, value)
    client.param_groups = ours
    # torch's schedulers warn at their first step unless the optimizer they were built on has stepped (a flag its
    # wrapped step() sets); the engine's optimizer steps in its place
    optimizer.register_step_post_hook(lambda *_: setattr(client, "_opt_called", True))
    return True
