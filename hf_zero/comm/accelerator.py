"""The device this process computes on, answered the way DeepSpeed's ``get_accelerator()`` answers it.

transformers calls ``get_accelerator().current_device_name()`` (where to put broadcast buffers under ZeRO-3) and
``device_name(local_rank)``; ``deepspeed.accelerator.get_accelerator`` forwards here. The device is CUDA when this
process sees a GPU, else CPU -- the same rule as :func:`hf_zero.comm.default_backend`, so the device and the
communication backend always agree (cuda/nccl or cpu/gloo).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os

import psutil
import torch

from . import host_memory
from .process_group import default_backend, get_local_rank

__all__ = ["Accelerator", "get_accelerator"]


class Accelerator:
    """DeepSpeed's accelerator interface, the part HF code and training scripts call.

    On CUDA every call is torch.cuda's. On CPU the answers are DeepSpeed's CPU accelerator's: one device named
    ``'cpu'``, ``set_device`` a no-op, host memory (RSS, see :mod:`hf_zero.comm.host_memory`) for the memory
    queries, streams and events absent (``stream()`` is a null context).
    """

    def __init__(self, device_type: str):
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"hf_zero: unsupported accelerator device type {device_type!r}; expected 'cuda' or 'cpu'")
        self._name = device_type  # DeepSpeed's attribute name, read by some scripts
        self._communication_backend_name = default_backend()
        self._compile_backend = "inductor"

    @property
    def _cuda(self) -> bool:
        return self._name == "cuda"

    # ---- devices --------------------------------------------------------------------------------------------------
    def device_name(self, device_index: int | str | None = None) -> str:
        """``'cuda'`` / ``'cuda:<i>'``; always ``'cpu'`` on CPU (DeepSpeed's CPU accelerator ignores the index)."""
        if not self._cuda or device_index is None:
            return self._name
        return f"{self._name}:{int(device_index)}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        """CUDA: make ``device_index`` current. CPU: nothing to select (as in DeepSpeed)."""
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """CUDA's current device index; on CPU, the local rank (as DeepSpeed's CPU accelerator answers)."""
        return torch.cuda.current_device() if self._cuda else get_local_rank()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        """CUDA's device count. On CPU, DeepSpeed's CPU accelerator's answer: ``LOCAL_SIZE`` when the launcher set
        it, else the NUMA nodes that have cores (scripts size their worlds and skip on it)."""
        if self._cuda:
            return torch.cuda.device_count()
        local_size = int(os.environ.get("LOCAL_SIZE", "0") or 0)
        return local_size if local_size > 0 else _numa_nodes_with_cores()

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        """True on CPU: work is done when the call returns (no streams to wait for)."""
        return not self._cuda

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    # ---- random numbers -------------------------------------------------------------------------------------------
    def random(self):
        return torch.random

    def manual_seed(self, seed: int):
        """Returns what the torch call returns, as DeepSpeed's: None on CUDA, the CPU generator on CPU."""
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        """A method, as DeepSpeed's (``get_accelerator().default_generator(index)``): that device's generator; on CPU
        the one CPU generator whatever the index."""
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # ---- memory (bytes) -------------------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else host_memory.rss_bytes()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else host_memory.peak_rss_bytes()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            host_memory.reset_peak_rss()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else host_memory.rss_bytes()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else host_memory.peak_rss_bytes()

    memory_cached = memory_reserved  # DeepSpeed keeps torch's old names too
    max_memory_cached = max_memory_reserved
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": host_memory.rss_bytes(),
                "allocated_bytes.all.peak": host_memory.peak_rss_bytes()}

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or torch.cuda.current_device()).total_memory
        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return psutil.virtual_memory().available

    # ---- tensors --------------------------------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """Page-locked copy for fast device transfers; CPU has no device to transfer to, so the tensor itself."""
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ---- tensor constructors: DeepSpeed's ``get_accelerator().FloatTensor([...])`` -------------------------------
    # CPU: torch's legacy CPU tensor types (as DeepSpeed's CPU accelerator). CUDA: torch.tensor on the GPU with that
    # dtype (as DeepSpeed's CUDA accelerator; torch.cuda.FloatTensor & co. are deprecated).
    def _tensor_type(self, dtype: torch.dtype, cpu_type):
        return functools.partial(torch.tensor, dtype=dtype, device="cuda") if self._cuda else cpu_type

    @property
    def BFloat16Tensor(self):
        return self._tensor_type(torch.bfloat16, torch.BFloat16Tensor)

    @property
    def ByteTensor(self):
        return self._tensor_type(torch.uint8, torch.ByteTensor)

    @property
    def DoubleTensor(self):
        return self._tensor_type(torch.float64, torch.DoubleTensor)

    @property
    def FloatTensor(self):
        return self._tensor_type(torch.float32, torch.FloatTensor)

    @property
    def HalfTensor(self):
        return self._tensor_type(torch.float16, torch.HalfTensor)

    @property
    def IntTensor(self):
        return self._tensor_type(torch.int32, torch.IntTensor)

    @property
    def LongTensor(self):
        return self._tensor_type(torch.int64, torch.LongTensor)

    # ---- op builders ----------------------------------------------------------------------------------------------
    def get_op_builder(self, class_name: str):
        """The op builder class named ``class_name`` (``"CPUAdamBuilder"``, ``"FusedAdamBuilder"``, ...), or DeepSpeed's
        ``NotImplementedBuilder`` for a name that has none here (as DeepSpeed answers, rather than None).

        The builders are DeepSpeed's names, so they are looked up where DeepSpeed-style code finds them:
        ``deepspeed.ops.op_builder`` -- hf_zero's compatibility layer, or a real DeepSpeed if one is installed. This
        package never imports the layers above it; that namespace is the public face they give it.
        """
        import importlib

        builders = importlib.import_module("deepspeed.ops.op_builder")
        return getattr(builders, class_name, None) or builders.NotImplementedBuilder

    def create_op_builder(self, op_name: str):
        """An instance of :meth:`get_op_builder`'s class."""
        builder_class = self.get_op_builder(op_name)
        return None if builder_class is None else builder_class()

    # ---- capabilities ---------------------------------------------------------------------------------------------
    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True  # CPU: torch computes fp16 on CPU (DeepSpeed's CPU accelerator says so when the CPU has AVX512)

    def supported_dtypes(self) -> list[torch.dtype]:
        """DeepSpeed's order: CUDA float32, float16, bfloat16 (if supported); CPU float32, bfloat16, float16."""
        if not self._cuda:
            return [torch.float32, torch.bfloat16, torch.float16]
        dtypes = [torch.float32, torch.float16]
        return dtypes + [torch.bfloat16] if self.is_bf16_supported() else dtypes

    def is_triton_supported(self) -> bool:
        return self._cuda

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    # ---- streams, events, profiler ranges (CPU: none, as DeepSpeed's CPU accelerator) -----------------------------
    @property
    def Stream(self):
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self):
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream):
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        """CUDA: run ``callback`` once CUDA is initialised (torch.cuda._lazy_call). CPU: run it now and return its
        result, as DeepSpeed's CPU accelerator does."""
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    def amp(self):
        return torch.amp

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"


def _numa_nodes_with_cores() -> int:
    """NUMA nodes listing CPUs (HBM-only nodes list none), 1 where sysfs shows no nodes."""
    lists = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist")):
        with open(path) as f:
            cpus = f.read().strip()
        if cpus and cpus not in lists:
            lists.append(cpus)
    return max(1, len(lists))


@functools.cache
def get_accelerator() -> Accelerator:
    """The process's accelerator (decided once, like DeepSpeed's)."""
    from .device import accelerator_type

    return Accelerator(accelerator_type())


# the accelerators hf_zero runs on (DeepSpeed's list is longer: xpu, npu, hpu, mps, ...)
SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]


def is_current_accelerator_supported() -> bool:
    """``deepspeed.accelerator.is_current_accelerator_supported``."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST
