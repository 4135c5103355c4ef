"""A re-cut load (another TP size, another pipeline cut) is verified like any load and writes nothing into the
checkpoint it reads (issue #25; hf_zero/checkpoint/reshard.py).

* TP: written at TP 2 after two steps, loaded at TP 1 (one rank): no "unverified" line is logged (the re-cut
  one-rank checkpoint carries its manifest), the next steps continue the single-process loss curve; a saved
  part's shard file with one flipped byte is refused naming that file; and the re-cut's own output is verified:
  a flipped byte in it is refused too.
* Pipeline: written on 2 stages, re-staged onto 1 stage from a read-only directory (``chmod -R a-w``; as root,
  where the mode does not stop writes, the check that counts is that every file's name, size and mtime is as it
  was), and training continues on the reference's loss curve.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_zero.testing import run_distributed

from _pipe_util import ADAM, data, ds_config, layer_list, reference_run
from _tp_util import clipped_adamw_reference, engine_range, make_model

TP_STEPS, TP_SAVED_AT, CLIP, LR = 3, 2, 0.5, 1e-3


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _tp_config(tp: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 1}, "steps_per_print": 1000, "tensor_parallel": {"autotp_size": tp}}


def _tp_reference() -> list[float]:
    return clipped_adamw_reference("llama", TP_STEPS, lr=LR, clip=CLIP)


def _tp_steps(engine, start: int, stop: int) -> list[float]:
    return engine_range(engine, TP_STEPS, start, stop)


def _tp_save(root: str) -> list[float]:
    import hf_zero

    engine, *_ = hf_zero.initialize(model=make_model("llama"), config=_tp_config(2))
    losses = _tp_steps(engine, 0, TP_SAVED_AT)
    engine.save_checkpoint(root)
    return losses


def _flip_byte(path: str) -> None:
    blob = bytearray(open(path, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    open(path, "wb").write(bytes(blob))


def _tp_load_at_one(root: str) -> dict:
    import hf_zero
    from hf_zero.checkpoint.disk_format import open_saved
    from hf_zero.checkpoint.files import CheckpointError, read_manifest
    from hf_zero.checkpoint.reshard import TPCut, write_recut

    out = {}
    lines = _Lines()
    logging.getLogger("hf_zero").addHandler(lines)
    try:
        engine, *_ = hf_zero.initialize(model=make_model("llama", seed=7), config=_tp_config(1))
        path, _ = engine.load_checkpoint(root)
    finally:
        logging.getLogger("hf_zero").removeHandler(lines)
    out["path"], out["steps"], out["lines"] = path, engine.global_steps, lines.lines
    out["losses"] = _tp_steps(engine, TP_SAVED_AT, TP_STEPS)

    # a flipped byte in a saved part's shard file: refused naming it, nothing changed
    broken = f"{root}-broken"
    shutil.copytree(root, broken)
    tag = open(f"{root}/latest").read()
    shard = f"{broken}/{tag}/tp/rank01/state/zero_rank00000.safetensors"
    _flip_byte(shard)
    fresh, *_ = hf_zero.initialize(model=make_model("llama", seed=7), config=_tp_config(1))
    before = [p.detach().clone() for p in fresh.module.parameters()]
    try:
        fresh.load_checkpoint(broken)
        out["corrupt part"] = "loaded"
    except CheckpointError as exc:
        out["corrupt part"] = str(exc)
    out["corrupt part unchanged"] = all(torch.equal(a, p) for a, p in zip(before, fresh.module.parameters()))

    # the re-cut's own output (what the load above read, from a temporary directory) carries a manifest, so it is
    # verified as any checkpoint is
    saved_root = Path(root) / tag
    info = json.loads((saved_root / "tp.json").read_text())
    recut_dir = Path(f"{root}-recut")
    write_recut(recut_dir, fresh.groups, [[saved_root / "tp" / f"rank{r:02d}" / "state" for r in range(2)]],
                cut=TPCut(saved_tp=2, saved_layouts=info["params"], info_file=saved_root / "tp.json"),
                parts_root=saved_root / "tp")
    out["recut manifest"] = sorted(read_manifest(recut_dir))
    _flip_byte(f"{recut_dir}/zero_rank00000.safetensors")
    try:
        open_saved(recut_dir)
        out["corrupt recut"] = "opened"
    except CheckpointError as exc:
        out["corrupt recut"] = str(exc)
    return out


def test_tp_recut_is_verified_and_continues_the_loss_curve(tmp_path):
    root = str(tmp_path / "tp")
    ref = _tp_reference()
    saved = run_distributed(_tp_save, world_size=2, args=(root,), timeout_s=300)
    assert saved[0] == pytest.approx(ref[:TP_SAVED_AT], rel=1e-4)
    (got,) = run_distributed(_tp_load_at_one, world_size=1, args=(root,), timeout_s=300)
    assert got["steps"] == TP_SAVED_AT and got["path"] is not None
    assert not [line for line in got["lines"] if "unverified" in line], got["lines"]
    assert got["losses"] == pytest.approx(ref[TP_SAVED_AT:], rel=1e-4)
    assert "tp/rank01/state/zero_rank00000.safetensors" in got["corrupt part"], got["corrupt part"]
    assert "sha256" in got["corrupt part"] and got["corrupt part unchanged"], got["corrupt part"]
    assert got["recut manifest"] == ["engine_state.pt", "meta.json", "zero_rank00000.safetensors"]
    assert "zero_rank00000.safetensors" in got["corrupt recut"] and "sha256" in got["corrupt recut"], \
        got["corrupt recut"]


# ---- pipeline: re-stage from a read-only checkpoint --------------------------------------------------------------
M = 2  # micro-batches per step when saving


def _pipe_run(ckpt: str, stages: int, start: int, steps: int, save: bool):
    import hf_zero
    from hf_zero.pipe import PipelineModule

    net = PipelineModule(layer_list(True), num_stages=stages, loss_fn=F.mse_loss, seed_layers=True,
                         partition_method="uniform")
    engine, *_ = hf_zero.initialize(model=net, config=ds_config(M, 0, "gpipe", optimizer=ADAM))
    lines = _Lines()
    logging.getLogger("hf_zero").addHandler(lines)
    try:
        if start:
            engine.load_checkpoint(ckpt)
    finally:
        logging.getLogger("hf_zero").removeHandler(lines)
    x, y = data(3, M, 1)
    losses = [engine.train_batch(iter([(x[s, j, 0], y[s, j, 0]) for j in range(M)])).item()
              for s in range(start, start + steps)]
    if save:
        engine.save_checkpoint(ckpt)
    return losses, engine.global_steps, lines.lines


def _listing(root: str) -> dict[str, tuple[int, int]]:
    """Every file and directory under ``root``: (size, mtime in ns) -- a write anywhere changes it."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.stat(os.path.join(d, name))
            out[os.path.relpath(os.path.join(d, name), root)] = (st.st_size if name in files else 0, st.st_mtime_ns)
    return out


def _make_read_only(root: str, writable: bool) -> None:
    bits = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
    for d, dirs, files in os.walk(root):
        for p in [d] + [os.path.join(d, f) for f in files]:
            mode = os.stat(p).st_mode
            os.chmod(p, (mode | stat.S_IWUSR) if writable else (mode & ~bits))


def test_pipeline_restage_from_a_read_only_checkpoint(tmp_path):
    ckpt = str(tmp_path / "pipe")
    ref_losses, _, _, _ = reference_run(True, 3, M, 1, adam=True)
    saved = run_distributed(_pipe_run, world_size=2, args=(ckpt, 2, 0, 2, True), timeout_s=300)
    assert saved[0][0] == pytest.approx(ref_losses[:2], rel=1e-5)
    before = _listing(ckpt)
    _make_read_only(ckpt, writable=False)
    try:
        (got,) = run_distributed(_pipe_run, world_size=1, args=(ckpt, 1, 2, 1, False), timeout_s=300)
        after = _listing(ckpt)
    finally:
        _make_read_only(ckpt, writable=True)  # so that pytest can remove tmp_path
    losses, global_steps, lines = got
    assert global_steps == 3 and losses == pytest.approx(ref_losses[2:], rel=1e-5)
    assert after == before, sorted(set(after) ^ set(before))  # nothing written, renamed or touched inside it
    assert not [line for line in lines if "unverified" in line], lines
