"""``deepspeed.zero`` / ``deepspeed.runtime.zero``: Init, GatheredParameters, register_external_parameter, and
ZeroParamStatus (the values of a ZeRO-3 parameter's ``ds_status``), unwrap_model_for_generation, TiledLinear and
TiledLinearReturnBias (hf_zero/zero/tiling.py)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "Init": "hf_zero.zero:Init",
    "GatheredParameters": "hf_zero.zero:GatheredParameters",
    "register_external_parameter": "hf_zero.zero:register_external_parameter",
    "ZeroParamStatus": "hf_zero.zero.stage3.param:ZeroParamStatus",
    "unwrap_model_for_generation": "hf_zero.zero.gathered:unwrap_model_for_generation",
    "TiledLinear": "hf_zero.zero.tiling:TiledLinear",
    "TiledLinearReturnBias": "hf_zero.zero.tiling:TiledLinearReturnBias",
}, submodules=["config", "offload_config", "partition_parameters", "stage3", "stage_1_and_2", "tiling"])
