"""Ulysses attention for Hugging Face models: the sequence is split over the SP ranks everywhere except inside the
attention function, where the split moves from the sequence to the heads and back.

    q, k, v from the model on each rank: [batch, heads, seq/n, head_dim]      (this rank's tokens, all heads)
      ── all-to-all ──>                  [batch, heads/n, seq, head_dim]      (every token, this rank's heads)
    the model's own attention function (sdpa, flash, flex) over the whole sequence, causal
    output                               [batch, seq, heads/n, head_dim]
      ── all-to-all ──>                  [batch, seq/n, heads, head_dim]      (back to this rank's tokens)

Everything outside attention (embeddings, norms, MLP, LM head) is per token, so it runs unchanged on the shard.
The model code is not edited: :meth:`UlyssesSPAttentionHF.register_with_transformers` replaces the entry of the
model's attention implementation in transformers' ``ALL_ATTENTION_FUNCTIONS`` with the wrapper, so every branch
transformers takes for e.g. ``"sdpa"`` still runs and only the call itself is intercepted (as DeepSpeed does).

Masks: the model builds its mask for the shard's length, which is meaningless after the exchange, and a full
``[seq, seq]`` mask is what long-sequence training cannot afford; the wrapper drops it and the attention function
runs causal (``is_causal``). Padding is expressed through ``position_ids`` and the ``-100`` labels instead, as in
DeepSpeed; ``eager`` (which needs the 4-D mask) and ``flex_attention`` (whose block mask DeepSpeed rebuilds for the
full sequence; not done here) are refused, as accelerate's DeepSpeedSequenceParallelConfig refuses both.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_zero.comm import sequence_groups
from hf_zero.sequence_parallel.all_to_all import seq_all_to_all

__all__ = ["UlyssesSPAttentionHF", "unregister_from_transformers"]

logger = logging.getLogger("hf_zero")

HEAD_DIM, SEQ_DIM = 1, 2          # of q/k/v: [batch, heads, seq, head_dim]
OUT_SEQ_DIM, OUT_HEAD_DIM = 1, 2  # of the attention output: [batch, seq, heads, head_dim]
# implementations the wrapper cannot run causal without the model's mask, and why
UNSUPPORTED = {"eager": "it needs the 4-D mask", "paged|eager": "it needs the 4-D mask",
               "flex_attention": "without its block mask it attends both ways"}

# implementation name -> the function it had before the wrapper replaced it (for unregister and re-registration)
_REPLACED: dict[str, Any] = {}


class UlyssesSPAttentionHF(nn.Module):
    """The wrapper around one attention function; DeepSpeed's constructor signature.

    ``attn``: the core function (transformers' signature ``(module, q, k, v, mask, **kw) -> (out, weights)``).
    ``seq_length_is_variable=False`` pins the shard length to ``local_seq_length`` (checked every call).
    ``disable_in_eval``: in eval mode call ``attn`` directly, on whatever the rank holds (no exchange).
    """

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count = attn_head_count
        self.attn_head_size = attn_head_size
        self.kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation: str | None = None  # set by register_with_transformers
        n = self.world_size
        if attn_head_count % n:
            raise ValueError(f"sequence parallel size {n} does not divide the {attn_head_count} attention heads "
                             "(num_attention_heads): each rank computes attention for heads / sp_size of them")
        if kv_head_count % n and n % kv_head_count:
            raise ValueError(f"sequence parallel size {n} and the {kv_head_count} key/value heads "
                             "(num_key_value_heads) do not divide one another")
        # fewer kv heads than ranks (MQA, small GQA): each kv head is copied to the ranks whose query heads use it,
        # so every rank ends up with exactly one kv head
        self.kv_replication = n // kv_head_count if kv_head_count < n else 1
        if not seq_length_is_variable and local_seq_length is None:
            raise ValueError("seq_length_is_variable=False needs local_seq_length (the per-rank shard length)")

    def forward(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask, *args, **kwargs):
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        local_len = query.shape[SEQ_DIM]
        if not self.seq_length_is_variable and local_len != self.local_seq_length:
            raise ValueError(f"Ulysses attention was registered for a fixed shard length of {self.local_seq_length} "
                             f"tokens (seq_length / sp_size) but got {local_len}; register with "
                             "seq_length_is_variable=True for batches of varying length")
        if kwargs.get("position_ids") is None:
            # without them each rank's rotary embedding would number its shard from 0 (and flash attention would
            # read the gathered positions as packed documents)
            raise ValueError("Ulysses sequence parallelism needs position_ids in every forward call (the global "
                             "position of each token of the shard); UlyssesSPDataLoaderAdapter puts them in the "
                             "batch, or pass position_ids=torch.arange(seq_len) sharded like input_ids")
        kwargs["position_ids"] = _gather_sequence(kwargs["position_ids"], self.process_group, self.world_size)
        if self.kv_replication > 1:
            key = key.repeat_interleave(self.kv_replication, dim=HEAD_DIM)
            value = value.repeat_interleave(self.kv_replication, dim=HEAD_DIM)
        group = self.process_group
        q = seq_all_to_all(query, group, scatter_dim=HEAD_DIM, gather_dim=SEQ_DIM)   # [b, h/n, s, d]
        k = seq_all_to_all(key, group, scatter_dim=HEAD_DIM, gather_dim=SEQ_DIM)
        v = seq_all_to_all(value, group, scatter_dim=HEAD_DIM, gather_dim=SEQ_DIM)
        groups_before = getattr(module, "num_key_value_groups", None)
        if groups_before is not None:
            # the core function repeats kv heads by this ratio; after the exchange it is the local one
            module.num_key_value_groups = q.shape[HEAD_DIM] // k.shape[HEAD_DIM]
        try:
            # the model's mask was built for the shard's length: dropped, causal instead (module docstring); the
            # eval bypass above keeps it, since there the shard is all the attention sees
            out, weights = self.attn(module, q, k, v, None, *args, **kwargs)             # [b, s, h/n, d]
        finally:
            if groups_before is not None:
                module.num_key_value_groups = groups_before
        out = seq_all_to_all(out, group, scatter_dim=OUT_SEQ_DIM, gather_dim=OUT_HEAD_DIM)  # [b, s/n, h, d]
        return out, weights

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None):
        """Set up the SP groups and put the wrapper in place of ``core_attn_implementation``; returns the mpu
        (:mod:`hf_zero.comm.sequence_groups`) to pass to ``initialize(mpu=...)``, or None when the size is 1.

        ``model_name_or_path``: the loaded model (its attention implementation must be ``core_attn_implementation``)
        or a name / path whose config gives the head counts. ``max_length``: DeepSpeed's old name of ``seq_length``.
        """
        if sequence_parallel_size == 1:
            return None
        if seq_length is None:
            seq_length = max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("register_with_transformers: seq_length_is_variable=False needs seq_length (the length "
                             "of every batch)")
        if core_attn_implementation in UNSUPPORTED:
            raise ValueError(f"core_attn_implementation={core_attn_implementation!r}: Ulysses sequence parallelism "
                             "drops the model's attention mask and runs causal attention, and "
                             f"{UNSUPPORTED[core_attn_implementation]}. Use 'sdpa' or a flash attention variant")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        config = getattr(model_name_or_path, "config", None)
        if config is None:
            config = AutoConfig.from_pretrained(model_name_or_path)
        else:
            model_impl = getattr(config, "_attn_implementation", None)
            if model_impl is not None and model_impl != core_attn_implementation:
                raise ValueError(f"core_attn_implementation={core_attn_implementation!r} but the model runs "
                                 f"attn_implementation={model_impl!r}: the wrapper replaces only the function the "
                                 "model calls, so load the model with the same attn_implementation")
        original = _REPLACED.get(core_attn_implementation)
        if original is None:
            if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
                raise ValueError(f"{core_attn_implementation!r} is not an attention implementation transformers "
                                 f"knows; choose one of {sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())}")
            original = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]

        sequence_groups.initialize_sequence_parallel(sequence_parallel_size)
        text = config.get_text_config()
        heads = text.num_attention_heads
        uattn = cls(attn=original, batch_size=micro_batch_size, attn_head_count=heads,
                    attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
                    kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
                    num_hidden_layers=text.num_hidden_layers,
                    process_group=sequence_groups.get_sequence_parallel_group(),
                    seq_length_is_variable=seq_length_is_variable,
                    local_seq_length=None if seq_length_is_variable else seq_length // sequence_parallel_size,
                    global_seq_length=None if seq_length_is_variable else seq_length,
                    disable_in_eval=disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        ulysses_attention.ulysses = uattn
        _REPLACED[core_attn_implementation] = original
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        logger.info("hf_zero: Ulysses sequence parallelism over %d ranks wraps attention %r (%d heads, %d per rank)",
                    sequence_parallel_size, core_attn_implementation, heads, heads // sequence_parallel_size)
        return sequence_groups


def unregister_from_transformers(core_attn_implementation: str) -> None:
    """Put back the attention function :meth:`UlyssesSPAttentionHF.register_with_transformers` replaced."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = _REPLACED.pop(core_attn_implementation, None)
    if original is not None:
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = original


def _gather_sequence(t: torch.Tensor, group, world: int) -> torch.Tensor:
    """Concatenate every rank's ``[batch, seq/n]`` shard along the sequence (integer ids: no gradient)."""
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)
