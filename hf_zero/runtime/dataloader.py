"""The loader ``initialize(training_data=...)`` and ``engine.deepspeed_io(dataset)`` return, as DeepSpeed builds it.

DeepSpeed's rule (``DeepSpeedDataLoader``, runtime/dataloader.py, 0.19.8), which scripts depend on for which
samples each rank sees and in which order:

* sampler: the caller's ``data_sampler``, else ``DistributedSampler(dataset, num_replicas=<data-parallel size>,
  rank=<data-parallel rank>)`` with torch's defaults -- ``shuffle=True``, ``seed=0``, ``drop_last=False`` (so the
  sampler pads the dataset to a multiple of the replicas by repeating its first indices) -- also at one rank.
  ``set_epoch`` is never called: every epoch reads the same order unless the script calls
  ``loader.data_sampler.set_epoch(epoch)`` itself. Evaluation routes (``deepspeed_io(route="eval"/"predict")``)
  use the same sampler with ``shuffle=False``.
* batches of ``batch_size`` (the micro batch by default); the last, partial batch is kept unless the config's
  ``dataloader_drop_last`` is true. ``len(loader)`` counts batches accordingly.
* ``num_local_io_workers`` worker processes (default 2), ``pin_memory=True``.
* the loader is its own iterator: ``iter(loader)`` starts a new pass and returns ``loader``.

DeepSpeed's curriculum-learning sampler (``data_efficiency``) is not built here; hf_zero lists that section as not
run. ``initialize`` and ``deepspeed_io`` always take DeepSpeed's launched branch (``local_rank >= 0``): hf_zero's
local rank is ``LOCAL_RANK``, 0 when unset.
"""

from __future__ import annotations

import math
import multiprocessing
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, Sampler

__all__ = ["DeepSpeedDataLoader", "ROUTE_TRAIN", "ROUTE_EVAL", "ROUTE_PREDICT", "ROUTE_ENCODE", "build_loader"]

ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT, ROUTE_ENCODE = "train", "eval", "predict", "encode"


class DeepSpeedDataLoader:
    """A re-iterable loader over ``dataset`` with DeepSpeed's constructor and attributes (``data_sampler``,
    ``batch_size``, ``num_local_io_workers``, ``dataloader_drop_last``, ``post_process_func``), ``len()`` in batches.

    ``local_rank < 0`` (no launcher) is DeepSpeed's single-process branch: a RandomSampler over batches of
    ``batch_size`` times the visible GPUs. ``tput_timer``: an object whose ``start()`` runs before each batch.
    """

    def __init__(self, dataset: Dataset, batch_size: int, pin_memory: bool, local_rank: int, tput_timer: Any,
                 collate_fn: Callable | None = None, num_local_io_workers: int | None = None,
                 data_sampler: Sampler | None = None, data_parallel_world_size: int | None = None,
                 data_parallel_rank: int | None = None, dataloader_drop_last: bool = False,
                 deepspeed_dataloader_config: dict | None = None):
        if (deepspeed_dataloader_config or {}).get("curriculum_learning"):
            raise ValueError("DeepSpeedDataLoader: curriculum learning (data_efficiency.data_sampling) is not run "
                             "by hf_zero; remove it from deepspeed_dataloader_config")
        if local_rank >= 0:
            device_count = 1
            if data_sampler is None:
                data_sampler = DistributedSampler(dataset, num_replicas=data_parallel_world_size,
                                                  rank=data_parallel_rank)
        else:
            device_count = max(torch.cuda.device_count(), 1)
            if data_sampler is None:
                data_sampler = RandomSampler(dataset)
            batch_size *= device_count
        self.dataset = dataset
        self.batch_size = batch_size
        self.data_sampler = data_sampler
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.tput_timer = tput_timer
        self.num_local_io_workers = 2 * device_count if num_local_io_workers is None else num_local_io_workers
        self.dataloader_drop_last = dataloader_drop_last
        self.device_count = device_count
        self.post_process_func = None   # DeepSpeed applies it to curriculum-learning batches only
        self.dataloader: DataLoader | None = None  # the torch loader of the current pass
        self._batches = None
        n = len(data_sampler)
        self.len = n // batch_size if dataloader_drop_last else math.ceil(n / batch_size)

    def __len__(self) -> int:
        return self.len

    def __iter__(self) -> "DeepSpeedDataLoader":
        workers = self.num_local_io_workers
        if workers and multiprocessing.current_process().daemon:
            workers = 0  # a daemonic process may not start children; the batches are the same without workers
        self.dataloader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.data_sampler,
                                     collate_fn=self.collate_fn, num_workers=workers,
                                     pin_memory=self.pin_memory and _accelerator_present(),
                                     drop_last=self.dataloader_drop_last)
        self._batches = iter(self.dataloader)
        return self

    def __next__(self) -> Any:
        if self._batches is None:
            raise TypeError("DeepSpeedDataLoader: call iter(loader) (or loop over it) before next(loader)")
        if self.tput_timer is not None:
            self.tput_timer.start()
        return next(self._batches)


def build_loader(dataset, batch_size: int, *, dp_size: int, dp_rank: int, route: str = ROUTE_TRAIN,
                 pin_memory: bool = True, data_sampler: Sampler | None = None, collate_fn: Callable | None = None,
                 num_local_io_workers: int | None = None, drop_last: bool = False,
                 tput_timer: Any = None) -> DeepSpeedDataLoader:
    """DeepSpeed's ``deepspeed_io`` after the engine has filled in its defaults (batch size, collate_fn, ranks)."""
    if not (_map_style(dataset) or isinstance(dataset, IterableDataset)):
        raise ValueError(f"training data must be a torch Dataset (with __getitem__ and __len__, or an "
                         f"IterableDataset), got {type(dataset).__name__}")
    if data_sampler is None:
        if not _map_style(dataset):
            raise TypeError(f"{type(dataset).__name__} is an IterableDataset: DeepSpeed's loader shards a dataset "
                            "by index (DistributedSampler), which needs __len__ and __getitem__. Pass a map-style "
                            "dataset, a data_sampler, or build your own DataLoader")
        data_sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank,
                                          shuffle=route not in (ROUTE_EVAL, ROUTE_PREDICT))
    # local_rank 0: hf_zero's ranks always have one (LOCAL_RANK, 0 when unset), so DeepSpeed's launched branch
    return DeepSpeedDataLoader(dataset, batch_size, pin_memory, 0, tput_timer, collate_fn=collate_fn,
                               num_local_io_workers=num_local_io_workers, data_sampler=data_sampler,
                               data_parallel_world_size=dp_size, data_parallel_rank=dp_rank,
                               dataloader_drop_last=drop_last)


def _map_style(obj) -> bool:
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")


def _accelerator_present() -> bool:
    # pinning without an accelerator only makes torch warn; DeepSpeed's CPU runs pin nothing either
    return torch.cuda.is_available()
