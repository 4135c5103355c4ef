"""Where a checkpoint's optimizer-group shards are: the names of their tensors and the saved ranks whose
``zero_rank*`` files hold their pieces -- the one statement of it, for the optimizer that writes them and for the
checkpoint loader, its validation and the offline converter (hf_zero/checkpoint/) that read them.

An ordinary group ``i``'s tensors are ``group<i>.<name>``, cut over the saved data-parallel world (piece ``r`` in
rank ``r``'s file). An expert-parallel group's are ``group<i>.ep<e>.<name>`` per EP rank ``e`` (ranks of different
EP ranks hold different experts under the same parameter names), cut over its expert-data-parallel group: meta.json
names the ranks whose files hold the pieces, in piece order (``groups[i]["expert"]["piece_ranks"][e]``; at stage 0
one piece, written by the EDP group's first rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_zero.zero.layout import ShardLayout

__all__ = ["group_prefix", "parse_group_prefix", "SavedPieces"]


def group_prefix(gi: int, ep_rank: int | None = None) -> str:
    """The name prefix of optimizer group ``gi``'s tensors: ``group<i>.``; an expert-parallel group's, of EP rank
    ``ep_rank``: ``group<i>.ep<e>.``."""
    return f"group{gi}." if ep_rank is None else f"group{gi}.ep{ep_rank}."


def parse_group_prefix(prefix: str) -> tuple[int, int | None] | None:
    """``(group index, EP rank or None)`` of a prefix :func:`group_prefix` names; None for any other string."""
    head, _, rest = prefix.partition(".")
    ep = rest[:-1] if rest.endswith(".") else None
    try:
        parsed = (int(head[len("group"):]), int(ep[len("ep"):]) if ep else None)
    except ValueError:
        return None
    return parsed if group_prefix(*parsed) == prefix else None


@dataclass(frozen=True)
class SavedPieces:
    """The saved ranks holding each group's pieces. ``world``: the saved data-parallel world an ordinary group is
    cut over; ``experts``: ``{group_prefix(i, e): saved ranks, in piece order}`` of every expert-parallel group."""

    world: int
    experts: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, meta: dict) -> SavedPieces:
        """From a checkpoint's meta.json (the optimizer's ``scalar_state()``)."""
        return cls(int(meta.get("shard_world_size", 0)),
                   {group_prefix(gi, e): tuple(int(r) for r in ranks)
                    for gi, group in enumerate(meta.get("groups", ()))
                    for e, ranks in enumerate(group.get("expert", {}).get("piece_ranks", ()))})

    def prefix(self, gi: int, ep_rank: int) -> str:
        """Group ``gi``'s prefix as saved for EP rank ``ep_rank``: its expert one if the group was saved
        expert-parallel, else the ordinary one."""
        prefix = group_prefix(gi, ep_rank)
        return prefix if prefix in self.experts else group_prefix(gi)

    def missing(self, prefix: str) -> bool:
        """Whether ``prefix`` names an expert-parallel group's pieces that the checkpoint does not hold."""
        parsed = parse_group_prefix(prefix)
        return parsed is not None and parsed[1] is not None and prefix not in self.experts

    def ranks(self, key: str) -> tuple[int, ...]:
        """The saved ranks whose files hold the pieces of tensor ``key`` (or of every tensor under a prefix), in
        piece order."""
        ranks = self._expert_ranks(key)
        return tuple(range(self.world)) if ranks is None else ranks

    def file_of(self, key: str, piece: int) -> int:
        """The saved rank whose file holds piece ``piece`` of ``key`` (an ordinary group's: rank ``piece``)."""
        ranks = self._expert_ranks(key)
        return piece if ranks is None else ranks[piece]

    def layout(self, key: str, numels) -> ShardLayout:
        """How ``key``'s group (of parameters of ``numels`` elements) was cut at save."""
        return ShardLayout(tuple(numels), len(self.ranks(key)))

    def _expert_ranks(self, key: str) -> tuple[int, ...] | None:
        return next((r for p, r in self.experts.items() if key.startswith(p)), None)

    def all_ranks(self) -> list[int]:
        """Every saved rank whose file holds pieces, sorted."""
        return sorted(set(range(self.world)).union(*self.experts.values()))
