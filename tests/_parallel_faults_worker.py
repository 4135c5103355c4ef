"""One rank of a pipeline or tensor-parallel fault run (launched through tests/_faults.py, one plain process per
rank).

    python tests/_parallel_faults_worker.py <kind>_<fault> <unused> <timeout_s>

``kind``: ``pipe`` (2 ranks = 2 pipeline stages, 2 micro-batches) or ``tp`` (a tiny Llama, tensor parallelism 2,
the vocabulary-parallel loss). At step 2 of 4, rank 1 stops itself (SIGSTOP) or dies (SIGKILL): in the pipeline,
in its stage's forward (stage 0 is then waiting in a receive torch.distributed.pipelining issued); with TP, right
before its loss (rank 0 is then in the loss's all-reduce). Prints ``FAULT_AT <t>`` right before the fault and
``DONE`` if it finished.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import hf_zero

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
CASE, TIMEOUT_S = sys.argv[1], float(sys.argv[3])
KIND, FAULT = CASE.split("_")
RANK = int(os.environ["RANK"])
FAULT_STEP = 2
SIG = signal.SIGSTOP if FAULT == "sigstop" else signal.SIGKILL


def fault_now() -> None:
    print(f"FAULT_AT {time.time():.3f}", flush=True)
    os.kill(os.getpid(), SIG)


class Trap(nn.Module):
    """Identity, until step FAULT_STEP's first micro-batch on rank 1."""

    step = 0

    def forward(self, x):
        if RANK == 1 and Trap.step == FAULT_STEP:
            Trap.step = -1
            fault_now()
        return x


def pipe() -> None:
    from _pipe_util import MICRO, W, ds_config, layer_list

    from hf_zero.pipe import PipelineModule

    net = PipelineModule(layer_list(False, n_hidden=1) + [Trap()], num_stages=2, loss_fn=F.mse_loss,
                         seed_layers=True, partition_method="uniform")
    engine, *_ = hf_zero.initialize(model=net, config={**ds_config(2), "comms_timeout_s": TIMEOUT_S})
    x = torch.randn(4, 2, MICRO, W, generator=torch.Generator().manual_seed(0))
    for step in range(4):
        if Trap.step >= 0:
            Trap.step = step
        engine.train_batch(iter([(x[step, 0], x[step, 0]), (x[step, 1], x[step, 1])]))


def tp() -> None:
    from _tp_util import make_model, token_data

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
              "tensor_parallel": {"autotp_size": 2}, "comms_timeout_s": TIMEOUT_S}
    engine, *_ = hf_zero.initialize(model=make_model("llama"), config=config)
    loss_function = engine.module.loss_function
    assert type(loss_function).__name__ == "VocabParallelCausalLMLoss", loss_function
    step = {"n": 0}

    def trapped(*args, **kwargs):
        if RANK == 1 and step["n"] == FAULT_STEP:
            fault_now()
        return loss_function(*args, **kwargs)

    engine.module.loss_function = trapped
    data = token_data(4, batch=2)
    for s in range(4):
        step["n"] = s
        loss = engine(input_ids=data[s], labels=data[s]).loss
        engine.backward(loss)
        engine.step()


if __name__ == "__main__":
    torch.manual_seed(0)
    {"pipe": pipe, "tp": tp}[KIND]()
    print("DONE", flush=True)
