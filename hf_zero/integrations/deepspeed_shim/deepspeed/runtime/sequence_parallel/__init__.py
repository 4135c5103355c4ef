"""``deepspeed.runtime.sequence_parallel``: Ulysses / ALST sequence parallelism (hf_zero.sequence_parallel)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["ulysses_sp", "parallel_state_sp"])
