"""The one module hf_zero swaps into a model to compress it during training.

:class:`CompressedLinear` *is* an ``nn.Linear`` (isinstance checks in transformers and peft keep working) and
owns the very same ``weight`` / ``bias`` Parameter objects as the layer it replaces, so state-dict keys of the
weights do not change and optimizers built before or after see the same tensors. What compression adds lives in
two ``ModuleDict``s keyed by method name:

- ``weight_transforms``: ``(weight, bias) -> (weight, bias)`` -- masks first, the quantizer last;
- ``input_transforms``: ``x -> x`` -- activation quantization.

Transforms read ``self.weight`` at forward time, whatever it is then (under ZeRO-3 the gathered full weight), and
keep all their state (masks, bits, densities, learned scores) as buffers/parameters of the module, so it is saved
with the model and restored on resume.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CompressedLinear", "WeightTransform", "InputTransform", "wrap_linear", "unwrap_all",
           "compressed_modules", "TRANSFORM_ORDER", "full_shape", "full_parameters", "is_partitioned",
           "require_full_parameters"]

# masks compose in any order; quantization must see the masked weight so pruned zeros stay exact zeros
TRANSFORM_ORDER = ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning", "weight_quantization")


def is_partitioned(param: torch.Tensor) -> bool:
    """True for a ZeRO-3 parameter (hf_zero's or DeepSpeed's): its ``data`` is a placeholder outside forward."""
    return getattr(param, "ds_id", None) is not None


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's real shape, also while ZeRO-3 holds only a shard of it."""
    ds_shape = getattr(param, "ds_shape", None)
    return torch.Size(ds_shape) if ds_shape is not None else param.shape


@contextlib.contextmanager
def full_parameters(params: Iterable[torch.Tensor | None]) -> Iterator[None]:
    """Read-only full values of possibly partitioned parameters inside the block (edits are discarded); a no-op
    for ordinary parameters. Used wherever compression reads weights outside a forward pass."""
    sharded = [p for p in params if p is not None and is_partitioned(p)]
    if not sharded:
        yield
        return
    from hf_zero.zero import GatheredParameters

    with GatheredParameters(sharded):
        yield


def require_full_parameters(model: nn.Module, what: str) -> None:
    """Structural changes replace parameters, which ZeRO-3 partitioning cannot follow: ask for a full model."""
    names = [n for n, p in model.named_parameters() if is_partitioned(p)]
    if names:
        raise RuntimeError(f"{what} needs the full model, but {len(names)} parameters are ZeRO-3 partitioned "
                           f"(e.g. {names[0]}); run it on the consolidated model (engine.save_16bit_model / "
                           f"_zero3_consolidated_16bit_state_dict loaded into an unpartitioned copy)")


class WeightTransform(nn.Module):
    """A change of the effective weight. ``forward`` is differentiable (straight-through where needed);
    ``fold`` gives the exact effective weight for :func:`redundancy_clean`; ``set_step`` moves its schedule."""

    def set_step(self, step: int) -> None:
        raise NotImplementedError

    def fold(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.no_grad():
            return self(weight, bias)

    def stats(self) -> dict[str, float]:
        return {}


class InputTransform(nn.Module):
    def set_step(self, step: int) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        return {}


class CompressedLinear(nn.Linear):
    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # same Parameter objects: (out, in), (out,)
        self.bias = linear.bias
        self.weight_transforms = nn.ModuleDict()
        self.input_transforms = nn.ModuleDict()

    def add_weight_transform(self, method: str, transform: WeightTransform) -> None:
        if method in self.weight_transforms:
            raise ValueError(f"{method} is already applied to this module (two groups match it)")
        items = dict(self.weight_transforms.items())
        items[method] = transform
        ordered = sorted(items.items(), key=lambda kv: TRANSFORM_ORDER.index(kv[0]))
        self.weight_transforms = nn.ModuleDict(ordered)

    def add_input_transform(self, method: str, transform: InputTransform) -> None:
        if method in self.input_transforms:
            raise ValueError(f"{method} is already applied to this module (two groups match it)")
        self.input_transforms[method] = transform

    def effective_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = self.weight, self.bias
        for t in self.weight_transforms.values():
            weight, bias = t(weight, bias)
        return weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.effective_weight()
        for t in self.input_transforms.values():
            x = t(x)
        return F.linear(x, weight, bias)

    def folded(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Exact effective (weight, bias) without autograd: what :func:`redundancy_clean` writes back. Gathers
        ZeRO-3 parameters for the call; the result is a copy."""
        own = [self.weight, self.bias, *self.weight_transforms.parameters()]
        with full_parameters(own):
            weight, bias = self.weight.detach(), None if self.bias is None else self.bias.detach()
            for t in self.weight_transforms.values():
                weight, bias = t.fold(weight, bias)
            return weight.clone(), None if bias is None else bias.clone()

    def extra_repr(self) -> str:
        methods = [*self.weight_transforms.keys(), *self.input_transforms.keys()]
        return f"{super().extra_repr()}, compression={methods}"


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def wrap_linear(model: nn.Module, name: str) -> CompressedLinear:
    """The CompressedLinear at ``name``, swapping one in (sharing parameters) if it is still a plain Linear."""
    module = model.get_submodule(name)
    if isinstance(module, CompressedLinear):
        return module
    if type(module) is not nn.Linear:
        raise TypeError(f"{name} is a {type(module).__name__}; compression applies to torch.nn.Linear only")
    wrapped = CompressedLinear(module)
    _set_submodule(model, name, wrapped)
    return wrapped


def compressed_modules(model: nn.Module) -> dict[str, CompressedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, CompressedLinear)}


def unwrap_all(model: nn.Module) -> None:
    """Replace every CompressedLinear by a plain nn.Linear holding its current weight/bias (already folded)."""
    for name, module in compressed_modules(model).items():
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                          device="meta")
        plain.weight = module.weight
        plain.bias = module.bias
        _set_submodule(model, name, plain)
