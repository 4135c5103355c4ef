"""3D parallelism: data 2 x pipeline 2 x tensor 2 on 8 gloo processes (one spawn), against one process training
the unsplit model on the whole global batch.

``hf_zero.pipeline.wrap(model, num_stages=2, tp_size=2)`` lays the ranks out (pipe, data, model) on one device
mesh; ``initialize`` with ``tensor_parallel.autotp_size: 2`` shards each stage's modules over its TP pair and runs
ZeRO over the data-parallel pair. Tiny Llama with grouped-query attention (4 heads, 2 key/value heads: one per TP
rank) and tied embeddings (the tied copies on the first and last stage are vocabulary shards), tiny GPT-2 (fused
c_attn, tied). Ragged right padding; clipping active (the norm must count every stage, every TP shard once and
every replicated norm weight once); a NaN gradient on one rank only must make every rank skip the step.
"""

from __future__ import annotations

import pytest
import torch

from _pipe_util import padded_micro_batch
from _tp_spawns import case, register

VOCAB, SEQ, MICRO, M, STEPS, LR, CLIP = 64, 8, 2, 2, 2, 0.5, 0.5
DP = 2
CASES = (("llama", 1), ("gpt2", 2))  # (family, ZeRO stage)


def make_model(family: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, attn_implementation="eager"))
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0, attn_implementation="eager"))


def make_batches():
    """[step][replica][micro-batch] dicts, right-padded with ragged lengths."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(DP):
            mbs = []
            for _ in range(M):
                mbs.append(padded_micro_batch(g, MICRO, SEQ, VOCAB))
            step.append(mbs)
        out.append(step)
    return out


def reference(family: str):
    model = make_model(family)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in make_batches():
        flat = [mb for rep in step for mb in rep]
        loss = model(**{k: torch.cat([mb[k] for mb in flat]) for k in flat[0]}).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config(zero: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": M, "gradient_clipping": CLIP,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": zero, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000},
            "tensor_parallel": {"autotp_size": 2}, "pipeline": {"schedule": "1f1b"}, "steps_per_print": 1000}


def _worker():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import hf_zero
    from hf_zero.config.errors import ConfigError
    from hf_zero.pipeline import wrap

    out = {}
    for family, zero in CASES:
        pipe = wrap(make_model(family), num_stages=2, tp_size=2)
        engine, *_ = hf_zero.initialize(model=pipe, config=_config(zero))
        grid = engine.grid
        losses, norms = [], []
        for step in make_batches():
            losses.append(engine.train_batch(iter(step[grid.data_parallel_id])).item())
            norms.append(engine.get_global_grad_norm())
        sharded = sorted(n for n, p in pipe.named_parameters() if isinstance(p, DTensor)
                         and p.to_local().numel() < p.numel())
        state = pipe.hf_state_dict()  # gathers the TP shards (collective over the TP pair)
        out[family] = dict(losses=losses, norms=norms, state={k: v.clone() for k, v in state.items()},
                           sharded=sharded, coords=(grid.stage_id, grid.data_parallel_id,
                                                    grid.get_slice_parallel_rank()),
                           groups={"dp": grid.get_data_parallel_group_ranks(), "pp": list(grid.pp_group),
                                   "tp": list(grid.slice_group)})
        if family == "llama":
            # one rank's gradient turns NaN: the overflow decision, taken from the norm summed over the data,
            # pipeline and tensor groups, must skip the step on all eight ranks
            engine.optimizer.check_overflow = True
            reduce = engine._reduce_gradients
            if dist.get_rank() == 5:
                def poisoned():
                    reduce()
                    engine.groups[0].grad.view(-1)[0] = float("nan")
                engine._reduce_gradients = poisoned
            before = {n: p.to_local().clone() if isinstance(p, DTensor) else p.detach().clone()
                      for n, p in pipe.named_parameters()}
            engine.train_batch(iter(make_batches()[0][grid.data_parallel_id]))
            after = {n: p.to_local() if isinstance(p, DTensor) else p.detach() for n, p in pipe.named_parameters()}
            out[family]["overflow"] = (engine.optimizer.overflow,
                                       all(torch.equal(before[n], after[n]) for n in before))
        engine.destroy()
        dist.barrier()
    # a config that disagrees with the wrapped layout is refused before anything trains
    try:
        hf_zero.initialize(model=wrap(make_model("llama"), num_stages=2, tp_size=2),
                           config={**_config(1), "tensor_parallel": {"autotp_size": 4}})
        out["mismatch"] = "accepted"
    except ConfigError as exc:
        out["mismatch"] = str(exc)
    return out


# in the shared 8-rank process group (tests/_tp_spawns.py; test_tp_3d_checkpoint.py saves its checkpoint there)
register(8, "3d", _worker)


@pytest.fixture(scope="module")
def results():
    return case(8, "3d")


@pytest.mark.parametrize("family", [c[0] for c in CASES])
def test_dp2_pp2_tp2_matches_one_process(results, family):
    ref_losses, ref_norms, ref_state = reference(family)
    assert all(n > CLIP for n in ref_norms), ref_norms  # clipping changes every step
    merged = {}
    for rank, per in enumerate(results):
        r = per[family]
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), (family, rank)
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), (family, rank)
        stage, dp, tp = r["coords"]
        assert rank == stage * 4 + dp * 2 + tp  # (pipe, data, model), tensor innermost
        assert r["groups"] == {"dp": [stage * 4 + tp, stage * 4 + 2 + tp], "pp": [dp * 2 + tp, 4 + dp * 2 + tp],
                               "tp": [stage * 4 + dp * 2, stage * 4 + dp * 2 + 1]}, rank
        # every stage really is split: its projections (and the vocabulary-parallel embedding / head) are shards
        assert any("q_proj" in n or "c_attn" in n for n in r["sharded"]), (rank, r["sharded"])
        for key, value in r["state"].items():
            if key in merged:
                torch.testing.assert_close(value, merged[key], rtol=0, atol=0)  # replicas and TP peers agree
            merged[key] = value
    expected = set(ref_state) - ({"lm_head.weight"} if family in ("llama", "gpt2") else set())
    assert set(merged) == expected, set(merged) ^ expected
    for key in expected:
        torch.testing.assert_close(merged[key], ref_state[key], rtol=1e-5, atol=1e-6, msg=f"{family}: {key}")


def test_3d_overflow_and_refusals(results):
    for rank, per in enumerate(results):
        assert per["llama"]["overflow"] == (True, True), rank  # every rank skipped, no parameter moved
        assert "tensor_parallel.autotp_size" in per["mismatch"] and "tp_size=4" in per["mismatch"], per["mismatch"]
