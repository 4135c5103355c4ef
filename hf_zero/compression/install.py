"""Installing a grouped method module by module, and finding what it installed when the model is cleaned.

Every per-module method (the quantizers, the unit masks) walks the config the same way: each group's ``modules``
select linears, and each selected linear gets one transform, attached under the method's name. Only building that
transform is the method's own (``build``). It is built before the linear is swapped for a CompressedLinear, so a
config error found while building leaves that module as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Union

from torch import nn

from .layer import CompressedLinear, InputTransform, WeightTransform, wrap_linear
from .matching import blamed_on, match_group

if TYPE_CHECKING:
    from .config import Group, MethodConfig

__all__ = ["Build", "install_each", "each_installed", "installed_transform"]

# (model, method config, group, module name) -> the transform for that module
Build = Callable[[nn.Module, "MethodConfig", "Group", str], Union[WeightTransform, InputTransform]]


def install_each(model: nn.Module, cfg: MethodConfig, build: Build, excluded: tuple[str, ...] = ()) -> list[str]:
    """Attach ``build``'s transform to every module each group selects (``excluded``: name patterns skipped);
    returns the names changed. Two groups selecting one module is an error blamed on the second group."""
    touched: list[str] = []
    for group in cfg.groups:
        for name in match_group(model, group, excluded=excluded):
            transform = build(model, cfg, group, name)
            module = wrap_linear(model, name)
            attach = module.add_input_transform if isinstance(transform, InputTransform) else \
                module.add_weight_transform
            with blamed_on(group, name):
                attach(cfg.method, transform)
            touched.append(name)
    return touched


def installed_transform(model: nn.Module, name: str, method: str) -> WeightTransform | None:
    """The weight transform ``method`` put on module ``name``, or None (never installed, or cleaned already)."""
    module = model.get_submodule(name)
    if isinstance(module, CompressedLinear) and method in module.weight_transforms:
        return module.weight_transforms[method]
    return None


def each_installed(model: nn.Module, cfg: MethodConfig) -> Iterator[tuple[Group, str, WeightTransform]]:
    """(group, module name, transform) for every selected module that holds the method's weight transform, in
    install order; modules without one are skipped, so planning a clean of a clean model plans nothing."""
    for group in cfg.groups:
        for name in match_group(model, group):
            transform = installed_transform(model, name, cfg.method)
            if transform is not None:
                yield group, name, transform
