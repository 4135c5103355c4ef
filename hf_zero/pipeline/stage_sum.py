"""Sums over a pipeline replica's stages that one training step needs (the squared gradient norm for clipping and
the fp16 overflow decision; the loss every stage reports), passed along the pipeline instead of all-reduced.

In every schedule a stage's last backward ends before the previous stage's (gradients flow from the last stage to
the first), so the last stage reaches its optimizer step first and the first stage last. Each stage adds its part
to what the next stage sent and sends the sum on to the previous stage while the earlier stages are still
computing; the first stage then has the total as soon as its own backward is done and broadcasts it. After the
first stage's last backward only that broadcast remains, where an all-reduce (plus its divergence check) and a
separate loss broadcast were three collectives on the step's critical path.

Each send, receive and the broadcast is bounded and diagnosed like every hf_zero collective (comm/faults.py, on the
pipeline group's channel): a stage that died or stopped is named within comms_timeout_s. A stage that fails
elsewhere aborts the pipeline group (pipeline/failure.py), which ends these waits on every other stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_zero.comm import faults

__all__ = ["sum_over_stages"]

_TAG = 0x5EED  # apart from torch.distributed.pipelining's own point-to-point messages on the same group


def sum_over_stages(values: torch.Tensor, grid) -> torch.Tensor:
    """``values`` (a small 1-D tensor) summed over this replica's pipeline stages, on every stage."""
    stage, stages = grid.stage_id, grid.pipe_parallel_size
    group = grid.get_pipe_parallel_group()
    total = values.clone()
    if stage < stages - 1:
        tail = torch.empty_like(total)
        with faults.bounded(f"the step's sums: the receive from stage {stage + 1}", group):
            dist.recv(tail, src=grid.stage_to_global(stage + 1), group=group, tag=_TAG)
        total += tail
    if stage > 0:
        with faults.bounded(f"the step's sums: the send to stage {stage - 1}", group):
            dist.send(total, dst=grid.stage_to_global(stage - 1), group=group, tag=_TAG)
    with faults.bounded("the step's sums: the broadcast from stage 0", group):
        dist.broadcast(total, src=grid.stage_to_global(0), group=group)
    return total
