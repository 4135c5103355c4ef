"""Step time before the run: a roofline of compute, exposed communication, optimizer and offload I/O.

    t_step = t_compute + t_comm_exposed + t_optimizer + t_offload

- compute: model FLOPs of the step (per rank) / (peak x efficiency); efficiency 0.45 until calibrated;
- communication: ZeRO volume per rank / bus bandwidth x the part not hidden behind compute (stage 0: all-reduce of
  the gradients, 2(N-1)/N x P; stages 1-2: reduce-scatter + all-gather, 2(N-1)/N x P; stage 3: two all-gathers and
  a reduce-scatter, 3(N-1)/N x P; exposed share 0.3 for stages 0-2, 1.0 for stage 3);
- optimizer: 32 B moved per shard element (fp32 master, gradient, two moments) / memory bandwidth;
- offload: gradients down and weights up across PCIe (cpu), plus master + moments read and written (nvme).

:meth:`StepTimeModel.calibrate` replaces the efficiency by the one that explains measured step times (the engine
times its steps); the rest of the roofline stays. On CPU the defaults are rough: say so when quoting them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

__all__ = ["Hardware", "StepTimeModel", "estimate_step_time"]


@dataclass(frozen=True)
class Hardware:
    peak_tflops: float            # dense peak of one device in the compute dtype
    mem_bw_gbs: float = 2000.0    # device memory bandwidth, GB/s
    bus_bw_gbs: float = 100.0     # collective bus bandwidth between ranks, GB/s
    pcie_gbs: float = 25.0        # host <-> device
    nvme_gbs: float = 3.0         # NVMe read/write
    host_bw_gbs: float = 20.0     # host memory bandwidth (CPU Adam)


@dataclass(frozen=True)
class StepTimeModel:
    hardware: Hardware
    efficiency: float = 0.45

    def breakdown(self, *, model_flops_per_rank: float, params: int, trainable: int, stage: int, world_size: int,
                  param_bytes: int = 2, offload_optimizer: str = "none") -> dict[str, float]:
        hw = self.hardware
        shard = trainable / (1 if stage == 0 else world_size)
        compute = model_flops_per_rank / (hw.peak_tflops * 1e12 * self.efficiency)
        ring = (world_size - 1) / world_size if world_size > 1 else 0.0
        volume = {0: 2, 1: 2, 2: 2, 3: 3}[stage] * ring * params * param_bytes
        exposed = 1.0 if stage == 3 else 0.3
        comm = volume / (hw.bus_bw_gbs * 1e9) * exposed
        if offload_optimizer == "none":
            optimizer = 32 * shard / (hw.mem_bw_gbs * 1e9)
            offload = 0.0
        else:
            optimizer = 32 * shard / (hw.host_bw_gbs * 1e9)
            offload = 2 * shard * param_bytes / (hw.pcie_gbs * 1e9)
            if offload_optimizer == "nvme":
                offload += 2 * 12 * shard / (hw.nvme_gbs * 1e9)
        parts = {"compute": compute, "communication": comm, "optimizer": optimizer, "offload": offload}
        parts["step"] = sum(parts.values())
        return parts

    def calibrate(self, measured_step_s: list[float], **workload) -> "StepTimeModel":
        """The same roofline with the compute efficiency that makes its step time the median measured one."""
        if not measured_step_s:
            raise ValueError("StepTimeModel.calibrate: no measured step times")
        ordered = sorted(measured_step_s)
        median = ordered[len(ordered) // 2]
        parts = self.breakdown(**workload)
        rest = parts["step"] - parts["compute"]
        compute_s = max(median - rest, 1e-9)
        efficiency = parts["compute"] * self.efficiency / compute_s
        return replace(self, efficiency=efficiency)

    def to_dict(self) -> dict:
        return {"efficiency": self.efficiency, **asdict(self.hardware)}


def estimate_step_time(model_flops_per_rank: float, *, params: int, trainable: int | None = None, stage: int = 0,
                       world_size: int = 1, peak_tflops: float, param_bytes: int = 2,
                       offload_optimizer: str = "none", efficiency: float = 0.45, **hardware) -> dict[str, float]:
    """Seconds per optimizer step and their split (compute, communication, optimizer, offload)."""
    model = StepTimeModel(Hardware(peak_tflops=peak_tflops, **hardware), efficiency=efficiency)
    return model.breakdown(model_flops_per_rank=model_flops_per_rank, params=params,
                           trainable=params if trainable is None else trainable, stage=stage, world_size=world_size,
                           param_bytes=param_bytes, offload_optimizer=offload_optimizer)
