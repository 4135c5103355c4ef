"""hf_zero fixes glibc's mmap threshold on CPU (comm/host_memory.py): freed tensors of 1 MiB and more go back to the
kernel at once instead of staying in the heap; HF_ZERO_HOST_MALLOC=default or a user's MALLOC_MMAP_THRESHOLD_ keep
glibc's own behaviour."""

import json
import os
import subprocess
import sys

_PROBE = r"""
import json
import torch
from hf_zero.comm.host_memory import tune_host_malloc, rss_bytes

tuned = tune_host_malloc()
big = torch.ones(30 << 18)  # 30 MiB, mmapped and freed: glibc (untuned) raises its threshold to 30 MiB
del big
before = rss_bytes()
blocks = [torch.ones(300_000) for _ in range(40)]  # 40 x 1.2 MB, 48 MB
held = rss_bytes() - before
del blocks
print(json.dumps({"tuned": tuned, "held": held, "kept_after_free": rss_bytes() - before}))
"""


def _probe(**env) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "HF_ZERO_HOST_MALLOC")}
    full_env.update(env, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _PROBE], env=full_env, capture_output=True, text=True, timeout=300,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_tensors_return_to_the_kernel_unless_opted_out():
    tuned, default, user = _probe(), _probe(HF_ZERO_HOST_MALLOC="default"), _probe(MALLOC_MMAP_THRESHOLD_="131072")
    assert tuned["tuned"] and not default["tuned"] and not user["tuned"]
    for r in (tuned, default, user):
        assert r["held"] > 40e6, r  # the blocks were really resident
    assert tuned["kept_after_free"] < 8e6, tuned        # returned with each free
    assert default["kept_after_free"] > 30e6, default   # glibc's raised threshold: kept in the heap
    assert user["kept_after_free"] < 8e6, user          # the user's own fixed threshold is left in place
