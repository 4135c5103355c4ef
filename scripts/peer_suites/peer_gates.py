"""pytest plugin (``-p peer_gates``): lifts the peers' hardware gates, and nothing else, before collection.

The peers' DeepSpeed tests are decorated ``@require_non_cpu``, ``@require_multi_device``, ``@require_cuda``
and the like, imported from ``accelerate.test_utils`` / ``transformers.testing_utils``. Those decorators are
``unittest.skipUnless(<a GPU is present>)``; this plugin replaces each with the identity in the module that
defines it (and in the package namespace that re-exports it) when pytest imports the plugin, which is before the
peer's conftest files and test modules, so the test files are run unedited. Software gates (``require_deepspeed``,
``require_fp16``, ``require_huggingface_suite``, ``slow``) are left alone: they decide as they always do.

accelerate's ``get_backend()``, which test modules call at import to skip themselves on a CPU, returns a "cpu"
that does not compare equal to "cpu" (and is the CPU everywhere it is used). transformers' ``TrainingArguments``
refuses ``bf16=True`` unless a GPU supports bf16 (``is_torch_bf16_gpu_available``, read by that check alone); the
probe it reads answers True where the CPU runs bf16, so the peers' bf16 tests run on the CPU.

A test that then asks for more devices than the machine has gets ``PEER_SUITES_NPROC`` CPU processes
(default 2): accelerate's ``device_count`` and ``DEFAULT_LAUNCH_COMMAND`` are set to it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys

__all__ = ["GATES", "lift_gates", "lifted"]

# module -> names of decorators that gate on hardware (GPU presence, GPU count). Missing names are ignored:
# the list covers several versions of each peer.
GATES: dict[str, tuple[str, ...]] = {
    "accelerate.test_utils.testing": (
        "require_non_cpu", "require_cuda", "require_cuda_or_hpu", "require_cuda_or_xpu", "require_multi_device",
        "require_multi_gpu", "require_multi_gpu_or_xpu", "require_single_device", "require_single_gpu",
    ),
    "transformers.testing_utils": (
        "require_torch_gpu", "require_torch_accelerator", "require_torch_multi_gpu",
        "require_torch_multi_accelerator", "require_torch_up_to_2_gpus", "require_torch_up_to_2_accelerators",
        "require_torch_non_multi_gpu", "require_torch_non_multi_accelerator",
    ),
    "peft.testing_utils": ("require_non_cpu", "require_torch_gpu", "require_torch_multi_gpu"),
}

# A peer's own test helpers (peft's ``tests/testing_utils.py``) define gates of the same names; they are lifted
# as those modules are imported, by an import hook, before the test module that imports them continues.
_HELPER_SUFFIX = "testing_utils"
_HELPER_GATES = tuple(sorted({name for names in GATES.values() for name in names}))

# Package namespaces that re-export the decorators (``from accelerate.test_utils import require_cuda``).
_REEXPORTS: dict[str, tuple[str, ...]] = {"accelerate.test_utils.testing": ("accelerate.test_utils",)}

# module -> probes asked "does the GPU support X" by a check that refuses an option without one; each answers for
# the CPU too (the run's device). Only the named module's binding is replaced.
PROBES: dict[str, tuple[str, ...]] = {"transformers.training_args": ("is_torch_bf16_gpu_available",)}

lifted: list[str] = []


def _identity(test_case=None, *args, **kwargs):
    return test_case


class _UngatedCpu(str):
    """"cpu" that does not compare equal to "cpu": for module-level gates of the form
    ``device, _, _ = get_backend(); if device == "cpu": pytest.skip(allow_module_level=True)`` (peft's GPU test
    module). Everything that uses the value (``torch.device(device)``, ``.to(device)``) still gets the CPU."""

    def __eq__(self, other):
        return False if other == "cpu" else str.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


def _ungated_backend(get_backend):
    def wrapper(*args, **kwargs):
        device, *rest = get_backend(*args, **kwargs)
        return (_UngatedCpu(device) if device == "cpu" else device, *rest)

    return wrapper


def _or_cpu_bf16(probe):
    def wrapper(*args, **kwargs):
        from transformers.utils import is_torch_bf16_available_on_device

        return probe(*args, **kwargs) or is_torch_bf16_available_on_device("cpu")  # a bf16 op runs on this CPU

    return wrapper


def lift_probes() -> list[str]:
    done = []
    for module_name, names in PROBES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in names:
            if callable(getattr(module, name, None)):
                setattr(module, name, _or_cpu_bf16(getattr(module, name)))
                done.append(f"{module_name}.{name}")
    return done


def lift_gates(nproc: int) -> list[str]:
    """Replaces every gate found; returns ``module.name`` for each one replaced."""
    done = []
    for module_name, names in GATES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        namespaces = [module] + [sys.modules[m] for m in _REEXPORTS.get(module_name, ()) if m in sys.modules]
        for name in names:
            if not hasattr(module, name):
                continue
            for namespace in namespaces:
                if hasattr(namespace, name):
                    setattr(namespace, name, _identity)
            done.append(f"{module_name}.{name}")
        if module_name == "accelerate.test_utils.testing":
            _set_accelerate_devices(module, namespaces, nproc)
            if hasattr(module, "get_backend"):
                for namespace in namespaces:
                    if hasattr(namespace, "get_backend"):
                        namespace.get_backend = _ungated_backend(module.get_backend)
                done.append(f"{module_name}.get_backend")
    return done


def _lift_in(module) -> list[str]:
    done = []
    for name in _HELPER_GATES:
        if callable(getattr(module, name, None)):
            setattr(module, name, _identity)
            done.append(f"{module.__name__}.{name}")
    return done


class _HelperGateLifter(importlib.abc.MetaPathFinder):
    """Finds ``*testing_utils`` modules outside the installed packages through the other finders and lifts the
    gates they define right after they are executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.rsplit(".", 1)[-1] != _HELPER_SUFFIX or fullname in GATES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _LiftingLoader(spec.loader)
                return spec
            if spec is not None:
                return spec
        return None


class _LiftingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        lifted.extend(_lift_in(module))


def _set_accelerate_devices(module, namespaces, nproc: int) -> None:
    if getattr(module, "device_count", nproc) >= nproc:
        return
    for namespace in namespaces:
        if hasattr(namespace, "device_count"):
            namespace.device_count = nproc
        if hasattr(namespace, "DEFAULT_LAUNCH_COMMAND"):
            namespace.DEFAULT_LAUNCH_COMMAND = module.get_launch_command(num_processes=nproc, monitor_interval=0.1)


# At import: ``-p peer_gates`` imports this before the peer's conftest files and test modules.
lifted[:] = lift_gates(int(os.environ.get("PEER_SUITES_NPROC", "2"))) + lift_probes()
sys.meta_path.insert(0, _HelperGateLifter())


def pytest_report_header(config):
    return f"peer_gates: lifted {len(lifted)} hardware gates: {', '.join(n.rsplit('.', 1)[1] for n in lifted)}"
