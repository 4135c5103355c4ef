"""The compatibility layer's modules for the DeepSpeed-name tests: installed as the start-up .pth line does in an
installed hf_zero, and checked to be hf_zero's (not a real DeepSpeed that happens to be importable)."""

from __future__ import annotations

import importlib

from hf_zero.integrations.deepspeed_shim._finder import install

install()


def ds(module: str):
    mod = importlib.import_module(module)
    assert "hf_zero" in (mod.__file__ or "") or "hf_zero" in mod.__name__ or hasattr(mod, "_hf_zero_forward"), \
        f"{module} is not hf_zero's compatibility layer"
    return mod
