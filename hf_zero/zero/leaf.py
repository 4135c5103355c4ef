"""ZeRO-3 leaf modules (DeepSpeed's ``set_z3_leaf_modules`` and friends).

A leaf module's whole subtree is one gather group: every parameter below it is gathered when its forward (or
backward) starts and its descendants get no hooks of their own. Use it where a module uses its sub-modules'
parameters without calling them in a way hf_zero cannot see (``torch.stack(list(experts.parameters()))``), or calls
a data-dependent subset of them (mixture-of-experts routing: ranks would otherwise gather different experts).
Parameters read through ``module.weight`` inside another module's forward are gathered automatically (see
``Stage3Runtime``), leaf or not.

A leaf is also where ranks may use different parameters: its gradients are held and reduced together when its
backward ends, with zeros for the parameters this rank did not use (stage3/leaf_grads.py, DeepSpeed's rule). Every
rank must still call the leaf itself. The config key ``zero_optimization.leaf_module`` chooses leaves by class, name
or name suffix (:func:`apply_leaf_module_config`; by default DeepSpeed's list of MoE blocks).

Same names, arguments and return values as ``deepspeed.utils``; changing leaves after the engine was built takes
effect at the next forward.
"""

from __future__ import annotations

import logging
from typing import Sequence

from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "module_granularity", "set_z3_leaf_modules_by_granularity", "apply_leaf_module_config", "LEAF_ATTR"]

LEAF_ATTR = "_z3_leaf"  # DeepSpeed's attribute name: code that sets it directly keeps working


def z3_leaf_module(module: nn.Module) -> bool:
    return bool(getattr(module, LEAF_ATTR, False))


def z3_leaf_parameter(param) -> bool:
    """Whether ``param`` belongs to a leaf module of a running ZeRO-3 engine (``param.ds_z3_leaf_module``)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(module: nn.Module, flag: bool) -> None:
    setattr(module, LEAF_ATTR, bool(flag))
    _changed()


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of ``model`` that is an instance of one of ``leaf_module_classes`` (classes, or class
    names: ``"MixtralSparseMoeBlock"`` or ``"pkg.module.MixtralSparseMoeBlock"``); returns the flagged modules."""
    return _set(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    return _set(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf flag of the modules named ``module_names`` (exact ``model.named_modules()`` names, ``""`` for
    ``model`` itself). Returns ``(modules, missing)``: the modules in the order of the names (a name given twice
    appears twice, as in DeepSpeed), and the names that matched no module."""
    by_name = dict(model.named_modules())
    found, missing = [], []
    for name in module_names:
        module = by_name.get(name)
        if module is None:
            missing.append(name)
        else:
            setattr(module, LEAF_ATTR, bool(flag))
            found.append(module)
    if found:
        _changed()
    if missing and raise_if_not_found:
        raise ValueError(f"hf_zero: no module named {missing} in {type(model).__name__} (names are those of "
                         f"model.named_modules(), e.g. {_examples(by_name)}); pass raise_if_not_found=False to allow "
                         f"this")
    return found, missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf flag of every module whose ``model.named_modules()`` name ends with one of
    ``module_name_suffixes`` (plain string suffix: ``"mlp"`` also matches ``"layers.0.shared_mlp"``). Returns
    ``(modules, missing)``: each matched module once, and the suffixes that matched nothing."""
    by_name = dict(model.named_modules())
    found, missing, seen = [], [], set()
    for suffix in module_name_suffixes:
        matched = [m for name, m in by_name.items() if name.endswith(suffix)]
        if not matched:
            missing.append(suffix)
        for module in matched:
            setattr(module, LEAF_ATTR, bool(flag))
            if id(module) not in seen:
                seen.add(id(module))
                found.append(module)
    if found:
        _changed()
    if missing and raise_if_not_found:
        raise ValueError(f"hf_zero: no module name of {type(model).__name__} ends with {missing} (names are those of "
                         f"model.named_modules(), e.g. {_examples(by_name)}); pass raise_if_not_found=False to allow "
                         f"this")
    return found, missing


def apply_leaf_module_config(model: nn.Module, classes: Sequence[str] = (), names: Sequence[str] = (),
                             name_suffixes: Sequence[str] = (), *, warn_unmatched: bool = False) -> list[nn.Module]:
    """``zero_optimization.leaf_module``: flag the modules of ``model`` matching one of ``classes``, ``names`` or
    ``name_suffixes`` (what matches nothing is no error: the default classes are DeepSpeed's MoE blocks, absent from
    most models). With ``warn_unmatched`` (the config changed the defaults) unmatched names and suffixes, and a
    configuration that matched nothing, are logged as warnings naming the key, as DeepSpeed does. Returns the
    flagged modules, each once."""
    flagged: dict[int, nn.Module] = {}
    if classes:
        for m in _set(model, classes, True, raise_if_not_found=False):
            flagged.setdefault(id(m), m)
    for what, values, setter in (("names", names, set_z3_leaf_modules_by_name),
                                 ("name_suffixes", name_suffixes, set_z3_leaf_modules_by_suffix)):
        if not values:
            continue
        found, missing = setter(model, values, raise_if_not_found=False)
        for m in found:
            flagged.setdefault(id(m), m)
        if missing and warn_unmatched:
            logger.warning("hf_zero ZeRO-3: zero_optimization.leaf_module.%s %s match no module of %s (names are "
                           "those of model.named_modules(), e.g. %s)", what, missing, type(model).__name__,
                           _examples(dict(model.named_modules())))
    if not flagged and warn_unmatched:
        logger.warning("hf_zero ZeRO-3: zero_optimization.leaf_module matched no module of %s; its modules are "
                       "gathered one by one as usual", type(model).__name__)
    return list(flagged.values())


# DeepSpeed's measure for ``stage3_module_granularity_threshold``, kept so that one config picks the same leaves on
# both engines. A module's granularity is its subtree's parameter count (full, unpartitioned sizes) divided by its
# "layers": torch leaf modules that own parameters, plus every composite module (itself included). Modules that own
# no parameters, torch leaf modules, the containers (whose forward may never run, so their children need their own
# hooks) and subtrees above _MAX_LEAF_NUMEL (one gather that large costs more memory than hooks cost time) are
# never chosen.
_CONTAINERS = frozenset(("Container", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict"))
_MAX_LEAF_NUMEL = 1_000_000_000


def _full_numel(param) -> int:
    return int(getattr(param, "ds_numel", None) or param.numel())  # ZeRO-3 partitions keep their full size here


def module_granularity(model: nn.Module) -> dict[nn.Module, int | None]:
    """Every module of ``model`` -> its granularity (parameters per layer), None where it can never be a leaf."""
    out: dict[nn.Module, int | None] = {}

    def visit(module: nn.Module) -> tuple[int, int]:  # (layers, parameters) of the subtree
        if next(module.parameters(), None) is None:
            out[module] = None
            for m in module.modules():
                out.setdefault(m, None)
            return 0, 0
        numel = sum(_full_numel(p) for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            out[module] = None
            return 1, numel
        layers = 0
        for child in children:
            child_layers, child_numel = visit(child)
            layers += child_layers
            numel += child_numel
        if type(module).__name__ in _CONTAINERS:
            out[module] = None
            return layers, numel
        layers += 1
        out[module] = numel // layers if numel <= _MAX_LEAF_NUMEL else None
        return layers, numel

    visit(model)
    return out


def set_z3_leaf_modules_by_granularity(model: nn.Module, threshold: int,
                                       granularity: dict[nn.Module, int | None] | None = None) -> list[nn.Module]:
    """``stage3_module_granularity_threshold``: flag as leaves the outermost modules whose granularity is at most
    ``threshold`` (a parent is preferred to its children), so each is gathered as one unit -- one all-gather and one
    hook pair instead of one per sub-module, and under ``torch.compile`` one graph per leaf instead of a graph break
    at every sub-module. Returns the flagged modules, outermost first; none if ``threshold`` is below every
    module's granularity (the caller says so). ``granularity``: :func:`module_granularity` of ``model``, when the
    caller has it already."""
    if granularity is None:
        granularity = module_granularity(model)
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        g = granularity.get(module)
        if g is not None and g <= threshold:
            setattr(module, LEAF_ATTR, True)
            chosen.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    if chosen:
        _changed()
    return chosen


def _examples(by_name: dict) -> str:
    names = [n for n in by_name if n][:4]
    return ", ".join(repr(n) for n in names) + (" ..." if len(by_name) > 5 else "") if names else "none"


def _matches(module: nn.Module, spec: type | str) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    cls = type(module)
    return spec in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set(model: nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    classes = list(classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"hf_zero: leaf_module_classes must be classes or class names, got {bad!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    if not found and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"hf_zero: no module of the classes {names} in {type(model).__name__}; check the class "
                         f"names (pass raise_if_not_found=False to allow this)")
    for m in found:
        setattr(m, LEAF_ATTR, flag)
    if found:
        _changed()
    return found


def _changed() -> None:
    """A running ZeRO-3 engine rebuilds its gather groups at its next forward. Called only when a flag was set:
    building an engine applies the config's leaf classes to its model, and a call that matched nothing must not make
    every other live engine (TRL's reference model, say) rebuild its groups and re-record its trace."""
    from hf_zero.zero.stage3.runtime import bump_external_version

    bump_external_version()
