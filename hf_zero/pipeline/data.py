"""DeepSpeed's ``RepeatingLoader``: an endless iterator over a data loader (the pipeline engine pulls micro-batches
from it for as many steps as the user trains)."""

from __future__ import annotations

__all__ = ["RepeatingLoader"]


class RepeatingLoader:
    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            sampler = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):  # a DistributedSampler reshuffles per epoch, the same on every rank
                sampler.set_epoch(getattr(sampler, "epoch", 0) + 1)
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
