"""hf_zero.integrations: glue between hf_zero and the Hugging Face stack.

- ``deepspeed_shim/``: what ``import deepspeed`` gives when the real DeepSpeed is not installed -- a tree of
  forwarders onto hf_zero's native API -- and the import hook that provides it.
- ``hf_zero_deepspeed.pth``: the one start-up line, copied into site-packages at install, that installs that hook
  in every Python process. ``HF_ZERO_DISABLE_DEEPSPEED_SHIM=1`` switches it off.
- ``ds_comm.py``: ``deepspeed.comm`` -- ``hf_zero.comm`` plus the fix that lets accelerate see every rank on CPU.
- ``trainer_callback.py``: ``HfZeroCallback`` (engine statistics in the Trainer's logs, model cards) and
  ``write_model_card``.
- ``compat.py``: module-level DeepSpeed names hf_zero keeps (``logger``, ``DEEPSPEED_ENVIRONMENT_NAME``).

Names are imported on first use: ``import hf_zero.integrations`` must not import transformers.

Top package layer: may import every other hf_zero package; none imports it (the layer table is ``LAYERS`` in
``tests/test_layering.py``).
"""

from __future__ import annotations

from hf_zero.util import lazy_exports

_LAZY = {
    "HfZeroCallback": "hf_zero.integrations.trainer_callback",
    "write_model_card": "hf_zero.integrations.trainer_callback",
    "peak_memory_mb": "hf_zero.integrations.trainer_callback",
}

__all__ = list(_LAZY)


__getattr__ = lazy_exports(__name__, _LAZY, globals())
