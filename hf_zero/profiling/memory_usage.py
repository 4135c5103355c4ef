"""DeepSpeed's ``see_memory_usage``: the memory report ``memory_breakdown`` prints at each stage of a step.

The engine calls it before and after forward, backward and step (and around its construction) when the config sets
``memory_breakdown``; scripts call it as ``deepspeed.runtime.utils.see_memory_usage``.
"""

from __future__ import annotations

import gc

import torch.distributed as dist

from hf_zero.comm.accelerator import get_accelerator

__all__ = ["see_memory_usage"]

_GB = 1024**3


def see_memory_usage(message, force: bool = False) -> None:
    """With ``force``, on global rank 0: print ``message``, the accelerator's allocated/reserved bytes and their peaks
    (on CPU: this process's resident memory, see ``hf_zero.comm.accelerator``) and the host's used memory, then
    start a new peak. Without ``force``, nothing (as DeepSpeed)."""
    if not force or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()  # Python frees cyclic garbage lazily; collect so the numbers are current
    acc = get_accelerator()
    print(message)
    print(f"MA {round(acc.memory_allocated() / _GB, 2)} GB         Max_MA {round(acc.max_memory_allocated() / _GB, 2)} "
          f"GB         CA {round(acc.memory_reserved() / _GB, 2)} GB         Max_CA "
          f"{round(acc.max_memory_reserved() / _GB)} GB ")
    import psutil

    vm = psutil.virtual_memory()
    print(f"CPU Virtual Memory:  used = {round((vm.total - vm.available) / _GB, 2)} GB, percent = {vm.percent}%")
    acc.reset_peak_memory_stats()
