"""``inject(model)``: run a transformers model's norms and GeLU activations on hf_zero's fused kernels.

Matching modules keep their identity, attributes and parameters: only their class is swapped for a subclass of
the original whose ``forward`` calls the fused op. So parameter names, ``state_dict`` keys, ``isinstance`` checks
(transformers' ``_init_weights``, ``_no_split_modules``) and ``save_pretrained`` output are unchanged, and the
model's own code is never edited (the torchtitan habit).

Swapped:
- ``nn.LayerNorm`` (and subclasses) over the last dimension              -> ``layer_norm``
- Llama-style RMSNorms: ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` -> ``rms_norm``
- GeLU activations: ``nn.GELU``, transformers' ``GELUActivation`` (erf) and the tanh approximations
  ``NewGELUActivation``, ``GELUTanh`` / ``PytorchGELUTanh``, ``FastGELUActivation`` -> ``bias_gelu``

``remove_injection(model)`` restores the original classes.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from hf_zero.ops.norm import layer_norm, rms_norm
from hf_zero.ops.transformer import bias_gelu

__all__ = ["inject", "remove_injection"]

# RMSNorm classes whose forward is LlamaRMSNorm's (weight * normalized, eps in ``variance_epsilon``). Gemma's
# (1 + weight) and T5's fp32-weight variants are deliberately absent.
_LLAMA_STYLE_RMSNORMS = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm", "Qwen3RMSNorm",
    "Qwen3MoeRMSNorm", "Phi3RMSNorm", "OlmoRMSNorm", "Olmo2RMSNorm", "GraniteRMSNorm", "SmolLM3RMSNorm",
})
# transformers.activations class name -> approximate
_HF_GELUS = {
    "GELUActivation": "none",
    "NewGELUActivation": "tanh",
    "GELUTanh": "tanh",
    "PytorchGELUTanh": "tanh",
    "FastGELUActivation": "tanh",
}


class _FusedLayerNormMixin:
    hf_zero_fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


class _FusedRMSNormMixin:
    hf_zero_fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


class _FusedGELUMixin:
    hf_zero_fused = True
    hf_zero_approximate = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu(x, None, self.hf_zero_approximate)


_fused_classes: dict[tuple[type, str], type] = {}


def _fused_class(original: type, mixin: type, approximate: str = "") -> type:
    key = (original, approximate)
    cls = _fused_classes.get(key)
    if cls is None:
        name = f"HfZeroFused{original.__name__}" + (f"_{approximate}" if approximate else "")
        attrs = {"__module__": __name__, "__qualname__": name}
        if approximate:
            attrs["hf_zero_approximate"] = approximate
        cls = type(name, (mixin, original), attrs)
        # Reachable by name so that pickling an injected model works within a process that ran inject().
        setattr(sys.modules[__name__], name, cls)
        _fused_classes[key] = cls
    return cls


def _replacement(module: nn.Module) -> type | None:
    if getattr(module, "hf_zero_fused", False):
        return None
    cls = type(module)
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) == 1:
            return _fused_class(cls, _FusedLayerNormMixin)
        return None
    if cls.__name__ in _LLAMA_STYLE_RMSNORMS and isinstance(getattr(module, "weight", None), torch.Tensor) \
            and hasattr(module, "variance_epsilon"):
        return _fused_class(cls, _FusedRMSNormMixin)
    if isinstance(module, nn.GELU):
        return _fused_class(cls, _FusedGELUMixin, module.approximate)
    approximate = _HF_GELUS.get(cls.__name__)
    if approximate is not None and cls.__module__.startswith("transformers."):
        return _fused_class(cls, _FusedGELUMixin, approximate)
    return None


def inject(model: nn.Module) -> dict[str, int]:
    """Swap matching modules of ``model`` (in place) onto the fused kernels; returns {original class: count}."""
    counts: dict[str, int] = {}
    for module in model.modules():
        fused = _replacement(module)
        if fused is not None:
            original = type(module).__name__
            module.__class__ = fused
            counts[original] = counts.get(original, 0) + 1
    return counts


def remove_injection(model: nn.Module) -> int:
    """Restore the original classes of every module ``inject`` swapped; returns how many."""
    restored = 0
    for module in model.modules():
        if getattr(module, "hf_zero_fused", False):
            module.__class__ = type(module).__mro__[2]  # (fused, mixin, original, ...)
            restored += 1
    return restored
