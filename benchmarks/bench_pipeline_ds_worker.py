"""One rank of DeepSpeed's PipelineEngine for bench_pipeline.py (run by DeepSpeed's own Python, one process per
rank, gloo, DS_ACCELERATOR=cpu). It never imports hf_zero: it builds the same sleep-layer model with DeepSpeed's
PipelineModule/LayerSpec and steps only when bench_pipeline.py says so through a TCP store, so its steps interleave
with hf_zero's and raw torch's in one run.

Protocol (keys in the orchestrating store): ``cfg/<i>`` = "m tf" builds an engine and takes one untimed step, then
this rank sets ``built/<i>/<rank>``; ``go/<i>/<r>`` runs one timed step, then ``t/<i>/<r>/<rank>`` = "start end busy";
``cfg/<i>`` = "end" exits.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402

from _pipe_sleep import BUSY, MICRO, SleepLayer, batches  # noqa: E402


def main() -> None:
    store_port, stages = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=1800))
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=1800))
    rank = dist.get_rank()
    i = 0
    while True:
        store.wait([f"cfg/{i}"])
        spec = store.get(f"cfg/{i}").decode()
        if spec == "end":
            break
        m, tf = int(spec.split()[0]), float(spec.split()[1])
        torch.manual_seed(1234)
        net = PipelineModule([LayerSpec(SleepLayer, tf) for _ in range(stages)], num_stages=stages,
                             loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m,
               "train_batch_size": MICRO * m, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
               "wall_clock_breakdown": False}
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)
        x, y = batches(m)
        data = [(x[j], y[j]) for j in range(m)]
        engine.train_batch(iter(data))  # shape exchange, first-step allocation
        store.set(f"built/{i}/{rank}", "1")
        r = 0
        while True:
            key = f"go/{i}/{r}"
            store.wait([key])
            if store.get(key).decode() == "stop":
                break
            dist.barrier()
            busy0 = BUSY[0]
            start = time.perf_counter()
            engine.train_batch(iter(data))
            end = time.perf_counter()
            store.set(f"t/{i}/{r}/{rank}", f"{start} {end} {BUSY[0] - busy0}")
            r += 1
        dist.barrier()
        i += 1
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # DeepSpeed's atexit hooks are not needed and can hang on a gloo teardown


if __name__ == "__main__":
    main()
