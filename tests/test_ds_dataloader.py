"""The loader ``initialize(training_data=...)`` / ``engine.deepspeed_io`` return reads what DeepSpeed's reads.

The case: a 21-sample dataset whose sample ``i`` is ``(full((8,), i), i % 4)``, micro batch 4, a collate_fn
returning a dict. DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``, torchrun) gives, by first feature of each row:

* 1 rank: ``len 6``, ``[[11, 20, 2, 9], [6, 16, 13, 10], [12, 8, 19, 17], [18, 1, 5, 0], [15, 14, 4, 3], [7]]``
  in both epochs (:data:`DS_1RANK`); ``dataloader_drop_last: true`` drops the ``[7]`` (len 5).
* 2 ranks: ``len 3`` per rank, rank 0 ``[[11, 2, 6, 13], [12, 19, 18, 5], [15, 4, 7]]``, rank 1
  ``[[20, 9, 16, 10], [8, 17, 1, 0], [14, 3, 11]]`` (the sampler pads 21 to 22 with index 11); with drop_last 2.
* ``dl.data_sampler`` a DistributedSampler, ``dl.batch_size`` 4, ``dl.num_local_io_workers`` 2,
  ``engine.training_dataloader is dl``; ``engine.deepspeed_io(ds)``: len 6, first rows 11, 6, 12;
  ``deepspeed_io(ds, batch_size=5, route="eval")``: len 5 (3 at 2 ranks), batches of 5.
* a pipeline model: initialize returns a RepeatingLoader reading indices in order (``[0..3], ..., [20], [0..3]``).

Beside the literal numbers, every order is checked against DeepSpeed's rule: ``DistributedSampler(dataset,
num_replicas=<dp size>, rank=<dp rank>)`` with torch's defaults (shuffle, seed 0, no set_epoch between epochs).
"""

import pytest
import torch
from torch.utils.data import DistributedSampler

from hf_zero.testing import run_distributed

N, MICRO = 21, 4
DS_1RANK = [[11, 20, 2, 9], [6, 16, 13, 10], [12, 8, 19, 17], [18, 1, 5, 0], [15, 14, 4, 3], [7]]
DS_2RANKS = [[[11, 2, 6, 13], [12, 19, 18, 5], [15, 4, 7]], [[20, 9, 16, 10], [8, 17, 1, 0], [14, 3, 11]]]


class Odd(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.full((8,), float(i)), torch.tensor(i % 4)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from ((torch.full((8,), float(i)), torch.tensor(i % 4)) for i in range(10))


def collate(batch):
    xs, ys = zip(*batch)
    return {"x": torch.stack(xs), "y": torch.stack(ys), "n": len(batch)}


def rule(world: int, rank: int, drop_last: bool, batch: int = MICRO, shuffle: bool = True) -> list[list[int]]:
    """DeepSpeed's order: the default DistributedSampler's indices, cut into batches."""
    idx = list(DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=shuffle))
    out = [idx[i:i + batch] for i in range(0, len(idx), batch)]
    return [b for b in out if len(b) == batch] if drop_last else out


def _config(**extra):
    return {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, **extra}


def _rows(loader, key=None):
    return [[int(v) for v in (b[key] if key else b[0])[:, 0].tolist()] for b in loader]


def _loaders():
    import torch.distributed as dist

    import hf_zero

    out = {"rank": dist.get_rank()}
    for drop in (None, False, True):
        cfg = _config() if drop is None else _config(dataloader_drop_last=drop)
        engine, _, dl, _ = hf_zero.initialize(model=torch.nn.Linear(8, 4), config=cfg, training_data=Odd(),
                                              collate_fn=collate)
        out[drop] = dict(len=len(dl), epochs=[_rows(dl, "x") for _ in range(2)], sizes=[b["n"] for b in dl],
                         sampler=type(dl.data_sampler).__name__, batch_size=dl.batch_size,
                         workers=dl.num_local_io_workers, drop_attr=dl.dataloader_drop_last,
                         post=dl.post_process_func, kept=engine.training_dataloader is dl, own_iter=iter(dl) is dl,
                         collate=engine.collate_fn is collate)
    engine, _, dl, _ = hf_zero.initialize(model=torch.nn.Linear(8, 4), config=_config())
    out["no_data"] = (dl, engine.training_dataloader)
    io = engine.deepspeed_io(Odd())
    out["io"] = (type(io).__name__, len(io), _rows(io))
    ev = engine.deepspeed_io(Odd(), batch_size=5, route="eval")
    out["eval"] = (len(ev), _rows(ev))
    for name, data in (("iterable", Stream()), ("not_a_dataset", [1, 2, 3].__iter__())):
        try:
            engine.deepspeed_io(data)
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = (type(e).__name__, str(e))
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def runs(request):
    return run_distributed(_loaders, request.param)


def test_order_length_and_last_batch_as_deepspeed(runs):
    world = len(runs)
    for r in runs:
        rank = r["rank"]
        want = DS_1RANK if world == 1 else DS_2RANKS[rank]
        assert want == rule(world, rank, drop_last=False)
        for drop in (None, False):  # the key absent is dataloader_drop_last false
            assert r[drop]["len"] == (6 if world == 1 else 3)
            assert r[drop]["epochs"] == [want, want]  # no reshuffle between epochs: DeepSpeed never calls set_epoch
            assert r[drop]["sizes"] == ([4] * 5 + [1] if world == 1 else [4, 4, 3])
        assert r[True]["len"] == (5 if world == 1 else 2)
        assert r[True]["epochs"] == [want[:-1]] * 2 == [rule(world, rank, drop_last=True)] * 2


def test_every_sample_seen_each_epoch(runs):
    seen = sorted(i for r in runs for b in r[False]["epochs"][0] for i in b)
    # all 21 at one rank; at two ranks the sampler pads with the first shuffled index (11), as DeepSpeed's does
    assert seen == (list(range(N)) if len(runs) == 1 else sorted(list(range(N)) + [11]))


def test_deepspeed_attributes(runs):
    for r in runs:
        for drop in (None, False, True):
            got = r[drop]
            assert (got["sampler"], got["batch_size"], got["workers"], got["post"]) == ("DistributedSampler", 4, 2,
                                                                                        None)
            assert got["drop_attr"] is bool(drop) and got["kept"] and got["own_iter"] and got["collate"]
        assert r["no_data"] == (None, None)


def test_deepspeed_io_routes(runs):
    world = len(runs)
    for r in runs:
        rank = r["rank"]
        name, length, rows = r["io"]
        assert (name, length) == ("DeepSpeedDataLoader", 6 if world == 1 else 3)
        assert rows == rule(world, rank, drop_last=False)
        assert [b[0] for b in rows][:3] == ([11, 6, 12] if world == 1 else [[11, 12, 15], [20, 8, 14]][rank])
        length, rows = r["eval"]  # eval: no shuffle, batch_size=5 overrides the micro batch
        assert length == (5 if world == 1 else 3)
        assert rows == rule(world, rank, drop_last=False, batch=5, shuffle=False)


def test_datasets_deepspeed_cannot_shard_are_refused(runs):
    kind, msg = runs[0]["iterable"]
    assert kind == "TypeError" and "IterableDataset" in msg  # DeepSpeed: TypeError, the sampler needs len()
    kind, msg = runs[0]["not_a_dataset"]
    assert kind == "ValueError" and "torch Dataset" in msg


def test_worker_processes_give_the_same_batches():
    # the ranks above run in daemonic processes (no workers); here, in the test process, DeepSpeed's 2 workers run
    from hf_zero.runtime.dataloader import build_loader

    dl = build_loader(Odd(), MICRO, dp_size=1, dp_rank=0, collate_fn=collate)
    assert dl.num_local_io_workers == 2
    assert _rows(dl, "x") == DS_1RANK and dl.dataloader.num_workers == 2
    assert _rows(build_loader(Odd(), MICRO, dp_size=1, dp_rank=0, num_local_io_workers=0, drop_last=True)) == \
        DS_1RANK[:-1]
    with pytest.raises(TypeError, match="iter"):
        next(build_loader(Odd(), MICRO, dp_size=1, dp_rank=0))


def _pipeline():
    import hf_zero
    from hf_zero.pipe import PipelineModule

    torch.manual_seed(0)
    net = PipelineModule(layers=[torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)], num_stages=1,
                         loss_fn=torch.nn.functional.cross_entropy)
    engine, _, dl, _ = hf_zero.initialize(model=net, config=_config(), training_data=Odd())
    shuffled = engine.deepspeed_io(Odd())
    return (type(dl).__name__, dl is engine.training_dataloader, dl is engine.data_iterator,
            [[int(v) for v in next(dl)[0][:, 0].tolist()] for _ in range(7)], _rows(shuffled))


def test_pipeline_reads_in_index_order_forever():
    name, kept, is_iter, rows, shuffled = run_distributed(_pipeline, 1)[0]
    assert (name, kept, is_iter) == ("RepeatingLoader", True, True)
    assert rows == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19], [20], [0, 1, 2, 3]]
    assert shuffled == DS_1RANK


def test_dataloader_drop_last_is_honoured_in_the_config():
    from hf_zero.config import load_config
    from hf_zero.config.status import STATUS, Status

    assert STATUS["dataloader_drop_last"].status is Status.HONOURED
    assert load_config(_config(dataloader_drop_last=True), world_size=1, rank=0).dataloader_drop_last is True
    assert load_config(_config(), world_size=1, rank=0).dataloader_drop_last is False


def test_deepspeed_constructor_signature():
    # DeepSpeed's positional order: dataset, batch_size, pin_memory, local_rank, tput_timer; the shim's
    # deepspeed.runtime.dataloader.DeepSpeedDataLoader is this class
    from hf_zero.runtime.dataloader import DeepSpeedDataLoader

    class Timer:
        starts = 0

        def start(self):
            Timer.starts += 1

    dl = DeepSpeedDataLoader(Odd(), MICRO, False, 0, Timer(), num_local_io_workers=0, data_parallel_world_size=2,
                             data_parallel_rank=1, dataloader_drop_last=True)
    # start() runs before every next(), the one ending the pass included, as in DeepSpeed
    assert (len(dl), _rows(dl), Timer.starts) == (2, DS_2RANKS[1][:2], 3)
    single = DeepSpeedDataLoader(Odd(), MICRO, False, -1, None, num_local_io_workers=0)
    assert type(single.data_sampler).__name__ == "RandomSampler" and single.device_count >= 1
    assert sorted(i for b in _rows(single) for i in b) == list(range(N))
