"""One rank of a fault-injection run (launched by tests/_faults.py as a plain process per rank).

    python tests/_faults_worker.py <case> <stage> <timeout_s>

Trains a 4-layer model for 4 steps; at step 2 rank 1 injects the fault named by ``case``. Prints ``FAULT_AT <t>``
(wall clock) right before injecting and ``DONE`` if it finished.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn

import hf_zero

CASE, STAGE, TIMEOUT_S = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
RANK = int(os.environ["RANK"])
FAULT_STEP = 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.extra = nn.Linear(16, 16)
        self.mode = "normal"

    def forward(self, x):
        order = [0, 1, 2, 3]
        if self.mode == "swap":
            order = [0, 2, 1, 3]
        elif self.mode == "skip":
            order = [0, 1, 3]
        for i in order:
            x = torch.tanh(self.layers[i](x))
        if self.mode == "branch":
            x = self.extra(x)
        return x


def fault_now() -> None:
    print(f"FAULT_AT {time.time():.3f}", flush=True)


def next_batch_that_never_comes() -> None:
    """A data loader that hangs: the rank is alive, answers its heartbeats, and never reaches the collective."""
    while True:
        time.sleep(0.05)


def main() -> None:
    torch.manual_seed(0)
    model = Net()
    zero = {"stage": STAGE}
    if STAGE == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every layer is gathered (default prefetch settings)
    if CASE == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": os.environ["FAULT_NVME_PATH"]}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero,
           "comms_timeout_s": TIMEOUT_S}
    engine, *_ = hf_zero.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(RANK)
    for step in range(4):
        x = torch.randn(2, 16, generator=gen)
        faulty = RANK == 1 and step == FAULT_STEP
        if faulty and CASE in ("branch", "swap", "skip"):
            fault_now()
            model.mode = CASE
        if faulty and CASE == "hang":
            fault_now()
            next_batch_that_never_comes()
        if faulty and CASE == "extra_microbatch":
            fault_now()
            engine.backward(engine(x).pow(2).mean())  # one micro-batch more than the other rank
        if faulty and CASE in ("sigstop", "kill"):
            sig = signal.SIGSTOP if CASE == "sigstop" else signal.SIGKILL

            def stop_in_forward(module, args):
                fault_now()
                os.kill(os.getpid(), sig)

            model.layers[2].register_forward_pre_hook(stop_in_forward)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        model.mode = "normal"
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
