"""Hostfiles and DeepSpeed's ``--include``/``--exclude`` resource filters.

A hostfile has one node per line, ``hostname slots=N`` (N processes on that node); ``#`` starts a comment. The
resources of a run are an ordered mapping ``host -> [slot, ...]`` (slot = local device index); the filters keep or
drop whole hosts (``worker-1``) or single slots (``worker-1:0,2``), several separated by ``@``.
"""

from __future__ import annotations

import os
import re

__all__ = ["LaunchError", "read_hostfile", "filter_resources", "parse_core_list"]

_LINE = re.compile(r"^(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\d+)$")


class LaunchError(ValueError):
    """A launch that cannot go ahead as asked; the message names the flag or file and what to change."""


def read_hostfile(path: str) -> dict[str, int] | None:
    """``{host: slots}`` in file order, or None when there is no such file (then the run is this node only)."""
    if not path or not os.path.isfile(path):
        return None
    hosts: dict[str, int] = {}
    with open(path) as f:
        for number, raw in enumerate(f, start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            match = _LINE.match(line)
            if match is None:
                raise LaunchError(f"hostfile {path}, line {number}: {raw.strip()!r} is not 'hostname slots=N'")
            host, slots = match.group("host"), int(match.group("slots"))
            if host in hosts:
                raise LaunchError(f"hostfile {path}, line {number}: host {host!r} is listed twice")
            if slots < 1:
                raise LaunchError(f"hostfile {path}, line {number}: host {host!r} has slots={slots}; need >= 1")
            hosts[host] = slots
    if not hosts:
        raise LaunchError(f"hostfile {path} lists no hosts; add lines like 'worker-0 slots=8' or remove the file")
    return hosts


def _parse_filter(text: str, flag: str, resources: dict[str, list[int]]) -> dict[str, list[int] | None]:
    """``'a@b:0,2'`` -> ``{'a': None, 'b': [0, 2]}`` (None: the whole host), checked against ``resources``."""
    wanted: dict[str, list[int] | None] = {}
    for part in filter(None, text.split("@")):
        host, _, slots = part.partition(":")
        if host not in resources:
            raise LaunchError(f"{flag} {text!r}: host {host!r} is not among the hosts {list(resources)}")
        if not slots:
            wanted[host] = None
            continue
        try:
            ids = [int(s) for s in slots.split(",")]
        except ValueError:
            raise LaunchError(f"{flag} {text!r}: slots of {host!r} must be integers like 'host:0,1'") from None
        missing = [s for s in ids if s not in resources[host]]
        if missing:
            raise LaunchError(f"{flag} {text!r}: host {host!r} has no slot(s) {missing} (it has {resources[host]})")
        wanted[host] = ids
    return wanted


def filter_resources(resources: dict[str, list[int]], include: str = "", exclude: str = "") -> dict[str, list[int]]:
    """The resources kept by ``--include`` (only these) or ``--exclude`` (all but these); not both at once."""
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive; give one of them")
    if include:
        wanted = _parse_filter(include, "--include", resources)
        return {h: (list(resources[h]) if s is None else sorted(set(s))) for h, s in resources.items()
                if h in wanted for s in [wanted[h]]}
    if exclude:
        dropped = _parse_filter(exclude, "--exclude", resources)
        kept = {}
        for host, slots in resources.items():
            if host in dropped:
                if dropped[host] is None:
                    continue
                slots = [s for s in slots if s not in dropped[host]]
                if not slots:
                    continue
            kept[host] = list(slots)
        if not kept:
            raise LaunchError(f"--exclude {exclude!r} leaves no host to run on")
        return kept
    return {h: list(s) for h, s in resources.items()}


def parse_core_list(text: str) -> list[int]:
    """``'0-3,8,10-11'`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (``--bind_core_list``)."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, sep, last = part.partition("-")
        try:
            lo = int(first)
            hi = int(last) if sep else lo
        except ValueError:
            raise LaunchError(f"--bind_core_list {text!r}: {part!r} is not a core number or range like '0-3'") \
                from None
        if hi < lo:
            raise LaunchError(f"--bind_core_list {text!r}: range {part!r} goes backwards")
        cores.extend(range(lo, hi + 1))
    if len(set(cores)) != len(cores):
        raise LaunchError(f"--bind_core_list {text!r} names a core twice")
    return cores
