"""``deepspeed.utils.timer``: SynchronizedWallClockTimer, ThroughputTimer, NoopTimer (``hf_zero.integrations.ds_timer``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {name: f"hf_zero.integrations.ds_timer:{name}" for name in (
    "SynchronizedWallClockTimer", "ThroughputTimer", "NoopTimer", "trim_mean")})
