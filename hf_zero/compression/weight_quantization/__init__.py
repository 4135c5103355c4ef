"""Weight quantization-aware training: ``config`` (schema), ``layer`` (WeightQuantizer), ``apply`` (install)."""

from ..registry import Method, register
from .apply import install
from .config import WeightQuantizationParams, WeightQuantizationShared
from .layer import WeightQuantizer

METHOD = register(Method(name="weight_quantization", install=install))

__all__ = ["WeightQuantizer", "WeightQuantizationShared", "WeightQuantizationParams", "install", "METHOD"]
