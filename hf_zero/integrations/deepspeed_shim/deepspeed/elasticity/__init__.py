"""``deepspeed.elasticity``: ``compute_elastic_config`` and the rest of DeepSpeed's elasticity names
(hf_zero/integrations/ds_elasticity.py over hf_zero/config/elasticity.py). ``DSElasticAgent`` is not provided:
hf_zero's launcher refuses elastic training (the restart agent); the batch plan is honoured."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "compute_elastic_config": "hf_zero.integrations.ds_elasticity:compute_elastic_config",
    "elasticity_enabled": "hf_zero.integrations.ds_elasticity:elasticity_enabled",
    "ensure_immutable_elastic_config": "hf_zero.integrations.ds_elasticity:ensure_immutable_elastic_config",
    "is_torch_elastic_compatible": "hf_zero.integrations.ds_elasticity:is_torch_elastic_compatible",
    "ELASTICITY": "hf_zero.integrations.ds_elasticity:ELASTICITY",
    "ENABLED": "hf_zero.integrations.ds_elasticity:ENABLED",
    "ENABLED_DEFAULT": "hf_zero.integrations.ds_elasticity:ENABLED_DEFAULT",
    # DeepSpeed defines these in deepspeed.elasticity.config; also here, where launcher code looks first
    "ElasticityError": "hf_zero.config.elasticity:ElasticityError",
    "ElasticityConfigError": "hf_zero.config.elasticity:ElasticityConfigError",
    "ElasticityIncompatibleWorldSize": "hf_zero.config.elasticity:ElasticityIncompatibleWorldSize",
}, submodules=["config", "elasticity"])
