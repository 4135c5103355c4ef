"""``deepspeed.runtime.zero.tiling``: ``TiledLinear``, ``TiledLinearReturnBias`` and ``split_tensor_along_last_dim``
(hf_zero/zero/tiling.py)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "TiledLinear": "hf_zero.zero.tiling:TiledLinear",
    "TiledLinearReturnBias": "hf_zero.zero.tiling:TiledLinearReturnBias",
    "split_tensor_along_last_dim": "hf_zero.zero.tiling:split_tensor_along_last_dim",
})
