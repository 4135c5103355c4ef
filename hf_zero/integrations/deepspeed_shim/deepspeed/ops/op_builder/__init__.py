"""``deepspeed.ops.op_builder``: the builders scripts import from here (DeepNVMe's ``AsyncIOBuilder``, the Adam ops'
``CPUAdamBuilder``/``FusedAdamBuilder``) and ``NotImplementedBuilder`` (what ``get_accelerator().get_op_builder``
answers for any other name; DeepSpeed's other builder names are NotImplementedBuilders of their op); hf_zero's ops
are built at install, so a builder's ``load()`` returns the op module without compiling."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward
from hf_zero.integrations.ds_op_builder import UNAVAILABLE_OP_NAMES as _UNAVAILABLE  # a dict: cheap to import

_forward(__name__, {
    "AsyncIOBuilder": "hf_zero.ops.aio_handle:AsyncIOBuilder",
    **{name: f"hf_zero.integrations.ds_op_builder:{name}" for name in (
        "CPUAdamBuilder", "FusedAdamBuilder", "NotImplementedBuilder", *_UNAVAILABLE)},
})
