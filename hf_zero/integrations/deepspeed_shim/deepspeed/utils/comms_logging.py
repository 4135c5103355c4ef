"""``deepspeed.utils.comms_logging``: CommsLogger, calc_bw_log, convert_size, get_caller_func
(``hf_zero.comm.comms_log``; ``deepspeed.comm``'s logger is its ``logger``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {name: f"hf_zero.comm.comms_log:{name}" for name in (
    "CommsLogger", "calc_bw_log", "convert_size", "get_caller_func")})
