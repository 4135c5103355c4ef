"""NVMe optimizer offload really bounds resident memory, and the swap files really hold the states.

A bf16 model of N parameters (ZeRO-2, one rank) has 12*N bytes of optimizer state: fp32 master, exp_avg and
exp_avg_sq. With ``offload_optimizer: {device: nvme}`` and ``sub_group_size = S``:

* after ``initialize`` the process holds no optimizer state: RSS grew by less than 2 bytes per parameter (the 16-bit
  gradient shard) + the tile buffers 2*3*4*S + 16 MiB over the RSS before ``initialize`` (with the fp32 model);
* during training (the peak RSS, ``VmHWM`` reset with ``/proc/self/clear_refs`` after ``initialize``) the process
  stays below RSS-after-initialize + 2*3*4*S + 6*N (the backward's 16-bit gradients and the reduction's buffers)
  + 32 MiB, which is below what the states alone would take (12*N) on top of the same RSS;
* the files under ``nvme_path`` are 12*N bytes, allocated on disk (``st_blocks``), and hold the states: their
  master stream equals the fp32 weights the engine checkpoints.

The same run with ``device: cpu`` is the control: there the states are resident, and its RSS after initialize is at
least 0.9 * 12 * N above the RSS before it, which shows the measurement sees them.
"""

import os

import torch

from hf_zero.testing import run_distributed

HIDDEN = 4096
N = HIDDEN * HIDDEN + HIDDEN * 8  # two bias-free Linear layers
SUB_GROUP = 1 << 20
TILE_BUFFERS = 2 * 3 * 4 * SUB_GROUP
MiB = 1 << 20


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _train(mode: str, root: str) -> dict:
    import gc

    from torch import nn

    import hf_zero

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**6,
           "zero_optimization": {"stage": 2, "sub_group_size": SUB_GROUP,
                                 "offload_optimizer": {"device": mode, "nvme_path": root}}}
    # warm-up on a tiny model: lazy imports and kernel loads must not count as state
    warm, *_ = hf_zero.initialize(model=nn.Linear(8, 8), config=cfg)
    warm.backward(warm(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum())
    warm.step()
    warm.destroy()
    del warm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN, bias=False), nn.Linear(HIDDEN, 8, bias=False))
    gc.collect()
    # blocks the previous run freed stay mapped in the host cache (hf_zero.ops.host_cache) and would serve this
    # engine's states without growing the RSS this test reads
    from hf_zero.ops import host_cache

    host_cache.empty_cache()
    rss_before_init = _status_bytes("VmRSS")
    engine, *_ = hf_zero.initialize(model=model, config=cfg)
    del model
    gc.collect()
    rss_after_init = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM: the peak below is the training phase's
    x = torch.randn(2, HIDDEN, dtype=torch.bfloat16)
    for _ in range(3):
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
    out = {"rss_before_init": rss_before_init, "rss_after_init": rss_after_init, "hwm": _status_bytes("VmHWM"),
           "state_numel": engine.optimizer.offload.offloaded_numel()}
    swap = engine.optimizer.offload.swap
    if swap is not None:
        out["files"] = {name: (os.stat(swap.file(name)).st_size, os.stat(swap.file(name)).st_blocks * 512)
                        for name in swap.file_nbytes()}
        master = torch.empty(N)
        swap.read_async("group0.master", master, 0).result()
        out["master_matches"] = torch.equal(master, engine.optimizer.offload.state_tensors(0)["master"])
        out["master_vs_weights"] = (master[:8].clone(), engine.module[0].weight.detach().reshape(-1)[:8].float())
        out["swap_dir"] = str(swap.path)
    engine.destroy()
    return out


def _both(root: str) -> dict:
    return {mode: _train(mode, f"{root}/{mode}") for mode in ("nvme", "cpu")}  # nvme first: a clean heap


def test_nvme_offload_bounds_resident_memory(tmp_path):
    res = run_distributed(_both, 1, args=(str(tmp_path),), timeout_s=240)[0]
    nvme, cpu = res["nvme"], res["cpu"]
    states = 12 * N
    assert nvme["state_numel"] == N

    # the swap files hold the states (and were removed by destroy)
    assert len(nvme["files"]) == 3
    assert all(size == 4 * N and allocated >= 4 * N for size, allocated in nvme["files"].values()), nvme["files"]
    assert nvme["master_matches"]
    master, weights = nvme["master_vs_weights"]
    torch.testing.assert_close(master.to(torch.bfloat16).float(), weights, rtol=0, atol=0)
    assert not os.path.exists(nvme["swap_dir"])

    init_growth = nvme["rss_after_init"] - nvme["rss_before_init"]
    assert init_growth < 2 * N + TILE_BUFFERS + 16 * MiB, init_growth / MiB
    bound = nvme["rss_after_init"] + TILE_BUFFERS + 6 * N + 32 * MiB
    assert nvme["hwm"] < bound, (nvme["hwm"] / MiB, bound / MiB)
    assert bound < nvme["rss_after_init"] + states  # the bound is tighter than keeping the states resident

    # control: with device cpu the same measurement sees the 12*N bytes of resident state (less the fp32 weights the
    # cast to bf16 frees, 4*N, plus the bf16 weights, 2*N: ~10*N; the gradient shard comes with the first backward)
    assert cpu["rss_after_init"] - cpu["rss_before_init"] > 0.75 * states, \
        (cpu["rss_after_init"] - cpu["rss_before_init"]) / MiB
    assert nvme["hwm"] < cpu["hwm"] - 0.8 * (states - TILE_BUFFERS), (nvme["hwm"] / MiB, cpu["hwm"] / MiB)


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-3 with the parameters on NVMe as well (offload_param + offload_optimizer, ZeRO-Infinity)
#
# A fp32 model of N3 parameters (LAYERS bias-free square Linear layers) built under zero.Init with the nvme config,
# one rank. Parameters + optimizer states are 16*N3 bytes. What stays resident is the fp32 gradient shard (4*N3),
# the optimizer's tile buffers, and a few layers gathered at once; the bounds asserted:
#
# * building the model grows RSS by less than 3 layers + 16 MiB (each layer is swapped out as it is built);
#   the control (offload_param none) grows by at least 0.9 * 4*N3, so the measurement sees the parameters;
# * the training peak stays below RSS-before-building + 4*N3 + TILE_BUFFERS + 8 layers + 64 MiB (a gather holds
#   its packed buffer and the unpacked layer, the next layer is prefetched the same way, the backward adds the
#   layer's gradient and its packed bucket); above the gradient shard that is less than half of the 16*N3 bytes
#   the parameters and states would take, and the peak is at least 0.8 * 4*N3 below the control's (parameters
#   resident, optimizer states on NVMe in both). The forward pass frees the storage
#   of each released layer even though autograd saved views of it (see ShardedParam.to_partitioned(park=True)):
#   without that, every layer would stay whole until the backward;
# * the swap files hold 16*N3 bytes: 4*N3 of parameters and 12*N3 of optimizer states.

WIDTH3, LAYERS = 2048, 8
LAYER_BYTES = 4 * WIDTH3 * WIDTH3
N3 = LAYERS * WIDTH3 * WIDTH3


def _zero3(param_device: str, root: str) -> dict:
    import ctypes
    import gc

    from torch import nn

    import hf_zero
    from hf_zero.zero import Init

    off = {"device": param_device, "nvme_path": root} if param_device == "nvme" else {"device": "none"}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**6,
           "zero_optimization": {"stage": 3, "sub_group_size": SUB_GROUP, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": WIDTH3 * WIDTH3, "stage3_max_reuse_distance": 0,
                                 "reduce_bucket_size": WIDTH3 * WIDTH3,
                                 "offload_param": off, "offload_optimizer": {"device": "nvme", "nvme_path": root}}}
    warm, *_ = hf_zero.initialize(model=nn.Linear(8, 8), config=cfg)  # lazy imports, kernel loads
    warm.backward(warm(torch.randn(2, 8)).sum())
    warm.step()
    warm.destroy()
    del warm
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss_before = _status_bytes("VmRSS")
    torch.manual_seed(0)
    with Init(config_dict_or_path=cfg):
        model = nn.Sequential(*[nn.Linear(WIDTH3, WIDTH3, bias=False) for _ in range(LAYERS)])
    gc.collect()
    # glibc keeps freed heap chunks (16 MiB layers sit below its dynamic mmap threshold) until trimmed; trimming
    # makes RSS show what is live, which is the claim here
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss_built = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    engine, *_ = hf_zero.initialize(model=model, config=cfg)
    x = torch.randn(2, WIDTH3)
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step()
    out = {"rss_before": rss_before, "rss_built": rss_built, "hwm": _status_bytes("VmHWM")}
    sw = engine.stage3.swapper
    out["disk"] = (sw.nbytes if sw is not None else 0) + engine.optimizer.offload.swap.nbytes
    engine.destroy()
    return out


def _zero3_both(root: str) -> dict:
    return {dev: _zero3(dev, f"{root}/{dev}") for dev in ("nvme", "none")}


def test_zero3_param_and_optimizer_nvme_offload_bounds_resident_memory(tmp_path, monkeypatch):
    # Buffers of 1 MiB and more are mmapped (and unmapped when freed) in the spawned rank, so RSS shows live memory
    # rather than what glibc's heap keeps after the gathers free their 16 MiB buffers. glibc reads the variable when
    # the process starts: the rank is spawned, not forked from the fork server.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    res = run_distributed(_zero3_both, 1, args=(str(tmp_path),), timeout_s=300, fork_server=False)[0]
    nvme, control = res["nvme"], res["none"]
    assert nvme["disk"] == 16 * N3
    assert nvme["rss_built"] - nvme["rss_before"] < 3 * LAYER_BYTES + 16 * MiB, \
        (nvme["rss_built"] - nvme["rss_before"]) / MiB
    assert control["rss_built"] - control["rss_before"] > 0.9 * 4 * N3, \
        (control["rss_built"] - control["rss_before"]) / MiB
    bound = nvme["rss_before"] + 4 * N3 + TILE_BUFFERS + 8 * LAYER_BYTES + 64 * MiB
    assert nvme["hwm"] < bound, (nvme["hwm"] / MiB, bound / MiB)
    assert bound - nvme["rss_before"] - 4 * N3 < 0.5 * 16 * N3
    assert nvme["hwm"] < control["hwm"] - 0.8 * 4 * N3, (nvme["hwm"] / MiB, control["hwm"] / MiB)
