"""Per-rank memory of a training run before it runs: ``estimate_memory(model_or_config, ds_config, ...)``.

Model states follow the engine's own data structures, byte for byte (``tests/test_profiling_memory.py`` compares
them with a real engine's tensors, so a change to either breaks that test instead of the estimate):

stages 0-2 (``ShardedGroup``; stage 0 shards over a world of one)::

    parameters   every parameter, full, compute dtype. At a sharding world of one the trainable ones are views of
                 the group's 16-bit shard (fp32: of the master itself), so they are not counted twice
    master       fp32, one shard: sum over trainable parameters of ceil(numel / world); bf16 with
                 ``bf16.bf16_master_weights_and_grads`` (then, like an fp32 master, it *is* the 16-bit shard)
    param16      compute-dtype copy of the shard (none for fp32, none at a world of one: it *is* the parameters)
    gradients    transients: the shard from the first reducing backward of an accumulation window to the step
                 (every micro-step at stage 2, the boundary at stages 0/1), and at stages 0/1 the full
                 ``param.grad`` between micro-steps
    optimizer    Adam/AdamW 8 B per shard element (exp_avg, exp_avg_sq; 4 B with ``bf16_optimizer_states``), SGD
                 with momentum 4 B, else 0

stage 3 (``Stage3Group``): master, param16 (= master for fp32) and the gradient shard per trainable parameter; the
partitioned parameters are views of param16; frozen parameters keep their own shard; parameters of at most
``stage3_param_persistence_threshold`` elements are also kept whole on every rank.

``offload_optimizer`` moves master and moments to the host (``cpu``) or to NVMe files with two sets of host tile
buffers (``nvme``); on a CPU-only machine host and accelerator are the same memory, and the engine then keeps
the master where it is (no copy).

Transients on top of the states, per phase (:func:`_transients`): ``backward_start`` (activations and backward
temporaries at their peak, traced under ``FakeTensorMode`` -- see :mod:`hf_zero.profiling.activations` -- with what
stage 3 keeps gathered from forward), ``gradient_reduction`` (stages 0-2: the end of backward, full gradients and
the reducer's bucket; stage 3: the worst bucket flush of the reducer replayed along backward, see
:func:`_stage3_reduction`) and ``step`` (the boundary gradient shard, the stage-1/2 publish all-gather). Peak =
states + the largest phase, per device.
Buckets and the ZeRO-3 prefetch are those the engine allocates: at most the configured size and
:data:`hf_zero.comm.buckets.BUCKET_CAP_BYTES` (one parameter larger than that gets a bucket of its own).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from hf_zero.config.boolean import truthy
from hf_zero.config.policies import NO_PERSISTENCE_CAP, persistent_parameters
from hf_zero.config.schema import primary_keys
from hf_zero.config.sections import ZeroConfig
from hf_zero.profiling.activations import ActivationProfile

__all__ = ["Component", "MemoryEstimate", "ParamLayout", "estimate_memory", "model_state_bytes", "build_meta_model",
           "with_lora",
           "param_layout"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEVICES = ("accelerator", "host", "nvme")
PHASES = ("states", "backward_start", "gradient_reduction", "step")
_FP32 = 4
# What a CPU training process grows by besides the tensors counted here (autograd graph and engine threads, module
# hooks, gloo buffers, code pages first touched, allocator metadata and retained small blocks), measured as a rank's
# RSS between two steps minus the bytes of every tensor it holds then (gc-visible storages; the model states above,
# byte for byte): 35.2-37.1 MiB for the 7.4M Llama of benchmarks/bench_estimate.py (stages 0, 1, 2, 3; 1 and 2
# ranks), 40.5 MiB for the 33.7M one (stage 3, 2 ranks); forked ranks, MALLOC_MMAP_THRESHOLD_=131072. (It was 25 MiB
# when it was fitted to the peaks, with the transients of the time.) On a GPU the allocator's peak has no such term.
CPU_RUNTIME_BYTES = 37 * 2**20


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Component:
    name: str
    device: str        # accelerator | host | nvme
    nbytes: int
    phase: str         # states (always resident) | backward_start | gradient_reduction | step (transients)
    note: str = ""


@dataclass(frozen=True)
class ParamLayout:
    """What the estimate needs to know about the parameters: numels in order, trainable flags, module groups."""

    numels: tuple[int, ...]
    trainable: tuple[bool, ...]
    largest_module_numel: int      # parameters a module owns directly (one ZeRO-3 gather)
    embedding_numel: int = 0

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def trainable_total(self) -> int:
        return sum(n for n, t in zip(self.numels, self.trainable) if t)


def param_layout(model: nn.Module, trainable=None) -> ParamLayout:
    """The layout of ``model``'s parameters (true sizes under ZeRO-3). ``trainable(name) -> bool`` overrides
    ``requires_grad`` (e.g. LoRA: only adapter weights train)."""
    from hf_zero.profiling.params import true_numel

    numels, flags, seen = [], [], set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        numels.append(true_numel(p))
        flags.append(bool(trainable(name)) if trainable is not None else p.requires_grad)
    largest = max((sum(true_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    emb = sum(true_numel(m.weight) for m in model.modules() if isinstance(m, nn.Embedding))
    return ParamLayout(tuple(numels), tuple(flags), largest, emb)


@dataclass
class MemoryEstimate:
    """Components per rank, each tagged with a device and a phase; peaks derived from them."""

    components: list[Component] = field(default_factory=list)
    inputs: dict[str, Any] = field(default_factory=dict)

    def total(self, device: str, phase: str | None = None) -> int:
        return sum(c.nbytes for c in self.components if c.device == device and (phase is None or c.phase == phase))

    def peak(self, device: str) -> int:
        """Resident states plus the largest transient phase on ``device``."""
        return self.total(device, "states") + max(self.total(device, ph) for ph in PHASES[1:])

    def peak_phase(self, device: str) -> str:
        return max(PHASES[1:], key=lambda ph: self.total(device, ph))

    def model_states(self) -> int:
        return sum(c.nbytes for c in self.components if c.phase == "states" and c.device != "nvme"
                   and c.name != "runtime")

    def to_dict(self) -> dict:
        return {"inputs": self.inputs, "components": [asdict(c) for c in self.components],
                "peak_bytes": {d: self.peak(d) for d in DEVICES},
                "peak_phase": {d: self.peak_phase(d) for d in DEVICES}}

    def table(self) -> str:
        mib = lambda b: f"{b / 2**20:10.1f}"  # noqa: E731
        lines = [f"{'component':<38}{'device':<12}{'phase':<17}{'MiB':>10}  note"]
        for c in self.components:
            if c.nbytes:
                lines.append(f"{c.name:<38}{c.device:<12}{c.phase:<17}{mib(c.nbytes)}  {c.note}")
        lines.append("")
        for d in DEVICES:
            if any(c.device == d and c.nbytes for c in self.components):
                lines.append(f"peak {d:<12} {mib(self.peak(d))} MiB  (states {self.total(d, 'states') / 2**20:.1f}"
                             f" + {self.peak_phase(d)} {self.total(d, self.peak_phase(d)) / 2**20:.1f})")
        return "\n".join(lines)


# ---- model states: the engine's layout ---------------------------------------------------------------------------

def model_state_bytes(layout: ParamLayout, *, stage: int, world_size: int, compute_dtype: torch.dtype,
                      grad_dtype: torch.dtype | None = None, optimizer: str = "adamw", momentum: float = 0.0,
                      offload_optimizer: str = "none", offload_param: str = "none", accelerator: str = "cuda",
                      persistence_threshold: int = 100_000, sub_group_size: int = 1_000_000_000,
                      model_persistence_threshold: int = NO_PERSISTENCE_CAP, master_dtype: torch.dtype = torch.float32,
                      state_dtype: torch.dtype = torch.float32) -> list[Component]:
    """Resident model-state components of one rank (phase ``states``), as the engine allocates them.
    ``master_dtype`` / ``state_dtype``: bf16 with ``bf16.bf16_master_weights_and_grads`` / ``bf16_optimizer_states``."""
    c = torch.empty(0, dtype=compute_dtype).element_size()
    g = torch.empty(0, dtype=grad_dtype or compute_dtype).element_size()
    m = torch.empty(0, dtype=master_dtype).element_size()
    m_name = "master (fp32 shard)" if m == _FP32 else "master (bf16 shard)"
    shard_world = 1 if stage == 0 else world_size
    trainable = [n for n, t in zip(layout.numels, layout.trainable) if t]
    frozen = [n for n, t in zip(layout.numels, layout.trainable) if not t]
    shard = sum(_ceil_div(n, shard_world) for n in trainable)
    opt_per_elem = {"adam": 8, "adamw": 8}.get(optimizer.lower(), 4 if momentum else 0)
    opt_per_elem = opt_per_elem * torch.empty(0, dtype=state_dtype).element_size() // _FP32
    host = "host" if accelerator != "cpu" else "accelerator"  # a CPU-only run: host memory is the device memory
    out: list[Component] = []
    add = lambda name, device, nbytes, note="": out.append(Component(name, device, int(nbytes), "states", note))  # noqa: E731
    if stage < 3:
        bound = shard_world == 1  # trainable parameters are views of the 16-bit shard (fp32: of the master)
        params = sum(frozen) * c + (0 if bound and c == m else sum(trainable) * c)
        add("parameters (full)", "accelerator", params, "every parameter, compute dtype")
        if c != m and not bound:
            add("param16 shard", "accelerator", shard * c, "16-bit copy of the master shard")
    else:
        keep = persistent_parameters(layout.numels, persistence_threshold, model_persistence_threshold)
        persistent = [n for n, k in zip(layout.numels, keep) if k]
        frozen_shard = sum(_ceil_div(n, world_size) for n in frozen)
        add("parameters (persistent, full)", "accelerator", sum(persistent) * c,
            f"numel <= stage3_param_persistence_threshold ({persistence_threshold})"
            + (f", at most {model_persistence_threshold} in total" if model_persistence_threshold < NO_PERSISTENCE_CAP else ""))
        if offload_param == "nvme":
            add("parameter shards", "nvme", (shard + frozen_shard) * c, "swap files")
        else:
            dev = "accelerator" if offload_param == "none" else host
            add("parameter shards (16-bit)", dev, (shard if c != m else 0) * c + frozen_shard * c,
                "trainable: views of param16; fp32: of the master")
        add("gradient shard", "accelerator", shard * g, "reduced every micro-step")
    # master + optimizer moments, where offload_optimizer puts them
    master_in_weights = c == m and (stage < 3 or offload_param != "nvme")
    if offload_optimizer == "none":
        add(m_name, "accelerator", shard * m, "it is also the 16-bit shard" if c == m else "")
        add(f"optimizer states ({optimizer})", "accelerator", shard * opt_per_elem)
    elif offload_optimizer == "cpu":
        if accelerator == "cpu":
            add(m_name, "accelerator", shard * m, "offloaded to host = the same memory on CPU")
        else:
            add(m_name, "host", shard * m, "offload_optimizer cpu")
            if master_in_weights:
                add("weights (former master)", "accelerator", shard * m, "param16 is the master")
        add(f"optimizer states ({optimizer})", host, shard * opt_per_elem, "offload_optimizer cpu")
    else:  # nvme
        add("master + optimizer states", "nvme", shard * (m + opt_per_elem), "swap files")
        if master_in_weights:
            add("weights (former master)", "accelerator", shard * m, "param16 is the master")
        tile = min(sub_group_size, shard)
        add("optimizer tile buffers", host, 2 * tile * (m + opt_per_elem), "2 sets x (master, exp_avg, exp_avg_sq)")
    return out


def _transients(layout: ParamLayout, *, stage: int, world_size: int, c: int, g: int, zero: dict,
                profile: ActivationProfile, accelerator: str, accumulation: int = 1) -> list[Component]:
    """The engine's transient buffers per phase (see the module docstring), beside the traced activations.

    ``backward_start``: activations and temporaries at their peak (the traced figure), plus the first parameter
    gradient (the last module's, about the largest one) and, at stage 3, what forward left gathered.
    ``gradient_reduction``: the end of backward, when the reducer packs the gradients into its bucket
    (stages 0-2: :class:`~hf_zero.zero.grad_reducer.GroupGradReducer`, every full ``param.grad`` of the bucket
    still referenced while it is packed; stage 3: the worst moment of :func:`_stage3_reduction`).
    ``step``: the optimizer step.
    """
    trainable = layout.trainable_total
    shard_world = 1 if stage == 0 else world_size
    shard = sum(_ceil_div(n, shard_world) for n, t in zip(layout.numels, layout.trainable) if t)
    padded = shard * shard_world
    from hf_zero.comm.buckets import capped_bucket_numel

    largest = max((n for n, t in zip(layout.numels, layout.trainable) if t), default=0)
    configured = max(int(float(zero.get("reduce_bucket_size", 5e8))), 1)
    # stages 0-2 cut buckets at the cap (a larger parameter alone); stage 3 sizes its bucket rows from the cap
    reduce_bucket = max(capped_bucket_numel(configured, g), largest) if stage < 3 else \
        capped_bucket_numel(configured, c)
    allgather_bucket = max(capped_bucket_numel(int(float(zero.get("allgather_bucket_size", 5e8))), c), largest)
    first_grad = min(layout.largest_module_numel, trainable) * c
    out = []
    add = lambda name, nbytes, phase, note="": out.append(Component(name, "accelerator", int(nbytes), phase, note))  # noqa: E731
    add("activations + backward temporaries", profile.peak, "backward_start", "traced under FakeTensorMode")
    add("first parameter gradient", first_grad, "backward_start", "the last module's, before it is reduced")
    if stage < 3 and world_size == 1:
        # GroupGradReducer alone: no hooks, no buckets; after backward every param.grad goes into the shard,
        # allocated then (activations freed by then), in one batch
        for phase in ("gradient_reduction", "step"):
            add("gradient shard", shard * g, phase, "allocated after backward, freed after the step")
        add("full gradients (param.grad)", trainable * c, "gradient_reduction", "all of them, until taken")
    elif stage < 3:
        # the gradient shard exists from the window's first reducing bucket (early in backward: every micro-step
        # at stage 2, the boundary at stages 0/1) to the step
        for phase in ("backward_start", "gradient_reduction", "step"):
            add("gradient shard", shard * g, phase, "allocated by the reducing backward, freed after the step")
        # one bucket while every bucket fits: the full gradients it packs are all still alive when it launches
        bucket = min(reduce_bucket, padded)
        grads = trainable if bucket >= padded else min(trainable, bucket)
        add("full gradients (param.grad)", grads * c, "gradient_reduction", "alive until their bucket is packed")
        # GroupGradReducer: a window's first reduction writes into the fresh gradient shard -- stage 0 all-reduces
        # the shard in place (no bucket), stages 1/2 reduce-scatter into it (no output); only stage 2's later
        # micro-steps of an accumulation window (stages 0/1 reduce at the boundary alone) need an output to add
        if stage > 0:
            add("gradient bucket", bucket * g, "gradient_reduction", "(world, span) packed, reduce_bucket_size")
        if stage == 2 and accumulation > 1:
            add("reduce-scatter output", _ceil_div(bucket, world_size) * g, "gradient_reduction",
                "this rank's row of the bucket, added to the shard (micro-steps after a window's first)")
        if stage > 0 and world_size > 1 and accelerator == "cpu":
            add("gloo reduce-scatter staging", bucket * g, "gradient_reduction",
                "gloo reduces a full copy of the bucket")
        if stage > 0 and world_size > 1:
            add("publish all-gather buffer", min(allgather_bucket, padded) * c, "step", "allgather_bucket_size")
    else:
        keep = persistent_parameters(layout.numels, _int(zero.get("stage3_param_persistence_threshold"), 100_000),
                                     _int(zero.get("stage3_model_persistence_threshold"), NO_PERSISTENCE_CAP))
        gathered_numel = sum(n for n, k in zip(layout.numels, keep) if not k)
        from hf_zero.config.policies import STAGE3_REUSE_DISTANCE_DEFAULT

        prefetch = capped_bucket_numel(int(float(zero.get("stage3_prefetch_bucket_size", 5e7))), c)
        live = int(float(zero.get("stage3_max_live_parameters", 1e9)))
        reuse = int(float(zero.get("stage3_max_reuse_distance", STAGE3_REUSE_DISTANCE_DEFAULT)))
        kept = None
        if reuse >= gathered_numel:  # every module comes back in backward within the distance: forward keeps it
            gathered = kept = min(gathered_numel, max(live, layout.largest_module_numel))
            note = "forward keeps every module gathered for backward (stage3_max_reuse_distance)"
        else:
            gathered = min(layout.largest_module_numel + min(prefetch, gathered_numel),
                           max(live, layout.largest_module_numel))
            note = "largest module + prefetch, capped by stage3_max_live_parameters"
        add("stage-3 gathered parameters", gathered * c, "backward_start", note)
        overlap = zero.get("overlap_comm")
        overlap = True if overlap is None else bool(overlap)  # stage 3's default
        out += _stage3_reduction(layout, profile, world_size=world_size, c=c, overlap=overlap,
                                 bucket_numel=configured, cpu=accelerator == "cpu", persistent=keep,
                                 prefetch=prefetch, kept=kept * c if kept is not None else None)
    return out


def _stage3_reduction(layout: ParamLayout, profile: ActivationProfile, *, world_size: int, c: int, overlap: bool,
                      bucket_numel: int, cpu: bool, persistent: list[bool], prefetch: int, kept: int | None
                      ) -> list[Component]:
    """The largest moment of ZeRO-3's gradient reduction, replayed bucket by bucket as
    :class:`~hf_zero.zero.stage3.reduce.Stage3GradReducer` fills them during backward.

    Gradients arrive in backward's order (the trace's; without one, reverse parameter order) and are packed into a
    ``(world, capacity)`` bucket, capacity = the capped ``reduce_bucket_size`` / world columns (at least one
    shard). A gradient that does not fit first flushes the bucket, mid-backward; the last bucket is flushed at the
    end of backward. At a flush, measured per allocation (tiny Llama, 1 and 2 gloo ranks, forked ranks, VmRSS
    around each step of ``flush``): the bucket (on a CPU its written columns); its contiguous copy when it is part
    full on several ranks (``[:, :used]`` of two rows is not contiguous; of one row it is); gloo's copy of the
    whole packed input, which its work object keeps until the flush that drains it; the reduce-scatter output
    (one row); with ``overlap_comm`` the previous bucket still in flight with its packed buffer, output and gloo
    copy. Mid-backward also: the activations backward still holds at that gradient (the trace's figure), the full
    gradient being packed, its parameter (gathered until its gradient is reduced) and the prefetch of the next
    parameters in backward's order up to ``stage3_prefetch_bucket_size`` (each in flight as a packed buffer and a
    send buffer: ``1 + 1/world`` times its bytes), or everything forward kept gathered (``kept``).
    """
    trainable = [i for i, t in enumerate(layout.trainable) if t]
    alive = dict(profile.at_grads)
    order = [i for i, _ in profile.at_grads if i < len(layout.numels) and layout.trainable[i]]
    if sorted(order) != trainable:  # no trace of this layout (closed form, another model): reverse order, and
        order = trainable[::-1]     # the activations falling from their peak to nothing along backward
        alive = {i: profile.peak * (len(order) - 1 - k) // max(len(order) - 1, 1) for k, i in enumerate(order)}
    from hf_zero.comm.buckets import capped_bucket_numel

    row_capacity = max(capped_bucket_numel(bucket_numel, c) // world_size, 1)
    staged = world_size > 1 and cpu
    gathered_numels = [0 if persistent[i] else layout.numels[i] for i in order]

    def gathered_at(pos: int) -> int:
        if kept is not None:
            return kept
        ahead, total = 0, 0
        for n in gathered_numels[pos + 1:]:
            if total + n > prefetch:
                break
            total += n
        ahead = total * c * (world_size + 1) // world_size
        return gathered_numels[pos] * c + ahead

    def flush(used: int, capacity: int, inflight: int, pos: int | None, index: int, total: int) -> list:
        at = order[pos] if pos is not None else None
        packed = used * world_size * c
        copy = packed if world_size > 1 and used < capacity else 0
        return [
            ("activations still alive", alive.get(at, 0) if at is not None else 0,
             "the trace's bytes when this gradient is accumulated"),
            ("gradient being packed", layout.numels[at] * c if at is not None else 0, "the full gradient"),
            ("stage-3 gathered parameters", gathered_at(pos) if pos is not None else 0,
             "this parameter and the prefetch after it" if kept is None else "forward keeps every module"),
            ("gradient bucket", packed if cpu else capacity * world_size * c,
             f"bucket {index} of {total}: {used} of {capacity} columns x {world_size} rows"
             + (" (written pages)" if cpu else "")),
            ("bucket packed for the collective", copy, "contiguous copy of the used columns"),
            ("gloo reduce-scatter copy", packed if staged else 0, "kept by the work until it is drained"),
            ("reduce-scatter output", used * c, "this rank's row of the bucket"),
            ("previous bucket in flight", inflight, "overlap_comm: packed buffer, output, gloo's copy"),
        ]

    moments, capacity, used, inflight = [], 0, 0, 0
    for pos, i in enumerate(order):
        width = _ceil_div(layout.numels[i], world_size)
        if capacity and used + width > capacity:
            moments.append((used, capacity, inflight, pos))
            packed = used * world_size * c
            inflight = (packed * (2 if staged else 1) + used * c) if overlap else 0
            capacity = 0
        if not capacity:
            capacity, used = max(row_capacity, width), 0
        used += width
    if capacity:
        moments.append((used, capacity, inflight, None))
    if not moments:
        return []
    worst = max((flush(*m, k + 1, len(moments)) for k, m in enumerate(moments)),
                key=lambda parts: sum(b for _, b, _ in parts))
    return [Component(name, "accelerator", int(nbytes), "gradient_reduction", note)
            for name, nbytes, note in worst if nbytes]


# ---- inputs ----------------------------------------------------------------------------------------------------

def load_model_config(model_or_config: Any):
    """A transformers config from a path (config.json or its directory), a config object, or a model."""
    if isinstance(model_or_config, (str, os.PathLike)):
        from transformers import AutoConfig

        path = os.fspath(model_or_config)
        if not os.path.exists(path):
            raise FileNotFoundError(f"hf-zero estimate: model config {path!r} does not exist (pass a config.json "
                                    f"or a directory holding one; nothing is downloaded)")
        return AutoConfig.from_pretrained(path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)),
                                          local_files_only=True) if os.path.basename(path) == "config.json" or \
            os.path.isdir(path) else _config_from_file(path)
    return model_or_config


def _config_from_file(path: str):
    from transformers import AutoConfig

    with open(path) as f:
        data = json.load(f)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"hf-zero estimate: {path} has no 'model_type'; is it a transformers config.json?")
    return AutoConfig.for_model(model_type, **data)


def build_meta_model(config, lora: dict | None = None) -> nn.Module:
    """The model ``config`` describes, on the meta device (shapes only: no memory, no weights, no download);
    with ``lora`` (``peft.LoraConfig`` keywords, e.g. ``{"r": 16, "target_modules": ["q_proj", "v_proj"]}``) the
    adapters are added as PEFT adds them, and only they train."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto = AutoModelForMaskedLM if config.model_type in ("bert", "roberta", "xlm-roberta", "electra") \
        else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
        return with_lora(model, lora) if lora else model


def with_lora(model: nn.Module, lora: dict) -> nn.Module:
    """``model`` with PEFT LoRA adapters per ``lora`` (``peft.LoraConfig`` keywords)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("hf_zero estimate: LoRA targets need the peft package (pip install peft)") from err
    try:
        return get_peft_model(model, LoraConfig(**lora))
    except (TypeError, ValueError) as err:
        raise ValueError(f"hf_zero estimate: LoRA settings {lora!r} were refused by peft ({err}); give "
                         f"peft.LoraConfig keywords, e.g. r and target_modules naming the model's linear layers") \
            from err


def read_ds_config(ds_config: Any) -> dict:
    if ds_config is None:
        return {}
    if isinstance(ds_config, (str, os.PathLike)):
        with open(ds_config) as f:
            return json.load(f)
    return dict(ds_config)


def compute_dtype(ds: dict) -> torch.dtype:
    if truthy((ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled")):
        return torch.bfloat16
    if truthy((ds.get("fp16") or {}).get("enabled")):
        return torch.float16
    return torch.float32


def _accumulation(ds: dict, micro: int, world_size: int) -> int:
    """gradient_accumulation_steps as the config gives or implies it (train_batch_size / (micro x world))."""
    gas = ds.get("gradient_accumulation_steps")
    if gas not in (None, "auto"):
        return int(gas)
    total = ds.get("train_batch_size")
    return max(int(total) // (micro * world_size), 1) if total not in (None, "auto") else 1


def _int(value: Any, default: int) -> int:
    return default if value in (None, "auto") else int(value)


def estimate_memory(model_or_config: Any, ds_config: Any = None, *, world_size: int = 1, micro_batch: int | None = None,
                    seq_len: int = 512, accelerator: str | None = None, trainable=None,
                    gradient_checkpointing: bool = False, activations: "int | ActivationProfile | None" = None,
                    lora: dict | None = None) -> MemoryEstimate:
    """Per-rank memory of training ``model_or_config`` (an ``nn.Module``, a transformers config, or a path to a
    ``config.json``) with the DeepSpeed/hf_zero config ``ds_config`` (dict or JSON path) on ``world_size`` ranks.

    ``micro_batch`` defaults to the config's ``train_micro_batch_size_per_gpu`` (1 when "auto"); ``trainable``
    (``name -> bool``) overrides which parameters train; ``activations`` (bytes, or an
    :class:`~hf_zero.profiling.activations.ActivationProfile`) skips the trace; ``lora``
    (``peft.LoraConfig`` keywords) adds LoRA adapters to a config-built model: master weights, gradients and
    optimizer states then exist for the adapters only (a PEFT model passed as ``model_or_config`` is estimated as
    it is).
    """
    ds = read_ds_config(ds_config)
    zero = primary_keys(ZeroConfig, ds.get("zero_optimization"))  # DeepSpeed's unprefixed stage-3 names too
    stage = _int(zero.get("stage"), 0)
    compute = compute_dtype(ds)
    grad_name = (ds.get("data_types") or {}).get("grad_accum_dtype")
    grad_dtype = _DTYPES[grad_name] if grad_name else compute
    bf16 = ds.get("bf16") or {}
    master16 = bool(bf16.get("enabled")) and bool(bf16.get("bf16_master_weights_and_grads"))
    states16 = master16 and bool(bf16.get("bf16_optimizer_states"))
    micro = micro_batch or _int(ds.get("train_micro_batch_size_per_gpu"), 1)
    opt = ds.get("optimizer") or {"type": "AdamW"}
    off_opt = (zero.get("offload_optimizer") or {}).get("device", "none") or "none"
    off_param = (zero.get("offload_param") or {}).get("device", "none") or "none"
    if accelerator is None:
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(model_or_config, nn.Module):
        if lora:
            raise ValueError("estimate_memory: lora= adds adapters to a model built from a config; a model passed "
                             "in is estimated as it is (apply peft to it first, or pass its config)")
        model, config = model_or_config, getattr(model_or_config, "config", None)
    else:
        config = load_model_config(model_or_config)
        model = build_meta_model(config, lora)
    layout = param_layout(model, trainable)
    c = torch.empty(0, dtype=compute).element_size()
    g = torch.empty(0, dtype=grad_dtype).element_size()
    states = model_state_bytes(
        layout, stage=stage, world_size=world_size, compute_dtype=compute, grad_dtype=grad_dtype,
        optimizer=str(opt.get("type", "AdamW")), momentum=float((opt.get("params") or {}).get("momentum", 0.0)),
        offload_optimizer=off_opt, offload_param=off_param, accelerator=accelerator,
        persistence_threshold=_int(zero.get("stage3_param_persistence_threshold"), 100_000),
        model_persistence_threshold=_int(zero.get("stage3_model_persistence_threshold"), NO_PERSISTENCE_CAP),
        sub_group_size=_int(zero.get("sub_group_size"), 1_000_000_000),
        master_dtype=torch.bfloat16 if master16 else torch.float32,
        state_dtype=torch.bfloat16 if states16 else torch.float32)
    if activations is None:
        from hf_zero.profiling.activations import activation_profile

        activations = activation_profile(config, micro, seq_len, dtype=compute,
                                         gradient_checkpointing=gradient_checkpointing, trainable=trainable,
                                         lora=lora)
    profile = activations if isinstance(activations, ActivationProfile) else ActivationProfile(int(activations))
    transients = _transients(layout, stage=stage, world_size=world_size, c=c, g=g, zero=zero,
                             profile=profile, accelerator=accelerator,
                             accumulation=_accumulation(ds, micro, world_size))
    if accelerator == "cpu":
        states.append(Component("runtime", "accelerator", CPU_RUNTIME_BYTES, "states",
                                 "process growth besides tensors (autograd, hooks, gloo), measured"))
    est = MemoryEstimate(states + transients, inputs=dict(
        stage=stage, world_size=world_size, micro_batch=micro, seq_len=seq_len, dtype=str(compute).split(".")[-1],
        offload_optimizer=off_opt, offload_param=off_param, accelerator=accelerator, params=layout.total,
        trainable_params=layout.trainable_total, gradient_checkpointing=gradient_checkpointing, lora=lora))
    return est
