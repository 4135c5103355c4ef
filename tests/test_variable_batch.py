"""Dynamic batching (``data_efficiency.data_sampling.dynamic_batching``, hf_zero/runtime/variable_batch.py): the
packing, the scaled learning rate, the config, and the data loader an engine builds on 2 ranks.

DeepSpeed 0.19.8's ``batch_by_seqlens`` on DeepSpeedExamples' variable-batch example dataset (1000 sequences of
``random.Random(42).randrange(3, 15)`` tokens, those of 5-10 tokens, max_tokens 20, 1-10 sequences per pack,
train_batch_size 16, seed 42) gives, for each picking order, exactly the packs, batch sizes and longest sequences
hf_zero gives (``_EXAMPLE_DIGESTS``: sha256 of the JSON of both outputs, equal). On the small case below DeepSpeed
never packs the last sequence of the picking order (its scan stops one short): with ``dataloader`` order it returns
3 batches, [4, 3, 3] sequences, leaving sequences 10-12 out; hf_zero packs all 13 into 4 batches, [4, 3, 3, 3].
Its learning rates for the same optimizer (0.5, sqrt scaling, base batch 4): 0.5, 0.4330, 0.4330, 0.5 (its 3-batch
cycle), 0.4330, then 0.5 after ``step(0)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import warnings

import pytest
import torch

from hf_zero.config import load_config
from hf_zero.config.errors import ConfigError
from hf_zero.config.status import ConfigKeyIgnored
from hf_zero.runtime.sample_metrics import read_sample_metric, write_sample_metric
from hf_zero.runtime.variable_batch import VariableBatchSizeLR, batch_by_seqlens, parse_dynamic_batching, scale_lr
from hf_zero.testing import run_distributed

SMALL = [3, 4, 5, 2, 8, 7, 1, 6, 6, 2, 9, 1, 4]
_EXAMPLE_DIGESTS = {"seqlen": "57debcb2c153d0b0", "dataloader": "701be15f892e124b", "random": "682c8eacd3359056"}


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, default=int).encode()).hexdigest()[:16]


def test_packs_every_sequence_greedily_within_the_limits():
    mb, sizes, longest = batch_by_seqlens(SMALL, 10, None, 1, 3, "dataloader", 2)
    assert mb == [(0, [0, 1]), (0, [2, 3]), (1, [4]), (1, [5, 6]), (2, [7]), (2, [8, 9]), (3, [10, 11]), (3, [12])]
    assert sizes == [4, 3, 3, 3] and longest == [5, 8, 6, 9]
    mb, sizes, _ = batch_by_seqlens(SMALL, 10, None, 1, 3, "seqlen", 2)
    assert [ids for _, ids in mb] == [[6, 11, 3], [9, 0, 1], [12, 2], [7], [8], [5], [4], [10]]
    assert sizes == [6, 3, 2, 2]  # max_batch_size 3 closes the first packs before max_tokens does
    # the limits hold for every pack, every sequence appears once, and each pack could not take the next sequence
    lens = [random.Random(s).randrange(1, 12) for s in range(200)]  # any two fit in 24: no pack is impossible
    mb, sizes, _ = batch_by_seqlens(lens, 24, None, 2, 5, "random", 4, seed=3)
    packs = [ids for _, ids in mb]
    assert all(2 <= len(p) <= 5 and sum(lens[i] for i in p) <= 24 for p in packs)
    flat = [i for p in packs for i in p]
    assert len(flat) == len(set(flat)) and len(packs) % 4 == 0 and sum(sizes) == len(flat)
    order = list(range(200))
    random.Random(3).shuffle(order)
    assert flat == order[:len(flat)]  # the seeded picking order, consumed from the start
    for p, nxt in zip(packs, packs[1:]):
        assert len(p) == 5 or sum(lens[i] for i in p) + lens[nxt[0]] > 24


def test_too_long_sequences_are_left_out_and_too_few_packs_refused(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        mb, _, _ = batch_by_seqlens([3, 30, 4], 10, None, 1, None, "dataloader", 1)
    assert [ids for _, ids in mb] == [[0, 2]] and "leaves out sequences [1]" in caplog.text
    with pytest.raises(ValueError, match="fewer than one batch of 8"):
        batch_by_seqlens([3, 4], 10, None, 1, None, "dataloader", 8)


def test_packing_equals_deepspeeds_on_the_example_dataset():
    rng = random.Random(42)
    lens = [rng.randrange(3, 15) for _ in range(1000)]
    ids = [i for i, n in enumerate(lens) if 5 <= n <= 10]
    for order, digest in _EXAMPLE_DIGESTS.items():
        out = batch_by_seqlens(lens, 20, ids, 1, 10, order, 16, False, False, 42)
        assert _digest([[list(x) for x in out[0]], out[1], out[2]]) == digest, order


def test_learning_rate_follows_each_batchs_size():
    assert scale_lr(4, 8, 0.5, "linear") == 1.0 and scale_lr(4, 1, 0.5, "sqrt") == 0.25
    assert scale_lr(4, 8, 0.5, "none") == 0.5 and scale_lr(4, 8, 0.5, None) == 0.5
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = VariableBatchSizeLR(opt, 4, [4, 3, 3, 3], "sqrt")
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(4):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    sched.step(0)
    lrs.append(opt.param_groups[0]["lr"])
    s3 = 0.5 * math.sqrt(3 / 4)
    assert lrs == pytest.approx([0.5, s3, s3, s3, 0.5, 0.5])
    assert sched.get_last_lr() == [0.5]  # the base schedule's rate, unscaled

    class Halving:  # a base schedule DeepSpeed-style: .optimizer, step(epoch)
        def __init__(self, optimizer):
            self.optimizer, self.n = optimizer, 0

        def step(self, epoch=None):
            self.n = 0 if epoch == 0 else self.n + 1
            for group in self.optimizer.param_groups:
                group["lr"] = 1.0 / 2 ** self.n

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = VariableBatchSizeLR(Halving(opt), 2, [2, 4, 1], "linear")
    got = [opt.param_groups[0]["lr"]]
    for _ in range(3):
        sched.step()
        got.append(opt.param_groups[0]["lr"])
    assert got == pytest.approx([1.0, 0.5 * 2, 0.25 * 0.5, 0.125 * 1.0])
    state = sched.state_dict()
    sched.step()
    sched.load_state_dict(state)
    assert sched.last_epoch == 3 and sched.get_last_lr() == [0.125]


def _section(**batching) -> dict:
    return {"enabled": True, "seed": 42, "data_sampling": {"num_workers": 0, "dynamic_batching": {
        "enabled": True, "max_tokens": 20, **batching}}}


@pytest.mark.parametrize("batching,key", [
    ({"enabled": False}, "dynamic_batching.enabled"),
    ({"max_tokens": 0}, "dynamic_batching.max_tokens"),
    ({"lr_scaling_method": "cubic"}, "dynamic_batching.lr_scaling_method"),
    ({"sequence_picking_order": "alphabetical"}, "dynamic_batching.sequence_picking_order"),
    ({"min_batch_size": 4, "max_batch_size": 2}, "dynamic_batching.min_batch_size"),
    ({"max_token": 20}, "dynamic_batching.max_token"),
])
def test_bad_dynamic_batching_is_refused_naming_the_key(batching, key):
    with pytest.raises(ConfigError) as err:
        parse_dynamic_batching(_section(**batching))
    assert str(err.value).startswith(f"data_efficiency.data_sampling.{key}")


def test_policy_and_what_the_config_warns():
    policy = parse_dynamic_batching(_section(sequence_picking_order="seqlen", metrics_path="./out"))
    assert (policy.max_tokens, policy.sequence_picking_order, policy.seed, policy.lr_scaling_method,
            policy.metrics_path) == (20, "seqlen", 42, "linear", "./out")

    def ignored(section):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_config({"train_batch_size": 2, "data_efficiency": section}, world_size=1, log=False)
        return [str(w.message) for w in caught if issubclass(w.category, ConfigKeyIgnored)]

    assert ignored(_section()) == []  # dynamic batching alone: honoured, nothing to warn
    # random-LTD routing is honoured too (tests/test_random_ltd.py); curriculum sampling warns by name
    routed = dict(_section(), data_routing={"enabled": True, "random_ltd": {"enabled": True}})
    assert ignored(routed) == []
    curriculum = dict(_section())
    curriculum["data_sampling"] = {**curriculum["data_sampling"], "curriculum_learning": {"enabled": True}}
    assert any("data_efficiency" in w and "curriculum data sampling is not run" in w for w in ignored(curriculum))


def _engine_run():
    """DeepSpeedExamples' variable-batch example in small: sequences of ones whose label is their length, packed by
    length; each rank's loader, and the learning rate the engine's optimizer holds at each step."""
    import torch.distributed as dist
    from torch import nn

    import hf_zero
    from hf_zero.runtime.variable_batch import get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed

    rng = random.Random(42)
    seqs = [torch.ones(rng.randrange(3, 15), 5) for _ in range(200)]
    dataset = [(s, len(s)) for s in seqs]

    def collate(batch):
        xs, ys = zip(*batch)
        return nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor(ys, dtype=torch.float32)

    def seqlens(batch):
        return (batch[0][:, :, 0] != 0).sum(1)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "data_efficiency": _section(sequence_picking_order="seqlen", max_batch_size=10)}
    engine, *_ = hf_zero.initialize(model=model, config=config)
    loader, sched, io_kwargs = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset, engine, dataset_filter_ids=[i for i, s in enumerate(seqs) if 5 <= len(s) <= 10],
        dataloader_collate_fn=collate, batch_seqlens_fn=seqlens)
    engine.lr_scheduler = sched
    # the keyword arguments returned for engine.deepspeed_io build the same loader (DeepSpeed's alternative)
    same_io = [tuple(x.shape) for x, _ in engine.deepspeed_io(**io_kwargs)] == [tuple(x.shape) for x, _ in loader]
    lrs, shapes, losses = [engine.optimizer.param_groups[0]["lr"]], [], []
    it = iter(loader)
    for _ in range(len(loader) // engine.gradient_accumulation_steps()):
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(it)
            shapes.append(tuple(x.shape))
            loss = nn.functional.mse_loss(engine(x).sum(dim=(1, 2)), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        lrs.append(engine.optimizer.param_groups[0]["lr"])
    return {"rank": dist.get_rank(), "shapes": shapes, "lrs": lrs, "batch_sizes": sched.batch_sizes,
            "finite": all(math.isfinite(v) for v in losses), "same_io": same_io}


def test_engine_data_loader_splits_packs_and_scales_the_rate_per_step():
    out = run_distributed(_engine_run, 2, timeout_s=300)
    rng = random.Random(42)
    lens = [rng.randrange(3, 15) for _ in range(200)]
    ids = [i for i, n in enumerate(lens) if 5 <= n <= 10]
    mb, sizes, _ = batch_by_seqlens(lens, 20, ids, 1, 10, "seqlen", 8, seed=42)
    for rank, got in enumerate(out):
        assert got["finite"] and got["batch_sizes"] == sizes and got["same_io"]
        mine = [ids for _, ids in mb][rank::2]  # DistributedSampler: packs in turn over the ranks
        # each micro-batch is 2 of this rank's packs, padded to their longest sequence
        want = [(len(a) + len(b), max(lens[i] for i in a + b), 5) for a, b in zip(mine[::2], mine[1::2])]
        assert got["shapes"] == want, rank
        # after each optimizer step the rate is the base 1e-3 scaled by the next batch's sequences / 8
        expect = [1e-3 * sizes[s % len(sizes)] / 8 for s in range(len(got["lrs"]))]
        assert got["lrs"] == pytest.approx(expect), rank


DS_METRIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ds_seqlen_metric",
                         "seqlen_sample_to_metric")
DS_LENGTHS = [7, 3, 12, 5, 9, 4, 11, 6, 8, 10, 3, 14]


def test_metric_files_are_deepspeeds_format(tmp_path):
    """tests/data/ds_seqlen_metric was written by DeepSpeed 0.19.8's MMapIndexedDatasetBuilder (int64, one
    ``add_item`` of one value per sample, one ``end_document``), the way its DataAnalyzer writes
    ``seqlen_sample_to_metric``; DeepSpeed's ``MMapIndexedDataset`` read hf_zero's copy back as the same lengths.
    The DataAnalyzer's own output for DeepSpeedExamples' variable-batch example (uint8 values) read back here as its
    1000 lengths, and DeepSpeed's example run used hf_zero's file without re-analyzing (docs/deepspeed_scripts.md)."""
    assert read_sample_metric(DS_METRIC).tolist() == DS_LENGTHS
    ours = str(tmp_path / "seqlen" / "seqlen_sample_to_metric")
    write_sample_metric(ours, DS_LENGTHS)
    for suffix in (".idx", ".bin"):
        with open(DS_METRIC + suffix, "rb") as a, open(ours + suffix, "rb") as b:
            assert a.read() == b.read(), suffix  # byte for byte
    assert sorted(os.listdir(tmp_path / "seqlen")) == ["seqlen_sample_to_metric.bin", "seqlen_sample_to_metric.idx"]
    (tmp_path / "bad.idx").write_bytes(b"TNTIDX\x00\x00" + bytes(40))
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not an indexed-dataset index"):
        read_sample_metric(str(tmp_path / "bad"))


class _Engine:
    """What the DeepSpeed entry point reads from an engine, for a one-process run."""

    def __init__(self, section):
        import types

        self._config = types.SimpleNamespace(data_efficiency=section)
        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        self.lr_scheduler = None
        self.data_parallel_group = None

    def train_batch_size(self):
        return 2

    def train_micro_batch_size_per_gpu(self):
        return 1


def test_lengths_are_read_from_metrics_path_or_computed_and_written_there(tmp_path):
    from hf_zero.runtime.variable_batch import get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed as get

    dataset = [torch.ones(n) for n in DS_LENGTHS]
    calls = []

    def seqlens(batch):
        calls.append(len(batch))
        return [len(x) for x in batch]

    path = tmp_path / "metrics"
    engine = _Engine(_section(metrics_path=str(path)))
    loader, sched, _ = get(dataset, engine, batch_seqlens_fn=seqlens)
    assert calls == [12] and read_sample_metric(str(path / "seqlen" / "seqlen_sample_to_metric")).tolist() == \
        DS_LENGTHS  # computed once, written for the next run
    first = [[len(x) for x in batch] for batch in loader]
    loader, _, _ = get(dataset, engine, batch_seqlens_fn=seqlens)
    assert calls == [12] and [[len(x) for x in batch] for batch in loader] == first  # read back, not recomputed
    # DeepSpeed's own file for the same lengths serves as well; one for another dataset is refused, naming it
    os.makedirs(tmp_path / "ds" / "seqlen")
    for suffix in (".idx", ".bin"):
        with open(DS_METRIC + suffix, "rb") as f:
            (tmp_path / "ds" / "seqlen" / ("seqlen_sample_to_metric" + suffix)).write_bytes(f.read())
    loader, _, _ = get(dataset, _Engine(_section(metrics_path=str(tmp_path / "ds"))))
    assert [[len(x) for x in batch] for batch in loader] == first
    with pytest.raises(ValueError, match="12 lengths for 3 samples.*delete"):
        get(dataset[:3], _Engine(_section(metrics_path=str(tmp_path / "ds"))))
    with pytest.raises(ValueError, match="pass dataset_seqlens or batch_seqlens_fn"):
        get(dataset, _Engine(_section(metrics_path=str(tmp_path / "empty"))))
