"""Run one of hf_zero's distributed test workers under the real DeepSpeed, unchanged (issue #26's record of
DeepSpeed's own run of the same test).

    HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
        --nproc_per_node 2 scripts/ds_same_test.py tests/test_engine_two_engines.py _both ['json args']

Each rank initializes gloo (as hf_zero.testing.run_distributed does for the workers), points hf_zero's entry points
the worker calls at DeepSpeed's (``hf_zero.initialize`` -> ``deepspeed.initialize``, ``hf_zero.pipe`` ->
``deepspeed.pipe``), imports the test file and calls the worker; rank 0 prints the result as JSON (tensors as lists)
after a ``RESULT`` marker, so the test's own reference can be compared with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist


def _plain(value):
    """Tensors and tuples as JSON-able lists, recursively."""
    if isinstance(value, torch.Tensor):
        return value.detach().float().tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def main() -> None:
    test_file, worker = sys.argv[1], sys.argv[2]
    args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else []
    import deepspeed
    import deepspeed.pipe

    import hf_zero

    # the shim is off (HF_ZERO_DISABLE_DEEPSPEED_SHIM=1): `deepspeed` is DeepSpeed 0.19.8 itself
    assert "site-packages" in deepspeed.__file__, deepspeed.__file__
    hf_zero.initialize = deepspeed.initialize
    sys.modules["hf_zero.pipe"] = deepspeed.pipe
    deepspeed.init_distributed("gloo")  # DeepSpeed's comm backend too (PipelineModule reads it)
    torch.set_num_threads(1)
    # the tests' own helper modules (_parity, _pipe_util) and test modules a DeepSpeed-side worker reuses
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    spec = importlib.util.spec_from_file_location("ds_same_test_module", test_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = getattr(module, worker)(*args)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(_plain(result)), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
