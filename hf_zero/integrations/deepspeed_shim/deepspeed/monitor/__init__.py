"""``deepspeed.monitor``: ``monitor.MonitorMaster`` (hf_zero's metric monitors, hf_zero/runtime/monitor.py)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["monitor"])
