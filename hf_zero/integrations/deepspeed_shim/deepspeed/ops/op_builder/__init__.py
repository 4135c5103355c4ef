"""``deepspeed.ops.op_builder``: the builders scripts import from here (DeepNVMe's ``AsyncIOBuilder``, the Adam ops'
``CPUAdamBuilder``/``FusedAdamBuilder``) and ``NotImplementedBuilder`` (what ``get_accelerator().get_op_builder``
answers for any other name); hf_zero's ops are built at install, so a builder's ``load()`` returns the op module
without compiling."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "AsyncIOBuilder": "hf_zero.ops.aio_handle:AsyncIOBuilder",
    **{name: f"hf_zero.integrations.ds_op_builder:{name}" for name in (
        "CPUAdamBuilder", "FusedAdamBuilder", "NotImplementedBuilder")},
})
