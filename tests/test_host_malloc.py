"""hf_zero fixes glibc's mmap threshold on CPU (comm/host_memory.py): freed tensors of 2 MiB and more (1 MiB and more
once stage 3 asked) go back to the kernel at once instead of staying in the heap; HF_ZERO_HOST_MALLOC=default or a
user's MALLOC_MMAP_THRESHOLD_ keep glibc's own behaviour."""

import json
import os
import subprocess
import sys

_PROBE = r"""
import json
import torch
import ctypes
import sys
from hf_zero.comm.host_memory import MALLOC_MMAP_THRESHOLD_STAGE3, tune_host_malloc, rss_bytes

tuned = tune_host_malloc()
if sys.argv[1] == "stage3":
    tuned = tune_host_malloc(MALLOC_MMAP_THRESHOLD_STAGE3) and tuned  # lowers it
    tune_host_malloc()  # a later stage 0-2 engine does not raise it again
big = torch.ones(30 << 18)  # 30 MiB, mmapped and freed: glibc (untuned) raises its threshold to 30 MiB
del big
from hf_zero.comm import host_memory
out = {"tuned": tuned, "threshold": host_memory._tuned}
for name, numel, count in (("small", 300_000, 40), ("large", 600_000, 20)):  # 1.2 MB and 2.4 MB blocks, 48 MB
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # free heap kept by the round before would serve this one's blocks
    before = rss_bytes()
    blocks = [torch.ones(numel) for _ in range(count)]
    out[name + "_held"] = rss_bytes() - before
    del blocks
    out[name + "_kept"] = rss_bytes() - before
print(json.dumps(out))
"""


def _probe(case="engine", **env) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "HF_ZERO_HOST_MALLOC")}
    full_env.update(env, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _PROBE, case], env=full_env, capture_output=True, text=True, timeout=300,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_tensors_return_to_the_kernel_unless_opted_out():
    tuned, stage3 = _probe(), _probe("stage3")
    default, user = _probe(HF_ZERO_HOST_MALLOC="default"), _probe(MALLOC_MMAP_THRESHOLD_="131072")
    assert tuned["tuned"] and stage3["tuned"] and not default["tuned"] and not user["tuned"]
    for r in (tuned, stage3, default, user):
        assert r["small_held"] > 40e6 and r["large_held"] > 40e6, r  # the blocks were really resident
    assert tuned["large_kept"] < 8e6, tuned            # 2.4 MB blocks: returned with each free
    assert (tuned["threshold"], stage3["threshold"]) == (2 << 20, 1 << 20)  # stage 3 lowers it; nothing raises it
    assert stage3["small_kept"] < 8e6 and stage3["large_kept"] < 8e6, stage3  # stage 3's 1 MiB, not raised again
    assert default["small_kept"] > 30e6, default       # glibc's raised threshold: kept in the heap
    assert user["small_kept"] < 8e6, user              # the user's own fixed threshold is left in place
