"""``deepspeed.runtime.fp16.loss_scaler`` -> ``hf_zero.integrations.ds_loss_scaler`` (its classes carry this module's
name, which DeepSpeed's checkpoints pickle them under: ``add_safe_globals([LossScaler])`` admits them)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {name: f"hf_zero.integrations.ds_loss_scaler:{name}" for name in (
    "INITIAL_LOSS_SCALE", "SCALE_WINDOW", "DELAYED_SHIFT", "CONSECUTIVE_HYSTERESIS", "MIN_LOSS_SCALE",
    "LossScalerBase", "LossScaler", "DynamicLossScaler", "CreateLossScaler")})
