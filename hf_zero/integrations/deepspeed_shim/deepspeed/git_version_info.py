"""``deepspeed.git_version_info``: version, installed_ops, torch_info (``hf_zero.integrations.ds_version_info``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {name: f"hf_zero.integrations.ds_version_info:{name}" for name in (
    "version", "git_hash", "git_branch", "installed_ops", "accelerator_name", "torch_info")})
