"""``deepspeed.ops.aio``: ``AsyncIOBuilder`` -> ``hf_zero.ops.aio_handle`` (``load().aio_handle``: DeepSpeed's
handle over hf_zero's compiled pread/pwrite pool)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"AsyncIOBuilder": "hf_zero.ops.aio_handle:AsyncIOBuilder"})
