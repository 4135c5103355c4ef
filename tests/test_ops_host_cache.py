"""The large-block cache of torch's CPU allocator (csrc/alloc/host_cache.cpp, hf_zero.ops.host_cache).

Installing it is process-wide and permanent, so each case runs in a process of its own (forked from the test fork
server, where torch is imported and the cache is not installed) and reports numbers as JSON:
which pointer a request got, what the cache holds, hits, misses and evictions. The reference is the policy as
documented: reuse of the most recently freed block of the smallest fitting size within 25%, no new mapping while
live + cached would exceed the most ever live (headroom 0), at most ``cap_bytes`` cached.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hf_zero.ops import host_cache
from hf_zero.testing import run_distributed

pytestmark = pytest.mark.skipif(not host_cache.available() or not sys.platform.startswith("linux"),
                                reason="needs hf_zero._C built with the host cache (Linux)")

MiB = 1 << 20

_PRELUDE = """
import json, os, sys
import torch
torch.set_num_threads(1)
from hf_zero.ops import host_cache as hc
MiB = 1 << 20
def st():
    return hc.stats().__dict__
def big(mib, fill=None):
    t = torch.empty(int(mib * MiB), dtype=torch.uint8)
    if fill is not None:
        t.fill_(fill)
    return t
"""


def _exec(code: str) -> dict:
    """Runs ``code`` and returns the JSON object it printed last."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<host cache case>", "exec"), {"__name__": "__host_cache_case__"})
    return json.loads(out.getvalue().strip().splitlines()[-1])


def _run(body: str, env: dict | None = None) -> dict:
    """``body`` in a process of its own, forked from the test fork server (torch already imported, the cache not
    installed: installing is what the cases test), as a world of one."""
    return run_distributed(_exec, 1, args=(_PRELUDE + textwrap.dedent(body),), env=env, timeout_s=120)[0]


def test_freed_block_is_reused_for_the_next_request_of_its_size():
    out = _run("""
        assert hc.enable(MiB, 64 * MiB)
        a = big(3, fill=7); pa = a.data_ptr(); del a
        b = big(3 - 1e-4); pb = b.data_ptr()   # a little smaller: same page-rounded block fits
        s1 = st()
        c = big(4)                               # 4 MiB > 3 MiB + 25%: a new block
        s2 = st()
        print(json.dumps(dict(same=pa == pb, s1=s1, s2=s2, other=c.data_ptr() != pb)))
    """)
    assert out["same"] and out["other"]
    assert (out["s1"]["hits"], out["s1"]["misses"]) == (1, 1)
    assert out["s1"]["live_bytes"] == 3 * MiB and out["s1"]["cached_bytes"] == 0
    assert (out["s2"]["hits"], out["s2"]["misses"]) == (1, 2)
    assert out["s2"]["installed"] and out["s2"]["min_bytes"] == MiB


def test_smaller_request_does_not_take_a_much_larger_block_and_small_tensors_bypass():
    out = _run("""
        hc.enable(MiB, 64 * MiB)
        a = big(8); pa = a.data_ptr(); del a
        b = big(2); pb = b.data_ptr()          # 8 MiB is more than 25% above 2 MiB
        small = torch.ones(1000)               # below min_bytes: c10's allocator, not counted
        s = st()
        print(json.dumps(dict(reused=pa == pb, s=s)))
    """)
    assert not out["reused"]
    assert out["s"]["hits"] == 0 and out["s"]["misses"] == 2
    # and mapping the 2 MiB block unmapped the 8 MiB one: 2 + 8 would exceed the live peak (8)
    assert out["s"]["live_bytes"] == 2 * MiB and out["s"]["cached_bytes"] == 0 and out["s"]["evictions"] == 1


def test_most_recently_freed_block_of_a_size_is_taken_first():
    out = _run("""
        hc.enable(MiB, 64 * MiB)
        a, b = big(2), big(2)
        pa, pb = a.data_ptr(), b.data_ptr()
        del a; del b                            # b freed last
        c = big(2)
        print(json.dumps(dict(got_b=c.data_ptr() == pb, got_a=c.data_ptr() == pa)))
    """)
    assert out == {"got_b": True, "got_a": False}


def test_cap_bounds_the_cached_bytes_oldest_first():
    out = _run("""
        hc.enable(MiB, 8 * MiB)
        ts = [big(3) for _ in range(4)]
        first = ts[0].data_ptr(); last = ts[3].data_ptr()
        for i in range(4):                      # 12 MiB freed in order into an 8 MiB cap: the oldest are unmapped
            ts[i] = None
        s = st()
        x = big(3)                               # the most recently freed comes back
        print(json.dumps(dict(s=s, got_last=x.data_ptr() == last)))
    """)
    assert out["s"]["cached_bytes"] == 6 * MiB  # two 3 MiB blocks fit under 8 MiB
    assert out["s"]["evictions"] == 2 and out["s"]["live_bytes"] == 0
    assert out["got_last"]


def test_new_mapping_never_raises_live_plus_cached_above_the_live_peak():
    out = _run("""
        hc.enable(MiB, 256 * MiB)
        a = big(4); b = big(4); del a; del b    # live peak 8 MiB, 8 MiB cached
        c = big(6)                               # no fit (4 < 6): mapping 6 would make 6 + 8 > 8
        s = st()
        print(json.dumps(s))
    """)
    assert out["live_bytes"] == 6 * MiB
    assert out["cached_bytes"] == 0 and out["evictions"] == 2  # both 4 MiB blocks unmapped (8 - 6 = 2 < 4)
    assert out["peak_mapped_bytes"] <= 8 * MiB + 6 * MiB
    out = _run("""
        hc.enable(MiB, 256 * MiB)
        a = big(4); b = big(4); del a; del b
        hc.reset_peak()
        c = big(6)
        print(json.dumps(st()))
    """)
    assert out["peak_mapped_bytes"] <= 8 * MiB  # at most the live peak is ever mapped (headroom 0)


def test_values_and_threads_through_the_cache():
    out = _run("""
        import threading
        hc.enable(MiB, 128 * MiB)
        errors = []
        def work(seed):
            g = torch.Generator().manual_seed(seed)
            for i in range(40):
                x = torch.randn(600, 700, generator=g)     # 1.6 MiB: cached
                y = torch.randn(700, 500, generator=g)
                ref = (x.double() @ y.double()).float()
                z = x @ y
                if not torch.allclose(z, ref, atol=1e-3, rtol=1e-4):
                    errors.append((seed, i))
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        [t.start() for t in threads]; [t.join() for t in threads]
        s = st()
        print(json.dumps(dict(errors=errors, s=s)))
    """)
    assert out["errors"] == []
    assert out["s"]["hits"] > 100 and out["s"]["live_bytes"] == 0


def test_raw_interface_mkldnn_and_tensors_from_before_install():
    out = _run("""
        import gc
        before = torch.randn(1024, 1024)          # 4 MiB from c10's allocator
        mk_before = torch.randn(1024, 1024).to_mkldnn()
        hc.enable(MiB, 64 * MiB)
        mk = torch.randn(1024, 1024).to_mkldnn()
        dense = mk.to_dense()
        total = float(before.sum() + dense.sum() + mk_before.to_dense().sum())
        del before, mk_before, mk, dense; gc.collect()
        s = st()
        print(json.dumps(dict(s=s, ok=total == total)))
    """)
    assert out["ok"] and out["s"]["live_bytes"] == 0


def test_fork_child_allocates_and_exits():
    out = _run("""
        hc.enable(MiB, 64 * MiB)
        t = big(4); del t
        pid = os.fork()
        if pid == 0:
            u = big(4, fill=1); hits = hc.stats().hits; del u
            v = torch.ones(1 << 20)
            os._exit(0 if hits == 1 and int(v.sum()) == (1 << 20) else 3)
        _, status = os.waitpid(pid, 0)
        print(json.dumps(dict(status=status)))
    """)
    assert out["status"] == 0


def test_disable_empties_and_stops_caching():
    out = _run("""
        hc.enable(MiB, 64 * MiB)
        a = big(4); b = big(4); del a
        hc.disable(); s1 = st()
        del b; s2 = st()
        c = big(4); s3 = st()
        print(json.dumps(dict(s1=s1, s2=s2, s3=s3)))
    """)
    assert out["s1"]["cached_bytes"] == 0 and not out["s1"]["caching"] and out["s1"]["installed"]
    assert out["s2"]["cached_bytes"] == 0 and out["s2"]["live_bytes"] == 0
    assert out["s3"]["hits"] == 0 and out["s3"]["live_bytes"] == 4 * MiB


def test_opt_out_leaves_it_off():
    out = _run("""
        on = hc.enable(MiB)
        print(json.dumps(dict(on=on, s=st())))
    """, env={"HF_ZERO_HOST_MALLOC": "default"})
    assert out["on"] is False and not out["s"]["installed"]


@pytest.mark.parametrize("stage,min_bytes", [(2, 2 * MiB), (3, MiB)])
def test_cpu_engine_turns_it_on_at_the_mmap_threshold(stage, min_bytes):
    out = _run(f"""
        import hf_zero
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))
        cfg = {{"train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
               "zero_optimization": {{"stage": {stage}}}}}
        engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        for _ in range(3):
            loss = engine(torch.randn(2, 1024)).pow(2).mean()
            engine.backward(loss); engine.step()
        print(json.dumps(st()))
    """)
    assert out["installed"] and out["caching"] and out["min_bytes"] == min_bytes
    assert out["cap_bytes"] == host_cache.DEFAULT_CAP_BYTES
    assert out["hits"] > 0  # 4 MiB weights' gradients come back every step


def test_cap_env_zero_turns_it_off_and_bad_value_names_the_variable():
    out = _run("""
        import hf_zero.zero.host_memory as hm
        hm.tune_cpu_training_memory(stage3=True)
        print(json.dumps(st()))
    """, env={"HF_ZERO_HOST_CACHE_BYTES": "0"})
    assert not out["caching"]
    proc = subprocess.run([sys.executable, "-c", "import hf_zero.zero.host_memory as hm; "
                           "hm.tune_cpu_training_memory(stage3=False)"], capture_output=True, text=True,
                          env={**os.environ, "HF_ZERO_HOST_CACHE_BYTES": "lots"}, timeout=120)
    assert proc.returncode != 0 and "HF_ZERO_HOST_CACHE_BYTES='lots'" in proc.stderr


def test_trim_unmaps_blocks_idle_for_a_whole_interval():
    out = _run("""
        hc.enable(MiB, 64 * MiB)
        a, b = big(2), big(3)
        del a; del b
        hc.trim(); s1 = st()                 # both freed in the interval before: kept for one more
        c = big(3); del c                    # the 3 MiB block is used again in this interval
        hc.trim(); s2 = st()                 # the 2 MiB block stayed idle a whole interval: unmapped
        hc.trim(); s3 = st()                 # and now the 3 MiB one
        print(json.dumps(dict(s1=s1, s2=s2, s3=s3)))
    """)
    assert out["s1"]["cached_bytes"] == 5 * MiB and out["s1"]["evictions"] == 0
    assert out["s2"]["cached_bytes"] == 3 * MiB and out["s2"]["evictions"] == 1
    assert out["s3"]["cached_bytes"] == 0 and out["s3"]["evictions"] == 2


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")]


def test_huge_page_blocks_are_aligned_and_backed_by_huge_pages():
    out = _run("""
        hc.enable(MiB, 64 * MiB)
        t = big(6, fill=1)
        start = t.data_ptr()
        huge_kb = 0
        lines = open("/proc/self/smaps").read().splitlines()
        for i, line in enumerate(lines):
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= start < hi
            elif inside and line.startswith("AnonHugePages:"):
                huge_kb = int(line.split()[1])
        print(json.dumps(dict(aligned=start % (2 * MiB) == 0, huge_kb=huge_kb)))
    """)
    assert out["aligned"]
    if _thp_mode() in ("madvise", "always"):
        assert out["huge_kb"] >= 2048, out  # at least one 2 MiB page in the 6 MiB block


def test_engine_leaves_the_cache_empty_after_initialize():
    out = _run("""
        import hf_zero
        hc.enable(MiB, 256 * MiB)
        junk = [big(4) for _ in range(4)]; del junk      # cached before the engine exists
        before = st()["cached_bytes"]
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 2}}
        engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        after_init = st()["cached_bytes"]
        print(json.dumps(dict(before=before, after_init=after_init)))
    """)
    assert out["before"] == 16 * MiB and out["after_init"] == 0
