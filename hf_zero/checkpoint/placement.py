"""Which directory each rank's checkpoint files go to, and which rank finalizes it: shared or node-local storage.

A checkpoint directory is either one shared file system (every rank sees what rank 0 writes) or, with
``checkpoint.use_node_local_storage`` (DeepSpeed's key), a private disk per node under the same path. Which case
holds is *observed*, not assumed: before a save, each directory's candidate writer (rank 0; with the key, the first
rank of every node) creates a probe file named by a nonce all ranks share, and every rank reports which probes it
sees. Ranks that see the same probes share a directory (a *domain*); the lowest rank seen is that domain's writer: it
creates and finalizes the domain's files (``meta.json``, ``engine_state.pt``, ``model.safetensors``, the manifest,
``latest``); every rank writes its own shard file into its domain. So:

* no key, directory not shared: every rank that does not see rank 0's probe is named in an error that says to set
  ``checkpoint.use_node_local_storage`` -- instead of a write failing on "rank 1";
* key set, node-local disks: one complete copy of the shared files per node, each rank's shards on its node;
* key set on a shared file system: the nodes see each other's probes and form one domain -- one copy, as without it;
* ranks of one node that pass *different* directories (a script naming its run directory per rank): each rank's
  files go where it was told, as in DeepSpeed -- each directory is a domain, finalized by its lowest rank -- and a
  warning says so (:func:`_per_rank_directories`).

Nodes are told apart by :func:`hf_zero.comm.get_node_id` (host name, plus torchrun's ``GROUP_RANK``).

At load, :func:`agree_on_tag` makes every rank load the same tag: each reads its own ``latest``; ranks whose tags
differ are named with their tags, and nothing is loaded.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hf_zero import comm
from hf_zero.checkpoint.files import CheckpointError

__all__ = ["Placement", "place", "agree_on_tag", "describe_ranks"]

KEY = "checkpoint.use_node_local_storage"
log = logging.getLogger("hf_zero")


@dataclass(frozen=True)
class Placement:
    """Where one save goes, seen from this rank (identical facts on every rank)."""

    rank: int
    nodes: tuple[str, ...]             # node id of every rank
    writers: tuple[int, ...]           # writer rank of every rank's directory
    node_local: bool                   # checkpoint.use_node_local_storage was set

    @property
    def writer(self) -> int:
        return self.writers[self.rank]

    @property
    def is_writer(self) -> bool:
        return self.writer == self.rank

    @property
    def domain(self) -> list[int]:
        """The ranks whose files share this rank's directory."""
        return [r for r, w in enumerate(self.writers) if w == self.writer]

    @property
    def domain_writers(self) -> list[int]:
        return sorted(set(self.writers))


def describe_ranks(ranks: list[int], nodes: tuple[str, ...] | list[str]) -> str:
    """``ranks [2, 3] (node 'b#1')`` -- ranks grouped by node, for error messages."""
    by_node: dict[str, list[int]] = {}
    for r in ranks:
        by_node.setdefault(nodes[r], []).append(r)
    return ", ".join(f"rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]} (node {n!r})"
                     for n, rs in by_node.items())


def _first_rank_of_nodes(nodes: list[str]) -> list[int]:
    seen: dict[str, int] = {}
    for r, n in enumerate(nodes):
        seen.setdefault(n, r)
    return sorted(seen.values())


def place(rank: int, world: int, root: Path, node_local: bool, agree: Callable[[Any, str], list[Any]],
          barrier: Callable[[str], None], what: str, label: str) -> Placement:
    """Decide every rank's directory writer for a save into ``root`` (collective; see the module docstring).
    ``what`` names the save in errors, ``label`` in the collectives (the same on every rank: no path). Raises the
    same :class:`CheckpointError` on every rank when the directories are not as the config says."""
    gathered = agree((comm.get_node_id(), secrets.token_hex(8), os.path.abspath(root)),
                     f"the node exchange of {label}")
    nodes = tuple(n for n, _, _ in gathered)
    if world == 1:
        return Placement(rank, nodes, (0,), node_local)
    paths = [p for _, _, p in gathered]
    if len(set(nodes)) == 1 and len(set(paths)) > 1:
        return _per_rank_directories(rank, nodes, paths, node_local, what)
    nonce = gathered[0][1]
    candidates = _first_rank_of_nodes(list(nodes)) if node_local else [0]
    probe = root / f".probe-{nonce}-{rank}"
    error = None
    if rank in candidates:
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe.write_text(nodes[rank])
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    barrier(f"the directory probe of {label}")
    # a lookup by name (not a directory listing, which network file systems cache) of each candidate's probe
    seen = [w for w in candidates if (root / f".probe-{nonce}-{w}").is_file()]
    views = agree((error, seen), f"the directory check of {label}")
    if rank in candidates:
        probe.unlink(missing_ok=True)
    failed = [r for r, (err, _) in enumerate(views) if err is not None]
    if failed:
        raise CheckpointError(f"hf_zero: {what}: cannot write into {str(root)!r} on "
                              f"{describe_ranks(failed, nodes)}: {views[failed[0]][0]}")
    seen_by = [tuple(s) for _, s in views]
    if not node_local:
        blind = [r for r, s in enumerate(seen_by) if 0 not in s]
        if blind:
            raise CheckpointError(
                f"hf_zero: {what}: {describe_ranks(blind, nodes)} do not see the files rank 0 (node {nodes[0]!r}) "
                f"writes in {str(root)!r}: the directory is not shared between the nodes. Set "
                f'"checkpoint": {{"use_node_local_storage": true}} in the DeepSpeed config to write a copy on every '
                f"node (its first rank writes the model and engine files, every rank its own shards), or put the "
                f"checkpoints on a file system all nodes share. Nothing was written.")
        return Placement(rank, nodes, tuple(0 for _ in range(world)), node_local)
    first = {n: r for r, n in reversed(list(enumerate(nodes)))}
    lost = [r for r, s in enumerate(seen_by) if first[nodes[r]] not in s]
    if lost:
        r = lost[0]
        raise CheckpointError(
            f"hf_zero: {what} with {KEY}: {describe_ranks(lost, nodes)} do not see the file their node's first rank "
            f"(rank {first[nodes[r]]}) writes in {str(root)!r}: processes that report the same node (host name and "
            f"torchrun's GROUP_RANK) must see the same directory. Nothing was written.")
    writers = tuple(min(s) for s in seen_by)
    odd = [r for r in range(world) if seen_by[writers[r]] != seen_by[r]]
    if odd:
        raise CheckpointError(
            f"hf_zero: {what} with {KEY}: the nodes' directories overlap inconsistently: {describe_ranks(odd, nodes)} "
            f"see the files of ranks {list(seen_by[odd[0]])}, rank {writers[odd[0]]} sees those of "
            f"{list(seen_by[writers[odd[0]]])}. Nothing was written.")
    return Placement(rank, nodes, writers, node_local)


def _per_rank_directories(rank: int, nodes: tuple[str, ...], paths: list[str], node_local: bool,
                          what: str) -> Placement:
    """Ranks of one node passed different directories (a script that names its run directory per rank): as in
    DeepSpeed, each rank's files go where that rank was told. Each directory is finalized by its lowest rank and holds
    the model and engine files plus the shards of the ranks that named it, like a node's copy under
    use_node_local_storage: it loads back with the same per-rank directories; elsewhere a load names what is
    missing. Said once, by rank 0, since a shared directory is the usual intent."""
    writers = tuple(paths.index(p) for p in paths)
    if rank == 0:
        by_path: dict[str, list[int]] = {}
        for r, p in enumerate(paths):
            by_path.setdefault(p, []).append(r)
        listing = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {p!r}"
                            for p, rs in by_path.items())
        log.warning("hf_zero: %s: the ranks passed different directories (%s). Each directory gets the files of "
                    "the ranks that named it, as in DeepSpeed: a complete checkpoint needs all of them (load with "
                    "the same per-rank directories, or copy every zero_rank*.safetensors into one). Pass the same "
                    "directory on every rank for one complete checkpoint.", what, listing)
    return Placement(rank, nodes, writers, node_local)


def agree_on_tag(rank: int, world: int, root: Path, tag: str | None, read_latest: Callable[[Path], str | None],
                 agree: Callable[[Any, str], list[Any]]) -> str | None:
    """The tag every rank loads: ``tag`` if given, else this rank's ``latest``; all ranks' choices are compared
    (one all-gather, bounded by comms_timeout_s) and must be equal -- else a CheckpointError naming the ranks, their
    nodes and tags, raised on every rank before anything is read. None (on every rank): no ``latest`` anywhere."""
    error = None
    try:
        mine = str(tag) if tag is not None else read_latest(root)
    except OSError as exc:
        mine, error = None, f"{type(exc).__name__}: {exc}"
    choices = agree((comm.get_node_id(), mine, error), "the tag agreement of load_checkpoint")
    if world == 1 or len({(m, e) for _, m, e in choices}) == 1:
        if error is not None:
            raise CheckpointError(f"hf_zero: load_checkpoint: cannot read {str(root / 'latest')!r}: {error}")
        return mine
    nodes = tuple(n for n, _, _ in choices)
    groups: dict[tuple, list[int]] = {}
    for r, (_, m, e) in enumerate(choices):
        groups.setdefault((m, e), []).append(r)
    source = "the tag argument" if tag is not None else "their 'latest' file"
    parts = [f"{describe_ranks(rs, nodes)} " + (f"failed to read 'latest' ({e})" if e is not None else
                                                f"read {m!r}" if m is not None else "found no 'latest' file")
             for (m, e), rs in groups.items()]
    raise CheckpointError(
        f"hf_zero: load_checkpoint({str(root)!r}): the ranks would load different checkpoints (from {source}): "
        f"{'; '.join(parts)}. Nothing was loaded. Pass the same tag= on every rank, or make every node's "
        f"directory hold the same complete checkpoint and 'latest'.")
