"""How large a communication bucket hf_zero allocates (gradient reduce-scatters, the publishing all-gathers,
ZeRO-3's gradient buckets and prefetch): here, below zero/ and profiling/, so the memory estimator sizes buckets
with the same function the engine does."""

from __future__ import annotations

__all__ = ["BUCKET_CAP_BYTES", "capped_bucket_numel"]

# Communication buckets (gradient reduce-scatters, the publishing all-gathers, ZeRO-3's gradient buckets) hold at
# most this many bytes, whatever larger reduce_bucket_size / allgather_bucket_size the config allows. DeepSpeed's
# defaults (5e8 elements: 2 GB of fp32 per bucket) are sized for GPUs with NCCL; on a 32M-parameter model they put
# every gradient in one bucket, so nothing is reduced before backward ends (no overlap) and the packed copy of the
# whole gradient sits beside the full gradients. 16 MiB already amortizes a collective's latency (gloo on one host:
# ~0.1 ms against ~5 ms to move the bucket) and keeps 2-3 buckets in flight cheap. The configured sizes stay upper
# bounds, as DeepSpeed documents them ("limits the memory required").
BUCKET_CAP_BYTES = 16 << 20


def capped_bucket_numel(configured: int, itemsize: int) -> int:
    """Elements per bucket: the configured size, at most :data:`BUCKET_CAP_BYTES` of ``itemsize``-byte elements."""
    return max(1, min(int(configured), BUCKET_CAP_BYTES // int(itemsize)))
