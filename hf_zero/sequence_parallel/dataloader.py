"""Feed Ulysses: every rank of an SP group works on the same sample, each on its slice of the sequence.

    underlying loader, per rank:   rank 0 -> sample a      rank 1 -> sample b
    adapter, step 1:               rank 0 -> a[:, :S/2]    rank 1 -> a[:, S/2:]
    adapter, step 2:               rank 0 -> b[:, :S/2]    rank 1 -> b[:, S/2:]

So one pass over the underlying loader takes ``sp_size`` times as many steps, and no sample is dropped or seen
twice. Labels are shifted *before* slicing (``shift_labels``, ``-100`` past the end) and ``labels`` removed: the
next-token target of a shard's last token is the first token of the next shard, which the model on this rank never
sees, so the model must not shift them itself (transformers' loss functions take ``shift_labels``).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["UlyssesSPDataLoaderAdapter", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # transformers' cross-entropy ignores these targets
SEQ_DIM = 1          # batches are [batch, seq, ...]


class UlyssesSPDataLoaderAdapter:
    """Wrap ``dl`` (batches: dicts with ``input_ids``, ``position_ids``, ``labels`` of shape ``[batch, seq, ...]``;
    other tensors are sliced the same way, non-tensors copied). Shards are returned on the host; move them to the
    device as any batch (DeepSpeed does the same: ``sp_size`` whole samples wait in the queue)."""

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.iter: Iterator | None = None
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        self.iter = iter(self.dl)
        self.micro_batches.clear()
        return self

    def __next__(self) -> dict[str, Any]:
        if self.iter is None:
            self.iter = iter(self.dl)
        if not self.micro_batches:
            try:
                batch = next(self.iter)
            except StopIteration:
                self.iter = None  # the next epoch starts a fresh pass
                raise
            self.micro_batches.extend(self._shards_of_every_ranks_batch(batch))
        return self.micro_batches.popleft()

    def _shards_of_every_ranks_batch(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """This rank's shard of each SP rank's batch, in rank order (collective over the SP group)."""
        if "position_ids" not in batch:
            raise ValueError("Ulysses sequence parallelism needs position_ids in every batch (each token keeps its "
                             "global position after the sequence is split); add "
                             "position_ids = torch.arange(seq_len) per sample to the collator's output")
        seq_len = batch["input_ids"].shape[SEQ_DIM]
        for key, value in batch.items():
            if torch.is_tensor(value) and (value.dim() <= SEQ_DIM or value.shape[SEQ_DIM] != seq_len):
                raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}; every tensor of a batch must be "
                                 f"[batch, seq, ...] with input_ids' sequence length {seq_len}")
        gathered = {key: (_gather_padded(value, self.sp_group, self.sp_world_size, self.device)
                          if torch.is_tensor(value) else _gather_object(value, self.sp_group, self.sp_world_size))
                    for key, value in batch.items()}
        return [self._shard({key: values[r] for key, values in gathered.items()}) for r in range(self.sp_world_size)]

    def _shard(self, sample: dict[str, Any]) -> dict[str, Any]:
        seq_len = sample["input_ids"].shape[SEQ_DIM]
        if seq_len % self.sp_world_size:
            raise ValueError(f"a batch's sequence length {seq_len} is not divisible by the sequence parallel size "
                             f"{self.sp_world_size}; pad the batches to a multiple of it")
        if "labels" in sample:
            labels = sample.pop("labels")
            sample["shift_labels"] = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
        chunk = seq_len // self.sp_world_size
        lo = chunk * self.sp_rank
        return {key: value[:, lo:lo + chunk].cpu() if torch.is_tensor(value) else value
                for key, value in sample.items()}


def _gather_padded(t: torch.Tensor, group, world: int, device: torch.device) -> list[torch.Tensor]:
    """Every rank's ``t`` (same dims, lengths may differ: padded to the longest for the collective, then cut)."""
    t = t.to(device)
    shape = torch.tensor(list(t.shape), dtype=torch.int64, device=device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    shapes = [tuple(s.tolist()) for s in shapes]
    longest = [max(dims) for dims in zip(*shapes)]
    padded = t.new_zeros(longest)
    padded[tuple(slice(0, n) for n in t.shape)] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    with torch.no_grad():
        dist.all_gather(parts, padded, group=group)
    return [part[tuple(slice(0, n) for n in s)] for part, s in zip(parts, shapes)]


def _gather_object(value: Any, group, world: int) -> list[Any]:
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out
