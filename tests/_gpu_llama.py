"""The GPU runs shared by tests/test_gpu_engine.py and benchmarks/bench_gpu.py: a 160M Llama (hidden 1024, 8 layers,
GQA 16/8 heads, vocab 32000), bf16, micro-batch 8 x 1024 tokens, AdamW lr 1e-4, clipping 1.0 -- the configuration
DeepSpeed 0.19.8 was measured on in ../shared/gpu/README.md -- trained by a plain torch loop (autocast bf16 +
fused AdamW, the reference) and through ``hf_zero.initialize`` at each ZeRO stage.

Every run builds the model on the CPU from the same seed, as a user script does, and hands it over (the engine
moves it to the GPU); ZeRO-3 runs build it under ``zero.Init`` (partitioned onto the GPU as it is built). Each run
reports its losses, per-step times, ``torch.cuda.max_memory_allocated`` over the steps, the activation memory of a
step (torch reference only, see :func:`torch_run`) and, for the engine, the parameter count and byte sizes the
ZeRO memory formula needs.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

B, S, VOCAB = 8, 1024, 32000
LR, CLIP = 1e-4, 1.0


def llama_config(layers: int = 8):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=VOCAB, max_position_embeddings=S, tie_word_embeddings=False,
                       attn_implementation="sdpa")


def batches(n: int = 4, device: str = "cuda") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (B, S), generator=g).to(device) for _ in range(n)]


@dataclass
class Run:
    mode: str
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    max_alloc: int = 0
    activation_bytes: int = 0  # torch reference: peak of one forward+backward above what the step started with
    numel: int = 0
    info: dict = field(default_factory=dict)

    @property
    def median_step_s(self) -> float:
        tail = sorted(self.step_s[4:] or self.step_s)
        return tail[len(tail) // 2]


def _fresh() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _build(layers: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(layers))


def torch_run(steps: int = 12, layers: int = 8, probe=None, compiled: bool = False) -> Run:
    """The reference: fp32 weights on the GPU, forward under autocast(bf16), torch's fused AdamW. ``probe(name,
    step)``: called once, before the second-to-last step, with a function running one extra training step (the
    profiler of benchmarks/profile_gpu_step.py). ``compiled``: ``model.compile()`` (inductor), the peer of an
    engine's ``compile()``."""
    _fresh()
    model = _build(layers).cuda()
    if compiled:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    data = batches()
    run = Run("torch", numel=sum(p.numel() for p in model.parameters()))
    for i in range(steps):
        x = data[i % len(data)]
        if probe is not None and i == steps - 2:
            def step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=x).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad()
            probe("torch", step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if i == 2:  # states exist from here on: the step's growth above its start is activations (+ grads)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if i == 2:
            # the fp32 gradients torch allocates in backward are not activations: take them out
            run.activation_bytes = torch.cuda.max_memory_allocated() - base - 4 * run.numel
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        run.step_s.append(time.perf_counter() - t0)
        run.losses.append(loss.item())
    run.max_alloc = torch.cuda.max_memory_allocated()
    del model, opt
    _fresh()
    return run


def fsdp2_run(steps: int = 12, layers: int = 8, probe=None) -> Run:
    """torch's FSDP2 on one GPU, the way torchtitan applies it: ``fully_shard`` on every decoder layer, then on the
    root; bf16 parameters for compute, fp32 gradient reduction; fused AdamW and clipping on the sharded fp32 DTensors.
    A world of one (FSDP2 needs a process group: NCCL with this process alone, unless one exists)."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29611")
        dist.init_process_group("nccl", rank=0, world_size=1)
    _fresh()
    model = _build(layers).cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    data = batches()
    run = Run("fsdp2", numel=sum(p.numel() for p in model.parameters()))

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return loss

    for i in range(steps):
        x = data[i % len(data)]
        if probe is not None and i == steps - 2:
            probe("fsdp2", lambda: step(x))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(x)
        torch.cuda.synchronize()
        run.step_s.append(time.perf_counter() - t0)
        run.losses.append(loss.item())
    run.max_alloc = torch.cuda.max_memory_allocated()
    del model, opt
    if created:  # the runners after this one start as they would alone (hf_zero creates its own group)
        dist.destroy_process_group()
    _fresh()
    return run


def ds_config(stage: int, offload: bool = False, **zero) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
           "zero_optimization": {"stage": stage, **zero}, "steps_per_print": 1000}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return cfg


def hf_zero_run(stage: int, offload: bool = False, steps: int = 12, layers: int = 8, inspect=None,
                probe=None, compiled: bool = False) -> Run:
    """``hf_zero.initialize`` on a model built on the CPU (ZeRO-3: under zero.Init), then the DeepSpeed loop.
    ``inspect(engine)`` runs after the last step, before the engine is dropped (placement checks); ``probe``: as
    for :func:`torch_run`."""
    import hf_zero

    _fresh()
    cfg = ds_config(stage, offload)
    if stage == 3:
        # The same starting weights as every other run: modules built under zero.Init initialise their own
        # (partitioned) weights, and transformers' ZeRO-3 initialisation draws the random numbers in another order,
        # so the reference's are written in through GatheredParameters (the modifier-rank write-back path).
        start = _build(layers).state_dict()
        with hf_zero.zero.Init(config_dict_or_path=cfg):
            model = _build(layers)
        with hf_zero.zero.GatheredParameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(start[name])
        del start
    else:
        model = _build(layers)
    engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if compiled:  # inductor, as accelerate's torch_compile does (docs/compile.md)
        engine.compile()
    data = batches()
    mode = f"hf_zero_z{stage}" + ("_offload" if offload else "") + ("_compiled" if compiled else "")
    run = Run(mode, numel=sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))
    run.info["grad_bytes"] = torch.finfo(engine.groups[0].grad.dtype).bits // 8
    for i in range(steps):
        x = data[i % len(data)]
        if probe is not None and i == steps - 2:
            def step():
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
            probe(mode, step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        run.step_s.append(time.perf_counter() - t0)
        run.losses.append(loss.item())
    run.max_alloc = torch.cuda.max_memory_allocated()
    if inspect is not None:
        inspect(engine)
    engine.destroy()
    del engine, model
    _fresh()
    return run


def zero_formula_bytes(run: Run, offload: bool, world_size: int = 1) -> int:
    """The ZeRO memory formula per GPU (Rajbhandari et al.): 2 bytes of bf16 weights per parameter, the gradient
    in its dtype, 12 bytes of fp32 master + Adam moments -- divided by the world per stage; at world size 1 every
    stage holds all of it. CPU optimizer offload keeps the 12 bytes in host memory."""
    per_param = 2 + run.info["grad_bytes"] + (0 if offload else 12)
    return per_param * run.numel // world_size

