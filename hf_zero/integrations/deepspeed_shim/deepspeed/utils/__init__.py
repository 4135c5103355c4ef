"""``deepspeed.utils``: logger, log_dist, print_dist, OnDevice, set_z3_leaf_modules (also by module name and name
suffix), is_initialized, RepeatingLoader, safe_update_full_grad_vectorized and the safe_get_*/safe_set_* accessors of
sharded parameters, the data- and tensor-parallel group getters of ``groups``, the ``comms_logging``, ``groups``,
``logging`` and ``timer`` modules and ``zero_to_fp32`` (offline consolidation of a checkpoint)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "logger": "hf_zero.integrations.compat:logger",
    "log_dist": "hf_zero.integrations.ds_utils:log_dist",
    "print_dist": "hf_zero.integrations.ds_utils:print_dist",
    "OnDevice": "hf_zero.integrations.ds_utils:OnDevice",
    "set_z3_leaf_modules": "hf_zero.zero:set_z3_leaf_modules",
    "unset_z3_leaf_modules": "hf_zero.zero:unset_z3_leaf_modules",
    "get_z3_leaf_modules": "hf_zero.zero:get_z3_leaf_modules",
    "set_z3_leaf_module": "hf_zero.zero:set_z3_leaf_module",
    "set_z3_leaf_modules_by_name": "hf_zero.zero:set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix": "hf_zero.zero:set_z3_leaf_modules_by_suffix",
    "z3_leaf_module": "hf_zero.zero:z3_leaf_module",
    "z3_leaf_parameter": "hf_zero.zero:z3_leaf_parameter",
    "is_initialized": "hf_zero.comm:is_initialized",
    "RepeatingLoader": "hf_zero.pipeline.data:RepeatingLoader",
    # DeepSpeed's utils re-exports its groups module's public getters
    **{name: f"hf_zero.integrations.ds_parallel_groups:{name}" for name in (
        "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
        "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
        "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
        "get_tensor_model_parallel_src_rank")},
    **{name: f"hf_zero.zero.tensor_fragment:{name}" for name in (
        "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
        "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
        "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
        "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
        "safe_update_full_grad_vectorized")},
}, submodules=["comms_logging", "groups", "logging", "module_utils", "tensor_fragment", "timer", "torch",
               "zero_to_fp32"])
