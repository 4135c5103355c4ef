"""Hugging Face decoders as they are, cut into pipeline stages: ``wrap(model, num_stages)``.

    model = LlamaForCausalLM(config)                      # or from_pretrained(...); the same on every rank
    pipe = hf_zero.pipeline.wrap(model, num_stages=2)     # this rank keeps only its own layers
    engine, *_ = hf_zero.initialize(model=pipe, config=ds_config)
    loss = engine.train_batch(iter(micro_batches))        # dicts: input_ids, attention_mask, labels
    pipe.save_pretrained("out")                           # an ordinary save_pretrained directory

The split is by module tree (embeddings | decoder layers | final norm + head), named by the model config's
``base_model_pp_plan`` for the Llama family (Llama, Mistral, Qwen2, Qwen3) and by a small adapter for GPT-2. Only
the hidden state crosses stages. Every stage gets the micro-batch's ``attention_mask`` (and ``position_ids`` if
given) and recomputes what the unsplit forward computes from them: the causal/padding (and sliding-window) masks,
default positions, rotary embeddings. Parameter names stay the model's own (``model.layers.3.mlp.up_proj.weight``),
so checkpoints and ``save_pretrained`` files are the unsplit model's.

The loss is the unsplit model's: token-level cross-entropy summed over the global batch (every micro-batch and
data-parallel replica) and divided by the global number of label tokens, so padding does not skew it.
Tied input/output embeddings (``tie_word_embeddings``) get a copy on the last stage; the engine sums the two
copies' gradients and counts the weight once in the gradient norm.

3D: ``wrap(model, num_stages, tp_size=2)`` lays the ranks out as (pipe, data, model) on one device mesh;
``initialize`` with ``tensor_parallel.autotp_size`` then shards each stage's modules over its TP group (the
runtime sets :attr:`HFPipelineModule.cross_entropy_sum` to the vocabulary-parallel loss and
:attr:`HFPipelineModule.full_state_dict_fn` to the gather that makes saved weights ordinary ones).
"""

from __future__ import annotations

import inspect

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hf_zero import comm
from hf_zero.pipeline.module import PipelineError, TiedGroup
from hf_zero.pipeline.partition import partition_uniform
from hf_zero.pipeline.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology, PipelineParallelGrid,
                                       ProcessTopology)

__all__ = ["wrap", "HFPipelineModule"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class _Family:
    """Where a family keeps its pieces (attribute paths on the *ForCausalLM model)."""

    base: str          # the base model attribute: "model" / "transformer"
    embed: str         # token embedding under base
    layers: str        # decoder layer list under base
    norm: str          # final norm under base
    head: str = "lm_head"
    kind: str = "llama"


_LLAMA = _Family(base="model", embed="embed_tokens", layers="layers", norm="norm")
_GPT2 = _Family(base="transformer", embed="wte", layers="h", norm="ln_f", kind="gpt2")
FAMILIES = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "gpt2": _GPT2}


def _token_ce_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _family_of(model: nn.Module) -> _Family:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in FAMILIES:
        raise PipelineError(f"hf_zero.pipeline.wrap: model_type {model_type!r} has no pipeline adapter; supported: "
                            f"{sorted(FAMILIES)}. For another model, give its layers to hf_zero.pipe.PipelineModule")
    family = FAMILIES[model_type]
    plan = getattr(model.config, "base_model_pp_plan", None)
    if family.kind == "llama" and plan and not {family.embed, family.layers, family.norm} <= set(plan):
        raise PipelineError(f"hf_zero.pipeline.wrap: {model_type}'s base_model_pp_plan {sorted(plan)} does not "
                            f"name {family.embed}/{family.layers}/{family.norm}; this transformers version is not "
                            f"supported by the adapter")
    if not hasattr(model, family.head) or not hasattr(model, family.base):
        raise PipelineError(f"hf_zero.pipeline.wrap: expected a *ForCausalLM model with .{family.base} and "
                            f".{family.head}; got {type(model).__name__}")
    return family


class HFPipelineModule(nn.Module):
    """This rank's part of an HF causal LM (see the module docstring); built by :func:`wrap`."""

    data_on_every_stage = True  # every stage needs the micro-batch's attention mask
    partition_method = "uniform"
    dynamic_shape = True  # every stage sees the batch, so a new sequence length re-runs shape inference everywhere

    def __init__(self, model: nn.Module, num_stages: int | None = None, topology: ProcessTopology | None = None,
                 virtual_stages: int = 1, layers_per_stage: list[int] | None = None, tp_size: int = 1,
                 load_weights=None):
        super().__init__()
        family = _family_of(model)
        comm.init_distributed()
        world = dist.get_world_size()
        if topology is None:
            tp_size = int(tp_size)
            if num_stages is None or tp_size < 1 or world % (int(num_stages) * tp_size):
                raise ValueError(f"wrap: num_stages={num_stages} x tp_size={tp_size} must divide the world size "
                                 f"{world}")
            dp = world // (int(num_stages) * tp_size)
            topology = PipeModelDataParallelTopology(num_pp=int(num_stages), num_mp=tp_size, num_dp=dp) \
                if tp_size > 1 else PipeDataParallelTopology(num_pp=int(num_stages), num_dp=dp)
        elif tp_size != 1:
            raise ValueError("wrap: pass tp_size or a topology (whose 'model' axis is the tensor-parallel size), "
                             "not both")
        self._topo = topology
        self._grid = PipelineParallelGrid(topology)
        self.num_stages = self._grid.pipe_parallel_size
        self.stage_id = self._grid.stage_id
        self.virtual_stages = int(virtual_stages)
        self.family = family
        object.__setattr__(self, "hf_model", model)  # not a child: its kept children are adopted below
        self.config = model.config
        base = getattr(model, family.base)
        n_layers = len(getattr(base, family.layers))
        parts = self.num_stages * self.virtual_stages
        # units: the embedding, each decoder layer, the norm + head; cut into contiguous parts
        if layers_per_stage is not None:
            if len(layers_per_stage) != parts or sum(layers_per_stage) != n_layers:
                raise ValueError(f"wrap: layers_per_stage={layers_per_stage} must have {parts} entries summing "
                                 f"to the model's {n_layers} layers")
            bounds = [0]
            for k, n in enumerate(layers_per_stage):
                bounds.append(bounds[-1] + n + (1 if k == 0 else 0) + (1 if k == parts - 1 else 0))
            self.parts = bounds
        else:
            self.parts = partition_uniform(n_layers + 2, parts)
        self.local_chunks = [self.stage_id + k * self.num_stages for k in range(self.virtual_stages)]
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False)) and \
            getattr(model, family.head).weight is getattr(base, family.embed).weight
        own_units = {u for c in self.local_chunks for u in range(self.parts[c], self.parts[c + 1])}
        self.has_embed = 0 in own_units
        self.has_head = (n_layers + 1) in own_units
        self.layer_ids = sorted(u - 1 for u in own_units if 1 <= u <= n_layers)
        # prune: drop what other stages own, keep the model's attribute names (and so its parameter names)
        kept = nn.ModuleDict({str(i): getattr(base, family.layers)[i] for i in self.layer_ids})
        setattr(base, family.layers, kept)
        if not self.has_embed:
            setattr(base, family.embed, None)
            if family.kind == "gpt2":
                base.wpe = None
        if not self.has_head:
            setattr(base, family.norm, None)
            setattr(model, family.head, None)
        setattr(self, family.base, base)
        if self.has_head:
            setattr(self, family.head, getattr(model, family.head))
        self.base_model_prefix = family.base  # where apply_tp finds the base model's plan entries
        # replaced by the runtime under tensor parallelism (vocabulary-sharded logits; DTensor parameters)
        self.cross_entropy_sum = _token_ce_sum
        self.full_state_dict_fn = None
        if load_weights is not None:  # from_pretrained: this stage's parameters are still on the meta device
            self.loaded_keys = load_weights(self)
        self._tie = self._tie_group()

    @property
    def tied_groups(self) -> list[TiedGroup]:
        """The tied embedding / head copy of this stage with its group; the weight looked up now, since tensor
        parallelism replaces it by a vocabulary-sharded parameter after wrap()."""
        if self._tie is None:
            return []
        return [TiedGroup("embed", [self._tied_weight()], self._tie[0], self._tie[1])]

    def _tied_weight(self) -> nn.Parameter:
        base = getattr(self, self.family.base)
        return getattr(base, self.family.embed).weight if self.has_embed else getattr(self, self.family.head).weight

    def get_input_embeddings(self) -> nn.Module | None:
        """This stage's token embedding (None off the first stage)."""
        return getattr(getattr(self, self.family.base), self.family.embed) if self.has_embed else None

    def get_output_embeddings(self) -> nn.Module | None:
        """This stage's LM head (None off the last stage)."""
        return getattr(self, self.family.head) if self.has_head else None

    def _tie_group(self) -> tuple[list[int], Any] | None:
        """(owner stages, this replica's group of the copies) when this stage holds a tied copy, else None."""
        if not self.tied or self.num_stages == 1:
            return None
        owners = [0, self.num_stages - 1]
        # one group per (replica, tensor-parallel rank): the first and the last stage's copies of the same shard
        mine = self._grid.stage_copies_group(owners)
        if mine is None:
            return None
        with torch.no_grad():  # the last stage's copy starts from the first stage's weights
            dist.broadcast(self._tied_weight().data, src=mine[0][0], group=mine[1])
        return owners, mine[1]

    # ---- the stage's computation --------------------------------------------------------------------------------
    @property
    def grid(self) -> PipelineParallelGrid:
        return self._grid

    def topology(self) -> ProcessTopology:
        return self._topo

    def chunk_modules(self) -> list[tuple[int, nn.Module]]:
        if self.virtual_stages == 1:
            return [(self.local_chunks[0], self)]
        return [(c, _HFChunk(self, c)) for c in self.local_chunks]

    def forward(self, x, attention_mask=None, position_ids=None):
        return self.run_chunk(self.local_chunks[0], x, attention_mask, position_ids)

    def run_chunk(self, chunk: int, x, attention_mask=None, position_ids=None):
        lo, hi = self.parts[chunk], self.parts[chunk + 1]
        n_layers = self.config.num_hidden_layers
        base = getattr(self, self.family.base)
        hidden = x
        if position_ids is None:  # the unsplit forward's default (no cache)
            position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        if lo == 0:
            hidden = self._embed(base, x, position_ids)
        layers = [i for i in range(max(lo, 1) - 1, min(hi, n_layers + 1) - 1)]
        if layers:
            hidden = self._decoder(base, layers, hidden, attention_mask, position_ids)
        if hi == n_layers + 2:
            hidden = getattr(base, self.family.norm)(hidden)
            hidden = getattr(self, self.family.head)(hidden)
        return hidden

    def _embed(self, base, input_ids, position_ids):
        if input_ids.is_floating_point():
            raise PipelineError("the first pipeline stage expects token ids (input_ids), got a float tensor")
        hidden = getattr(base, self.family.embed)(input_ids)
        if self.family.kind == "gpt2":
            hidden = base.drop(hidden + base.wpe(position_ids))
        return hidden

    def _decoder(self, base, layer_ids, hidden, attention_mask, position_ids):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        # no cache while training; transformers 5 renamed the argument (passing the old name warns)
        cache_arg = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
        mask_kwargs = {"config": self.config, "inputs_embeds": hidden, "attention_mask": attention_mask,
                       cache_arg: None, "position_ids": position_ids}
        layers = getattr(base, self.family.layers)
        if self.family.kind == "gpt2":
            mask = create_causal_mask(**mask_kwargs)
            for i in layer_ids:
                hidden = layers[str(i)](hidden, attention_mask=mask, use_cache=False, position_ids=position_ids)
                hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            return hidden
        types = getattr(self.config, "layer_types", None)
        if types is None and getattr(self.config, "sliding_window", None) is not None \
                and self.config.model_type == "mistral":
            types = ["sliding_attention"] * self.config.num_hidden_layers
        masks = {}
        for i in layer_ids:
            kind = types[i] if types is not None else "full_attention"
            if kind not in masks:
                fn = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
                masks[kind] = fn(**mask_kwargs)
        position_embeddings = base.rotary_emb(hidden, position_ids)
        for i in layer_ids:
            kind = types[i] if types is not None else "full_attention"
            hidden = layers[str(i)](hidden, attention_mask=masks[kind], position_embeddings=position_embeddings,
                                    position_ids=position_ids, use_cache=False)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return hidden

    # ---- what the engine feeds the schedule ---------------------------------------------------------------------
    def pipeline_batch(self, micro_batches: list, *, first: bool, last: bool, num_microbatches: int, dp_group,
                       dp_size: int):
        """``(args, kwargs, target, loss_fn)`` from dict micro-batches (``input_ids``, ``attention_mask``,
        ``labels``; labels default to input_ids as in HF causal LM training)."""
        batch = {}
        for key in ("input_ids", "attention_mask", "position_ids", "labels"):
            values = [mb.get(key) if isinstance(mb, dict) else None for mb in micro_batches]
            if any(v is None for v in values) and not all(v is None for v in values):
                raise PipelineError(f"some micro-batches have {key!r} and some do not")
            if values and values[0] is not None:
                batch[key] = torch.cat(values)
        if not micro_batches or "input_ids" not in batch:
            raise PipelineError("each micro-batch must be a dict with at least 'input_ids' (and 'attention_mask', "
                                "'labels' when padded)")
        unknown = {k for mb in micro_batches for k in mb} - {"input_ids", "attention_mask", "position_ids", "labels"}
        if unknown:
            raise PipelineError(f"micro-batch keys {sorted(unknown)} are not supported by the pipeline wrapper")
        args = (batch["input_ids"],) if first else ()
        kwargs = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
        target = None
        count = torch.zeros((), dtype=torch.float32)
        if last:
            labels = batch.get("labels", batch["input_ids"])
            target = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()  # shifted, as HF does
            count = (target != IGNORE_INDEX).sum().float()
            if dp_size > 1:
                dist.all_reduce(count, group=dp_group)
            if count.item() == 0:
                raise PipelineError("the global batch has no label tokens (all labels are -100)")
        # the data-parallel reduction averages over replicas; multiply back so the sum over replicas is divided by
        # the global token count only
        factor = dp_size / max(count.item(), 1.0)

        ce_sum = self.cross_entropy_sum

        def loss(logits, shifted):
            return ce_sum(logits, shifted) * factor

        return args, kwargs, target, loss

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def checkpoint_aliases(self) -> dict[str, tuple[str, ...]]:
        """A tied weight is one parameter on a single stage but two (embedding, head) when cut: either name finds
        it in a checkpoint written with another cut."""
        if not self.tied:
            return {}
        embed = f"{self.family.base}.{self.family.embed}.weight"
        head = f"{self.family.head}.weight"
        return {embed: (head,), head: (embed,)}

    def unit_of(self, key: str) -> int:
        """The unit (0 embedding, 1..L decoder layers, L+1 norm and head) holding the tensor named ``key``: the
        index of its per-layer checkpoint file, whatever the cut."""
        prefix_layers = f"{self.family.base}.{self.family.layers}."
        if key.startswith(prefix_layers):
            return int(key[len(prefix_layers):].split(".", 1)[0]) + 1
        if key.startswith(f"{self.family.base}.{self.family.norm}.") or key.startswith(f"{self.family.head}."):
            return self.config.num_hidden_layers + 1
        return 0

    def layer_state_dicts(self) -> dict[int, dict[str, torch.Tensor]]:
        """Unit index -> its tensors under HF names (see :meth:`unit_of`); full tensors under tensor parallelism
        (a collective over the TP group)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in self.hf_state_dict().items():
            out.setdefault(self.unit_of(key), {})[key] = value
        return out

    # ---- saving -------------------------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and persistent buffers under the unsplit model's names (a tied head omitted,
        as save_pretrained does)."""
        sd = self.full_state_dict_fn(self) if self.full_state_dict_fn is not None else dict(self.state_dict())
        if self.tied and f"{self.family.head}.weight" in sd:
            del sd[f"{self.family.head}.weight"]
        return sd

    def save_pretrained(self, save_directory: str | os.PathLike, state_dict: dict | None = None) -> None:
        """Collective over the pipeline: each stage's data-parallel rank 0 writes its own safetensors shard; global
        rank 0 writes the index and the config. ``from_pretrained(save_directory)`` loads the whole model."""
        from safetensors.torch import save_file

        grid = self._grid
        sd = self.hf_state_dict() if state_dict is None else state_dict
        os.makedirs(save_directory, exist_ok=True)
        names = [None] * grid.pipe_parallel_size
        dist.all_gather_object(names, sorted(sd), group=grid.get_pipe_parallel_group())
        fname = f"model-{self.stage_id + 1:05d}-of-{grid.pipe_parallel_size:05d}.safetensors"
        if grid.data_parallel_id == 0 and grid.get_slice_parallel_rank() == 0:  # TP peers hold the same full sd
            save_file({k: v.detach().contiguous().cpu() for k, v in sd.items()},
                      os.path.join(save_directory, fname), metadata={"format": "pt"})
            if self.stage_id == 0:
                weight_map = {k: f"model-{s + 1:05d}-of-{grid.pipe_parallel_size:05d}.safetensors"
                              for s, keys in enumerate(names) for k in keys}
                with open(os.path.join(save_directory, "model.safetensors.index.json"), "w") as f:
                    json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
                self.config.save_pretrained(save_directory)
        dist.barrier(group=grid.get_pipe_parallel_group())


class _HFChunk(nn.Module):
    """One virtual stage of an :class:`HFPipelineModule` (shares the parent's modules)."""

    def __init__(self, parent: HFPipelineModule, chunk: int):
        super().__init__()
        object.__setattr__(self, "_parent", parent)
        self.chunk = chunk
        base = getattr(parent, parent.family.base)
        n_layers = parent.config.num_hidden_layers
        lo, hi = parent.parts[chunk], parent.parts[chunk + 1]
        if lo == 0:
            self.embed = getattr(base, parent.family.embed)
        for u in range(max(lo, 1), min(hi, n_layers + 1)):
            self.add_module(f"layer{u - 1}", getattr(base, parent.family.layers)[str(u - 1)])
        if hi == n_layers + 2:
            self.norm = getattr(base, parent.family.norm)
            self.head = getattr(parent, parent.family.head)

    def forward(self, x, attention_mask=None, position_ids=None):
        return self._parent.run_chunk(self.chunk, x, attention_mask, position_ids)


def wrap(model: nn.Module, num_stages: int | None = None, *, topology: ProcessTopology | None = None,
         virtual_stages: int = 1, layers_per_stage: list[int] | None = None, tp_size: int = 1) -> HFPipelineModule:
    """Cut an HF causal LM into ``num_stages`` pipeline stages (x data-parallel replicas filling the world); this
    rank keeps its own stage's modules. Every rank must pass the same model (same weights, e.g. from_pretrained
    or the same seed). ``virtual_stages``: chunks per rank for interleaved schedules. ``layers_per_stage``:
    decoder layers per part instead of the uniform cut (the embedding and the head count as one layer each).
    ``tp_size``: tensor-parallel ranks per stage (3D; the config's ``tensor_parallel.autotp_size`` must agree):
    ranks are laid out (pipe, data, model), tensor parallel innermost."""
    return HFPipelineModule(model, num_stages=num_stages, topology=topology, virtual_stages=virtual_stages,
                            layers_per_stage=layers_per_stage, tp_size=tp_size)
