"""Checks that can be made before the model is touched, on every rank, agreed by all: NVMe swap paths.

ZeRO-3 partitions the user's model in place; a swap directory that turns out unwritable or full afterwards leaves
a half-converted model behind, and a rank that fails alone leaves the others in a collective. So before anything
is partitioned or cast, every rank checks each ``nvme_path`` it will use -- the directory can be created and
written (a probe file, fsynced), its filesystem has room for this rank's swap files, and the process may write
files that large (``RLIMIT_FSIZE``) -- and the ranks exchange their findings, so all of them raise the same
:class:`~hf_zero.config.ConfigError` naming each failing rank, path and size.
"""

from __future__ import annotations

import math
import os
import resource
import shutil
from pathlib import Path

import torch
from torch import nn

from hf_zero import comm
from hf_zero.comm import faults
from hf_zero.config.errors import ConfigError

__all__ = ["check_nvme_paths"]

_FP32 = 4
_ADAM_STATES = 3  # fp32 master, exp_avg, exp_avg_sq


def _needs(config, module: nn.Module, stage: int, world_size: int) -> dict[str, tuple[str, int, int]]:
    """``{path: (config key, bytes this rank swaps there, bytes of its largest single file)}``."""
    zero = config.zero
    shard_world = world_size if stage > 0 else 1
    out: dict[str, tuple[str, int, int]] = {}
    opt = zero.offload_optimizer
    if opt.device == "nvme":
        trainable = sum(math.ceil(p.numel() / shard_world) for p in module.parameters() if p.requires_grad)
        shard = int(trainable * opt.ratio)
        # one file per optimizer group and state: with one group (the usual case) a file holds the whole shard
        out[str(opt.nvme_path)] = ("zero_optimization.offload_optimizer", shard * _FP32 * _ADAM_STATES, shard * _FP32)
    par = zero.offload_param
    if par.device == "nvme" and stage == 3:
        size = torch.empty((), dtype=config.compute_dtype).element_size()
        numels = [math.ceil(p.numel() / world_size) for p in module.parameters()]
        key, total, largest = out.get(str(par.nvme_path), ("zero_optimization.offload_param", 0, 0))
        out[str(par.nvme_path)] = (key, total + sum(numels) * size, max(largest, max(numels, default=0) * size))
    return out


def _problems(needs: dict[str, tuple[str, int, int]], rank: int) -> list[str]:
    found = []
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    for path, (key, total, largest) in needs.items():
        where = f"rank {rank}: {key}.nvme_path={path!r}"
        probe = Path(path) / f".hf_zero-probe-rank{rank}-pid{os.getpid()}"
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"\0")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            found.append(f"{where} is not a writable directory ({exc.strerror or exc})")
            continue
        finally:
            probe.unlink(missing_ok=True)
        free = shutil.disk_usage(path).free
        if free < total:
            found.append(f"{where} has {free} bytes free, this rank's swap files need {total} "
                         f"({total / 2**30:.2f} GiB)")
        if limit != resource.RLIM_INFINITY and limit < largest:
            found.append(f"{where}: this process may not write files over {limit} bytes (RLIMIT_FSIZE, ulimit -f); "
                         f"its largest swap file needs {largest}")
    return found


def check_nvme_paths(config, module: nn.Module, *, stage: int, world_size: int, rank: int, group=None) -> None:
    """Raise the same ConfigError on every rank if any rank cannot use its NVMe swap paths (collective when any
    offload section uses NVMe; a no-op otherwise)."""
    needs = _needs(config, module, stage, world_size)
    if not needs:
        return
    mine = _problems(needs, rank)
    everyone = [mine]
    if comm.is_initialized() and world_size > 1:
        everyone = [None] * world_size
        with faults.bounded("the NVMe path check before partitioning", group):
            torch.distributed.all_gather_object(everyone, mine, group=group)
    problems = [p for rank_problems in everyone for p in rank_problems]
    if problems:
        key = next(iter(needs.values()))[0]
        raise ConfigError(f"{key}.nvme_path", "; ".join(problems) + ". Nothing was partitioned: free space, point "
                          "nvme_path at a larger writable drive, offload less (offload_optimizer.ratio), or raise "
                          "the file size limit.")
