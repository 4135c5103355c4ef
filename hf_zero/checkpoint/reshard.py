"""The one re-cut of saved shards: a checkpoint written on N data-parallel ranks, S pipeline stages and TP size T
is read by an engine with other numbers of each.

Two steps, each used by every front-end:

* :class:`ShardFiles` -- the data-parallel re-cut, inside the ordinary loader (engine.py): a component asks for
  the piece *its* :class:`~hf_zero.zero.layout.ShardLayout` gives *its* rank; when the checkpoint was written on
  another number of ranks, each parameter is reassembled from every saved rank's file
  (:func:`full_param_from_shards`) and cut again.
* :func:`write_recut` -- the stage and TP re-cut (tp.py, pipeline.py, pipeline_tp.py): exactly this rank's
  parameters (with TP, this TP rank's pieces of them), found by name in whichever saved stage held them and
  re-cut from the saved TP ranks' pieces, written as a one-rank checkpoint *with its manifest* into a directory
  of the caller's (a private temporary one: nothing is written into the checkpoint being read). The ordinary
  loader then loads it like any checkpoint -- verified against that manifest -- and re-cuts it for the current
  data-parallel group through :class:`ShardFiles`.

The saved parts it reads are verified against their own manifests as they are opened (disk_format.open_saved).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from hf_zero.checkpoint.disk_format import open_saved, rank_file
from hf_zero.checkpoint.files import CheckpointError, sha256_file, write_manifest
from hf_zero.tensor_parallel.reshard import full_from_pieces, piece_for, replicated_layout
from hf_zero.zero.layout import ShardLayout
from hf_zero.zero.saved_pieces import SavedPieces

__all__ = ["full_param_from_shards", "ShardFiles", "TPCut", "write_recut"]


def full_param_from_shards(files: list, key: str, layout: ShardLayout, index: int) -> torch.Tensor:
    """Reassemble parameter ``index``'s flat tensor from its shards in every saved rank's file."""
    lo, hi = layout.offsets[index], layout.offsets[index + 1]
    parts = [f.get_slice(key)[lo:hi] for f in files]
    return torch.cat(parts)[:layout.numels[index]]


class ShardFiles:
    """The :class:`~hf_zero.zero.checkpoint_state.ShardReader` over one validated checkpoint's rank files: the
    N->M re-cut lives here, so a component only ever sees its own rank's piece. ``handles``: every saved rank's
    file (a list), or -- a node-local directory loaded on the ranks that saved it -- ``{saved rank: file}`` of the
    ones this rank reads (validation made sure they are the ones it asks for)."""

    def __init__(self, handles: list | dict, pieces: SavedPieces | None = None):
        """``pieces``: which saved ranks' files hold each tensor's pieces (default: every file given, each the piece
        of its rank)."""
        self._handles = dict(enumerate(handles)) if isinstance(handles, list) else dict(handles)
        self._pieces = pieces if pieces is not None else SavedPieces(len(self._handles))
        first = next(iter(self._handles.values()), None)
        self._keys = set(first.keys()) if first is not None else set()
        for ranks in self._pieces.experts.values():  # an expert group's keys are in its pieces' files only
            if ranks and ranks[0] in self._handles:
                self._keys |= {k for k in self._handles[ranks[0]].keys()
                               if any(k.startswith(p) for p in self._pieces.experts)}

    def keys(self) -> set[str]:
        return self._keys

    def shard(self, key: str, layout: ShardLayout, rank: int) -> torch.Tensor:
        saved = self._pieces.layout(key, layout.numels)  # the groups were checked equal at validation
        if saved == layout:
            return self._handles[self._pieces.file_of(key, rank)].get_tensor(key)
        handles = [self._handles[r] for r in self._pieces.ranks(key)]
        out = torch.empty(layout.shard_numel, dtype=handles[0].get_slice(key)[0:0].dtype)
        for i in range(len(layout.numels)):
            full = full_param_from_shards(handles, key, saved, i)
            layout.shard_of(full, i, rank, out[layout.offsets[i]:layout.offsets[i + 1]])
        return out

    def whole(self, key: str) -> torch.Tensor:
        return next(iter(self._handles.values())).get_tensor(key)


@dataclass(frozen=True)
class TPCut:
    """How parameters are split over tensor-parallel ranks when saved and now. ``saved_layouts`` /
    ``current_layouts``: parameter name -> ``tensor_parallel.reshard.param_layout`` entry (full shape, split dim,
    fused q|k|v order); a parameter missing from ``current_layouts`` is whole here. ``info_file``: where the saved
    layouts were read (tp.json, pipeline.json), for errors."""

    saved_tp: int = 1
    tp: int = 1
    tp_rank: int = 0
    saved_layouts: dict = field(default_factory=dict)
    current_layouts: dict = field(default_factory=dict)
    info_file: Path | None = None

    @property
    def active(self) -> bool:
        """Whether any piece changes: TP on either side (both 1: the saved flat tensor is this rank's)."""
        return self.saved_tp > 1 or self.tp > 1

    def for_param(self, name: str, saved_name: str, local_numel: int, parts_root: Path
                  ) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        """The function turning a parameter's saved TP pieces (flat) into this rank's flat piece; the layouts are
        checked against each other here, before any tensor is read."""
        current = self.current_layouts.get(name)
        saved = self.saved_layouts.get(saved_name)
        if saved is None and self.saved_tp > 1:
            raise CheckpointError(f"hf_zero: checkpoint file {str(self.info_file)!r} has no layout for parameter "
                                  f"{saved_name!r} (saved at TP size {self.saved_tp})")
        saved = saved or replicated_layout(current["shape"])  # saved without TP: whole in the one piece
        current = current or replicated_layout(saved["shape"])  # loaded without TP: the whole tensor
        if list(saved["shape"]) != list(current["shape"]):
            raise CheckpointError(f"hf_zero: parameter {name!r} has shape {tuple(current['shape'])} in the model but "
                                  f"{tuple(saved['shape'])} in the checkpoint ({str(self.info_file)!r}, saved as "
                                  f"{saved_name!r})")
        full_numel = int(torch.Size(saved["shape"]).numel())

        def cut(pieces: list[torch.Tensor]) -> torch.Tensor:
            have = sum(p.numel() for p in pieces) if saved["dim"] is not None else pieces[0].numel()
            if have != full_numel:
                raise CheckpointError(f"hf_zero: parameter {saved_name!r}: the saved TP pieces under "
                                      f"{str(parts_root)!r} hold {have} elements, its shape "
                                      f"{tuple(saved['shape'])} needs {full_numel}")
            piece = piece_for(full_from_pieces(saved, pieces, self.saved_tp), current, self.tp, self.tp_rank)
            if piece.numel() != local_numel:
                raise CheckpointError(f"hf_zero: parameter {name!r}: this rank's piece has {piece.numel()} "
                                      f"elements, the engine holds {local_numel}")
            return piece

        return cut


def write_recut(out: Path, groups, parts: list[list[Path]], *, cut: TPCut, parts_root: Path,
                aliases: dict[str, tuple[str, ...]] | None = None) -> None:
    """Write under ``out`` a one-rank checkpoint (files and manifest) holding exactly ``groups``' parameters.

    ``groups``: the engine's optimizer groups (each with ``names`` and ``layout.numels``: this rank's flat numel
    of every parameter). ``parts``: per saved pipeline stage (one for a TP engine's checkpoint), the checkpoint
    directory of each saved TP rank, in TP-rank order; every parameter is looked up by name (or one of its
    ``aliases``, e.g. a tied head saved under the embedding's name) in the first stage that holds it. Every
    parameter is found and its layout checked before anything is written; errors name the parameter and file."""
    where: dict[str, tuple[int, int, int]] = {}  # parameter name -> (saved stage, group, index)
    sources = []  # per saved stage, per saved TP rank: (directory, meta, rank-file handles)
    for s, dirs in enumerate(parts):
        ranks = [(path, *open_saved(path)) for path in dirs]  # verified against each part's manifest
        sources.append(ranks)
        for gj, group in enumerate(ranks[0][1]["groups"]):
            for j, name in enumerate(group["names"]):
                where.setdefault(name, (s, gj, j))
    aliases = aliases or {}
    tensors: dict[str, torch.Tensor] = {}
    scalar_state, param_groups = [], []
    for gi, g in enumerate(groups):
        fulls: dict[str, list[torch.Tensor]] = {}
        state_src = (sources[0][0][1], gi)  # an empty group: the saved group of the same index
        for i, name in enumerate(g.names):
            saved_name = next((n for n in (name, *aliases.get(name, ())) if n in where), None)
            if saved_name is None:
                raise CheckpointError(f"hf_zero: parameter {name!r} is in no saved checkpoint part under "
                                      f"{str(parts_root)!r}")
            s, gj, j = where[saved_name]
            ranks = sources[s]
            cut_piece = cut.for_param(name, saved_name, int(g.layout.numels[i]), parts_root) if cut.active \
                else None
            metas = [m for _, m, _ in ranks]
            layouts = [ShardLayout(tuple(m["groups"][gj]["numels"]), m["shard_world_size"]) for m in metas]
            keys = [k.split(".", 1)[1] for k in ranks[0][2][0].keys() if k.startswith(f"group{gj}.")]
            for key in keys:
                pieces = [full_param_from_shards(h, f"group{gj}.{key}", layouts[r], j)
                          for r, (_, _, h) in enumerate(ranks)]
                fulls.setdefault(key, []).append(cut_piece(pieces) if cut_piece is not None else pieces[0])
            if i == 0:
                state_src = (metas[0], gj)
        for key, pieces in fulls.items():
            if len(pieces) == len(g.names):  # optimizer state exists for every parameter of the group
                tensors[f"group{gi}.{key}"] = torch.cat(pieces)
        meta, gj = state_src
        scalar_state.append(meta["optimizer_scalar_state"][gj])
        param_groups.append(meta["param_groups"][gj])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / rank_file(0)))
    first_dir, first_meta, _ = sources[0][0]
    (out / "meta.json").write_text(json.dumps({
        **first_meta, "world_size": 1, "shard_world_size": 1,
        "groups": [{"names": g.names, "numels": list(g.layout.numels)} for g in groups],
        "optimizer_scalar_state": scalar_state, "param_groups": param_groups}))
    shutil.copy(first_dir / "engine_state.pt", out / "engine_state.pt")
    # a temporary file: checksummed so that the load verifies it like any other, not fsynced (it never outlives
    # the process)
    write_manifest(out, {name: {"bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
                         for name in ("meta.json", "engine_state.pt", rank_file(0))})
