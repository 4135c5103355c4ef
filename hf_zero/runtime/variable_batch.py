"""Variable batch size and learning rate: DeepSpeed's dynamic batching (``data_efficiency.data_sampling.
dynamic_batching``), for scripts that call ``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed``.

    "data_efficiency": {"enabled": true, "seed": 42, "data_sampling": {"num_workers": 0, "dynamic_batching": {
        "enabled": true, "max_tokens": 20, "lr_scaling_method": "linear", "sequence_picking_order": "seqlen",
        "min_batch_size": 1, "max_batch_size": 10}}}

Sequences are packed into micro-batches of at most ``max_tokens`` tokens (between ``min_batch_size`` and
``max_batch_size`` sequences each), taken in ``sequence_picking_order`` (``dataloader``: as given, ``seqlen``:
shortest first, ``random``: shuffled with ``data_efficiency.seed``); each pack is one sample of the returned data
loader, so a micro-batch of ``train_micro_batch_size_per_gpu`` packs holds a varying number of sequences. A step's
``train_batch_size`` packs are spread over the data-parallel ranks as DeepSpeed's ``DistributedSampler`` does, and
the learning rate of each step is scaled by its number of sequences against ``train_batch_size``
(``lr_scaling_method``: ``linear`` -- lr x n / base, ``sqrt`` -- lr x sqrt(n / base), ``none``).

Differences from DeepSpeed 0.19.8, on purpose:
* the sequence lengths, when the script passes none, are read from ``<metrics_path>/seqlen/
  seqlen_sample_to_metric.{idx,bin}`` if present (DeepSpeed's DataAnalyzer output, or an earlier run's), else
  computed with ``batch_seqlens_fn`` over the dataset in memory and written there in the same format
  (sample_metrics.py; byte-identical to DeepSpeed's builder). DeepSpeed runs its DataAnalyzer map-reduce, which
  fails on 2 ranks (``TypeError: empty(): argument 'dtype' must be torch.dtype``).
* the packing considers every sequence; DeepSpeed's never takes the last one of the picking order into a pack (its
  scan stops one short), so with ``seqlen`` order it drops the longest sequence.
"""

from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from hf_zero.config.boolean import truthy
from hf_zero.config.errors import ConfigError
from hf_zero.runtime.sample_metrics import metric_files_exist, read_sample_metric, write_sample_metric

__all__ = ["DynamicBatching", "parse_dynamic_batching", "batch_by_seqlens", "scale_lr", "VariableBatchSizeLR",
           "dataloader_for_variable_batch_size", "get_dataloader_and_lr_scheduler_for_variable_batch_size",
           "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed"]

logger = logging.getLogger("hf_zero")

_KEY = "data_efficiency.data_sampling.dynamic_batching"
_ORDERS = ("dataloader", "seqlen", "random")
_METHODS = ("linear", "sqrt", "none")


@dataclass(frozen=True)
class DynamicBatching:
    """The ``dynamic_batching`` section and the data-sampling settings it runs with, checked."""

    max_tokens: int
    lr_scaling_method: str = "linear"
    sequence_picking_order: str = "dataloader"
    min_batch_size: int = 1
    max_batch_size: int | None = None
    verbose: bool = False
    seed: int = 1234                  # data_efficiency.seed
    num_workers: int = 0              # data_sampling.num_workers
    pin_memory: bool = False          # data_sampling.pin_memory
    metrics_path: str | None = None   # where the per-sample lengths are read from / written to


def parse_dynamic_batching(data_efficiency: Mapping[str, Any] | None) -> DynamicBatching:
    """The run's dynamic batching; a ConfigError names the key when it is off or a value is wrong."""
    sampling = (data_efficiency or {}).get("data_sampling") or {}
    section = sampling.get("dynamic_batching") or {}
    if not truthy(section.get("enabled")):
        raise ConfigError(f"{_KEY}.enabled", "must be true to build a variable-batch-size data loader (the script "
                                             "calls get_dataloader_and_lr_scheduler_for_variable_batch_size_"
                                             "deepspeed)")
    known = ("enabled", "max_tokens", "lr_scaling_method", "sequence_picking_order", "min_batch_size",
             "max_batch_size", "verbose", "metrics_path")
    for key in section:
        if key not in known:
            raise ConfigError(f"{_KEY}.{key}", f"unknown key; known keys: {list(known)}")
    tokens = section.get("max_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ConfigError(f"{_KEY}.max_tokens", f"must be a positive integer, got {tokens!r}")
    method = str(section.get("lr_scaling_method", "linear")).lower()
    if method not in _METHODS:
        raise ConfigError(f"{_KEY}.lr_scaling_method", f"{section['lr_scaling_method']!r} is not one of {_METHODS}")
    order = section.get("sequence_picking_order", "dataloader")
    if order not in _ORDERS:
        raise ConfigError(f"{_KEY}.sequence_picking_order", f"{order!r} is not one of {_ORDERS}")
    low, high = section.get("min_batch_size", 1), section.get("max_batch_size")
    if not isinstance(low, int) or low < 1 or (high is not None and (not isinstance(high, int) or high < low)):
        raise ConfigError(f"{_KEY}.min_batch_size", f"min_batch_size {low!r} / max_batch_size {high!r}: need "
                                                    "1 <= min_batch_size <= max_batch_size (or max_batch_size null)")
    path = section.get("metrics_path")
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"{_KEY}.metrics_path", f"must be a directory path, got {path!r}")
    return DynamicBatching(tokens, method, order, low, high, bool(section.get("verbose", False)),
                           int(data_efficiency.get("seed", 1234)), int(sampling.get("num_workers", 0)),
                           bool(sampling.get("pin_memory", False)), path or None)


def batch_by_seqlens(seqlens: Sequence[int], max_tokens: int, sequence_ids_per_mb: Sequence[int] | None = None,
                     min_batch_size: int = 1, max_batch_size: int | None = None,
                     sequence_picking_order: str = "dataloader", effective_batch_size: int = 1,
                     required_microbatches_of_same_size: bool = False, verbose: bool = False, seed: int | None = None):
    """Pack sequence ids into micro-batches of at most ``max_tokens`` tokens.

    Returns ``(microbatch_ids, batch_sizes, batch_max_seqlens)``: ``[(batch id, [sequence ids])]`` per micro-batch,
    and per batch of ``effective_batch_size`` micro-batches its number of sequences and its longest sequence.
    Sequences longer than ``max_tokens`` are left out (warned). Each pack is the longest run of the next sequences
    that fits (with ``required_microbatches_of_same_size``, ``effective_batch_size`` interleaved packs of equal
    count); packing ends where the next sequences cannot make a pack (fewer than ``min_batch_size`` fit), and
    trailing packs that do not fill a whole batch are dropped -- both as in DeepSpeed.
    """
    ids = range(len(seqlens)) if sequence_ids_per_mb is None else sequence_ids_per_mb
    items = [(int(seqlens[i]), int(i)) for i in ids]
    if sequence_picking_order == "random":
        random.Random(seed).shuffle(items)
    elif sequence_picking_order == "seqlen":
        items.sort()
    elif sequence_picking_order != "dataloader":
        raise ValueError(f"sequence_picking_order {sequence_picking_order!r} is not one of {_ORDERS}")
    too_long = [i for n, i in items if n > max_tokens]
    if too_long:
        logger.warning("hf_zero: dynamic batching leaves out sequences %s: each alone exceeds max_tokens=%d",
                       too_long, max_tokens)
        items = [(n, i) for n, i in items if n <= max_tokens]

    def too_big(pack) -> bool:  # stays true as the pack grows: the scan can stop
        return (max_batch_size is not None and len(pack) > max_batch_size) or sum(n for n, _ in pack) > max_tokens

    step = effective_batch_size if required_microbatches_of_same_size else 1
    packs, start = [], 0
    while start < len(items):
        end = start  # the longest extension whose every interleaved pack fits (too few sequences: keep growing)
        for stop in range(start + step, len(items) + 1, step):
            group = [items[start:stop][b::step] for b in range(step)]
            if any(too_big(p) for p in group):
                break
            if all(len(p) >= min_batch_size for p in group):
                end = stop
        if end == start:
            break  # what is left cannot make a valid pack
        packs += [items[start:end][b::step] for b in range(step)]
        start = end
    if len(packs) < effective_batch_size:
        raise ValueError(f"hf_zero: dynamic batching made {len(packs)} packs of at most {max_tokens} tokens, fewer "
                         f"than one batch of {effective_batch_size} (train_batch_size); lower it or raise max_tokens")
    packs = packs[:len(packs) - len(packs) % effective_batch_size]
    microbatch_ids, batch_sizes, batch_max_seqlens = [], [], []
    for batch_id, first in enumerate(range(0, len(packs), effective_batch_size)):
        batch = packs[first:first + effective_batch_size]
        batch_sizes.append(sum(len(p) for p in batch))
        batch_max_seqlens.append(max(n for p in batch for n, _ in p))
        microbatch_ids += [(batch_id, [i for _, i in p]) for p in batch]
        if verbose:
            logger.info("hf_zero: batch %d: %d sequences in packs of %s sequences / %s tokens", batch_id,
                        batch_sizes[-1], [len(p) for p in batch], [sum(n for n, _ in p) for p in batch])
    return microbatch_ids, batch_sizes, batch_max_seqlens


def scale_lr(base_batch_size: int, batch_size: int, base_lr: float = 1.0, method: str | None = "linear") -> float:
    """The learning rate for ``batch_size`` sequences when ``base_lr`` is right for ``base_batch_size``."""
    if method is None or str(method).lower() == "none":
        return base_lr
    if method == "linear":  # Goyal et al.: k times the batch, k times the rate
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":  # Krizhevsky: sqrt(k) keeps the gradient estimate's variance
        return base_lr * math.sqrt(batch_size / base_batch_size)
    raise ValueError(f"lr_scaling_method {method!r} is not one of {_METHODS}")


class VariableBatchSizeLR:
    """Scales each step's learning rate by that step's number of sequences, around a base schedule (an LR scheduler,
    or the optimizer's constant rates). ``step(0)`` restarts at the first batch; ``step()`` moves to the next one
    (the engine calls it after each optimizer step)."""

    def __init__(self, lr_scheduler_or_optimizer, base_batch_size: int, batch_sizes: Sequence[int],
                 lr_scaling_method: str = "linear", dataloader=None, verbose: bool = False) -> None:
        if hasattr(lr_scheduler_or_optimizer, "param_groups"):
            self.optimizer, self.base_lr_scheduler = lr_scheduler_or_optimizer, None
        elif hasattr(lr_scheduler_or_optimizer, "optimizer"):
            self.optimizer, self.base_lr_scheduler = lr_scheduler_or_optimizer.optimizer, lr_scheduler_or_optimizer
        else:
            raise TypeError(f"hf_zero: VariableBatchSizeLR needs an optimizer or an LR scheduler, got "
                            f"{type(lr_scheduler_or_optimizer).__name__}")
        self.base_batch_size = base_batch_size
        self.batch_sizes = list(batch_sizes)
        self.lr_scaling_method = lr_scaling_method
        self.dataloader = dataloader
        self.verbose = verbose
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self._unscaled = list(self.base_lrs)
        self.last_epoch = -1
        self.step(0)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        """The base schedule's rates for the current batch, before scaling."""
        return list(self._unscaled)

    def step(self, epoch: int | None = None) -> None:
        # the base schedule steps on unscaled rates, then this batch's scale is applied on top
        unscaled = self.base_lrs if epoch == 0 else self._unscaled
        for group, lr in zip(self.optimizer.param_groups, unscaled):
            group["lr"] = lr
        if self.base_lr_scheduler is not None:
            self.base_lr_scheduler.step(epoch)
        self._unscaled = [group["lr"] for group in self.optimizer.param_groups]
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        size = self.batch_sizes[self.last_epoch % len(self.batch_sizes)]
        for group in self.optimizer.param_groups:
            group["lr"] = scale_lr(self.base_batch_size, size, group["lr"], self.lr_scaling_method)
        if self.verbose:
            logger.info("hf_zero: batch %d: %d sequences (reference %d): lr %s -> %s", self.last_epoch, size,
                        self.base_batch_size, self._unscaled, self.get_lr())

    def state_dict(self) -> dict:
        return {"base_lr_scheduler": None if self.base_lr_scheduler is None else self.base_lr_scheduler.state_dict(),
                "base_batch_size": self.base_batch_size, "lr_scaling_method": self.lr_scaling_method,
                "batch_sizes": self.batch_sizes, "base_lrs": self.base_lrs, "last_epoch": self.last_epoch,
                "unscaled": self._unscaled, "verbose": self.verbose}

    def load_state_dict(self, state: dict) -> None:
        if self.base_lr_scheduler is not None and state.get("base_lr_scheduler") is not None:
            self.base_lr_scheduler.load_state_dict(state["base_lr_scheduler"])
        for key in ("base_batch_size", "lr_scaling_method", "batch_sizes", "base_lrs", "last_epoch", "verbose"):
            setattr(self, key, state[key])
        self._unscaled = list(state.get("unscaled", self.base_lrs))


def dataloader_for_variable_batch_size(dataset, microbatch_ids, batch_max_seqlens, dataloader_rank: int = 0,
                                       dataloader_batch_size: int = 1, dataloader_num_replicas: int = 1,
                                       dataloader_collate_fn: Callable | None = None, dataloader_num_workers: int = 0,
                                       dataloader_pin_memory: bool = False,
                                       required_microbatches_of_same_seqlen: bool = False,
                                       sample_padding_fn: Callable | None = None):
    """A data loader over the packs (each pack collated into one sample), split over the data-parallel ranks in
    turn; returns it and the keyword arguments DeepSpeed's ``engine.deepspeed_io`` would take for the same."""
    sampler = DistributedSampler(microbatch_ids, num_replicas=dataloader_num_replicas, rank=dataloader_rank,
                                 shuffle=False, drop_last=False)

    def collate(packs):
        samples = []
        for batch_id, ids in packs:
            data = [dataset[i] for i in ids]
            if required_microbatches_of_same_seqlen:
                if sample_padding_fn is None:
                    raise ValueError("hf_zero: pipeline micro-batches of one length need sample_padding_fn")
                data = [sample_padding_fn(sample, batch_max_seqlens[batch_id]) for sample in data]
            samples += data
        return dataloader_collate_fn(samples) if dataloader_collate_fn else samples

    loader = DataLoader(microbatch_ids, batch_size=dataloader_batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=dataloader_num_workers, pin_memory=dataloader_pin_memory)
    io_kwargs = dict(dataset=microbatch_ids, batch_size=dataloader_batch_size, pin_memory=dataloader_pin_memory,
                     data_sampler=sampler, collate_fn=collate, num_local_io_workers=dataloader_num_workers)
    return loader, io_kwargs


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset, dataset_seqlens, max_tokens: int, effective_batch_size: int, dataset_filter_ids=None,
        lr_scaling_method: str = "linear", min_batch_size: int = 1, max_batch_size: int | None = None,
        sequence_picking_order: str = "dataloader", dataloader_batch_size: int = 1, dataloader_rank: int = 0,
        dataloader_num_replicas: int = 1, dataloader_num_workers: int = 0, dataloader_collate_fn=None,
        dataloader_pin_memory: bool = False, lr_scheduler_or_optimizer=None,
        required_microbatches_of_same_size: bool = False, required_microbatches_of_same_seqlen: bool = False,
        sample_padding_fn=None, verbose: bool = False, seed: int | None = None):
    """The packs, their data loader and the scaled-LR scheduler: ``(dataloader, lr_scheduler, io_kwargs)``."""
    microbatch_ids, batch_sizes, batch_max_seqlens = batch_by_seqlens(
        dataset_seqlens, max_tokens, dataset_filter_ids, min_batch_size, max_batch_size, sequence_picking_order,
        effective_batch_size, required_microbatches_of_same_size, verbose, seed)
    loader, io_kwargs = dataloader_for_variable_batch_size(
        dataset, microbatch_ids, batch_max_seqlens, dataloader_rank, dataloader_batch_size, dataloader_num_replicas,
        dataloader_collate_fn, dataloader_num_workers, dataloader_pin_memory, required_microbatches_of_same_seqlen,
        sample_padding_fn)
    scheduler = VariableBatchSizeLR(lr_scheduler_or_optimizer, effective_batch_size, batch_sizes, lr_scaling_method,
                                    loader, verbose)
    return loader, scheduler, io_kwargs


def _seqlens_of(dataset, collate_fn, batch_seqlens_fn) -> list[int]:
    """Every sample's length: ``batch_seqlens_fn`` over collated chunks of the dataset, in order."""
    out: list[int] = []
    for start in range(0, len(dataset), 1024):
        chunk = [dataset[i] for i in range(start, min(start + 1024, len(dataset)))]
        lengths = batch_seqlens_fn(collate_fn(chunk) if collate_fn else chunk)
        out += [int(n) for n in (lengths.tolist() if hasattr(lengths, "tolist") else lengths)]
    if len(out) != len(dataset):
        raise ValueError(f"hf_zero: batch_seqlens_fn gave {len(out)} lengths for {len(dataset)} samples")
    return out


def _lengths(dataset, metrics_path: str | None, collate_fn, batch_seqlens_fn) -> list[int]:
    """The samples' lengths: ``<metrics_path>/seqlen/seqlen_sample_to_metric`` when it exists (DeepSpeed's
    DataAnalyzer or an earlier run wrote it), else ``batch_seqlens_fn`` over the dataset, written there by global
    rank 0 for the next run (each rank computes its own copy: no rank waits for a file)."""
    prefix = os.path.join(metrics_path, "seqlen", "seqlen_sample_to_metric") if metrics_path else None
    if prefix is not None and metric_files_exist(prefix):
        lengths = read_sample_metric(prefix).tolist()
        if len(lengths) != len(dataset):
            raise ValueError(f"hf_zero: {prefix}.bin holds {len(lengths)} lengths for {len(dataset)} samples: it was "
                             f"written for another dataset; delete {metrics_path} ({_KEY}.metrics_path) to recompute")
        return lengths
    if batch_seqlens_fn is None:
        raise ValueError("hf_zero: dynamic batching needs the sequence lengths: pass dataset_seqlens or "
                         f"batch_seqlens_fn" + (f" (no {prefix}.idx/.bin)" if prefix else ""))
    lengths = _seqlens_of(dataset, collate_fn, batch_seqlens_fn)
    if prefix is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        write_sample_metric(prefix, lengths)
    return lengths


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, engine, dataset_seqlens=None,
                                                                      dataset_filter_ids=None,
                                                                      dataloader_collate_fn=None,
                                                                      sample_padding_fn=None, batch_seqlens_fn=None):
    """DeepSpeed's entry point: the engine's config (``data_efficiency``), batch sizes, data-parallel group and
    optimizer or scheduler decide the rest. Sequence lengths: ``dataset_seqlens``, else ``batch_seqlens_fn``."""
    policy = parse_dynamic_batching(engine._config.data_efficiency)
    if dataset_seqlens is None:
        dataset_seqlens = _lengths(dataset, policy.metrics_path, dataloader_collate_fn, batch_seqlens_fn)
    elif len(dataset_seqlens) != len(dataset):
        raise ValueError(f"hf_zero: dataset_seqlens has {len(dataset_seqlens)} entries for {len(dataset)} samples")
    from hf_zero.runtime.pipe_engine import PipelineEngine  # lazily: the pipeline engine imports much

    pipeline = isinstance(engine, PipelineEngine)  # pipeline micro-batches must agree in count and length
    group = engine.data_parallel_group
    return get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset=dataset, dataset_seqlens=dataset_seqlens, max_tokens=policy.max_tokens,
        effective_batch_size=engine.train_batch_size(), dataset_filter_ids=dataset_filter_ids,
        lr_scaling_method=policy.lr_scaling_method, min_batch_size=policy.min_batch_size,
        max_batch_size=policy.max_batch_size, sequence_picking_order=policy.sequence_picking_order,
        dataloader_batch_size=engine.train_micro_batch_size_per_gpu(),
        dataloader_rank=dist.get_rank(group) if dist.is_initialized() else 0,
        dataloader_num_replicas=dist.get_world_size(group) if dist.is_initialized() else 1,
        dataloader_num_workers=policy.num_workers, dataloader_collate_fn=dataloader_collate_fn,
        dataloader_pin_memory=policy.pin_memory,
        lr_scheduler_or_optimizer=engine.lr_scheduler if engine.lr_scheduler is not None else engine.optimizer,
        required_microbatches_of_same_size=pipeline, required_microbatches_of_same_seqlen=pipeline,
        sample_padding_fn=sample_padding_fn, verbose=policy.verbose, seed=policy.seed)
