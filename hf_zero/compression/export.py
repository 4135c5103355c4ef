"""Export to real low-bit modules a user can run.

- :func:`export_int8` -- CPU: int8 weights (symmetric, one scale per output channel) and 8-bit dynamic
  activations through PyTorch's maintained x86/fbgemm kernels (``quantized::linear_prepack`` /
  ``quantized::linear_dynamic``). The state dict stores plain int8 tensors, so the model is ~4x smaller on disk.
  Where those kernels are missing the module computes the same thing with a float reference (slower), and says so
  once.
- :func:`export_bnb` -- bitsandbytes ``Linear8bitLt`` / ``Linear4bit`` (NF4 / FP4), on the devices bitsandbytes
  supports (CUDA, and CPU from bitsandbytes 0.45 on); anything else is a RuntimeError naming the alternatives.

Run :func:`~hf_zero.compression.redundancy_clean` first: export reads each ``nn.Linear``'s float weight. A weight
trained with 8-bit symmetric per-channel QAT is exported bit-exactly (the codes are the QAT grid).
"""

from __future__ import annotations

import re
import warnings
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .layer import CompressedLinear, require_full_parameters
from .quant import GroupSpec, group_view, quantize

__all__ = ["Int8Linear", "export_int8", "export_bnb", "linear_weight_nbytes"]


def _quantized_engine_ok() -> bool:
    try:
        return hasattr(torch.ops.quantized, "linear_dynamic") and bool(torch.backends.quantized.supported_engines)
    except (AttributeError, RuntimeError):
        return False


class Int8Linear(nn.Module):
    """y = x @ (weight_int8 * weight_scale[:, None]).T + bias, with x quantized to 8 bits on the fly.

    Buffers: ``weight_int8`` (out, in) int8; ``weight_scale`` (out,) float32; ``bias`` (out,) float32 or absent.
    The packed kernel weight is derived from them on first use and never saved.
    """

    _warned_reference = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32, device=device))
        else:
            self.bias = None
        self._packed = None
        self._packed_key: tuple | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        weight = linear.weight.detach().float()
        if isinstance(linear, CompressedLinear):
            weight = linear.folded()[0].float()
        codes, scale, _ = quantize(group_view(weight, GroupSpec(per_channel=True)), 8, symmetric=True)
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device=weight.device)
        out.weight_int8.copy_(codes.to(torch.int8))
        out.weight_scale.copy_(scale.flatten())
        if linear.bias is not None:
            out.bias.copy_(linear.bias.detach().float())
        return out

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_int8.float() * self.weight_scale[:, None]

    def _packed_weight(self):
        key = (self.weight_int8.data_ptr(), self.weight_int8._version, self.weight_scale._version,
               None if self.bias is None else self.bias._version)
        if self._packed is None or key != self._packed_key:
            with warnings.catch_warnings():  # the qint8 tensor API is deprecated; the kernels are not
                warnings.simplefilter("ignore")
                qweight = torch.quantize_per_channel(
                    self.weight_int8.float() * self.weight_scale[:, None], self.weight_scale.double(),
                    torch.zeros(self.out_features, dtype=torch.long), 0, torch.qint8)
                self._packed = torch.ops.quantized.linear_prepack(qweight, self.bias)
            self._packed_key = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and _quantized_engine_ok():
            shape = x.shape
            # reduce_range: 7-bit activations, as torch's default x86 qconfig, so int16 accumulation cannot saturate
            y = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).float().contiguous(),
                                                   self._packed_weight(), True)
            return y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        if not Int8Linear._warned_reference:
            warnings.warn(f"int8 kernels unavailable for {x.device}; Int8Linear computes with dequantized weights",
                          stacklevel=2)
            Int8Linear._warned_reference = True
        return F.linear(x, self.dequantized_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def _targets(model: nn.Module, modules: Iterable[str] | None, skip: Iterable[str]) -> list[str]:
    patterns = list(modules) if modules is not None else ["*"]
    skip = list(skip)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]
    picked = [n for n in names if any(p == "*" or re.search(p, n) for p in patterns)
              and not any(re.search(s, n) for s in skip)]
    if not picked:
        raise ValueError(f"no torch.nn.Linear in {type(model).__name__} matches modules={patterns} "
                         f"(skipping {skip}); linear modules are named like {names[:4]}")
    return picked


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


@torch.no_grad()
def export_int8(model: nn.Module, modules: Iterable[str] | None = None, skip: Iterable[str] = ()) -> nn.Module:
    """Replace (in place) the selected ``nn.Linear`` modules (regex on the name; default all) by
    :class:`Int8Linear`. Returns the model."""
    require_full_parameters(model, "export_int8")
    for name in _targets(model, modules, skip):
        _replace(model, name, Int8Linear.from_linear(model.get_submodule(name)))
    return model


@torch.no_grad()
def export_bnb(model: nn.Module, bits: int = 8, modules: Iterable[str] | None = None, skip: Iterable[str] = (),
               quant_type: str = "nf4", compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Replace the selected ``nn.Linear`` modules by bitsandbytes 8-bit (``Linear8bitLt``) or 4-bit
    (``Linear4bit``, ``quant_type`` "nf4" or "fp4") layers, quantized on the model's current device."""
    if bits not in (4, 8):
        raise ValueError(f"bitsandbytes export supports bits=8 or bits=4, got {bits}")
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise RuntimeError("export_bnb needs bitsandbytes (pip install 'hf-zero[bnb]'); without it, use "
                           "export_int8 (CPU int8) or quantize_weights (weight-only, any bits)") from err
    require_full_parameters(model, "export_bnb")
    names = _targets(model, modules, skip)
    device = next(model.parameters()).device
    for name in names:
        linear = model.get_submodule(name)
        if bits == 8:
            new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      has_fp16_weights=False, device="meta")
            new.weight = bnb.nn.Int8Params(linear.weight.detach().cpu().clone(), requires_grad=False,
                                           has_fp16_weights=False)
        else:
            new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                    compute_dtype=compute_dtype, quant_type=quant_type, device="meta")
            new.weight = bnb.nn.Params4bit(linear.weight.detach().cpu().clone(), requires_grad=False,
                                           quant_type=quant_type)
        if linear.bias is not None:
            new.bias = nn.Parameter(linear.bias.detach().cpu().clone(), requires_grad=False)
        try:
            new = new.to(device)  # bitsandbytes quantizes when the layer is moved to its device
            new(torch.zeros(1, linear.in_features, device=device, dtype=compute_dtype))
        except Exception as err:  # bitsandbytes raises assorted types for unsupported backends
            raise RuntimeError(f"bitsandbytes {getattr(bnb, '__version__', '?')} cannot run {bits}-bit layers on "
                               f"{device} ({type(err).__name__}: {err}); supported here: export_int8 (CPU) or "
                               f"bitsandbytes on CUDA") from err
        _replace(model, name, new)
    return model


def linear_weight_nbytes(model: nn.Module) -> int:
    """Bytes held by the weights (and scales) of the linear layers, float or exported."""
    total = 0
    for module in model.modules():
        if isinstance(module, Int8Linear):
            total += module.weight_int8.nbytes + module.weight_scale.nbytes
        elif isinstance(module, nn.Linear) or type(module).__module__.startswith("bitsandbytes"):
            weight = getattr(module, "weight", None)
            if weight is not None:
                total += weight.nbytes
                state = getattr(weight, "quant_state", None)
                if state is not None and getattr(state, "absmax", None) is not None:
                    total += state.absmax.nbytes
                scb = getattr(weight, "SCB", None)
                if scb is not None:
                    total += scb.nbytes
    return total
