"""A run that trained on DeepSpeed resumes on hf_zero from DeepSpeed's own checkpoint files.

``tests/data/deepspeed_checkpoints/<variant>/ckpt`` was written by DeepSpeed 0.19.8 on 2 CPU ranks after 3 steps
(``make_fixtures.py`` there: stages 0-3, fp32 and bf16, one or two optimizer parameter groups);
``continued.pt`` is what DeepSpeed computed in the two steps after the save: the losses and every parameter's fp32
weight (and Adam moments). hf_zero loads the tag with ``engine.load_checkpoint`` -- on 1 and 2 ranks, at its own
ZeRO stage -- and trains the same two steps: the losses and weights must be DeepSpeed's. The reader alone must give
DeepSpeed's weights and moments bit for bit, and ``zero_to_fp32`` must convert the tags.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from hf_zero.checkpoint.deepspeed_format import read_deepspeed_tag
from hf_zero.checkpoint.files import CheckpointError
from hf_zero.testing import run_distributed

DATA = Path(__file__).parent / "data" / "deepspeed_checkpoints"
sys.path.insert(0, str(DATA))
from make_fixtures import Tiny, batch, config, loss_of, param_groups  # noqa: E402  (the model DeepSpeed trained)

VARIANTS = sorted(p.name for p in DATA.iterdir() if (p / "ckpt").is_dir())


def _parse(variant: str) -> tuple[int, str, int]:
    stage, prec, groups = variant.split("_")
    return int(stage[len("stage"):]), prec, int(groups[len("groups"):])


def test_fixtures_present():
    assert len(VARIANTS) == 7, VARIANTS  # stages 0-3, fp32/bf16, 1-2 groups: a lost directory fails here
    assert UNIVERSAL == ["stage2_fp32_groups2", "stage3_bf16_groups2"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_reader_gives_deepspeeds_values_bit_for_bit(variant):
    """The fp32 masters and Adam moments reassembled from DeepSpeed's flat partitions are, bit for bit, what
    DeepSpeed's own safe_get_full_* returned just before the save; counters, scheduler, client_state as saved."""
    stage, prec, groups = _parse(variant)
    ref = torch.load(DATA / variant / "continued.pt", weights_only=True)
    tag = read_deepspeed_tag(DATA / variant / "ckpt" / "global_step3")
    assert (tag.stage, tag.world_size, tag.global_steps, tag.global_samples) == (stage, 2, 3, 12)
    assert tag.client_state["epoch"] == 7
    assert tag.lr_scheduler == {"last_batch_iteration": 2}
    if stage == 0:  # no names in a stage-0 optimizer: positions (matched by the engine, tested below)
        assert [len(g) for g in tag.groups] == ([5] if prec == "fp32" else [1])
        return
    named = tag.named_fp32()
    expected = {n: p.shape for n, p in Tiny().named_parameters() if p.requires_grad}
    assert {n: t.shape for n, t in named.items()} == expected
    states = {name: st for group, sts in zip(tag.groups, tag.states) for (name, _), st in zip(group, sts)}
    for name in expected:
        assert torch.equal(named[name], ref[f"saved:{name}"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            if f"saved:{name}:{key}" in ref:
                assert torch.equal(states[name][key], ref[f"saved:{name}:{key}"]), (name, key)
            assert states[name][key].shape == expected[name]
    assert tag.steps == [3] * groups
    assert {n: tuple(t.shape) for n, t in tag.frozen.items()} == ({"frozen.weight": (3, 3), "frozen.bias": (3,)}
                                                                   if stage > 1 else {})


def _resume(variant: str, stage: int, world: int, tmp: str, universal: bool = False):
    return _resume_dir(str(DATA / variant / ("universal" if universal else "ckpt")), stage, world, universal,
                       _parse(variant)[1], _parse(variant)[2])


def _resume_dir(load_dir: str, stage: int, world: int, universal: bool = True, prec: str = "fp32", groups: int = 2):
    """On each rank: an hf_zero engine at ZeRO ``stage`` loads DeepSpeed's tag and trains steps 3 and 4 on the same
    global batches as DeepSpeed's 2 ranks did. Returns (losses, fp32 weights and moments, lr, client_state)."""
    import torch.distributed as dist

    import hf_zero
    from hf_zero.zero.tensor_fragment import safe_get_full_fp32_param, safe_get_full_optimizer_state

    torch.manual_seed(123)  # other initial weights than DeepSpeed's: the load must replace them all
    model = Tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        model.scale.fill_(9.0)
    cfg = config(stage, prec)
    cfg["train_micro_batch_size_per_gpu"] = 4 // world
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = hf_zero.initialize(model=model, model_parameters=param_groups(model, groups), config=cfg)
    path, client = engine.load_checkpoint(load_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for step in (3, 4):
        rows = torch.cat([batch(step, r) for r in range(2)])  # DeepSpeed's two ranks' micro-batches
        mine = rows.chunk(world)[rank]
        loss = loss_of(engine(mine))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
        losses.append(float(mean) / world)
    out = {}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            out[n] = safe_get_full_fp32_param(p)
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{n}:{key}"] = safe_get_full_optimizer_state(p, key)
    frozen = {n: p.detach().clone() for n, p in engine.module.named_parameters() if not p.requires_grad} \
        if stage < 3 else {}
    scale = engine.module.scale.detach().clone()
    lr = engine.get_lr()[0]
    engine.destroy()
    return losses, out, lr, {"epoch": client.get("epoch"), "path": path}, frozen, scale


CASES = [(v, s, w) for v in VARIANTS for s, w in (((_parse(v)[0], 1), (3 if _parse(v)[0] < 3 else 1, 2)))]


UNIVERSAL = sorted(p.name for p in DATA.iterdir() if (p / "universal").is_dir())
CASES += [(v, s, w, True) for v in UNIVERSAL for s, w in ((1, 2), (3, 1))]
CASES = [c if len(c) == 4 else (*c, False) for c in CASES]


@pytest.mark.parametrize("variant,stage,world,universal", CASES,
                         ids=[f"{v}{'-universal' if u else ''}-as-stage{s}-{w}ranks" for v, s, w, u in CASES])
def test_resume_continues_deepspeeds_run(variant, stage, world, universal, tmp_path):
    """(universal: ds_to_universal's output of the same tag, loaded with checkpoint.load_universal, which names
    the tag by 'latest_universal', as DeepSpeed does)"""
    ref = torch.load(DATA / variant / "continued.pt", weights_only=True)
    results = run_distributed(_resume, world, args=(variant, stage, world, str(tmp_path), universal))
    losses, weights, lr, client, frozen, scale = results[0]
    _, prec, _ = _parse(variant)
    tol = dict(rtol=1e-5, atol=1e-6) if prec == "fp32" else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), **tol)
    for name, value in ref.items():
        if name in ("losses", "lr") or name.startswith("saved:") or value is None:
            continue  # (DeepSpeed's safe_get_full_optimizer_state gives None without ZeRO)
        torch.testing.assert_close(weights[name], value.float(), **tol, msg=lambda m: f"{name}: {m}")
    assert lr == pytest.approx(ref["lr"], rel=1e-9)
    assert client["epoch"] == 7
    expected_tag = "universal/global_step3_universal" if universal else "ckpt/global_step3"
    assert client["path"] == str(DATA / variant / expected_tag)
    assert torch.equal(scale, torch.arange(1.0, 4.0))  # the buffer is DeepSpeed's, not the model's 9.0
    tag = read_deepspeed_tag(DATA / variant / "ckpt" / "global_step3")
    for name, value in frozen.items():  # never trained: DeepSpeed's saved values, not this model's (+1.0)
        assert torch.equal(value, tag.frozen.get(name, tag.module[name]).to(value.dtype)), name


def _load_expect_error(ckpt: str):
    import hf_zero

    model = Tiny()
    model.b = torch.nn.Linear(7, 4)  # another shape than DeepSpeed's
    engine, *_ = hf_zero.initialize(model=model, model_parameters=param_groups(model, 1), config=config(2, "fp32"))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    try:
        engine.load_checkpoint(ckpt)
    except CheckpointError as exc:
        unchanged = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
        return str(exc), unchanged
    return None, None


def test_mismatched_model_is_refused_naming_the_parameter_and_nothing_changes():
    msg, unchanged = run_distributed(_load_expect_error, 1, args=(str(DATA / "stage2_fp32_groups2" / "ckpt"),))[0]
    assert msg is not None and "'b.weight'" in msg and "21 elements" in msg and "28" in msg, msg
    assert unchanged


def test_corrupt_deepspeed_file_is_named(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / "stage1_fp32_groups1" / "ckpt", ckpt)
    bad = ckpt / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    bad.write_bytes(bad.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        read_deepspeed_tag(ckpt / "global_step3")


def test_tensor_parallel_deepspeed_checkpoint_is_refused_by_name(tmp_path):
    tag = tmp_path / "global_step1"
    shutil.copytree(DATA / "stage0_fp32_groups1" / "ckpt" / "global_step3", tag)
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointError, match="tensor-parallel"):
        read_deepspeed_tag(tag)


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_to_fp32_converts_deepspeeds_checkpoints(variant, tmp_path):
    """``deepspeed.utils.zero_to_fp32`` on a DeepSpeed run's directory (hf_zero answering ``import deepspeed``): the
    fp32 masters at the save, the frozen layer and the buffer, under the model's names; the file it writes holds
    the same. Stage 0 (DeepSpeed's converter refuses it): the saved fp32 module; a 16-bit one is refused by name."""
    from hf_zero.checkpoint import zero_to_fp32 as z2f

    stage, prec, _ = _parse(variant)
    ckpt = DATA / variant / "ckpt"
    ref = torch.load(DATA / variant / "continued.pt", weights_only=True)
    if stage == 0 and prec == "bf16":
        with pytest.raises(CheckpointError, match="saved in torch.bfloat16.*engine.load_checkpoint"):
            z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt)
        return
    sd = z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert sorted(sd) == sorted(Tiny().state_dict())
    for name, p in Tiny().named_parameters():
        if p.requires_grad and stage > 0:
            assert torch.equal(sd[name], ref[f"saved:{name}"]), name
        # trainable: the fp32 masters; frozen: as saved (16-bit under bf16), as DeepSpeed's converter gives them
        assert sd[name].dtype == (torch.float32 if p.requires_grad or prec == "fp32" else torch.bfloat16), name
        assert sd[name].shape == p.shape
    assert torch.equal(sd["scale"], torch.arange(1.0, 4.0))
    torch.manual_seed(0)
    init = Tiny()  # DeepSpeed's model at seed 0: the frozen layer never moved
    expect = init.frozen.weight.detach().to(torch.bfloat16 if prec == "bf16" else torch.float32)
    assert torch.equal(sd["frozen.weight"].to(expect.dtype), expect)
    trimmed = z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True)
    if stage > 0:
        assert "frozen.weight" not in trimmed and "a.weight" in trimmed
    out = tmp_path / "model.safetensors"
    z2f.convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(out), safe_serialization=True)
    from safetensors.torch import load_file

    written = load_file(str(out))
    assert sorted(written) == sorted(sd) and all(torch.equal(written[k], sd[k]) for k in sd)


def _load_universal_flag_on_ordinary_tag(ckpt: str):
    import hf_zero

    model = Tiny()
    cfg = {**config(2, "fp32"), "checkpoint": {"load_universal": True}}
    engine, *_ = hf_zero.initialize(model=model, model_parameters=param_groups(model, 2), config=cfg)
    assert engine.load_universal_checkpoint() is True  # DeepSpeed's getter
    try:
        engine.load_checkpoint(ckpt, tag="global_step3")
    except CheckpointError as exc:
        return str(exc)


def test_load_universal_refuses_an_ordinary_tag_naming_the_key():
    msg = run_distributed(_load_universal_flag_on_ordinary_tag, 1,
                          args=(str(DATA / "stage2_fp32_groups2" / "ckpt"),))[0]
    assert msg is not None and "checkpoint.load_universal is true" in msg and "global_step3" in msg, msg


@pytest.mark.parametrize("variant", ["stage2_fp32_groups2", "stage3_bf16_groups2"])
def test_zero_to_fp32_converts_universal_checkpoints(variant):
    from hf_zero.checkpoint import zero_to_fp32 as z2f

    ref = torch.load(DATA / variant / "continued.pt", weights_only=True)
    sd = z2f.get_fp32_state_dict_from_zero_checkpoint(DATA / variant / "universal", tag="global_step3_universal")
    assert sorted(sd) == sorted(Tiny().state_dict())
    for name, p in Tiny().named_parameters():
        if p.requires_grad:
            assert torch.equal(sd[name], ref[f"saved:{name}"]), name
    assert torch.equal(sd["scale"], torch.arange(1.0, 4.0))


# ---- ds_to_universal: DeepSpeed's command, over DeepSpeed's tags and hf_zero's -----------------------------------

def test_ds_to_universal_of_a_deepspeed_tag_equals_deepspeeds_own(tmp_path):
    """hf_zero's ``ds_to_universal`` on DeepSpeed's stage-3 tag writes the values DeepSpeed's own command wrote
    (tests/data/.../universal, from DeepSpeed 0.19.8), bit for bit, and names the output in latest_universal."""
    from hf_zero.checkpoint.to_universal import main, parse_arguments

    out = tmp_path / "u" / "global_step3_universal"
    variant = DATA / "stage3_bf16_groups2"
    assert main(parse_arguments(["--input_folder", str(variant / "ckpt" / "global_step3"),
                                 "--output_folder", str(out), "--inject_missing_state"])) == 0
    assert (tmp_path / "u" / "latest_universal").read_text() == "global_step3_universal"
    theirs = variant / "universal" / "global_step3_universal" / "zero"
    compared = 0
    for ref in sorted(theirs.glob("*/*.pt")):
        if ref.name == "step.pt":
            continue
        mine = torch.load(out / "zero" / ref.parent.name / ref.name, weights_only=True)["param"]
        expect = torch.load(ref, weights_only=True)
        expect = expect["param"] if isinstance(expect, dict) else expect  # (DeepSpeed's ZeRO-3 ones: bare tensors)
        assert torch.equal(mine.reshape(-1), expect.reshape(-1).float()), ref
        compared += 1
    assert compared == 15  # 5 trainable parameters x (fp32, exp_avg, exp_avg_sq)


def _save_then_continue(root: str):
    """hf_zero, 2 ranks, ZeRO-2: 3 steps, save, 2 more steps; returns the 2 losses."""
    import torch.distributed as dist

    import hf_zero

    torch.manual_seed(0)
    model = Tiny()
    engine, *_ = hf_zero.initialize(model=model, model_parameters=param_groups(model, 2), config=config(2, "fp32"))
    rank = dist.get_rank()
    losses = []
    for step in range(5):
        loss = loss_of(engine(batch(step, rank)))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / 2)
        if step == 2:
            engine.save_checkpoint(root, client_state={"epoch": 7})
    engine.destroy()
    return losses[3:]


def test_ds_to_universal_of_an_hf_zero_tag_loads_with_load_universal(tmp_path):
    """A DeepSpeed universal-checkpoint workflow, unchanged, on hf_zero: save on 2 ranks (ZeRO-2), run
    ``python -m deepspeed.checkpoint.ds_to_universal``, load with ``checkpoint.load_universal`` on 1 rank at ZeRO-3:
    the next two steps are the uninterrupted run's."""
    import subprocess

    root = tmp_path / "ckpt"
    reference = run_distributed(_save_then_continue, 2, args=(str(root),))[0]
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(root / "global_step3"), "--output_folder", str(root / "global_step3_universal"),
                           "--num_extract_workers", "8", "--no_strict"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    # DeepSpeed's tuning flags are accepted and each named on stderr with what happens instead
    notes = [line for line in done.stderr.splitlines() if "has no effect" in line]
    assert notes == ["hf_zero: --num_extract_workers has no effect in hf_zero's converter: this process reads the "
                     "tag itself, without worker processes",
                     "hf_zero: --no_strict has no effect in hf_zero's converter: the checks stay strict (a parameter "
                     "missing from the tag is an error)"], done.stderr
    assert (root / "latest_universal").read_text() == "global_step3_universal"
    losses, _, _, client, _, scale = run_distributed(_resume_dir, 1, args=(str(root), 3, 1))[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)
    assert client == {"epoch": 7, "path": str(root / "global_step3_universal")}
    assert torch.equal(scale, torch.arange(1.0, 4.0))


def _universal_flag_on_other_engines(tmp: str):
    """checkpoint.load_universal where universal checkpoints cannot go: a pipeline engine refuses it by name."""
    import torch.nn.functional as F

    import hf_zero
    from hf_zero.pipe import PipelineModule

    sys.path.insert(0, str(Path(__file__).parent))
    from _pipe_util import ADAM, ds_config, layer_list

    net = PipelineModule(layer_list(False), num_stages=1, loss_fn=F.mse_loss, partition_method="uniform")
    cfg = {**ds_config(1, 0, "gpipe", optimizer=ADAM), "checkpoint": {"load_universal": True}}
    engine, *_ = hf_zero.initialize(model=net, config=cfg)
    try:
        engine.load_checkpoint(tmp)
    except NotImplementedError as exc:
        return str(exc)


def test_load_universal_is_refused_by_a_pipeline_engine(tmp_path):
    msg = run_distributed(_universal_flag_on_other_engines, 1, args=(str(tmp_path),))[0]
    assert msg is not None and "checkpoint.load_universal with a pipeline engine" in msg, msg


def _universal_flag_on_a_tp_engine(tmp: str):
    import hf_zero

    sys.path.insert(0, str(Path(__file__).parent))
    from _tp_util import make_model

    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2},
           "checkpoint": {"load_universal": True}}
    engine, *_ = hf_zero.initialize(model=make_model("llama"), config=cfg)
    try:
        engine.load_checkpoint(tmp)
    except NotImplementedError as exc:
        return str(exc)


def test_load_universal_is_refused_by_a_tensor_parallel_engine(tmp_path):
    for msg in run_distributed(_universal_flag_on_a_tp_engine, 2, args=(str(tmp_path),)):
        assert msg is not None and "checkpoint.load_universal with tensor parallelism" in msg, msg
