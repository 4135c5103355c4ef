"""What an engine checkpoint records for reading it offline, without the model or a process group.

The shards say how parameters were cut (meta.json's groups: names and numels); offline consolidation
(hf_zero/checkpoint/zero_to_fp32.py) also needs what the model would otherwise tell: each parameter's full shape,
which names share one tensor (tied weights), which parameters are frozen and which buffers persist. At stage 3
nothing else in the checkpoint holds that (no model.safetensors), so meta.json gets a ``module`` entry at every
stage -- DeepSpeed's model-states file carries the same facts (``param_shapes``, ``shared_params``,
``frozen_param_shapes``, ``buffer_names``).

And the ``zero_to_fp32.py`` script DeepSpeed copies into every checkpoint directory (``python zero_to_fp32.py .
out_dir``): here a few lines that call hf_zero's converter, written by the directory's writer as part of the save.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn

from hf_zero.checkpoint.files import fsync_file
from hf_zero.zero.stage3.param import sharded_param_of

__all__ = ["describe_module", "persistent_buffers", "write_recovery_script", "RECOVERY_SCRIPT"]

RECOVERY_SCRIPT = "zero_to_fp32.py"

_SCRIPT = '''#!/usr/bin/env python
"""Consolidate this directory's hf_zero checkpoint (ZeRO stage 0-3, any number of ranks) into one fp32 state dict,
offline -- DeepSpeed's zero_to_fp32.py command line:

    python zero_to_fp32.py . output_dir [--safe_serialization] [--max_shard_size 5GB] [-t TAG]
                                        [--exclude_frozen_parameters]

Written by hf_zero's save_checkpoint; needs hf_zero installed (the code is hf_zero.checkpoint.zero_to_fp32).
"""

import sys

from hf_zero.checkpoint.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
'''


def describe_module(module: nn.Module) -> dict:
    """``{"params": [{"names", "shape", "trainable"}], "buffers": [names]}`` in ``named_parameters`` order: one
    entry per parameter tensor, with every name it has (tied weights share an entry) and its full shape (a ZeRO-3
    parameter's, not its placeholder's)."""
    params: list[dict] = []
    index: dict[int, int] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in index:
            params[index[id(p)]]["names"].append(name)
            continue
        sp = sharded_param_of(p)
        index[id(p)] = len(params)
        params.append({"names": [name], "shape": list(sp.shape if sp is not None else p.shape),
                       "trainable": bool(p.requires_grad)})
    return {"params": params, "buffers": [n for n, _ in persistent_buffers(module)]}


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of the buffers ``state_dict`` holds (``register_buffer(persistent=False)`` left out)."""
    non_persistent = {f"{mn}.{b}" if mn else b for mn, m in module.named_modules()
                      for b in getattr(m, "_non_persistent_buffers_set", ())}
    return [(n, b) for n, b in module.named_buffers() if n not in non_persistent]


def write_recovery_script(root: Path) -> None:
    """``<root>/zero_to_fp32.py``, replaced atomically (a reader never sees half a script); fsynced before the
    tag it serves is renamed into place."""
    tmp = root / f".{RECOVERY_SCRIPT}.tmp-{os.getpid()}"
    try:
        tmp.write_text(_SCRIPT)
        os.chmod(tmp, 0o755)  # runnable as ./zero_to_fp32.py, as DeepSpeed's copy is
        fsync_file(tmp)
        os.replace(tmp, root / RECOVERY_SCRIPT)
    finally:
        tmp.unlink(missing_ok=True)
