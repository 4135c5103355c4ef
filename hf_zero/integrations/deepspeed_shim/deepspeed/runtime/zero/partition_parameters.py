"""``deepspeed.runtime.zero.partition_parameters`` is ``hf_zero.zero.init``.

An alias rather than a table of names: transformers' ``prevent_arange_dtype_change`` reads
``zero_wrapper_for_fp_tensor_constructor``, ``_orig_torch_arange`` and ``get_accelerator`` here and *assigns*
``zero_wrapper_for_fp_tensor_constructor`` for the duration of ``from_pretrained``; the assignment has to land in
the module hf_zero's ``zero.Init`` reads it from.
"""

from hf_zero.integrations.deepspeed_shim._forward import alias as _alias

_alias(__name__, "hf_zero.zero.init")
