"""Turning a diverged parameter gather into an error that names the module and the ranks, instead of a hang.

ZeRO-3 is a long chain of collectives that every rank must issue in the same order. When one rank takes another
code path (a data-dependent branch, an extra generate() step, a module skipped on one rank), the classic outcome
is a hang with no hint. Three checks:

1. **Header before every collective** (hf_zero/comm/faults.py): a 5-integer all-gather of (kind, size, dtype,
   sequence number, label) compared on every rank before the payload is issued, so collectives of *different*
   sizes are caught before they reach gloo (which aborts the process on them) or NCCL (which hangs). On by default
   (``comms_divergence_check``); when switched off, stage 3 still checks every gather of its first, recorded
   iteration (``Gatherer.header_checks``), where structural divergence shows up first.
2. **Trailer on every gather (free).** Each rank appends ``TRAILER_NUMEL`` elements to its row of the packed
   all-gather: the 24-bit key of the parameters it gathers, as three bytes, and the low byte of its gather
   sequence number. Bytes are integers <= 255, exact in fp32, bf16 and fp16, so the trailer rides in the payload's
   dtype. After the gather every rank compares all rows; a mismatch (same-size buffers, different parameters)
   raises :class:`DivergenceError` on every rank at once, also with the header check off.
3. **Bound on every wait** (comms_timeout_s, the smaller stage3_divergence_timeout_s for gathers): a rank that
   never joins is diagnosed by the fault channel -- stopped, dead, or alive elsewhere -- and every rank exits.

Every one of these errors is fatal for the job: the fault is published to the other ranks and each process exits
with status 1 (see hf_zero/comm/faults.py).
"""

from __future__ import annotations

import torch

from hf_zero.comm import faults
from hf_zero.comm.faults import DivergenceError

__all__ = ["DivergenceError", "TRAILER_NUMEL", "params_key", "write_trailer", "check_trailers", "wait_or_diagnose"]

TRAILER_NUMEL = 4  # key byte 0, key byte 1, key byte 2, sequence byte
_KEY_MASK = 0xFFFFFF


def params_key(ds_ids) -> int:
    """A 24-bit key of an ordered list of parameter ids (FNV-1a over the ids)."""
    h = 0x811C9DC5
    for i in ds_ids:
        h = ((h ^ (int(i) + 1)) * 0x01000193) & 0xFFFFFFFF
    return (h ^ (h >> 24)) & _KEY_MASK


def write_trailer(row_tail: torch.Tensor, key: int, seq: int) -> None:
    """``row_tail`` (TRAILER_NUMEL,) of this rank's send buffer."""
    row_tail.copy_(torch.tensor([key & 0xFF, (key >> 8) & 0xFF, (key >> 16) & 0xFF, seq & 0xFF],
                                dtype=row_tail.dtype))


def _decode(tails: torch.Tensor) -> list[tuple[int, int]]:
    # tails: (world_size, TRAILER_NUMEL)
    vals = tails.to(torch.int64).tolist()
    return [(b0 | (b1 << 8) | (b2 << 16), s) for b0, b1, b2, s in vals]


def check_trailers(tails: torch.Tensor, rank: int, describe, group=None) -> None:
    """Raise :class:`DivergenceError` (fatal, see module docstring) unless every rank's trailer equals this rank's."""
    rows = _decode(tails)
    if all(r == rows[rank] for r in rows):
        return
    try:
        _raise_mismatch(rows, rank, describe, "in the gathered data", seq_mod=256)
    except DivergenceError as exc:
        raise faults.fail(exc, group)


def _raise_mismatch(rows: list[tuple[int, int]], rank: int, describe, where: str, seq_mod: int | None = None) -> None:
    by_target: dict[tuple[int, int], list[int]] = {}
    for r, row in enumerate(rows):
        by_target.setdefault(row, []).append(r)
    mod = f" mod {seq_mod}" if seq_mod else ""
    parts = [f"ranks {ranks} gathered {describe(key)} (gather #{seq}{mod})"
             for (key, seq), ranks in by_target.items()]
    raise DivergenceError(
        f"hf_zero ZeRO-3: ranks diverged {where} (seen on rank {rank}): " + "; ".join(parts) +
        ". Every rank must run the same modules in the same order each step (same number of generate() steps -- "
        "use synced_gpus=True -- and no rank-dependent branches around partitioned modules).")


def _where(what: str, seq: int | None) -> str:
    return f"the gather of {what} (gather #{seq})" if seq is not None else what


def wait_or_diagnose(work, timeout_s: float, what: str, seq: int | None, group=None) -> None:
    """Wait for ``work`` at most ``timeout_s``; after that the fault channel raises a :class:`CommFault` saying
    where every rank is. ``what`` names the collective: parameters gathered (with their gather ``seq``) or, with
    ``seq=None``, anything else (a gradient reduce-scatter)."""
    if getattr(work, "work", work) is None:
        faults.settle(group)  # its check was deferred (comm/faults.check_deferred): verify it, issue the payload
    faults.bounded_wait(getattr(work, "work", work), _where(what, seq), group, min(timeout_s, faults.timeout_s()),
                        stream_ordered=getattr(work, "stream_ordered", False))
