"""``deepspeed.comm`` as hf_zero answers it: :mod:`hf_zero.comm`, plus the one fix accelerate needs on CPU.

accelerate starts DeepSpeed's process group in ``PartialState.__init__`` (``accelerate/state.py``, the
``ACCELERATE_USE_DEEPSPEED`` branch)::

    from deepspeed import comm as dist
    if not dist.is_initialized():
        dist.init_distributed(dist_backend=self.backend, auto_mpi_discovery=False, **kwargs)
    ...
    if self.backend is None:                      # no GPU backend was found: "no distributed training"
        self.num_processes, self.process_index = 1, 0

On a machine without a GPU ``self.backend`` is None at that point (accelerate picks ``gloo`` only for
``cpu=True``, and ``cpu=True`` makes it drop DeepSpeed), so every rank of a 2-process ``torchrun`` /
``accelerate launch`` believes it is alone: the Trainer fills ``train_batch_size`` for a world of 1 and
dataloaders are not sharded. That is what real DeepSpeed does on CPU (``ds_api_surface.md`` section 5).

hf_zero closes that gap here, without touching accelerate's code: when accelerate asks whether the group is
initialized, or has just had it initialized, *while that exact ``PartialState.__init__`` is running* (its shared
state holds ``backend=None`` and no ``num_processes`` yet) and the process group exists, the backend the group was
really started with (``gloo``) is recorded as accelerate's backend. accelerate then takes its own distributed
branch: ``num_processes = world_size``, ``process_index = rank``. Any other caller sees plain :mod:`hf_zero.comm`.
"""

from __future__ import annotations

import os
import sys

from hf_zero.comm import *  # noqa: F401,F403 -- deepspeed.comm is hf_zero.comm plus the two functions below
from hf_zero.comm import __all__ as _comm_all
from hf_zero.comm import init_distributed as _init_distributed
from hf_zero.comm import is_initialized as _is_initialized

__all__ = list(_comm_all)


def is_initialized() -> bool:
    initialized = _is_initialized()
    if initialized:
        _adopt_backend_into_accelerate_state()
    return initialized


def init_distributed(*args, **kwargs) -> None:
    _init_distributed(*args, **kwargs)
    _adopt_backend_into_accelerate_state()


def _adopt_backend_into_accelerate_state() -> bool:
    """Record the process group's backend as accelerate's, if accelerate is mid-``PartialState.__init__`` with
    DeepSpeed requested and no backend found. Returns whether it did."""
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return False
    shared = accelerate_state.PartialState._shared_state
    starting = (bool(shared) and "num_processes" not in shared and "backend" in shared
                and shared["backend"] is None and not shared.get("_cpu", False))
    if not starting or not _is_initialized():
        return False
    import torch.distributed as dist

    shared["backend"] = str(dist.get_backend())
    return True
