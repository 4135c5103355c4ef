"""``deepspeed.utils.groups``: the process-group getters transformers and accelerate call."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "_get_sequence_parallel_group": "hf_zero.comm:get_sequence_parallel_group",
    **{f"_{name}": f"hf_zero.comm.sequence_groups:{name}" for name in (
        "get_sequence_parallel_world_size", "get_sequence_parallel_rank", "get_sequence_data_parallel_group",
        "get_sequence_data_parallel_world_size", "get_sequence_data_parallel_rank")},
})
