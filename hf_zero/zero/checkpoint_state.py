"""What a stateful ZeRO component reads its checkpointed state through.

Each component saves and loads its own named state (``ZeroOptimizer``: master and optimizer-state shards plus
scalars; the stage-3 runtime: frozen-parameter shards and persistent buffers; ``LossScaler``: its scale). Where the
bytes go, their checksums and atomicity, and the re-cut of shards saved on another number of ranks belong to
``hf_zero/checkpoint/engine.py``, which hands a component a :class:`ShardReader` at load time. A component asks it
for the piece *its* layout gives *its* rank, and never learns how many ranks wrote the files.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hf_zero.zero.layout import ShardLayout

__all__ = ["ShardReader"]


class ShardReader(Protocol):
    """Read access to one checkpoint's saved tensors, already validated (present, checksummed, shaped)."""

    def keys(self) -> set[str]:
        """Every tensor name the checkpoint holds (the names the components gave at save)."""

    def shard(self, key: str, layout: ShardLayout, rank: int) -> torch.Tensor:
        """Rank ``rank``'s flat shard of ``key`` cut by ``layout`` (``(layout.shard_numel,)``, in the saved dtype),
        re-cut per parameter when the checkpoint was written on another number of ranks."""

    def whole(self, key: str) -> torch.Tensor:
        """A tensor saved whole (identical on every rank, e.g. a buffer), as one rank saved it."""
