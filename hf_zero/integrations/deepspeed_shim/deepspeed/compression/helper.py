"""``deepspeed.compression.helper``: ``recursive_getattr``, ``recursive_setattr`` -- where DeepSpeed-Chat imports them
from (DeepSpeed 0.19 moved them to ``deepspeed.utils.module_utils`` and kept this name with a FutureWarning; hf_zero
keeps it without one: the script is not the user's to edit)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {name: f"hf_zero.integrations.ds_utils:{name}" for name in ("recursive_getattr", "recursive_setattr")})
