"""CPU and NVMe placement of optimizer states (``zero_optimization.offload_optimizer``).

* :class:`OptimizerOffload` -- owns each group's fp32 master weights and Adam moments when offload is on, and runs
  the tiled CPU-Adam step (NVMe reads/writes overlapped with the math).
* :class:`SwapDir` -- this rank's swap files under ``nvme_path``, with asynchronous reads and writes through the
  compiled ``aio`` op (:mod:`hf_zero.ops.aio`).
* :func:`check_offload_config` -- refuses, at start-up, offload sections the engine cannot honour
  (``offload_param``'s status: :mod:`hf_zero.offload.params`).
* :class:`~hf_zero.offload.param_swap.ParamSwapper` -- ZeRO-3 shards in per-rank swap files
  (``offload_param: {device: nvme}``).

Owns where off-device bytes live and how they move (swap files, aio threads, host buffers). It sits *below* zero:
it may import profiling, comm, ops and config, never zero, runtime or anything above; zero uses it through the
interfaces zero declares (the layer table is ``LAYERS`` in ``tests/test_layering.py``).
"""

from hf_zero.offload.optimizer_states import OptimizerOffload, build_optimizer_offload
from hf_zero.offload.params import check_offload_config, check_param_offload
from hf_zero.offload.swapper import AioParams, SwapDir

__all__ = ["AioParams", "OptimizerOffload", "SwapDir", "build_optimizer_offload",
           "check_offload_config", "check_param_offload"]
