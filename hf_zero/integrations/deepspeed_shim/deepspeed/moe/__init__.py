"""``deepspeed.moe``: the mixture-of-experts layer and its optimizer-group helper (``hf_zero.moe``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["layer", "utils"])
