"""One DeepSpeed runner of benchmarks/bench_gpu.py, in its own process (real DeepSpeed on PYTHONPATH, hf_zero's
``deepspeed`` shim switched off): the same model, data, config and loop as tests/_gpu_llama.py's hf_zero runs.

    HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 PYTHONPATH=<deepspeed dirs> python benchmarks/_ds_gpu_run.py z3 PORT

Prints one line ``RESULT {json}`` with step_s per step, losses and max allocated bytes.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import _gpu_llama as gl  # noqa: E402


def main() -> None:
    mode, port = sys.argv[1], sys.argv[2]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import deepspeed

    assert "hf_zero" not in (getattr(deepspeed, "__file__", "") or ""), "hf_zero's shim answered, not DeepSpeed"
    offload = mode.endswith("_offload")
    stage = int(mode[1])
    cfg = gl.ds_config(stage, offload)
    if stage == 3:
        start = gl._build(8).state_dict()  # the same starting weights as every other runner (see gl.hf_zero_run)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = gl._build(8)
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(start[name])
        del start
    else:
        model = gl._build(8)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = gl.batches()
    torch.cuda.reset_peak_memory_stats()
    steps, losses = [], []
    for i in range(12):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = data[i % len(data)]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
        losses.append(loss.item())
    print("RESULT " + json.dumps({"mode": mode, "step_s": steps, "losses": [round(v, 4) for v in losses],
                                  "max_alloc": torch.cuda.max_memory_allocated(),
                                  "deepspeed": deepspeed.__version__}), flush=True)


if __name__ == "__main__":
    main()
