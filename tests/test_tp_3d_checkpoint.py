"""3D checkpoints (data x pipeline x tensor) reload on another shape and continue the uninterrupted loss curve.

Written by DP 2 x PP 2 x TP 2 on 8 ranks after 2 AdamW steps (clipping active), then reloaded into differently
initialised models on PP 2 x TP 1 at ZeRO 2 (TP re-cut, 2 ranks), PP 1 x TP 2 (stages merged, replicas 2 -> 1,
2 ranks), PP 2 x TP 2 x DP 1 (the saved cut and TP size: each (stage, TP rank) reads its own directory, re-cut for
one replica; 4 ranks) and PP 1 x TP 1 at ZeRO 0 (one process): the next 3 losses equal one process training the
unsplit model on the same global batches (<= 1e-5 relative). Adam's moments and step count must round-trip for
that -- a reload without them is shown to leave the curve -- and the parameters right after the reload equal the
saved per-layer files exactly. A plain pipeline checkpoint (PP 2, no TP) reloads into PP 2 x TP 2, and into PP 2
cut elsewhere. Broken checkpoints (a missing layer file, a model of another shape) are refused on every rank,
naming the file and the parameter, before anything changes.

Tiny Llama with grouped-query attention and tied embeddings (the tied head on the last stage is read under the
embedding's name) and tiny GPT-2 (fused q|k|v, Conv1D weights split along dim 1). The ranks come from the shared
process groups of tests/_tp_spawns.py: the 8-rank save runs in test_tp_3d.py's group.
"""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

from _pipe_util import padded_micro_batch
from _tp_spawns import SHARED_DIR, case, register

VOCAB, SEQ, MICRO, M, LR, CLIP = 64, 8, 2, 4, 1e-2, 0.5  # M micro-batches of MICRO rows: the global batch
SAVED_AT, STEPS = 2, 5
FAMILIES = ("llama", "gpt2")
# world, stages, TP, ZeRO stage (saved at ZeRO 1)
RESHAPES = {"pp2_tp1": (2, 2, 1, 2), "pp1_tp2": (2, 1, 2, 1), "pp2_tp2_dp1": (4, 2, 2, 1), "pp1_tp1": (1, 1, 1, 0)}


def make_model(family: str, seed: int = 0, intermediate: int = 48):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
            attn_implementation="eager"))
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0, attn_implementation="eager"))


def make_batches():
    """[step][micro-batch] dicts, right-padded with ragged lengths; replica d of D reads micro-batches
    [d*M/D, (d+1)*M/D)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        mbs = []
        for _ in range(M):
            mbs.append(padded_micro_batch(g, MICRO, SEQ, VOCAB))
        out.append(mbs)
    return out


@functools.lru_cache(maxsize=None)
def reference(family: str) -> list[float]:
    model = make_model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for mbs in make_batches():
        loss = model(**{k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0]}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _config(micro_batches: int, tp: int, zero: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": micro_batches,
            "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": zero}, "tensor_parallel": {"autotp_size": tp},
            "pipeline": {"schedule": "1f1b"}, "steps_per_print": 1000}


def _engine(family: str, stages: int, tp: int, seed: int = 0, zero: int = 1, layers_per_stage=None, **model_kw):
    import torch.distributed as dist

    import hf_zero
    from hf_zero.pipeline import wrap

    dp = dist.get_world_size() // (stages * tp)
    pipe = wrap(make_model(family, seed, **model_kw), num_stages=stages, tp_size=tp, layers_per_stage=layers_per_stage)
    engine, *_ = hf_zero.initialize(model=pipe, config=_config(M // dp, tp, zero))
    return engine, pipe


def _train(engine, start: int, stop: int) -> list[float]:
    m = engine.micro_batches
    d = engine.grid.data_parallel_id
    return [engine.train_batch(iter(make_batches()[s][d * m:(d + 1) * m])).item() for s in range(start, stop)]


def _done(engine) -> None:
    import torch.distributed as dist

    engine.destroy()
    dist.barrier()


def _save(root: str, stages: int, tp: int, name: str) -> dict:
    out = {}
    for family in FAMILIES:
        engine, _ = _engine(family, stages, tp)
        out[family] = _train(engine, 0, SAVED_AT)
        engine.save_checkpoint(os.path.join(root, name, family))
        _done(engine)
    return out


def _file_diff(pipe, root: str) -> float:
    """Largest difference between the model's gathered tensors and the per-layer files (a TP collective)."""
    sd = pipe.hf_state_dict()
    tag = open(os.path.join(root, "latest")).read()
    worst = 0.0
    for key, value in sd.items():
        saved = torch.load(os.path.join(root, tag, f"layer_{pipe.unit_of(key):02d}-model_states.pt"))[key]
        worst = max(worst, (value.float() - saved.float()).abs().max().item())
    return worst


def _resume(root: str, name: str, stages: int, tp: int, zero: int = 1, load_optimizer_states: bool = True,
            layers_per_stage=None) -> dict:
    out = {}
    for family in FAMILIES:
        # a different initial model: everything must come from the checkpoint
        engine, pipe = _engine(family, stages, tp, seed=7, zero=zero, layers_per_stage=layers_per_stage)
        path = os.path.join(root, name, family)
        engine.load_checkpoint(path, load_optimizer_states=load_optimizer_states)
        out[family] = {"steps": engine.global_steps, "file_diff": _file_diff(pipe, path),
                       "losses": _train(engine, SAVED_AT, STEPS)}
        _done(engine)
    return out


def _refusals(root: str, stages: int) -> dict:
    """Broken copies of the 3D checkpoint: every rank raises, and no parameter moved."""
    import torch.distributed as dist

    from hf_zero.checkpoint.files import CheckpointError

    src = os.path.join(root, "3d", "llama")
    broken = os.path.join(root, f"broken-{stages}")
    if dist.get_rank() == 0:
        shutil.copytree(src, broken)
        tag = open(os.path.join(src, "latest")).read()
        os.remove(os.path.join(broken, tag, "layer_03-model_states.pt"))  # the final norm (and tied head's stage)
    dist.barrier()
    out = {}
    for what, path, kw in (("missing", broken, {}), ("shape", src, {"intermediate": 40})):
        engine, pipe = _engine("llama", stages, 1, seed=7, **kw)
        before = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        try:
            engine.load_checkpoint(path)
            out[what] = "loaded"
        except CheckpointError as exc:
            out[what] = str(exc)
        out[what + "_unchanged"] = all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())
        _done(engine)
    return out


# the 8-rank save shares test_tp_3d.py's process group; the reloads run in the shared 1-, 2- and 4-rank groups
register(8, "3d_ckpt_save", _save, (SHARED_DIR, 2, 2, "3d"))
register(2, "plain_ckpt_save", _save, (SHARED_DIR, 2, 1, "plain"))
for _name, (_world, _stages, _tp, _zero) in RESHAPES.items():
    register(_world, f"3d_resume_{_name}", _resume, (SHARED_DIR, "3d", _stages, _tp, _zero), after=(8,))
register(1, "3d_resume_no_optimizer_state", _resume, (SHARED_DIR, "3d", 1, 1, 0, False), after=(8,))
register(4, "plain_into_3d", _resume, (SHARED_DIR, "plain", 2, 2), after=(2,))
# the same number of stages cut elsewhere (both decoder layers on stage 0): re-staged, not read as the saved cut
register(2, "plain_other_cut", _resume, (SHARED_DIR, "plain", 2, 1, 1, True, [2, 0]))
register(2, "3d_refusals", _refusals, (SHARED_DIR, 2), after=(8,))


def _close(got: list[float], ref: list[float]) -> bool:
    return all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, ref, strict=True))


def test_3d_save_matches_one_process():
    for rank, per in enumerate(case(8, "3d_ckpt_save")):
        for family in FAMILIES:
            assert _close(per[family], reference(family)[:SAVED_AT]), (rank, family, per[family])


@pytest.mark.parametrize("shape", list(RESHAPES))
def test_3d_checkpoint_continues_the_loss_curve_on_another_shape(shape):
    world = RESHAPES[shape][0]
    for rank, per in enumerate(case(world, f"3d_resume_{shape}")):
        for family in FAMILIES:
            r = per[family]
            assert r["steps"] == SAVED_AT, (shape, rank, family)
            assert r["file_diff"] == 0.0, (shape, rank, family)  # parameters restored exactly, re-cut or not
            assert _close(r["losses"], reference(family)[SAVED_AT:]), (shape, rank, family, r["losses"],
                                                                       reference(family))


def test_optimizer_state_matters():
    # the same reload without Adam's moments and step count: the curve leaves the reference by far more than the
    # tolerance, so the tests above do check the optimizer state
    for family in FAMILIES:
        got = case(1, "3d_resume_no_optimizer_state")[0][family]["losses"]
        ref = reference(family)[SAVED_AT:]
        assert max(abs(a - b) / b for a, b in zip(got, ref)) > 1e-3, (family, got, ref)


def test_plain_pipeline_checkpoint_into_3d():
    saved = case(2, "plain_ckpt_save")
    for family in FAMILIES:
        assert _close(saved[0][family], reference(family)[:SAVED_AT]), (family, saved[0][family])
    for rank, per in enumerate(case(4, "plain_into_3d")):
        for family in FAMILIES:
            r = per[family]
            assert r["file_diff"] == 0.0 and r["steps"] == SAVED_AT, (rank, family)
            assert _close(r["losses"], reference(family)[SAVED_AT:]), (rank, family, r["losses"])


def test_pipeline_checkpoint_on_another_cut_of_as_many_stages():
    for rank, per in enumerate(case(2, "plain_other_cut")):
        for family in FAMILIES:
            r = per[family]
            assert r["file_diff"] == 0.0 and r["steps"] == SAVED_AT, (rank, family)
            assert _close(r["losses"], reference(family)[SAVED_AT:]), (rank, family, r["losses"])


def test_broken_3d_checkpoint_is_refused_before_anything_changes():
    per = case(2, "3d_refusals")  # PP 2 x TP 1: stage 1 misses its layer file, stage 0 must refuse too
    assert "layer_03-model_states.pt" in per[1]["missing"] and "is missing" in per[1]["missing"], per[1]
    assert "failed on rank 1" in per[0]["missing"] and "layer_03-model_states.pt" in per[0]["missing"], per[0]
    assert "layer_01-model_states.pt" in per[0]["shape"] and "model.layers.0.mlp.gate_proj.weight" in per[0]["shape"]
    assert "(40, 32)" in per[0]["shape"] and "(48, 32)" in per[0]["shape"], per[0]["shape"]
    for r in per:
        assert r["missing_unchanged"] and r["shape_unchanged"], r
