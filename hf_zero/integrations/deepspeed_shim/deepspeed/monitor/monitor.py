"""``deepspeed.monitor.monitor.MonitorMaster`` -> ``hf_zero.integrations.ds_monitor``."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"MonitorMaster": "hf_zero.integrations.ds_monitor:MonitorMaster"})
