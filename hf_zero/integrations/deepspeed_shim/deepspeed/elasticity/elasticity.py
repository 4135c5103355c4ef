"""``deepspeed.elasticity.elasticity``: the module DeepSpeed defines its elasticity functions in
(hf_zero/integrations/ds_elasticity.py)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "compute_elastic_config": "hf_zero.integrations.ds_elasticity:compute_elastic_config",
    "elasticity_enabled": "hf_zero.integrations.ds_elasticity:elasticity_enabled",
    "ensure_immutable_elastic_config": "hf_zero.integrations.ds_elasticity:ensure_immutable_elastic_config",
    "ElasticityError": "hf_zero.config.elasticity:ElasticityError",
    "ElasticityConfigError": "hf_zero.config.elasticity:ElasticityConfigError",
    "ElasticityIncompatibleWorldSize": "hf_zero.config.elasticity:ElasticityIncompatibleWorldSize",
})
