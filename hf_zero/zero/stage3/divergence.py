"""Turning a diverged parameter gather into an error that names the module and the ranks, instead of a hang.

ZeRO-3 is a long chain of collectives that every rank must issue in the same order. When one rank takes another
code path (a data-dependent branch, an extra generate() step, a module skipped on one rank), the classic outcome
is a hang with no hint. Three checks, chosen so that the steady state pays no extra collective:

1. **Trailer on every gather (free).** Each rank appends ``TRAILER_NUMEL`` elements to its row of the packed
   all-gather: the 24-bit key of the parameters it gathers, as three bytes, and the low byte of its gather
   sequence number. Bytes are integers <= 255, exact in fp32, bf16 and fp16, so the trailer rides in the payload's
   dtype. After the gather every rank compares all rows; a mismatch (same-size buffers, different parameters or a
   skipped gather) raises :class:`DivergenceError` on every rank at once.
2. **Header before each gather while a trace is recorded (first iteration only).** Collectives of *different*
   sizes cannot be compared through a trailer: gloo aborts the process ("Received data size doesn't match") and
   NCCL hangs. So during the first forward/backward -- where structural divergence shows up -- each gather is
   preceded by a 3-int64 all-gather of (key, shard numel, sequence number). Later iterations follow the recorded
   order, and paying a second collective per gather forever for a failure that already had its chance to appear
   is not worth it.
3. **Timeout on every wait.** A rank that never joins (it finished early, or hangs elsewhere) is caught by
   ``Work.wait(timeout)``. The timed-out rank then writes what it was gathering to a small TCPStore side channel
   (created once, at the first partition) and reads what the other ranks wrote, so the error names the ranks that
   were gathering something else and the ones that never reached a gather.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

from hf_zero.comm import all_gather_packed

__all__ = ["DivergenceError", "TRAILER_NUMEL", "params_key", "write_trailer", "check_trailers", "check_header",
           "SideChannel"]

TRAILER_NUMEL = 4  # key byte 0, key byte 1, key byte 2, sequence byte
_KEY_MASK = 0xFFFFFF


class DivergenceError(RuntimeError):
    """Ranks disagreed on which parameters to gather (or one never came). Names the module(s) and the ranks."""


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


def check_trailers(tails: torch.Tensor, rank: int, describe) -> None:
    """Raise :class:`DivergenceError` unless every rank's trailer equals this rank's."""
    rows = _decode(tails)
    if all(r == rows[rank] for r in rows):
        return
    _raise_mismatch(rows, rank, describe, "in the gathered data", seq_mod=256)


def check_header(key: int, span: int, seq: int, rank: int, world_size: int, group, timeout_s: float,
                 describe, side: "SideChannel | None") -> None:
    """First-iteration check: all-gather (key, span, seq) and compare before the payload collective."""
    mine = torch.tensor([key, span, seq], dtype=torch.int64)
    out = torch.empty(world_size, 3, dtype=torch.int64)
    work = all_gather_packed(out, mine, group=group, async_op=True)
    wait_or_diagnose(work, timeout_s, rank, world_size, describe(key), seq, side)
    rows = [tuple(r) for r in out.tolist()]
    if all(r == rows[rank] for r in rows):
        return
    _raise_mismatch([(k, s) for k, _, s in rows], rank, describe, "before gathering")


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


def wait_or_diagnose(work, timeout_s: float, rank: int, world_size: int, what: str, seq: int | None,
                     side: "SideChannel | None") -> None:
    """Wait for ``work``; after ``timeout_s`` raise a :class:`DivergenceError` saying where every rank is.
    ``what`` names the collective: parameters gathered (with their gather ``seq``) or, with ``seq=None``, anything
    else (a gradient reduce-scatter)."""
    if world_size == 1:  # nothing was sent (hf_zero.comm returns a completed stand-in)
        work.wait()
        return
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        if side is None:
            raise DivergenceError(f"hf_zero ZeRO-3: rank {rank} waited {timeout_s:g}s in {_where(what, seq)}; "
                                  f"other ranks did not join ({exc})") from exc
        raise side.diagnose(rank, world_size, what, seq, timeout_s) from exc


class SideChannel:
    """A TCPStore beside the process group, used only after a timeout to learn where the other ranks are."""

    def __init__(self, group) -> None:
        rank = dist.get_rank(group)
        obj = [None]
        if rank == 0:
            # The group's rank 0 hosts it: the launcher's MASTER_ADDR when that is global rank 0, else this host.
            host = os.environ.get("MASTER_ADDR", "127.0.0.1") if dist.get_rank() == 0 else socket.gethostname()
            self._store = dist.TCPStore(host, 0, dist.get_world_size(group), True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=60))
            obj = [(host, self._store.port)]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(obj, src=src, group=group)
        if rank != 0:
            host, port = obj[0]
            self._store = dist.TCPStore(host, port, dist.get_world_size(group), False,
                                        timeout=datetime.timedelta(seconds=60))

    def diagnose(self, rank: int, world_size: int, what: str, seq: int | None, timeout_s: float) -> DivergenceError:
        self._store.set(f"hf_zero/stuck/{rank}", _where(what, seq))
        grace_s = min(timeout_s, 5.0)
        deadline = time.monotonic() + grace_s
        reports: dict[int, str] = {}
        while time.monotonic() < deadline and len(reports) < world_size - 1:
            for r in range(world_size):
                if r != rank and r not in reports and self._store.check([f"hf_zero/stuck/{r}"]):
                    reports[r] = self._store.get(f"hf_zero/stuck/{r}").decode()
            time.sleep(0.05)
        lines = [f"rank {rank} waited {timeout_s:g}s in {_where(what, seq)}"]
        for r, text in sorted(reports.items()):
            lines.append(f"rank {r} was stuck in {text}")
        absent = [r for r in range(world_size) if r != rank and r not in reports]
        if absent:
            lines.append(f"ranks {absent} never reached a parameter gather (finished early, or blocked in another "
                         f"collective)")
        return DivergenceError("hf_zero ZeRO-3: ranks diverged: " + "; ".join(lines) +
                               f". Raise stage3_divergence_timeout_s if a rank is legitimately slower.")
