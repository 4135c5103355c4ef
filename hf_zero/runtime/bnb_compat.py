"""bitsandbytes 4-bit layers under ZeRO-3.

bitsandbytes (0.50 on) repacks a ``Linear4bit`` weight for its CPU kernel on the first forward in eval mode without
gradients: ``weight.data`` is replaced in place by a uint8 tensor of another shape and the layer's ``quant_state`` is
marked as packed. A ZeRO-3 partitioned weight is re-gathered in its original layout on every forward, so the repack
cannot stick: the gathered tensor would be released with a shape the partition does not have, and the next gather
would hand the packed-format kernel an unpacked weight. For partitioned layers that fast path is turned off; they
run bitsandbytes' ordinary dequantize-and-matmul path (the same numbers as in training, in the compute dtype rather
than the packed kernel's bf16).
"""

from __future__ import annotations

from torch import nn

__all__ = ["keep_4bit_layout"]


def keep_4bit_layout(module: nn.Module) -> int:
    """Disable bitsandbytes' in-place CPU repack on every 4-bit layer of ``module``; returns how many layers."""
    count = 0
    for sub in module.modules():
        if type(sub).__module__.startswith("bitsandbytes") and hasattr(sub, "support_avx512bf16_for_cpu"):
            sub.support_avx512bf16_for_cpu = False
            count += 1
    return count
