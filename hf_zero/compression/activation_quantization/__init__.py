"""Activation quantization: ``config`` (schema), ``layer`` (ActivationQuantizer), ``apply`` (install).

:func:`~hf_zero.compression.redundancy_clean` drops the fake activation quantizers (a float model has no place
for them); :func:`~hf_zero.compression.export.export_int8` is where 8-bit activations become real: its kernel
quantizes each input dynamically to 8 bits, asymmetric, per tensor.
"""

from ..registry import Method, register
from .apply import install
from .config import ActivationQuantizationParams, ActivationQuantizationShared
from .layer import ActivationQuantizer

METHOD = register(Method(name="activation_quantization", install=install))

__all__ = ["ActivationQuantizer", "ActivationQuantizationShared", "ActivationQuantizationParams", "install",
           "METHOD"]
