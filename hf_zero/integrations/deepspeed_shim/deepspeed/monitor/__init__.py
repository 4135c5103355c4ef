"""``deepspeed.monitor``: ``monitor.MonitorMaster`` (hf_zero writes no metrics; it warns, naming the sections)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["monitor"])
