"""``deepspeed.utils.zero_to_fp32`` and the ``zero_to_fp32.py`` script every checkpoint directory gets (#26 items
10 and 12): a checkpoint saved by 2 ranks at ZeRO stage 0-3 is consolidated offline -- one process, no process
group -- into exactly the engine's full parameters (fp32 masters: bitwise), buffers, frozen and tied weights.

The model has what a consolidator can get wrong: uneven shards (every size prime-ish), a frozen layer, a tied weight
(two names, one tensor), BatchNorm buffers (floating statistics and an int64 counter).

DeepSpeed 0.19.8's run of this test's training and save (scripts/ds_pattern_workers.py::zero_to_fp32, the same
Tiny model, config and batches, 2 CPU ranks), then its own ``get_fp32_state_dict_from_zero_checkpoint`` on rank 0:
stages 2 and 3 give every key of the engine's state dict, each equal to the engine's tensor (torch.equal),
``num_batches_tracked`` int64 (as here), head/embed one tensor; stage 1 drops the frozen layer (frozen.weight,
frozen.bias missing); stage 0 fails (TypeError: 'NoneType' object is not iterable: no ZeRO files). hf_zero returns the
full set at every stage 0-3. From DeepSpeed's source: it reads its own layout (``mp_rank_00_model_states.pt``,
``*_optim_states.pt``), returns the fp32 masters for trainable parameters, the frozen parameters as saved, tied names
sharing one tensor;
``tag=None`` without ``latest`` is a ValueError, a missing tag directory a FileNotFoundError (the same types here);
``convert_zero_checkpoint_to_fp32_state_dict(dir, out, max_shard_size, safe_serialization)`` writes
``pytorch_model.bin`` / ``model.safetensors`` shards with transformers' index file, as here. A stage-0 fp32 DeepSpeed
run writes no ZeRO optimizer files, so its converter has nothing to read; here stage 0 converts like the others.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import hf_zero
from hf_zero.integrations.deepspeed_shim._finder import install
from hf_zero.testing import run_distributed

from _parity import full_optimizer_state

install()  # as the start-up .pth line does in an installed hf_zero
z2f = importlib.import_module("deepspeed.utils.zero_to_fp32")

VOCAB, DIM, BATCH = 11, 7, 6
FROZEN = ("frozen.weight", "frozen.bias")


class Tiny(nn.Module):
    def __init__(self, batch_norm: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        # buffers: running_mean/var (fp32), num_batches_tracked (int64). Not under bf16: hf_zero casts parameters,
        # not buffers, to bf16 (DeepSpeed's module.bfloat16() casts both), and CPU batch_norm refuses the mix
        self.norm = nn.BatchNorm1d(DIM) if batch_norm else nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, two names

    def forward(self, ids):  # ids: (B,)
        h = self.embed(ids)  # (B, DIM)
        return self.head(self.norm(torch.tanh(self.body(h)) + self.frozen(h)))  # (B, VOCAB)


def _config(stage: int, bf16: bool = False) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 50, "allgather_bucket_size": 50}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 10  # the biases stay whole, the rest is partitioned
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "zero_optimization": zero,
            "bf16": {"enabled": bf16}}


def _train_and_save(stage: int, save_dir: str, bf16: bool = False):
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine, *_ = hf_zero.initialize(model=Tiny(batch_norm=not bf16), config=_config(stage, bf16))
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (BATCH,), generator=g)
        engine.backward(nn.functional.cross_entropy(engine(ids), ids))
        engine.step()
    engine.save_checkpoint(save_dir)
    masters = full_optimizer_state(engine, "master")  # collective: every rank
    full = engine._zero3_consolidated_16bit_state_dict()  # collective at stage 3; rank 0's answer
    if rank != 0:
        return None
    return masters, {k: v.clone() for k, v in full.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """stage -> (checkpoint directory, {group name: full fp32 master}, the engine's full state dict)."""
    cache = {}

    def get(stage: int):
        if stage not in cache:
            save_dir = tmp_path_factory.mktemp(f"stage{stage}") / "ckpt"
            masters, full = run_distributed(_train_and_save, 2, args=(stage, str(save_dir)))[0]
            cache[stage] = save_dir, masters, full
        return cache[stage]

    return get


def _assert_matches(sd: dict, full: dict, masters: dict, *, frozen: bool = True):
    expect = set(full) - (set() if frozen else set(FROZEN))
    assert set(sd) == expect
    for name in expect:
        assert sd[name].dtype == (torch.int64 if name.endswith("num_batches_tracked") else torch.float32), name
        assert torch.equal(sd[name], full[name]), name
    for name, flat in masters.items():  # the optimizer's fp32 masters, bitwise
        assert torch.equal(sd[name].reshape(-1), flat), name
    # tied: one tensor under both names, as in state_dict()
    assert sd["head.weight"].data_ptr() == sd["embed.weight"].data_ptr()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_consolidates_every_stage_offline(stage, saved, tmp_path):
    save_dir, masters, full = saved(stage)
    # offline: this process never joined the ranks' group (an earlier in-process test may have left one of its
    # own; the script runs below in a fresh interpreter, with none)
    assert (save_dir / "latest").read_text() == "global_step3"
    assert set(masters) >= {"body.weight", "norm.weight"} and not set(masters) & set(FROZEN)

    _assert_matches(z2f.get_fp32_state_dict_from_zero_checkpoint(str(save_dir)), full, masters)
    _assert_matches(z2f.get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="global_step3",
                                                                 exclude_frozen_parameters=True),
                    full, masters, frozen=False)

    model = z2f.load_state_dict_from_zero_checkpoint(Tiny(), save_dir)
    _assert_matches(model.state_dict(keep_vars=False), full, masters)


@pytest.mark.parametrize("stage", [1, 3])
def test_script_written_beside_the_tags(stage, saved, tmp_path):
    save_dir, masters, full = saved(stage)
    script = save_dir / "zero_to_fp32.py"
    assert script.is_file() and script.stat().st_mode & 0o100  # executable, as DeepSpeed's copy
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "zero_to_fp32.py", ".", str(out), "--safe_serialization"],
                         cwd=save_dir, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    sd = load_file(str(out / "model.safetensors"))
    with safe_open(str(out / "model.safetensors"), "pt") as f:  # the tied name, recorded once
        for alias, src in json.loads(f.metadata()["aliases"]).items():
            sd[alias] = sd[src]
    _assert_matches(sd, full, masters)


def test_convert_shards_with_an_index(saved, tmp_path):
    save_dir, masters, full = saved(2)
    out = tmp_path / "sharded"
    z2f.convert_zero_checkpoint_to_fp32_state_dict(str(save_dir), str(out), max_shard_size=400)  # bytes
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    files = sorted(p.name for p in out.glob("pytorch_model-*.bin"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    sd = {}
    for name in files:
        sd.update(torch.load(out / name, weights_only=True))
    _assert_matches(sd, full, masters)
    # DeepSpeed < 0.15's output_file: one file
    z2f.convert_zero_checkpoint_to_fp32_state_dict(save_dir, tmp_path / "one.bin", tag="global_step3")
    _assert_matches(torch.load(tmp_path / "one.bin", weights_only=True), full, masters)


def test_bf16_training_gives_the_fp32_masters_not_the_bf16_weights(tmp_path):
    save_dir = tmp_path / "ckpt"
    masters, full = run_distributed(_train_and_save, 2, args=(3, str(save_dir), True))[0]
    sd = z2f.get_fp32_state_dict_from_zero_checkpoint(save_dir)
    for name, flat in masters.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name].reshape(-1), flat), name
        assert torch.equal(sd[name].bfloat16(), full[name]), name  # the engine's bf16 weights: the masters rounded
    assert any(not torch.equal(sd[n].reshape(-1), full[n].float().reshape(-1)) for n in masters)
    # frozen parameters as saved (bf16), as DeepSpeed's converter returns its 16-bit frozen fragments
    assert sd["frozen.weight"].dtype == torch.bfloat16 and torch.equal(sd["frozen.weight"], full["frozen.weight"])


def test_errors_name_the_file_and_tag(saved, tmp_path):
    save_dir, _, _ = saved(2)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(save_dir, ckpt)
    with pytest.raises(FileNotFoundError, match=r"global_step9.*does not exist.*global_step3"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="global_step9")
    shard = ckpt / "global_step3" / "zero_rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # one flipped bit in rank 1's masters
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"zero_rank00001\.safetensors.*corrupt"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    shard.unlink()
    with pytest.raises(ValueError, match=r"zero_rank00001\.safetensors.*missing"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    (ckpt / "latest").unlink()
    with pytest.raises(ValueError, match=r"no 'latest' file at .*ckpt/latest.*global_step3"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    ds = tmp_path / "ds" / "global_step1"  # DeepSpeed's own layout, unreadable: the file is named
    ds.mkdir(parents=True)
    (ds / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"checkpoint file .*mp_rank_00_model_states\.pt.*cannot be loaded"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(ds.parent, tag="global_step1")


def _strip_module_entry(ckpt):
    """A checkpoint as an hf_zero from before meta.json described the module saved it (manifest kept valid)."""
    from hf_zero.checkpoint.files import file_entry

    tag = ckpt / "global_step3"
    meta = json.loads((tag / "meta.json").read_text())
    del meta["module"]
    (tag / "meta.json").write_text(json.dumps(meta))
    manifest = json.loads((tag / "manifest.json").read_text())
    manifest["files"]["meta.json"] = file_entry(tag / "meta.json")
    (tag / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_saved_before_the_module_entry(stage, saved, tmp_path):
    save_dir, masters, full = saved(stage)
    ckpt = tmp_path / "old"
    shutil.copytree(save_dir, ckpt)
    _strip_module_entry(ckpt)
    if stage == 3:  # no model.safetensors: the shapes are nowhere
        with pytest.raises(ValueError, match=r"meta\.json.*no 'module' entry.*save it again"):
            z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt)
        return
    _assert_matches(z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt), full, masters)  # from model.safetensors
    with pytest.raises(ValueError, match=r"frozen parameters cannot be told from buffers"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True)
