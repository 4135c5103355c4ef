"""``torch.compile`` on a ZeRO engine, and ZeRO-3's gather granularity (``stage3_module_granularity_threshold``).

ZeRO-3's module hooks gather and release parameters, swap ``param.data`` and talk to the other ranks; they run
eagerly between compiled graphs (``hf_zero/zero/stage3/hooks.py:outside_graph``). Each graph then starts with its
module's parameters gathered, so a compiled run trains as the eager one. Checked on 2 CPU ranks (gloo) with a tiny
Llama whose parameters are all partitioned (``stage3_param_persistence_threshold: 0``):

- losses and final weights of ``engine.compile()`` runs against the same run eager: equal for aot_eager (dynamo
  and AOTAutograd's compiled backward, no kernel changes), within 1e-4 for inductor (fused kernels reorder sums);
- no recompilation after the first optimizer step (the graph count stops growing);
- leaf modules (``set_z3_leaf_modules`` or the granularity threshold) put a whole block in one graph: fewer graphs.

The granularity measure is DeepSpeed 0.19.8's; the figures below were printed by DeepSpeed's own
``DeepSpeedZeRoOffload._get_granularity_recursively`` / ``_set_leaf_by_threshold_preorder`` on the same model.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from _zero3_util import tiny_llama_config
from hf_zero.testing import run_distributed

STEPS = 4


def _config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


def _train(stage: int, backend: str | None, leaves: str | None = None, zero: dict | None = None,
           lora: bool = False):
    """``STEPS`` optimizer steps (2 micro-batches each); returns (losses, graph count after each micro-batch,
    full weights, this rank's parameter elements, leaf module names, hf_zero warnings)."""
    import hf_zero
    from torch._dynamo.utils import counters
    from transformers import LlamaForCausalLM

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    if leaves == "decoder_layers":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        hf_zero.zero.set_z3_leaf_modules(model, [LlamaDecoderLayer])
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("hf_zero").addHandler(handler)
    try:
        engine, *_ = hf_zero.initialize(model=model, config=_config(stage, **(zero or {})))
    finally:
        logging.getLogger("hf_zero").removeHandler(handler)
    if backend is not None:
        engine.compile(backend=backend)
    logging.getLogger("torch._dynamo").addHandler(handler)  # dynamo's recompile-limit warning
    names = {m: n or "<root>" for n, m in model.named_modules()}
    leaf_names = [names[m] for m in hf_zero.zero.get_z3_leaf_modules(model)]
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(10 + rank)
    losses, graphs = [], []
    for _ in range(STEPS * 2):
        ids = torch.randint(3, 64, (2, 8), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    logging.getLogger("torch._dynamo").removeHandler(handler)
    local = sum(p.numel() for p in model.parameters())
    with hf_zero.zero.GatheredParameters(list(model.parameters())):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, graphs, weights, local, leaf_names, warnings


def _eager_then_compiled(stage: int, backend: str, leaves: str | None = None, lora: bool = False):
    return _train(stage, None, leaves, lora=lora), _train(stage, backend, leaves, lora=lora)


# The ZeRO-3 runs three tests below compare, each trained once in one 2-rank group: per-module hooks eager and
# aot_eager; decoder layers as leaves eager, aot_eager and inductor. A run that raised holds its traceback, which
# fails only the tests that read it.
_ZERO3_RUNS = {"eager": (None, None), "aot_eager": ("aot_eager", None), "leaves_eager": (None, "decoder_layers"),
               "leaves_aot_eager": ("aot_eager", "decoder_layers"), "leaves_inductor": ("inductor", "decoder_layers")}


def _zero3_runs_worker() -> dict:
    import traceback

    out = {}
    for name, (backend, leaves) in _ZERO3_RUNS.items():
        try:
            out[name] = _train(3, backend, leaves)
        except Exception:
            out[name] = traceback.format_exc()
    return out


@functools.cache
def _zero3_runs() -> list[dict]:
    return run_distributed(_zero3_runs_worker, world_size=2, timeout_s=900)


def _zero3(*names: str) -> list[tuple]:
    """Each rank's results of the named runs (rank-ordered), or the failed run's traceback as the error."""
    per_rank = []
    for rank, runs in enumerate(_zero3_runs()):
        for name in names:
            if isinstance(runs[name], str):
                raise AssertionError(f"ZeRO-3 run {name!r} failed on rank {rank}:\n{runs[name]}")
        per_rank.append(tuple(runs[name] for name in names))
    return per_rank


def _check_compiled_trains_as_eager(stage: int, eager, compiled) -> None:
    assert compiled[0] == eager[0]  # the same losses, bit for bit
    for name, w in eager[2].items():
        torch.testing.assert_close(compiled[2][name], w, rtol=0, atol=0, msg=name)
    assert eager[1][-1] == 0  # the eager run compiled nothing
    graphs = compiled[1]
    assert graphs[0] > 0 and graphs[1] == graphs[-1], graphs  # compiled, and no recompilation after step 1
    if stage == 3:
        full = sum(w.numel() for w in eager[2].values())
        assert compiled[3] < 0.6 * full  # the parameters stayed partitioned (half each, plus padding)
        assert graphs[-1] > 8, graphs  # a graph break at every module with partitioned parameters
    else:
        assert graphs[-1] == 1, graphs  # stages 0-2 have no module hooks: one graph for the whole model


def test_aot_eager_compiled_engine_trains_as_eager_stage_2():
    for eager, compiled in run_distributed(_eager_then_compiled, world_size=2, args=(2, "aot_eager")):
        _check_compiled_trains_as_eager(2, eager, compiled)


def test_aot_eager_compiled_engine_trains_as_eager_stage_3():
    for eager, compiled in _zero3("eager", "aot_eager"):
        _check_compiled_trains_as_eager(3, eager, compiled)


def test_inductor_compiled_zero3_trains_as_eager():
    # decoder layers as leaves: a few large graphs compile in half the time of one per linear layer (CI's budget);
    # the per-module graph breaks are covered by the aot_eager test above
    for eager, compiled in _zero3("leaves_eager", "leaves_inductor"):
        torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(eager[0]), rtol=1e-4, atol=1e-5)
        for name, w in eager[2].items():
            torch.testing.assert_close(compiled[2][name], w, rtol=1e-4, atol=1e-5, msg=name)
        assert compiled[1][1] == compiled[1][-1] > 0


def test_leaf_decoder_layers_compile_each_layer_as_one_graph():
    (eager, compiled, per_module), _ = _zero3("leaves_eager", "leaves_aot_eager", "aot_eager")
    assert compiled[4] == ["model.layers.0", "model.layers.1"]
    assert compiled[0] == eager[0]
    # leaves change when parameters are gathered (and the gradient buckets' order), not what is computed
    torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(per_module[0]), rtol=1e-6, atol=0)
    # each layer's attention and MLP linears, norms and the arithmetic between them in one graph
    assert compiled[1][-1] < per_module[1][-1] - 8, (compiled[1], per_module[1])


def test_lora_compiles_every_linear_variant_without_eager_fallback():
    """LoRA under ZeRO-3: frozen and trainable linears of several shapes, each its own graph of nn.Linear.forward --
    more variants than dynamo's default recompile limit (8), past which it runs the rest eagerly with a warning.
    engine.compile raises the limit to what the model needs."""
    for eager, compiled in run_distributed(_eager_then_compiled, world_size=2, args=(3, "aot_eager", None, True)):
        torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(eager[0]), rtol=1e-6, atol=0)
        assert not any("recompile_limit" in w for w in compiled[5]), compiled[5]
        graphs = compiled[1]
        assert graphs[-1] > 8 and graphs[3] == graphs[-1], graphs  # settled by the second optimizer step


# DeepSpeed 0.19.8's granularity of each module of tiny_llama_config()'s model (modules it never chooses omitted)
DS_GRANULARITY = {"<root>": 782, "model": 764, "model.layers.0": 773, "model.layers.0.self_attn": 614,
                  "model.layers.0.mlp": 1536, "model.layers.1": 773, "model.layers.1.self_attn": 614,
                  "model.layers.1.mlp": 1536}
# ... and the modules its preorder walk flags as leaves for each threshold
DS_LEAVES = {613: [], 614: ["model.layers.0.self_attn", "model.layers.1.self_attn"], 770: ["model"], 800: ["<root>"]}


def test_granularity_matches_deepspeed():
    from transformers import LlamaForCausalLM

    from hf_zero.zero.leaf import module_granularity, set_z3_leaf_modules_by_granularity, z3_leaf_module

    model = LlamaForCausalLM(tiny_llama_config())
    names = {m: n or "<root>" for n, m in model.named_modules()}
    assert {names[m]: g for m, g in module_granularity(model).items() if g is not None} == DS_GRANULARITY
    for threshold, expected in DS_LEAVES.items():
        for m in model.modules():
            m._z3_leaf = False
        assert [names[m] for m in set_z3_leaf_modules_by_granularity(model, threshold)] == expected, threshold
        assert sorted(names[m] for m in model.modules() if z3_leaf_module(m)) == sorted(expected)


def _threshold_runs():
    plain = _train(3, None)
    chosen = _train(3, None, zero={"stage3_module_granularity_threshold": 614})
    none = _train(3, None, zero={"stage3_module_granularity_threshold": 100})
    return plain, chosen, none


def test_granularity_threshold_gathers_chosen_modules_whole():
    for plain, chosen, none in run_distributed(_threshold_runs, world_size=2):
        assert plain[4] == [] and none[4] == []
        assert chosen[4] == DS_LEAVES[614]
        torch.testing.assert_close(torch.tensor(chosen[0]), torch.tensor(plain[0]), rtol=1e-6, atol=0)
        for name, w in plain[2].items():
            torch.testing.assert_close(chosen[2][name], w, rtol=1e-6, atol=1e-7, msg=name)
        # a threshold below every module's granularity changes nothing and says so, with the value that would
        assert not any("granularity" in w for w in chosen[5])
        said = [w for w in none[5] if "stage3_module_granularity_threshold 100 selects no module" in w]
        assert len(said) == 1 and "smallest module granularity is 614 (LlamaAttention)" in said[0], none[5]
        assert none[0] == plain[0]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x)) * 2


def test_flop_window_at_the_first_call_leaves_the_model_compilable():
    """A dispatch mode active when dynamo first meets a frame makes it skip that code for the whole process: the
    Trainer callback's first counted micro-batch (and a flops_profiler at step 1) would have kept every module of
    the class from being compiled. The counting window runs compiled code eagerly instead."""
    from torch._dynamo.utils import counters

    from hf_zero.profiling.flops import FlopCounter

    torch._dynamo.reset()
    counters.clear()
    block = _Block()
    block.compile(backend="aot_eager")
    counter = FlopCounter(block)
    with counter.window("auto"):
        block(torch.randn(2, 4)).sum().backward()
    # forward 2*2*4*4, backward the weight's gradient only (the input needs none): counted eagerly
    assert counter.report.forward == counter.report.backward == 2 * 2 * 4 * 4
    assert counters["stats"]["unique_graphs"] == 0
    block(torch.randn(2, 4)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1  # compiled from the next call on


def _compile_arguments():
    import hf_zero

    model = _Block()
    engine, *_ = hf_zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("hf_zero").addHandler(handler)
    engine.compile(backend="eager", compiled_autograd_enabled=True)  # DeepSpeed's signature, as accelerate may pass
    first = model._compiled_call_impl
    engine.compile(backend="inductor")  # a second call keeps the first compilation, as DeepSpeed's
    logging.getLogger("hf_zero").removeHandler(handler)
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()
    return engine.is_compiled, model._compiled_call_impl is first, warnings


def test_engine_compile_takes_deepspeeds_arguments():
    compiled, same, warnings = run_distributed(_compile_arguments, world_size=1)[0]
    assert compiled and same
    assert len(warnings) == 1 and "compiled_autograd_enabled=True" in warnings[0], warnings
    with pytest.raises(Exception, match="schedule"):
        run_distributed(_compile_schedule, world_size=1)


def _compile_schedule():
    import hf_zero

    engine, *_ = hf_zero.initialize(model=_Block(), config={"train_micro_batch_size_per_gpu": 2})
    engine.compile(schedule=[(0, ["z3"])])
