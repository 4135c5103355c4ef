"""hf_zero.ops: compiled fused kernels, each with a pure-PyTorch reference beside it.

Every op is a ``torch.library`` op in the ``hf_zero`` namespace (``torch.ops.hf_zero.*``) with a CPU kernel
(``hf_zero._C``), a CUDA kernel (``hf_zero._C_cuda``), a fake kernel and autograd. When the compiled extension
for a device is unavailable, the wrappers below run the reference and warn once (see ``_native``).

    adam       CPUAdam, FusedAdam, adam_step_ (flat-partition step used by the engine and offload)
    adagrad    CPUAdagrad, adagrad_step_ (DeepSpeedCPUAdagrad)
    lion       CPULion, lion_step_ (DeepSpeedCPULion)
    norm       layer_norm, rms_norm, add_layer_norm, add_rms_norm
    reduce     sum_of_squares (fp32-accumulated, for the global gradient norm)
    transformer bias_gelu, scaled_masked_softmax, apply_rotary, apply_rotary_pos_emb
    inject     inject(model): swap a transformers model's norms / GeLUs onto the fused ops

Bottom layer: imports no other hf_zero package (the layer table is ``LAYERS`` in ``tests/test_layering.py``).
"""

from hf_zero.ops._native import extension_status, native_available, op_kernels
from hf_zero.ops.adagrad import CPUAdagrad, adagrad_step_
from hf_zero.ops.adam import CPUAdam, FusedAdam, adam_step_
from hf_zero.ops.inject import inject, remove_injection
from hf_zero.ops.lion import CPULion, lion_step_
from hf_zero.ops.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from hf_zero.ops.reduce import sum_of_squares
from hf_zero.ops.scale_add import scale_add
from hf_zero.ops.transformer import apply_rotary, apply_rotary_pos_emb, bias_gelu, scaled_masked_softmax

__all__ = [
    "CPUAdagrad",
    "CPUAdam",
    "CPULion",
    "adagrad_step_",
    "FusedAdam",
    "adam_step_",
    "add_layer_norm",
    "add_rms_norm",
    "apply_rotary",
    "apply_rotary_pos_emb",
    "bias_gelu",
    "extension_status",
    "inject",
    "layer_norm",
    "lion_step_",
    "native_available",
    "op_kernels",
    "remove_injection",
    "rms_norm",
    "scale_add",
    "scaled_masked_softmax",
    "sum_of_squares",
]
