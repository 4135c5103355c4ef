"""hf_zero fixes glibc's mmap threshold on CPU (comm/host_memory.py): freed tensors of 2 MiB and more (1 MiB and more
once stage 3 asked) go back to the kernel at once instead of staying in the heap; HF_ZERO_HOST_MALLOC=default or a
user's MALLOC_MMAP_THRESHOLD_ keep glibc's own behaviour."""

import json
import os
import subprocess
import sys

_PROBE = r"""
import json
import sys
import torch
from hf_zero.comm import host_memory
from hf_zero.comm.host_memory import MALLOC_MMAP_THRESHOLD_STAGE3, tune_host_malloc, rss_bytes

tuned = tune_host_malloc()
if sys.argv[1] == "stage3":
    tuned = tune_host_malloc(MALLOC_MMAP_THRESHOLD_STAGE3) and tuned  # lowers it
    tune_host_malloc()  # a later stage 0-2 engine does not raise it again
big = torch.ones(30 << 18)  # 30 MiB, mmapped and freed: glibc (untuned) raises its threshold to 30 MiB
del big
numel = int(sys.argv[2])
before = rss_bytes()
blocks = [torch.ones(numel) for _ in range((48 << 20) // (4 * numel))]  # 48 MiB of blocks of 4 x numel bytes
held = rss_bytes() - before
del blocks
print(json.dumps({"tuned": tuned, "threshold": host_memory._tuned, "held": held, "kept": rss_bytes() - before}))
"""

SMALL, LARGE = 300_000, 600_000  # 1.2 MB and 2.4 MB blocks: between stage 3's 1 MiB and stages 0-2's 2 MiB, above


def _probes(*cases: tuple[str, int, dict]) -> list[dict]:
    """One probe process per (case, block numel, environment), run side by side (each is mostly torch's import)."""
    procs = []
    for case, numel, env in cases:
        full_env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "HF_ZERO_HOST_MALLOC")}
        full_env.update(env, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", _PROBE, case, str(numel)], env=full_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_freed_tensors_return_to_the_kernel_unless_opted_out():
    # one block size per process: glibc serves a request from free heap before it considers mmap
    tuned, stage3, default, user = _probes(("engine", LARGE, {}), ("stage3", SMALL, {}),
                                           ("engine", SMALL, {"HF_ZERO_HOST_MALLOC": "default"}),
                                           ("engine", SMALL, {"MALLOC_MMAP_THRESHOLD_": "131072"}))
    assert tuned["tuned"] and stage3["tuned"] and not default["tuned"] and not user["tuned"]
    assert (tuned["threshold"], stage3["threshold"]) == (2 << 20, 1 << 20)  # stage 3 lowers it; nothing raises it
    for r in (tuned, stage3, default, user):
        assert r["held"] > 40e6, r  # the blocks were really resident
    assert tuned["kept"] < 8e6, tuned        # stages 0-2: 2.4 MB blocks returned with each free
    assert stage3["kept"] < 8e6, stage3      # stage 3: 1.2 MB blocks too
    assert default["kept"] > 30e6, default   # glibc's raised threshold: kept in the heap
    assert user["kept"] < 8e6, user          # the user's own fixed threshold is left in place
