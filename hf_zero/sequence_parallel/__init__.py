"""Ulysses sequence parallelism (DeepSpeed's ALST ``deepspeed.runtime.sequence_parallel.ulysses_sp``) for Hugging
Face models: each rank of an SP group holds a slice of one long sequence; attention trades the sequence split for a
head split with two all-to-alls; everything else runs per token on the slice.

    mpu = UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=2, micro_batch_size=1)
    engine, *_ = hf_zero.initialize(model=model, optimizer=opt, config=cfg, mpu=mpu)
    for batch in UlyssesSPDataLoaderAdapter(dl, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=mpu.
                                            get_sequence_parallel_group(), sp_world_size=2, device=device):
        out = engine(**batch)                       # batch["shift_labels"]: this shard's next-token targets
        loss = model.loss_function(logits=out.logits, labels=None, shift_labels=batch["shift_labels"],
                                   vocab_size=model.config.vocab_size)
        engine.backward(sequence_parallel_loss(loss, batch["shift_labels"], mpu.get_sequence_parallel_group()))

Owns the attention wrapper, the data-loader adapter, the loss aggregation and the tiled (per-tile checkpointed)
logits-loss / MLP / generic compute; the groups live in
``hf_zero.comm.sequence_groups``. May import comm, config and util; runtime wires it in, integrations forwards
``deepspeed.runtime.sequence_parallel`` here (the layer table is ``LAYERS`` in ``tests/test_layering.py``).
"""

from hf_zero.sequence_parallel.attention import UlyssesSPAttentionHF, unregister_from_transformers
from hf_zero.sequence_parallel.dataloader import UlyssesSPDataLoaderAdapter
from hf_zero.sequence_parallel.loss import sequence_parallel_loss
from hf_zero.sequence_parallel.setup import sequence_parallel_size
from hf_zero.sequence_parallel.tiled import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "sequence_parallel_loss", "sequence_parallel_size",
           "unregister_from_transformers", "sequence_tiled_compute", "TiledFusedLogitsLoss", "TiledMLP"]
