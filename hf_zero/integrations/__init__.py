"""hf_zero.integrations: glue between hf_zero and the Hugging Face stack.

- ``deepspeed_shim/``: what ``import deepspeed`` gives when the real DeepSpeed is not installed -- a tree of
  forwarders onto hf_zero's native API -- and the import hook that provides it.
- ``hf_zero_deepspeed.pth``: the one start-up line, copied into site-packages at install, that installs that hook
  in every Python process. ``HF_ZERO_DISABLE_DEEPSPEED_SHIM=1`` switches it off.
- ``compat.py``: module-level DeepSpeed names hf_zero keeps (``logger``, ``DEEPSPEED_ENVIRONMENT_NAME``).
"""
