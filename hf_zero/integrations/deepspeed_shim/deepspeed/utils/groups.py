"""``deepspeed.utils.groups``: the process-group getters transformers and accelerate call, the data- and
tensor-parallel ones of the last initialized run (hf_zero.integrations.ds_parallel_groups) and the MoE
expert-parallel ones (hf_zero.integrations.ds_groups)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "_get_sequence_parallel_group": "hf_zero.comm:get_sequence_parallel_group",
    **{f"_{name}": f"hf_zero.comm.sequence_groups:{name}" for name in (
        "get_sequence_parallel_world_size", "get_sequence_parallel_rank", "get_sequence_data_parallel_group",
        "get_sequence_data_parallel_world_size", "get_sequence_data_parallel_rank")},
    **{name: f"hf_zero.integrations.ds_parallel_groups:{name}" for name in (
        "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
        "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
        "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
        "get_tensor_model_parallel_src_rank", "_get_data_parallel_group", "_get_data_parallel_rank",
        "_get_data_parallel_world_size", "_get_model_parallel_world_size")},
    **{f"_{name}": f"hf_zero.integrations.ds_groups:{name}" for name in (
        "create_expert_and_data_parallel", "get_expert_parallel_group", "get_expert_parallel_group_ranks",
        "get_expert_parallel_group_dict", "get_expert_data_parallel_group", "get_expert_data_parallel_group_ranks",
        "get_expert_data_parallel_group_dict", "get_expert_parallel_world_size", "get_expert_parallel_rank",
        "get_expert_parallel_src_rank", "get_expert_data_parallel_world_size", "get_expert_data_parallel_rank",
        "get_expert_broadcast_src_rank", "get_max_expert_size", "get_max_expert_size_name",
        "get_max_expert_parallel_group")},
})
