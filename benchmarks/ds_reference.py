"""DeepSpeed's own figures for the models of ``bench_estimate.py``; run by it with a real DeepSpeed's python.

    DS_ACCELERATOR=cpu /work/venvs/ds/bin/python benchmarks/ds_reference.py '{"tiny": {...config...}}' 2x128 2

Prints one JSON object per model (give one model per process: zero.Init leaves F.linear patched for the rest
of the process, so a later plain model would be double counted too): ``get_model_profile`` on the plain model
(forward FLOPs, params), DeepSpeed's ``FlopsProfiler`` around a forward of a ZeRO-3 engine (one gloo rank; the model built under ``zero.Init``),
``model_to_params`` of that model and the model-state estimators ``estimate_zero2/3_model_states_mem_needs`` for
``world`` GPUs (no offload). Imports only DeepSpeed, torch and transformers (never hf_zero).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys


def main() -> None:
    models, shape, world = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    batch, seq = (int(x) for x in shape.split("x"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch
    from deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from transformers import LlamaConfig, LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for name, kwargs in models.items():
        cfg = LlamaConfig(max_position_embeddings=max(seq, 512), tie_word_embeddings=False, **kwargs)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
        model = LlamaForCausalLM(cfg)
        with contextlib.redirect_stdout(io.StringIO()):
            flops, macs, params = get_model_profile(model, kwargs={"input_ids": ids, "labels": ids},
                                                    print_profile=False, detailed=False, as_string=False)
        total = sum(p.numel() for p in model.parameters())
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        z2_cpu, z2_gpu = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=world, num_nodes=1,
                                                               cpu_offload=False)
        z3_cpu, z3_gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=world,
                                                                  num_nodes=1, cpu_offload=False,
                                                                  cpu_offload_params=False, zero_init=True)
        del model
        ds_config = {"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": 3},
                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            z3_model = LlamaForCausalLM(cfg)
        z3_total, z3_largest = _model_to_params(z3_model)
        engine, *_ = deepspeed.initialize(model=z3_model, config=ds_config)
        prof = FlopsProfiler(engine.module, ds_engine=engine)
        prof.start_profile()
        engine(input_ids=ids, labels=ids)
        z3_flops, z3_params = prof.get_total_flops(), prof.get_total_params()
        prof.end_profile()
        engine.destroy()
        out[name] = {"forward_flops": int(flops), "params": int(params), "zero3_forward_flops": int(z3_flops),
                     "zero3_params": int(z3_params), "zero3_model_to_params": [z3_total, z3_largest],
                     "estimate_zero2_gpu_bytes": int(z2_gpu), "estimate_zero3_gpu_bytes": int(z3_gpu),
                     "estimate_zero2_cpu_bytes": int(z2_cpu), "estimate_zero3_cpu_bytes": int(z3_cpu)}
    print(json.dumps(out))


def _model_to_params(model) -> tuple[int, int]:
    """DeepSpeed's ``model_to_params`` (what ``estimate_zero*_all_live`` counts) on a model."""
    from deepspeed.runtime.zero.stage3 import model_to_params

    return tuple(int(x) for x in model_to_params(model))


if __name__ == "__main__":
    main()
