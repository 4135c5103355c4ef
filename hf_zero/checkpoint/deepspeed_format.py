"""Reading a checkpoint tag written by DeepSpeed itself: its weights, optimizer states and counters by parameter
name, whole, whatever ZeRO stage and world size wrote them.

A run that trained on DeepSpeed resumes on hf_zero from its last checkpoint (``engine.load_checkpoint`` on the
DeepSpeed directory: from_deepspeed.py), and its weights come out with ``zero_to_fp32`` as they would with
DeepSpeed's converter. What DeepSpeed writes (0.10-0.19; measured on 0.19.8's files at stages 0-3, fp32/bf16, 1 and
2 ranks):

    <tag>/mp_rank_00_model_states.pt        stages 0-2: the module's state dict (16-bit weights under bf16/fp16),
                                            ``param_shapes`` (per optimizer group: name -> shape, in flat order),
                                            frozen parameters, ``shared_params``, counters, the LR scheduler, and
                                            the client_state's keys at the top level; stage 0: ``optimizer`` too
    <tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   stage 3: the same, once per rank; parameters are (0,)
                                            placeholders, frozen parameters this rank's pieces
    <tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   stages 1-3 (and stage 0 under bf16 on some
                                            versions): rank r's flat fp32 partition and optimizer-state partition of
                                            every group

How the flat partitions are cut (the same protocol DeepSpeed's zero_to_fp32 follows):

* stages 1/2: per group, the ranks' partitions concatenated are the group's flat vector: each parameter's
  elements in ``param_shapes`` order, ``param_alignment_paddings[i]`` elements after parameter i, padding at the
  end (the last rank's fp32 partition is saved without it, its optimizer states with it);
* stage 3: per rank, every parameter's piece of ``ceil(numel / world_size)`` elements in ``param_shapes`` order
  (sub-groups concatenated); parameter i is the ranks' pieces concatenated, cut to its numel;
* stage 0: ``optimizer`` in the model file: torch's optimizer state dict (fp32; per parameter index) or, under
  bf16/fp16, flat fp32 groups (``fp32_groups_flat``) in the optimizer's parameter order; no names are saved, so the
  caller matches them to its own parameters by position.

The files are pickles that name three DeepSpeed classes (the loss scaler, ``ZeroStageEnum``, ``fragment_address``):
they are loaded with ``torch.load(weights_only=True)`` -- no pickled code runs -- with stand-ins for those three
registered under DeepSpeed's names. Pipeline, tensor-parallel and MoE-expert checkpoints are refused by name.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_zero.checkpoint.files import CheckpointError, torch_load

__all__ = ["ZeroStageEnum", "fragment_address", "DeepSpeedTag", "is_deepspeed_tag", "is_universal_tag", "read_deepspeed_tag",
           "DEEPSPEED_OWN_KEYS"]

MODEL_FILE = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_Z3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")

# the top-level keys of DeepSpeed's model-states file that are DeepSpeed's own; the rest are the client_state the
# script passed to save_checkpoint (DeepSpeed's load_checkpoint returns every key but a few of its own: so do we)
DEEPSPEED_OWN_KEYS = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
                      "random_ltd", "lr_scheduler", "optimizer")


class ZeroStageEnum(enum.IntEnum):
    """DeepSpeed's ``deepspeed.runtime.zero.config.ZeroStageEnum``: the ZeRO stage, as its checkpoints pickle it."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class _PickledLossScaler:
    """The attributes of DeepSpeed's pickled ``LossScaler`` / ``DynamicLossScaler`` (``cur_scale``, ``cur_iter``,
    ``last_overflow_iter``, ``scale_window``, ``cur_hysteresis``, ...): read, never run."""


@dataclass
class fragment_address:  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's ``deepspeed.utils.tensor_fragment.fragment_address`` (where a parameter's fragment sits in a rank's
    partition), which its ZeRO-1/2 optimizer files pickle."""

    numel: int = 0
    start: int = 0


# Scripts allow DeepSpeed's pickled classes with torch.serialization.add_safe_globals([ZeroStageEnum, ...]), which
# allows a class under its __module__.__qualname__: these carry DeepSpeed's names (and the deepspeed shim's modules
# of those names forward to them), so such a script admits exactly what DeepSpeed's files hold.
ZeroStageEnum.__module__ = "deepspeed.runtime.zero.config"
fragment_address.__module__ = "deepspeed.utils.tensor_fragment"


_SAFE_GLOBALS = [
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_PickledLossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_PickledLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (fragment_address, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def _load(path: Path) -> Any:
    """One DeepSpeed file, loaded like every checkpoint file (``files.torch_load``: weights_only, errors naming the
    file), with DeepSpeed's three classes allowed."""
    with torch.serialization.safe_globals(_SAFE_GLOBALS):
        return torch_load(path)


def is_deepspeed_tag(path: Path) -> bool:
    """Whether ``path`` is a tag directory DeepSpeed wrote (and hf_zero did not)."""
    path = Path(path)
    if not path.is_dir() or (path / "meta.json").is_file():
        return False
    return (path / MODEL_FILE).is_file() or any(_Z3_MODEL.match(p.name) for p in path.iterdir())


def is_universal_tag(path: Path) -> bool:
    """Whether ``path`` is a DeepSpeed *universal* checkpoint (``ds_to_universal``'s output: ``zero/<name>/*.pt``)."""
    return (Path(path) / "zero" / "optimizer_state.pt").is_file()


@dataclass
class DeepSpeedTag:
    """One DeepSpeed tag, read whole. Tensors are fp32 (the masters) unless noted.

    ``groups``: per optimizer group, in DeepSpeed's flat order, ``(name or None, shape)`` of each trainable
    parameter (stage 0 saves no names: None). ``fp32``/``states``: per group, per parameter, the fp32 weight and each
    per-element optimizer state (``{"exp_avg": ..., "exp_avg_sq": ...}``); ``states`` is empty when the optimizer
    never stepped. ``steps``: per group, the optimizer's step count (None if never stepped). ``module``: the saved
    state dict (buffers; stage 0-2 16-bit weights). ``frozen``: whole frozen parameters. ``shared``: tied name ->
    name it is tied to."""

    path: Path
    stage: int
    world_size: int
    groups: list[list[tuple[str | None, torch.Size]]]
    fp32: list[list[torch.Tensor]]
    states: list[list[dict[str, torch.Tensor]]]
    steps: list[int | None]
    param_groups: list[dict]
    module: dict[str, torch.Tensor]
    buffer_names: list[str]
    frozen: dict[str, torch.Tensor]
    shared: dict[str, str]
    loss_scaler: dict | None
    lr_scheduler: Any
    global_steps: int
    global_samples: int
    skipped_steps: int
    client_state: dict = field(default_factory=dict)
    ds_version: str = "?"

    def named_fp32(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's fp32 weight by name (stages 1-3; stage 0 names come from the caller)."""
        return {name: t for group, ts in zip(self.groups, self.fp32) for (name, _), t in zip(group, ts)
                if name is not None}


def read_deepspeed_tag(path: Path) -> DeepSpeedTag:
    """Read every file of DeepSpeed tag ``path`` and reassemble its parameters whole. Raises CheckpointError naming
    the file for anything it cannot read or that does not add up (sizes are checked, not assumed)."""
    path = Path(path)
    names = sorted(p.name for p in path.iterdir())
    _refuse_other_layouts(path, names)
    z3_models = sorted((int(m.group(1)), n) for n in names if (m := _Z3_MODEL.match(n)))
    optim = sorted((int(m.group(2)), n) for n in names if (m := _OPTIM.match(n)))
    model_file = path / (MODEL_FILE if (path / MODEL_FILE).is_file() else z3_models[0][1])
    model = _load(model_file)
    if not isinstance(model, dict) or "module" not in model:
        raise CheckpointError(f"hf_zero: {str(model_file)!r} is not a DeepSpeed model-states file (no 'module')")
    world = int(model.get("dp_world_size") or max(1, len(optim)))
    if optim and [r for r, _ in optim] != list(range(world)):
        raise CheckpointError(f"hf_zero: DeepSpeed checkpoint {str(path)!r} was saved on {world} data-parallel ranks "
                              f"but holds optimizer files of ranks {[r for r, _ in optim]}")
    shared = dict(model.get("shared_params") or {})
    tag = DeepSpeedTag(
        path=path, stage=0, world_size=world, groups=[], fp32=[], states=[], steps=[], param_groups=[],
        module=dict(model["module"]), buffer_names=list(model.get("buffer_names") or []), frozen={}, shared=shared,
        loss_scaler=None, lr_scheduler=model.get("lr_scheduler"), global_steps=int(model.get("global_steps", 0)),
        global_samples=int(model.get("global_samples", 0)), skipped_steps=int(model.get("skipped_steps", 0)),
        client_state={k: v for k, v in model.items() if k not in DEEPSPEED_OWN_KEYS},
        ds_version=str(model.get("ds_version", "?")))
    if is_universal_tag(path):
        _read_universal(tag, model, path)
        return tag
    if not optim:
        _read_stage0(tag, model, model_file)
        return tag
    optim_sds = [_load(path / n)["optimizer_state_dict"] for _, n in optim]
    first = optim_sds[0]
    tag.stage = int(first.get("zero_stage", 0))
    tag.loss_scaler = _scaler_dict(first.get("loss_scaler"))
    shapes = model.get("param_shapes")
    if not shapes:
        raise CheckpointError(f"hf_zero: {str(model_file)!r} has no param_shapes: it cannot be matched to its "
                              f"optimizer files")
    tag.groups = [[(n, torch.Size(s)) for n, s in g.items()] for g in shapes]
    if tag.stage == 3:
        _read_zero3(tag, optim_sds, [_load(path / n) for _, n in z3_models] if len(z3_models) > 1 else [model])
    elif tag.stage in (1, 2) or "single_partition_of_fp32_groups" in first:
        tag.stage = tag.stage or 1
        _read_zero12(tag, optim_sds, model)
    else:
        raise CheckpointError(f"hf_zero: DeepSpeed checkpoint {str(path)!r}: optimizer files of an unknown layout "
                              f"(zero_stage {first.get('zero_stage')!r}, keys {sorted(first)[:8]})")
    return tag


def _refuse_other_layouts(path: Path, names: list[str]) -> None:
    why = None
    if any(n.startswith("layer_") and n.endswith("-model_states.pt") for n in names):
        why = "a pipeline-parallel checkpoint (layer_*-model_states.pt)"
    elif any(re.match(r"^(zero_pp_rank_\d+_)?mp_rank_0*[1-9]\d*_", n) for n in names):
        why = "a tensor-parallel (mp_rank > 0) checkpoint"
    elif any(n.startswith("expert_") or n.startswith("layer_") and "expert" in n for n in names):
        why = "a MoE checkpoint with expert files"
    if why:
        raise CheckpointError(f"hf_zero: DeepSpeed checkpoint {str(path)!r} is {why}; hf_zero reads DeepSpeed's "
                              f"data-parallel ZeRO checkpoints (stages 0-3) only. Convert it with DeepSpeed's own "
                              f"tools (ds_to_universal, zero_to_fp32) where DeepSpeed is installed")


def _scaler_dict(scaler: Any) -> dict | None:
    if scaler is None:
        return None
    fields = scaler if isinstance(scaler, dict) else vars(scaler)  # (hf_zero's universal output writes a dict)
    return {k: v for k, v in fields.items() if isinstance(v, (int, float, bool))}


def _flat_states(state: dict, group_index: int) -> tuple[dict[str, torch.Tensor], int | None]:
    """Group ``group_index``'s per-element states (1-d tensors) and step from a torch optimizer state dict whose
    state is keyed by group (DeepSpeed's flat optimizers: one flat parameter per group)."""
    entry = state.get("state", {}).get(group_index, {})
    tensors = {k: v for k, v in entry.items() if torch.is_tensor(v) and v.dim() == 1}
    step = entry.get("step")
    return tensors, (int(step.item() if torch.is_tensor(step) else step) if step is not None else None)


def _split(flat: torch.Tensor, shapes: list[torch.Size], paddings: list[int], where: str) -> list[torch.Tensor]:
    """Parameters ``shapes`` laid end to end in ``flat`` with ``paddings[i]`` elements after parameter i."""
    out, offset = [], 0
    for shape, pad in zip(shapes, paddings):
        numel = math.prod(shape)
        if offset + numel > flat.numel():
            raise CheckpointError(f"hf_zero: {where}: the flat partitions hold {flat.numel()} elements; the "
                                  f"parameters need more ({offset + numel} by parameter {len(out)})")
        out.append(flat[offset:offset + numel].view(shape).clone())
        offset += numel + pad
    return out


def _read_zero12(tag: DeepSpeedTag, optim_sds: list[dict], model: dict) -> None:
    where = f"DeepSpeed checkpoint {str(tag.path)!r} (ZeRO stage {tag.stage}, {tag.world_size} ranks)"
    fp32_key = "single_partition_of_fp32_groups"
    for gi, group in enumerate(tag.groups):
        shapes = [s for _, s in group]
        paddings = list(optim_sds[0].get("param_alignment_paddings", [[0] * len(shapes)] * (gi + 1))[gi])
        if len(paddings) != len(shapes):
            raise CheckpointError(f"hf_zero: {where}: group {gi} has {len(shapes)} parameters and "
                                  f"{len(paddings)} alignment paddings")
        flat = torch.cat([sd[fp32_key][gi].float() for sd in optim_sds])
        tag.fp32.append(_split(flat, shapes, paddings, where))
        per_rank = [_flat_states(sd["base_optimizer_state"], gi) for sd in optim_sds]
        keys = sorted(per_rank[0][0])
        tag.states.append([dict(zip(keys, vals)) for vals in zip(*[
            _split(torch.cat([states[k].float() for states, _ in per_rank]), shapes, paddings, where)
            for k in keys])] if keys else [{} for _ in shapes])
        tag.steps.append(per_rank[0][1])
    tag.param_groups = _hyper(optim_sds[0]["base_optimizer_state"])
    tag.frozen = _frozen_whole(model.get("frozen_param_fragments") or {}, model.get("frozen_param_shapes") or {})


def _read_zero3(tag: DeepSpeedTag, optim_sds: list[dict], models: list[dict]) -> None:
    where = f"DeepSpeed checkpoint {str(tag.path)!r} (ZeRO stage 3, {tag.world_size} ranks)"
    world = tag.world_size
    flat_fp32 = [torch.cat([t.float() for t in sd["fp32_flat_groups"]]) for sd in optim_sds]
    # optimizer states: one flat entry per sub-group, concatenated in sub-group order like the fp32 groups
    inner = [sd["optimizer_state_dict"] for sd in optim_sds]
    n_sub = len(optim_sds[0]["fp32_flat_groups"])
    keys = sorted(_flat_states(inner[0], 0)[0])
    flat_states = {k: [torch.cat([_flat_states(o, s)[0][k].float() for s in range(n_sub)]) for o in inner]
                   for k in keys}
    offset = 0
    for group in tag.groups:
        fp32, states = [], []
        for name, shape in group:
            numel = math.prod(shape)
            piece = -(-numel // world)
            if offset + piece > flat_fp32[0].numel():
                raise CheckpointError(f"hf_zero: {where}: rank 0's fp32 partition holds {flat_fp32[0].numel()} "
                                      f"elements; parameter {name!r} needs elements up to {offset + piece}")

            def whole(parts: list[torch.Tensor]) -> torch.Tensor:
                return torch.cat([p[offset:offset + piece] for p in parts])[:numel].view(shape).clone()

            fp32.append(whole(flat_fp32))
            states.append({k: whole(v) for k, v in flat_states.items()})
            offset += piece
        tag.fp32.append(fp32)
        tag.states.append(states)
        tag.steps.append(_flat_states(inner[0], 0)[1])
    tag.param_groups = _hyper(inner[0])
    shapes = models[0].get("frozen_param_shapes") or {}
    frags = {name: torch.cat([m["frozen_param_fragments"][name].reshape(-1) for m in models])
             for name in shapes} if len(models) == world else {}
    if shapes and not frags:
        raise CheckpointError(f"hf_zero: {where}: frozen parameters {list(shapes)[:3]} need every rank's "
                              f"zero_pp_rank_<r>_mp_rank_00_model_states.pt")
    tag.frozen = _frozen_whole(frags, shapes)


def _frozen_whole(fragments: dict, shapes: dict) -> dict[str, torch.Tensor]:
    return {name: fragments[name].reshape(-1)[:math.prod(shape)].view(shape).clone()
            for name, shape in shapes.items() if name in fragments}


def _hyper(optimizer_state: dict) -> list[dict]:
    return [{k: v for k, v in pg.items() if k != "params"} for pg in optimizer_state.get("param_groups", [])]


def _read_universal(tag: DeepSpeedTag, model: dict, path: Path) -> None:
    """A universal checkpoint: every parameter whole in its own files (``zero/<name>/fp32.pt``, one per optimizer
    state, ``step.pt``), the optimizer's common state in ``zero/optimizer_state.pt``; names and groups from the
    model-states file's ``param_shapes``."""
    zero = path / "zero"
    common = _load(zero / "optimizer_state.pt")
    tag.stage = int(common.get("zero_stage", 0))
    tag.loss_scaler = _scaler_dict(common.get("loss_scaler"))
    inner = common.get("optimizer_state_dict")  # ZeRO-3's: the first rank's flat optimizer state (step, groups)
    tag.param_groups = _hyper(inner if inner is not None else common)
    shapes = model.get("param_shapes") or []
    tag.groups = [[(n, torch.Size(s)) for n, s in g.items()] for g in shapes]

    def whole(name: str, what: str, shape) -> torch.Tensor:
        value = _load(zero / name / f"{what}.pt")
        value = value["param"] if isinstance(value, dict) else value
        if value.numel() != math.prod(shape):  # (ZeRO-3's are saved flat)
            raise CheckpointError(f"hf_zero: universal checkpoint file {str(zero / name / (what + '.pt'))!r} holds "
                                  f"shape {tuple(value.shape)}, the parameter has {tuple(shape)} (a tensor-parallel "
                                  f"slice? hf_zero reads universal checkpoints of whole parameters)")
        return value.reshape(shape).float()

    for group in tag.groups:
        fp32, states, steps = [], [], []
        for name, shape in group:
            fp32.append(whole(name, "fp32", shape))
            keys = sorted(p.stem for p in (zero / name).glob("*.pt") if p.stem not in ("fp32", "step"))
            states.append({k: whole(name, k, shape) for k in keys})
            if (zero / name / "step.pt").is_file():
                step = _load(zero / name / "step.pt")
                steps.append(int(step.item() if torch.is_tensor(step) else step))
        tag.fp32.append(fp32)
        tag.states.append(states)
        if not steps and inner is not None:  # ZeRO-3 writes no step.pt: one step for all, in the common state
            steps.append(_flat_states(inner, 0)[1])
        tag.steps.append(max(steps) if steps and steps[0] is not None else None)
    frozen = model.get("frozen_param_shapes") or {}
    tag.frozen = {name: whole(name, "fp32", shape).to(tag.module[name].dtype if name in tag.module else
                                                      torch.float32)
                  for name, shape in frozen.items() if (zero / name / "fp32.pt").is_file()}
    models = sorted(path.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"),
                    key=lambda p: int(_Z3_MODEL.match(p.name).group(1)))
    if len(tag.frozen) < len(frozen) and models:  # ZeRO-3: frozen pieces stay in the per-rank model files
        pieces = [_load(p) for p in models]
        tag.frozen.update(_frozen_whole({n: torch.cat([m["frozen_param_fragments"][n].reshape(-1) for m in pieces])
                                         for n in frozen if n not in tag.frozen}, frozen))


def _read_stage0(tag: DeepSpeedTag, model: dict, model_file: Path) -> None:
    """No ZeRO: the optimizer's state dict sits in the model file; its parameters have no names (positions)."""
    opt = model.get("optimizer")
    if opt is None:
        return  # saved without optimizer state (or no optimizer): weights only, from ``module``
    if "fp32_groups_flat" in opt:  # bf16/fp16 optimizer: one flat fp32 vector per group
        inner = opt.get("optimizer_state_dict", {})
        tag.param_groups = _hyper(inner)
        for gi, flat in enumerate(opt["fp32_groups_flat"]):
            states, step = _flat_states(inner, gi)
            tag.groups.append([(None, torch.Size([flat.numel()]))])  # split by the caller, who knows the shapes
            tag.fp32.append([flat.float().clone()])
            tag.states.append([{k: v.float().clone() for k, v in states.items()}])
            tag.steps.append(step)
        # FP16_Optimizer keeps its scaler's fields at the top level (cur_scale, cur_iter, ...); BF16's has none
        tag.loss_scaler = (_scaler_dict(opt["loss_scaler"]) if opt.get("loss_scaler") is not None else
                           {k: v for k, v in opt.items() if k.startswith(("cur_", "last_overflow", "scale_"))
                            and isinstance(v, (int, float, bool))} or None)
        return
    if "state" in opt and "param_groups" in opt:  # a torch optimizer over the parameters themselves
        tag.param_groups = _hyper(opt)
        for pg in opt["param_groups"]:
            entries = [opt["state"].get(i, {}) for i in pg["params"]]
            tag.groups.append([(None, None) for _ in entries])
            tag.fp32.append([None for _ in entries])  # the weights are the module's (fp32 training)
            tag.states.append([{k: v.float().clone() for k, v in e.items() if torch.is_tensor(v) and v.dim() > 0}
                               for e in entries])
            # the largest: DeepSpeed's FusedAdam on CPU counts in one entry and leaves the others at 0
            steps = [int(e["step"].item() if torch.is_tensor(e["step"]) else e["step"]) for e in entries if "step" in e]
            tag.steps.append(max(steps) if steps else None)
        return
    raise CheckpointError(f"hf_zero: {str(model_file)!r}: its 'optimizer' entry has an unknown layout "
                          f"(keys {sorted(opt)[:8]})")
