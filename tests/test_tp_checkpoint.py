"""Checkpoints of a tensor-parallel engine reshard across TP sizes: written at TP 2 after two steps, reloaded at
TP 1 (no tensor parallelism) and at TP 4, the next two steps continue the single-process loss curve (AdamW moments
and step count resharded too). GPT-2 covers the fused q|k|v column order; Llama the grouped-query split. "llama-sp"
trains with sequence parallelism (whole norm weights as replicated DTensors), resumed at TP 1 and at TP 4 with it.
"gpt2-z3" trains under ZeRO-3 (every TP shard partitioned over the data-parallel group), resumed at TP 1 and TP 4
under ZeRO-3 too: the tag holds the unsplit model and the optimizer's shards as at stages 1-2.

The tag is atomic as a whole: re-saving it one step later with TP rank 1's shard write failing raises on both ranks,
naming rank 1, and leaves every byte of the saved tag as it was (the reloads read it); an edited tp.json is refused
naming the file before any parameter changes."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil

import pytest
import torch

from _tp_spawns import SHARED_DIR, case, register
from _tp_util import clipped_adamw_reference, engine_range, make_model

STEPS, SAVED_AT, CLIP, LR = 4, 2, 0.5, 1e-3
KINDS = ("llama", "gpt2", "llama-sp", "gpt2-z3")


def _config(tp: int, kind: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": ({"stage": 3, "stage3_param_persistence_threshold": 0} if kind.endswith("-z3")
                                  else {"stage": 1}), "steps_per_print": 1000,
            "tensor_parallel": {"autotp_size": tp, "sequence_parallel": kind.endswith("-sp") and tp > 1}}


@functools.lru_cache(maxsize=None)
def reference(kind: str) -> list[float]:
    return clipped_adamw_reference(_family(kind), STEPS, lr=LR, clip=CLIP)


def _family(kind: str) -> str:
    return kind.split("-")[0]


def _steps(engine, start: int, stop: int) -> list[float]:
    return engine_range(engine, STEPS, start, stop)


def _digests(path: str) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), path): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(path) for f in files}


def _save(root: str):
    import torch.distributed as dist

    import hf_zero
    import hf_zero.checkpoint.engine as ckpt

    out = {}
    for kind in KINDS:
        engine, *_ = hf_zero.initialize(model=make_model(_family(kind)), config=_config(2, kind))
        out[kind] = _steps(engine, 0, SAVED_AT)
        engine.save_checkpoint(f"{root}/{kind}")
    # the last model again, one step on: re-saving the same tag with TP rank 1's shard write failing
    _steps(engine, SAVED_AT, SAVED_AT + 1)
    before = _digests(f"{root}/{kind}")
    real = ckpt.save_file

    def failing(tensors, filename, metadata=None):
        if "zero_rank" in str(filename):
            raise OSError("disk full (injected)")
        return real(tensors, filename, metadata=metadata)

    if dist.get_rank() == 1:
        ckpt.save_file = failing
    try:
        engine.save_checkpoint(f"{root}/{kind}", tag=f"global_step{SAVED_AT}")
        error = None
    except RuntimeError as exc:
        error = str(exc)
    finally:
        ckpt.save_file = real
    out["failed_resave"] = (error, before == _digests(f"{root}/{kind}"), sorted(os.listdir(f"{root}/{kind}")))
    return out


def _refused_tp_json(root: str, tp: int) -> tuple[str, bool]:
    """A copy whose tp.json was edited (still valid JSON): refused naming it, no parameter moved."""
    import hf_zero
    from hf_zero.checkpoint.files import CheckpointError

    broken = f"{root}/broken-tp{tp}"
    shutil.copytree(f"{root}/{KINDS[0]}", broken)
    info = f"{broken}/global_step{SAVED_AT}/tp.json"
    text = open(info).read()
    open(info, "w").write(text.replace('"tp_size": 2', '"tp_size": 4'))
    engine, *_ = hf_zero.initialize(model=make_model(KINDS[0], seed=7), config=_config(tp, KINDS[0]))
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        engine.load_checkpoint(broken)
        error = "loaded"
    except CheckpointError as exc:
        error = str(exc)
    return error, all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))


def _resume(root: str, tp: int):
    import hf_zero

    out = {"refused": _refused_tp_json(root, tp)} if tp == 1 else {}
    for kind in KINDS:
        # a different initial model: everything must come from the checkpoint
        engine, *_ = hf_zero.initialize(model=make_model(_family(kind), seed=7), config=_config(tp, kind))
        path, _ = engine.load_checkpoint(f"{root}/{kind}")
        assert path is not None and engine.global_steps == SAVED_AT
        out[kind] = _steps(engine, SAVED_AT, STEPS)
    return out


def _z3_dp2(root: str):
    """ZeRO-3 over a real data-parallel pair: saved at (dp 2, tp 2), reloaded at the same layout, at (dp 1, tp 4)
    and at (dp 4, tp 1), all under ZeRO-3 on the same four ranks."""
    import hf_zero

    kind, path = "gpt2-z3", f"{root}/z3-dp2"
    engine, *_ = hf_zero.initialize(model=make_model("gpt2"), config=_config(2, kind))
    out = {"saved": _steps(engine, 0, SAVED_AT)}
    engine.save_checkpoint(path)
    out["straight"] = _steps(engine, SAVED_AT, STEPS)
    engine.destroy()
    for tp in (2, 4, 1):
        engine, *_ = hf_zero.initialize(model=make_model("gpt2", seed=7), config=_config(tp, kind))
        engine.load_checkpoint(path)
        out[tp] = (engine.world_size, _steps(engine, SAVED_AT, STEPS))
        engine.destroy()
    return out


# in the shared process groups (tests/_tp_spawns.py): written by the 2-rank group, which therefore runs first
register(2, "ckpt_save", _save, (SHARED_DIR,))
for _tp in (1, 4):
    register(_tp, "ckpt_resume", _resume, (SHARED_DIR, _tp), after=(2,))
register(4, "ckpt_z3_dp2", _z3_dp2, (SHARED_DIR,))


def test_zero3_checkpoint_over_a_data_parallel_pair_reshards():
    ref = reference("gpt2-z3")
    for rank, out in enumerate(case(4, "ckpt_z3_dp2")):
        assert out[2][0] == 2 and out[4][0] == 1 and out[1][0] == 4, rank  # data-parallel sizes
        # the same layout continues bit for bit; the re-cut ones add the order of another reduction
        assert out[2][1] == out["straight"], (rank, out[2], out["straight"])
        for got in (out["saved"] + out["straight"], out["saved"] + out[4][1], out["saved"] + out[1][1]):
            for s, (a, b) in enumerate(zip(got, ref)):
                assert abs(a - b) <= 1e-5 * b, (rank, s, got, ref)


@pytest.mark.parametrize("tp", [1, 4])
def test_resharded_checkpoint_continues_the_loss_curve(tp):
    before = case(2, "ckpt_save")[0]
    after = case(tp, "ckpt_resume")
    for rank, saved in enumerate(case(2, "ckpt_save")):
        error, unchanged, listing = saved["failed_resave"]
        assert error is not None and "failed on rank 1 (TP rank 1, replica 0)" in error, (rank, error)
        assert "disk full (injected)" in error and "previous checkpoint is untouched" in error, (rank, error)
        assert unchanged and listing == [f"global_step{SAVED_AT}", "latest"], (rank, listing)
    if tp == 1:
        error, unchanged = after[0]["refused"]
        assert "tp.json" in error and "sha256" in error and unchanged, error
    for kind in KINDS:
        ref = reference(kind)
        got = before[kind] + after[0][kind]
        for s, (a, b) in enumerate(zip(got, ref)):
            assert abs(a - b) <= 1e-5 * b, (kind, tp, s, got, ref)
