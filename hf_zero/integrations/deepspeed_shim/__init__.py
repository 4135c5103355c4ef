"""hf_zero's ``deepspeed`` compatibility layer.

transformers and accelerate reach DeepSpeed only through ``import deepspeed``, and only if a distribution named
``deepspeed`` is installed. When the real DeepSpeed is not installed, ``import deepspeed`` gives the tree in
``deepspeed/`` beside this file: every name in it forwards to hf_zero's native API (``deepspeed.initialize`` ->
``hf_zero.initialize``, ``deepspeed.zero.Init`` -> ``hf_zero.zero.Init``, ...), and holds no logic of its own.

- ``_finder.py``: the ``sys.meta_path`` finder, installed in every Python process by the one-line
  ``hf_zero/integrations/hf_zero_deepspeed.pth`` that installation copies into site-packages.
- ``_forward.py``: the two forwarding mechanisms the tree's modules use.

Switch it off with the environment variable ``HF_ZERO_DISABLE_DEEPSPEED_SHIM=1``. It never shadows a real
DeepSpeed (installing DeepSpeed makes it stand aside) and is invisible to ``pip list`` and pip's resolver.
"""

from ._finder import DISABLE_ENV, disabled, real_deepspeed_installed, shim_version

__all__ = ["DISABLE_ENV", "disabled", "real_deepspeed_installed", "shim_version"]
