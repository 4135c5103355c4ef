"""Writes ``deepspeed_0.19.7.json`` beside this file: DeepSpeed's own answers for ``tests/test_elasticity.py``.

DeepSpeed 0.19.8 removed elasticity (it refuses the section), so the reference is 0.19.7, the last release with it.
Its source is enough (elasticity is pure Python; no ops are built), run with the interpreter of a venv that has
DeepSpeed's dependencies (torch, numpy, packaging, pydantic, hjson...), e.g. one with DeepSpeed 0.19.8 installed:

    pip download deepspeed==0.19.7 --no-deps --no-binary :all: -d /tmp/ds && tar xzf /tmp/ds/deepspeed-0.19.7.tar.gz -C /tmp/ds
    HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu python tests/data/elasticity/make_fixture.py /tmp/ds/deepspeed-0.19.7

Two kinds of record, each with its inputs and DeepSpeed's outcome (the values, or the exception's class name):

* ``compute``: ``deepspeed.elasticity.compute_elastic_config(ds_config, target, world_size, return_microbatch)``
  over a grid (versions 0.1 and 0.2, caps, micro-batch lists, GPU ranges, nodes and model parallelism, both
  ``prefer_larger_batch``, world sizes; a seeded sample of it, to keep the file small), without a world size
  (``WORLD_SIZE`` in the environment or not), and the error cases;
* ``runtime``: the batch sizes ``deepspeed.runtime.config.DeepSpeedConfig`` resolves for a data-parallel world size
  (given through an mpu, over a one-process gloo group), with and without batch keys beside the section.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = "0.19.7"


def _section(**keys) -> dict:
    return {"enabled": True, **keys}


def grid_inputs() -> list[dict]:
    """The full grid; ``main`` keeps a seeded sample of its ordinary outcomes (see ``_sample``)."""
    cases = []
    # version 0.1: the plan does not depend on the world size, which is only checked and picks the micro batch
    for cap, micro, (lo, hi), prefer in itertools.product(
            (2000, 96, 17), ([2, 4, 6], [1], [3, 5], [8, 4, 2], [7], [2, 2, 4]), ((1, 10000), (2, 16), (5, 6)),
            (True, False)):
        section = _section(max_train_batch_size=cap, micro_batch_sizes=micro, min_gpus=lo, max_gpus=hi,
                           prefer_larger_batch=prefer, version=0.1)
        cases += [{"section": section, "world_size": w} for w in (0, 3, 4, 8)]
    # version 0.2: the plan is made for the world size (nodes of num_gpus_per_node, model parallel inside a node)
    for cap, micro, (lo, hi), prefer, (per_node, mp) in itertools.product(
            (2000, 96), ([2, 4, 6], [1], [8, 4, 2], [3, 5]), ((1, 10000), (2, 16)), (True, False),
            ((1, 1), (2, 1), (4, 2), (8, 2), (4, 1))):
        section = _section(max_train_batch_size=cap, micro_batch_sizes=micro, min_gpus=lo, max_gpus=hi,
                           prefer_larger_batch=prefer, num_gpus_per_node=per_node, model_parallel_size=mp)
        cases += [{"section": section, "world_size": w} for w in (1, 2, 3, 4, 6, 8)]
    return cases


def special_inputs() -> list[dict]:
    """Kept whole: no world size, and the errors."""
    cases = []
    # without a world size: version 0.2 reads WORLD_SIZE; return_microbatch asks for the micro batch as well
    v2 = _section(max_train_batch_size=1000, micro_batch_sizes=[2, 4, 6], version=0.2)
    v1 = _section(max_train_batch_size=1000, micro_batch_sizes=[2, 4, 6], version=0.1)
    v2_fallback = _section(max_train_batch_size=100, micro_batch_sizes=[3, 4], num_gpus_per_node=2)
    # preferring smaller batches, version 0.2's micro batch is the first fitting one in the list as given
    v2_smaller = _section(max_train_batch_size=1000, micro_batch_sizes=[4, 2, 6], prefer_larger_batch=False)
    for section, env, micro in itertools.product((v1, v2, v2_fallback, v2_smaller), ("4", "5", None),
                                                 (False, True)):
        cases.append({"section": section, "world_size": 0, "return_microbatch": micro, "env_world_size": env})
    # the errors
    errors = [
        {"ds_config": {}},
        {"section": {"enabled": False, "max_train_batch_size": 8, "micro_batch_sizes": [2]}},
        {"section": _section(micro_batch_sizes=[2, 4])},
        {"section": _section(max_train_batch_size=64)},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=4)},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2, 2.5])},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[0, 2])},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], min_gpus=0)},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], min_gpus=8, max_gpus=4)},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], model_parallel_size=0)},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], num_gpus_per_node=0)},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], min_time=-1)},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], version=0.3)},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], version=0.15)},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], version=0.1, model_parallel_size=2,
                             num_gpus_per_node=2)},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], version=0.1), "target": "0.3.7"},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], version=0.1), "target": "0.3.8"},
        {"section": _section(max_train_batch_size=8, micro_batch_sizes=[4, 16], version=0.1)},
        {"section": _section(max_train_batch_size=8, micro_batch_sizes=[4, 8], num_gpus_per_node=4),
         "world_size": 4},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], num_gpus_per_node=4,
                             model_parallel_size=3), "world_size": 4},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2])},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], version=0.1), "world_size": 7},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], version=0.1, min_gpus=2),
         "world_size": 1},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], num_gpus_per_node=4,
                             model_parallel_size=2), "world_size": 5},
        # no GPU count in the range fits: version 0.2 falls back to the world size, or (preferring smaller
        # batches, where the search keeps its starting point) DeepSpeed fails
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], min_gpus=100, max_gpus=200),
         "world_size": 4},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], min_gpus=100, max_gpus=200,
                             prefer_larger_batch=False), "world_size": 4},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], min_gpus=100, max_gpus=200,
                             version=0.1)},
        {"section": _section(max_train_batch_size=64, micro_batch_sizes=[2], min_gpus=100, max_gpus=200,
                             version=0.1, prefer_larger_batch=False)},
    ]
    return cases + errors


RUNTIME_BASE = {"elasticity": _section(max_train_batch_size=96, micro_batch_sizes=[2, 4], version=0.1)}


def runtime_inputs() -> list[dict]:
    v2 = {"elasticity": _section(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6])}
    v2_nodes = {"elasticity": _section(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], num_gpus_per_node=2)}
    ignore = {"elasticity": {**RUNTIME_BASE["elasticity"], "ignore_non_elastic_batch_info": True}}
    too_small = {"elasticity": _section(max_train_batch_size=16, micro_batch_sizes=[4])}
    return [
        {"config": RUNTIME_BASE, "world_size": 1},
        {"config": RUNTIME_BASE, "world_size": 2},
        {"config": RUNTIME_BASE, "world_size": 3},
        {"config": RUNTIME_BASE, "world_size": 5},
        {"config": v2, "world_size": 2},
        {"config": v2, "world_size": 7},
        {"config": v2_nodes, "world_size": 4},
        {"config": v2_nodes, "world_size": 3},
        {"config": {**RUNTIME_BASE, "train_batch_size": 32}, "world_size": 2},
        {"config": {**RUNTIME_BASE, "train_micro_batch_size_per_gpu": 4}, "world_size": 2},
        {"config": {**RUNTIME_BASE, "gradient_accumulation_steps": 12}, "world_size": 2},
        {"config": {**ignore, "train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                    "gradient_accumulation_steps": 8}, "world_size": 2},
        {"config": {"elasticity": {**RUNTIME_BASE["elasticity"], "min_gpus": 2}}, "world_size": 1},
        {"config": too_small, "world_size": 8},
    ]


def _sample(records: list[dict], per_outcome: int = 200) -> list[dict]:
    """A seeded sample of at most ``per_outcome`` records per outcome kind (a value, or each error class), in grid
    order, so the fixture stays small while every kind of answer the grid produced is in it."""
    by_kind: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        by_kind.setdefault(record.get("error", "value"), []).append(i)
    rng = random.Random(0)
    keep = set()
    for indices in by_kind.values():
        keep.update(indices if len(indices) <= per_outcome else rng.sample(indices, per_outcome))
    return [records[i] for i in sorted(keep)]


def _outcome(call) -> dict:
    try:
        value = call()
    except Exception as err:  # the class is the record: DeepSpeed's errors are the thing being captured
        return {"error": type(err).__name__}
    return {"value": value}


def _plain(value):
    """numpy integers (DeepSpeed's lcm-based candidates) and tuples -> JSON."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return None if value is None else int(value)


def run_compute(case: dict) -> dict:
    from deepspeed.elasticity import compute_elastic_config

    ds_config = case.get("ds_config", {"elasticity": case.get("section")})
    env = case.get("env_world_size")
    os.environ.pop("WORLD_SIZE", None)
    if env is not None:
        os.environ["WORLD_SIZE"] = env
    out = _outcome(lambda: _plain(compute_elastic_config(ds_config, case.get("target", TARGET),
                                                         world_size=case.get("world_size", 0),
                                                         return_microbatch=case.get("return_microbatch", False))))
    os.environ.pop("WORLD_SIZE", None)
    return {**case, **out}


class _DataParallelMpu:
    """What DeepSpeedConfig reads of an mpu: the data-parallel world size it resolves the batch for."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


def run_runtime(case: dict) -> dict:
    from deepspeed.runtime.config import DeepSpeedConfig

    def resolve():
        cfg = DeepSpeedConfig(json.loads(json.dumps(case["config"])), mpu=_DataParallelMpu(case["world_size"]))
        return [cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps]

    return {**case, **_outcome(resolve)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("deepspeed_src", type=Path, help="DeepSpeed 0.19.7's unpacked source (holds version.txt)")
    args = parser.parse_args()
    src = args.deepspeed_src.resolve()
    sys.path.insert(0, str(src))
    os.chdir(src)  # DeepSpeed's uninstalled source reads its version from ./version.txt
    import deepspeed
    import torch.distributed as dist

    assert deepspeed.__version__.strip() == TARGET, f"expected DeepSpeed {TARGET} from {src}: {deepspeed.__version__}"
    assert deepspeed.__file__.startswith(str(src)), f"deepspeed imported from {deepspeed.__file__}, not {src}"
    compute = _sample([run_compute(c) for c in grid_inputs()]) + [run_compute(c) for c in special_inputs()]
    # DeepSpeedConfig asks deepspeed.comm for the rank before it reads the mpu: a one-process group answers
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")
    runtime = [run_runtime(c) for c in runtime_inputs()]
    dist.destroy_process_group()
    out = HERE / f"deepspeed_{TARGET}.json"
    with open(out, "w") as f:  # one record per line: reviewable diffs
        f.write('{"deepspeed": "%s",\n "compute": [\n' % TARGET)
        f.write(",\n".join("  " + json.dumps(c, sort_keys=True) for c in compute))
        f.write('\n ],\n "runtime": [\n')
        f.write(",\n".join("  " + json.dumps(c, sort_keys=True) for c in runtime))
        f.write("\n ]}\n")
    errors = sum("error" in c for c in compute + runtime)
    print(f"{out}: {len(compute)} compute and {len(runtime)} runtime records ({errors} errors)")


if __name__ == "__main__":
    main()
