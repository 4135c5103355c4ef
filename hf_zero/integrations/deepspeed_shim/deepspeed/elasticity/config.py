"""``deepspeed.elasticity.config``: DeepSpeed's elasticity error classes (hf_zero/config/elasticity.py)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "ElasticityError": "hf_zero.config.elasticity:ElasticityError",
    "ElasticityConfigError": "hf_zero.config.elasticity:ElasticityConfigError",
    "ElasticityIncompatibleWorldSize": "hf_zero.config.elasticity:ElasticityIncompatibleWorldSize",
})
