"""DeepSpeed's ``PipelineModule``: a model given as a list of layers, cut into pipeline stages.

    net = PipelineModule(layers=[LayerSpec(Embed, ...), *[LayerSpec(Block, ...) for _ in range(8)],
                                 TiedLayerSpec("embed", Embed, ..., forward_fn=lm_head)],
                         num_stages=2, loss_fn=nn.CrossEntropyLoss(), partition_method="parameters")

Each rank builds only the layers of its own stage(s) (``LayerSpec`` is a deferred constructor; modules and plain
callables given directly are used as they are). The layer boundaries are computed the same on every rank, from
the layers' classes and, for ``partition_method="parameters"``, their parameter counts (each LayerSpec built once
on the CPU and dropped, as in DeepSpeed). Between layers one value
flows: a tensor or a tuple of tensors.

Tied layers (``TiedLayerSpec`` with the same ``key``) share one module per stage; the copies on different stages
start from the lowest stage's weights, and the pipeline engine sums their gradients before every step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from hf_zero import comm
from hf_zero.pipeline.partition import partition_by_method
from hf_zero.pipeline.topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "PipelineError", "TiedGroup"]


class PipelineError(RuntimeError):
    """A call that a pipeline engine does not offer (forward/backward/step: use train_batch)."""


class LayerSpec:
    """``typename(*module_args, **module_kwargs)``, built only on the stage that owns the layer."""

    def __init__(self, typename: type, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec: typename must be an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer sharing its module (and so its weights) with every other ``TiedLayerSpec`` of the same ``key``.

    ``forward_fn(module, x)`` replaces ``module(x)`` for this use (e.g. an embedding reused as the output head).
    ``tied_weight_attr``: the attribute(s) of the module that are tied across stages.
    """

    def __init__(self, key: str, typename: type, *module_args, forward_fn: Callable | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = str(key)
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


@dataclass
class TiedGroup:
    """One tie key as seen from this rank: its module's tied parameters here, the stages holding a copy, and the
    process group of this replica's copies (None when one stage holds them all)."""

    key: str
    params: list[nn.Parameter]
    owner_stages: list[int]
    group: Any

    def counted_here(self, stage_id: int) -> bool:
        """The gradient norm counts a tied weight once: on its lowest stage."""
        return stage_id == self.owner_stages[0]


def _count_trainable(layer: Any) -> int:
    """Trainable parameters of one layer, for ``partition_method="parameters"``. A LayerSpec is built on the CPU and
    dropped, as DeepSpeed does: building on the meta device would be cheaper, but a constructor that loads or caches
    weights (a class-level cache, a file read) would keep meta tensors for the real build. The random-number state
    is restored afterwards, so counting does not change the weights the real build draws."""
    if isinstance(layer, LayerSpec):
        with torch.random.fork_rng(devices=[]):
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _class_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__ if isinstance(layer, nn.Module) else getattr(layer, "__name__", type(layer).__name__)


def _reseed_in_use(seed: int) -> None:
    """``torch.manual_seed(seed)`` for the generators a forward can draw from: the CPU's, and CUDA's once CUDA is
    initialized (an uninitialized CUDA has drawn nothing; its lazy seeding is what makes torch.manual_seed slow)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule`` (see the module docstring). hf_zero additions: ``virtual_stages`` (chunks per
    rank, for interleaved schedules); activation checkpointing is always torch's non-reentrant checkpoint unless
    ``activation_checkpoint_func`` is given."""

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers: Sequence[str] | None = None,
                 dynamic_shape: bool = False, virtual_stages: int = 1):
        super().__init__()
        if num_stages is None and topology is None:
            raise ValueError("PipelineModule: give num_stages or topology")
        comm.init_distributed()
        world = dist.get_world_size()
        if topology is None:
            if world % int(num_stages) != 0:
                raise ValueError(f"PipelineModule: num_stages={num_stages} does not divide the world size {world}")
            topology = PipeDataParallelTopology(num_pp=int(num_stages), num_dp=world // int(num_stages))
        elif num_stages is not None and topology.get_dim("pipe") != int(num_stages):
            raise ValueError(f"PipelineModule: num_stages={num_stages} but the topology has "
                             f"{topology.get_dim('pipe')} pipe stages")
        if int(virtual_stages) < 1:
            raise ValueError(f"PipelineModule: virtual_stages must be >= 1, got {virtual_stages}")
        self._topo = topology
        self._grid = PipelineParallelGrid(topology)
        self.num_stages = self._grid.pipe_parallel_size
        self.stage_id = self._grid.stage_id
        self.virtual_stages = int(virtual_stages)
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn or torch.manual_seed
        # forward re-seeds every layer of every micro-batch: torch.manual_seed costs ~1 ms there (it records a
        # traceback to seed CUDA lazily), on the pipeline's critical path; the default re-seeds what is in use
        self._forward_seed_fn = seed_fn or _reseed_in_use
        self.micro_offset = 0
        self.base_seed = int(base_seed)
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = list(checkpointable_layers) if checkpointable_layers is not None else None
        self.dynamic_shape = bool(dynamic_shape)
        self.partition_method = partition_method
        self._layer_specs = list(layers)
        for i, layer in enumerate(self._layer_specs):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(f"PipelineModule: layer {i} is {type(layer).__name__}; layers must be LayerSpec, "
                                f"TiedLayerSpec, nn.Module or callables")
        num_parts = self.num_stages * self.virtual_stages
        self.parts = partition_by_method(
            partition_method, num_parts, num_layers=len(self._layer_specs),
            # counted only where the method uses them (each LayerSpec is built once for it)
            param_counts=([_count_trainable(layer) for layer in self._layer_specs]
                          if str(partition_method).lower() == "parameters" else []),
            class_names=[_class_name(layer) for layer in self._layer_specs])
        # chunk c of the whole pipeline runs on rank c % num_stages ("loop" placement, torch's interleaved order)
        self.local_chunks = [self.stage_id + k * self.num_stages for k in range(self.virtual_stages)]
        self.tied_modules = nn.ModuleDict()
        self.forward_funcs: dict[int, Callable] = {}
        self._build()
        self.tied_groups = self._tie_groups()

    # ---- construction -------------------------------------------------------------------------------------------
    def _build(self) -> None:
        for chunk in self.local_chunks:
            for idx in range(self.parts[chunk], self.parts[chunk + 1]):
                layer = self._layer_specs[idx]
                if self.seed_layers:
                    self.seed_fn(self.base_seed + idx)
                if isinstance(layer, TiedLayerSpec):
                    if layer.key not in self.tied_modules:
                        self.tied_modules[layer.key] = layer.build()
                    module = self.tied_modules[layer.key]
                    if layer.forward_fn is None:
                        self.forward_funcs[idx] = module
                    else:
                        use = _TiedUse(module, layer.forward_fn)
                        self.add_module(f"tied_use_{idx}", use)
                        self.forward_funcs[idx] = use
                elif isinstance(layer, LayerSpec):
                    module = layer.build()
                    self.add_module(str(idx), module)
                    self.forward_funcs[idx] = module
                elif isinstance(layer, nn.Module):
                    self.add_module(str(idx), layer)
                    self.forward_funcs[idx] = layer
                else:
                    self.forward_funcs[idx] = layer

    def _stage_of_layer(self, idx: int) -> int:
        for chunk in range(len(self.parts) - 1):
            if self.parts[chunk] <= idx < self.parts[chunk + 1]:
                return chunk % self.num_stages
        raise IndexError(idx)

    def _tie_groups(self) -> list[TiedGroup]:
        """Groups of the copies of each tied key (created on every rank in the same order), weights synced."""
        keys: dict[str, TiedLayerSpec] = {}
        for layer in self._layer_specs:
            if isinstance(layer, TiedLayerSpec):
                keys.setdefault(layer.key, layer)
        out = []
        for key, spec in sorted(keys.items()):
            owners = sorted({self._stage_of_layer(i) for i, layer in enumerate(self._layer_specs)
                             if isinstance(layer, TiedLayerSpec) and layer.key == key})
            mine = self._grid.stage_copies_group(owners) if len(owners) > 1 else None
            if key not in self.tied_modules:
                continue
            module = self.tied_modules[key]
            params = [getattr(module, attr) for attr in spec.tied_weight_attr]
            if mine is not None:
                with torch.no_grad():  # every copy starts from the lowest stage's weights
                    for p in params:
                        dist.broadcast(p.data, src=mine[0][0], group=mine[1])
            out.append(TiedGroup(key, params, owners, mine[1] if mine is not None else None))
        return out

    # ---- the stage's computation --------------------------------------------------------------------------------
    def chunk_modules(self) -> list[tuple[int, nn.Module]]:
        """(pipeline stage index, module) for each chunk this rank runs; the module is ``self`` with one chunk."""
        if self.virtual_stages == 1:
            return [(self.local_chunks[0], self)]
        return [(chunk, _Chunk(self, chunk)) for chunk in self.local_chunks]

    def forward(self, *inputs):
        return self.run_chunk(self.local_chunks[0], inputs)

    def run_chunk(self, chunk: int, inputs: tuple) -> Any:
        inputs = tuple(_unleafed(t) for t in inputs)
        x = inputs[0] if len(inputs) == 1 else tuple(inputs)
        lo, hi = self.parts[chunk], self.parts[chunk + 1]
        k = self.activation_checkpoint_interval
        offset = 0
        if self.seed_layers and self.training:
            # DeepSpeed's: every forward (micro-batch) draws from new seeds; fixed here so that a checkpointed
            # range recomputed later re-seeds as its forward did
            self.micro_offset += 1
            offset = self.micro_offset
        if k <= 0 or not torch.is_grad_enabled():
            return self._run_layers(lo, hi, x, offset)
        for start in range(lo, hi, k):
            end = min(start + k, hi)
            if not self._checkpointable(start, end):
                x = self._run_layers(start, end, x, offset)
                continue
            run = functools.partial(self._run_layers_flat, start, end, offset)
            args = x if isinstance(x, tuple) else (x,)
            fn = self.activation_checkpoint_func
            if fn is not None:
                # DeepSpeed's reentrant checkpoint (its PipelineModule default) runs as its non-reentrant twin here:
                # same recomputation, same options, same gradients; torch's pipeline stages differentiate with
                # torch.autograd.grad (shape inference, zero-bubble schedules), which a reentrant region refuses
                fn = getattr(fn, "in_pipeline_stage", fn)
                if not getattr(fn, "keeps_graph", False):
                    args = _attached(args)
                x = fn(run, *args)
            else:
                x = _torch_checkpoint(run, *args, use_reentrant=False)
        return x

    def _run_layers_flat(self, start: int, end: int, offset: int, *args):
        return self._run_layers(start, end, args[0] if len(args) == 1 else tuple(args), offset)

    def _run_layers(self, start: int, end: int, x: Any, offset: int = 0) -> Any:
        for idx in range(start, end):
            if self.seed_layers and self.training:
                self._forward_seed_fn(self.base_seed * (offset + 1) + idx)
            x = self.forward_funcs[idx](x)
        return x

    def set_checkpoint_interval(self, interval: int) -> None:
        """DeepSpeed's setter: checkpoint every ``interval`` layers from the next forward on (0: off)."""
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"set_checkpoint_interval({interval!r}): the interval must be an integer >= 0")
        self.activation_checkpoint_interval = interval

    def _checkpointable(self, start: int, end: int) -> bool:
        funcs = [self.forward_funcs[i] for i in range(start, end)]
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    # ---- what the engine feeds the schedule ---------------------------------------------------------------------
    data_on_every_stage = False  # DeepSpeed's contract: the first stage reads inputs, the last stage labels

    def pipeline_batch(self, micro_batches: list, *, first: bool, last: bool, num_microbatches: int, dp_group,
                       dp_size: int):
        """``(args, kwargs, target, loss_fn)`` for one step from ``(inputs, labels)`` micro-batches. The loss of
        a micro-batch is ``loss_fn(outputs, labels) / num_microbatches`` (the outputs themselves without a
        loss_fn), DeepSpeed's scaling: averaged over the data-parallel replicas, the mean over the global batch."""
        args, target = (), None
        if micro_batches:
            for i, mb in enumerate(micro_batches):
                if not (isinstance(mb, (tuple, list)) and len(mb) == 2):
                    raise PipelineError(f"micro-batch {i} is a {type(mb).__name__}; a PipelineModule takes "
                                        f"(inputs, labels) pairs from its data iterator")
            if first:
                inputs = [mb[0] for mb in micro_batches]
                args = tuple(_cat(inputs)) if isinstance(inputs[0], (tuple, list)) else (_cat(inputs),)
            if last:
                labels = [mb[1] for mb in micro_batches]
                if isinstance(labels[0], (tuple, list)):
                    raise PipelineError("labels must be one tensor per micro-batch (a tuple was given)")
                target = _cat(labels) if labels[0] is not None else None
        fn = self.loss_fn

        def loss(output, label):
            value = output if fn is None else fn(output, label)
            return value / num_microbatches

        return args, {}, target, loss

    # ---- DeepSpeed's queries ------------------------------------------------------------------------------------
    def topology(self) -> ProcessTopology:
        return self._topo

    @property
    def grid(self) -> PipelineParallelGrid:
        return self._grid

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def stage_owner(self, layer_idx: int) -> int:
        return self._stage_of_layer(layer_idx)

    def local_layer_indices(self) -> list[int]:
        return [i for c in self.local_chunks for i in range(self.parts[c], self.parts[c + 1])]

    # ---- per-layer state (checkpoints that reload on another number of stages) ----------------------------------
    def layer_state_dicts(self) -> dict[int, dict[str, torch.Tensor]]:
        """Layer index -> that layer's state dict, for the layers built here. A tied module is stored with the
        first layer of its key (on the stage owning that layer)."""
        out = {}
        first_of_key: dict[str, int] = {}
        for i, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                first_of_key.setdefault(layer.key, i)
        for idx in self.local_layer_indices():
            layer = self._layer_specs[idx]
            if isinstance(layer, TiedLayerSpec):
                if first_of_key[layer.key] == idx:
                    out[idx] = self.tied_modules[layer.key].state_dict()
            elif str(idx) in self._modules:
                out[idx] = self._modules[str(idx)].state_dict()
        return out

    def load_layer_state_dicts(self, states: Callable[[int], dict[str, torch.Tensor] | None]) -> None:
        """Load each local layer from ``states(layer_idx)`` (tied modules from their key's first layer)."""
        first_of_key: dict[str, int] = {}
        for i, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                first_of_key.setdefault(layer.key, i)
        loaded_keys = set()
        for idx in self.local_layer_indices():
            layer = self._layer_specs[idx]
            if isinstance(layer, TiedLayerSpec):
                if layer.key in loaded_keys:
                    continue
                sd = states(first_of_key[layer.key])
                self.tied_modules[layer.key].load_state_dict(sd)
                loaded_keys.add(layer.key)
            elif str(idx) in self._modules:
                self._modules[str(idx)].load_state_dict(states(idx))


def _cat(values: list) -> Any:
    """The micro-batches' inputs or labels as one batch. Labels that are not tensors (DeepSpeed's tests feed a
    dummy ``0``) pass through unchanged from a single micro-batch, and become one tensor from several numbers."""
    if isinstance(values[0], (tuple, list)):
        return [_cat([v[i] for v in values]) for i in range(len(values[0]))]
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.cat(values)
    if len(values) == 1:
        return values[0]
    if all(isinstance(v, (bool, int, float)) for v in values):
        return torch.tensor(values)
    raise PipelineError(f"micro-batch values of types {sorted({type(v).__name__ for v in values})} cannot be "
                        f"joined into one batch; give tensors (or numbers) in the (inputs, labels) pairs")


def _attached(args: tuple) -> tuple:
    """A reentrant checkpoint function (DeepSpeed's ``checkpointing.checkpoint``, the PipelineModule default there)
    only connects its region to autograd through an input that requires grad; on the first stage none does (the
    data), and the region's parameters would silently get no gradient. As DeepSpeed does there, the floating-point
    inputs are made to require grad (their gradient is computed and dropped). Called in grad mode only."""
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return args
    return tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


def _unleafed(t: Any) -> Any:
    """A received activation is the autograd leaf whose ``.grad`` goes back to the previous stage, so a first layer
    that works in place (``nn.ReLU(inplace=True)`` after the stage boundary) would be refused by autograd on it.
    The layers run on a clone instead, DeepSpeed's ``_exec_forward_pass`` (``pipe_buffers['inputs'][id].clone()``);
    the gradient reaches the leaf through the clone. Data on the first stage needs no grad and is passed as is."""
    if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad:
        return t.clone()
    return t


class _TiedUse(nn.Module):
    """A tied module used through ``forward_fn`` (e.g. an embedding as the output head). A module of its own in the
    tree, with the tied weights registered as its external parameters, so ZeRO-3 gathers them around this use as
    it does around the module's own forward."""

    def __init__(self, module: nn.Module, fn: Callable):
        super().__init__()
        object.__setattr__(self, "tied", module)  # not a child: the weights are named under tied_modules
        self.fn = fn
        from hf_zero.zero.gathered import register_external_parameter

        for p in module.parameters():
            register_external_parameter(self, p)

    def forward(self, x):
        return self.fn(self.tied, x)


class _Chunk(nn.Module):
    """One of a rank's virtual stages: runs layers [parts[c], parts[c+1]) of the parent (shares its modules)."""

    def __init__(self, parent: PipelineModule, chunk: int):
        super().__init__()
        object.__setattr__(self, "_parent", parent)  # not a child: parameters are named and owned by the parent
        self.chunk = chunk
        for idx in range(parent.parts[chunk], parent.parts[chunk + 1]):
            f = parent.forward_funcs[idx]
            module = f.tied if isinstance(f, _TiedUse) else f
            if isinstance(module, nn.Module):
                self.add_module(str(idx), module)  # so PipelineStage.submod.parameters() sees this chunk's weights

    def forward(self, *inputs):
        return self._parent.run_chunk(self.chunk, inputs)
