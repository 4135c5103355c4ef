"""Writes ``deepspeed_tiling.json`` beside this file: what DeepSpeed's ``TiledLinear`` builds and computes, for
tests/test_zero_tiling.py (CI has no DeepSpeed). Run with real DeepSpeed and without hf_zero's shim:

    HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu python tests/data/tiling/make_fixture.py

(DeepSpeed 0.19.8 wrote the file here.) Recorded: the constructor's signature, the tile boundaries DeepSpeed's
``partition_uniform`` gives over a grid, each case's tiles (weight shape, bias shape or null, in row-major order),
the exception type of bad splits, and the forward results of a few cases on deterministic weights and inputs
(``weights``/``inputs`` of tests/_tiling_fixture.py, which the test builds too).
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import torch

import deepspeed
from deepspeed.runtime.utils import partition_uniform
from deepspeed.runtime.zero import TiledLinear, TiledLinearReturnBias

assert "hf_zero" not in (deepspeed.__file__ or ""), "run with HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 and real DeepSpeed"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the pieces the test rebuilds
from _tiling_fixture import BiasSkippingLinear, inputs, weights  # noqa: E402


SHAPE_CASES = [
    (10, 7, {}),
    (10, 7, {"in_splits": 3, "out_splits": 4}),
    (10, 7, {"in_splits": 10, "out_splits": 7}),
    (13, 5, {"in_splits": 4, "out_splits": 2, "bias": False}),
    (64, 48, {"in_splits": 5, "out_splits": 3}),
    (7, 9, {"out_splits": 4}),
    (100, 37, {"in_splits": 7, "out_splits": 6}),
]

ERROR_CASES = [(10, 7, {"in_splits": 0}), (10, 7, {"in_splits": 11}), (10, 7, {"out_splits": 0}),
               (10, 7, {"out_splits": 8})]

FORWARD_CASES = [
    ("TiledLinear", 10, 7, {"in_splits": 3, "out_splits": 4}),
    ("TiledLinear", 10, 7, {"in_splits": 3, "out_splits": 2, "bias": False, "combine_out_splits": False}),
    ("TiledLinear", 10, 7, {"in_splits": 3, "out_splits": 4, "input_is_already_split": True}),
    ("TiledLinearReturnBias", 10, 7, {"in_splits": 3, "out_splits": 2, "linear_cls": "BiasSkippingLinear"}),
    ("TiledLinearReturnBias", 10, 7, {"in_splits": 2, "out_splits": 3, "linear_cls": "BiasSkippingLinear",
                                      "combine_out_splits": False}),
]


def tiles(module: TiledLinear) -> list:
    return [[[list(t.weight.shape), None if t.bias is None else list(t.bias.shape)] for t in row]
            for row in module.linears]


def as_lists(result):
    if isinstance(result, torch.Tensor):
        return result.tolist()
    if result is None:
        return None
    return [as_lists(r) for r in result]


def main() -> None:
    sig = inspect.signature(TiledLinear.__init__)
    out = {
        "deepspeed_version": deepspeed.__version__,
        "signature": [[p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default)]
                      for p in sig.parameters.values()],
        "boundaries": [[n, k, partition_uniform(num_items=n, num_parts=k)] for n in range(1, 14)
                       for k in range(1, 14)],
        "shapes": [],
        "errors": [],
        "forward": [],
    }
    for in_f, out_f, kw in SHAPE_CASES:
        m = TiledLinear(in_f, out_f, **kw)
        out["shapes"].append({"in_features": in_f, "out_features": out_f, "kwargs": kw, "in_parts": m.in_parts,
                              "out_parts": m.out_parts, "tiles": tiles(m)})
    for in_f, out_f, kw in ERROR_CASES:
        try:
            TiledLinear(in_f, out_f, **kw)
        except Exception as e:  # noqa: BLE001 -- recording which one DeepSpeed raises
            out["errors"].append({"in_features": in_f, "out_features": out_f, "kwargs": kw,
                                  "exception": type(e).__name__})
        else:
            raise AssertionError(f"DeepSpeed accepted {kw}")
    classes = {"TiledLinear": TiledLinear, "TiledLinearReturnBias": TiledLinearReturnBias}
    for cls_name, in_f, out_f, kw in FORWARD_CASES:
        built = dict(kw)
        if built.get("linear_cls") == "BiasSkippingLinear":
            built["linear_cls"] = BiasSkippingLinear
        m = classes[cls_name](in_f, out_f, init_linear=weights(in_f, out_f, kw.get("bias", True)), **built)
        x = inputs(in_f)
        if kw.get("input_is_already_split"):
            x = [x[..., m.in_parts[i]:m.in_parts[i + 1]] for i in range(m.in_splits)]
        with torch.no_grad():
            result = m(x)
        out["forward"].append({"class": cls_name, "in_features": in_f, "out_features": out_f, "kwargs": kw,
                               "result": as_lists(result)})
    path = Path(__file__).with_name("deepspeed_tiling.json")
    # one record per line: small diffs when DeepSpeed's answer changes
    lines = []
    for key, value in out.items():
        if isinstance(value, list) and key != "signature":
            body = ",\n  ".join(json.dumps(v) for v in value)
            lines.append(f" {json.dumps(key)}: [\n  {body}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
