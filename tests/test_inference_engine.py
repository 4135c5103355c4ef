"""``deepspeed.init_inference`` / ``InferenceEngine`` (hf_zero/runtime/inference.py) against the plain model: tiny
Llama (grouped-query attention) and GPT-2 (fused Conv1D q|k|v, tied head) from config, fp32, at tensor-parallel
size 1 in this process and 2 on two gloo ranks (the shared world-2 group of the TP tests, tests/_tp_spawns.py).

DeepSpeed 0.19.8 (CPU, non-injected path) gives the same answers where it runs: Llama at TP 2 has logits within
1.8e-7 of the plain model's and identical greedy tokens; it refuses GPT-2 AutoTP ("container policy exists"), which
hf_zero shards with its own plan."""

from __future__ import annotations

import warnings

import pytest
import torch

from _tp_spawns import case, register
from _tp_util import VOCAB, make_model

NEW_TOKENS = 5


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


def _plain(kind: str):
    """The plain model's logits and greedy tokens."""
    model = make_model(kind).eval()
    with torch.no_grad():
        logits = model(input_ids=_ids()).logits
    tokens = model.generate(_ids(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return logits, tokens


def _run(engine):
    with torch.no_grad():
        logits = engine(input_ids=_ids()).logits
    return logits, engine.generate(_ids(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


# ---- world 2: tensor parallel size 2 ---------------------------------------------------------------------------------
def _tp2_worker():
    import deepspeed
    import hf_zero
    from hf_zero.tensor_parallel import tp_info

    out = {}
    for kind in ("llama", "gpt2"):
        model = make_model(kind).eval()
        engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32)
        logits, tokens = _run(engine)
        out[kind] = {"logits": logits, "tokens": tokens, "plain": _plain(kind), "module_is_model": engine.module is
                     model, "tp": tp_info(model).size, "head": tp_info(model).plan.get("lm_head"),
                     "q_local": _local_rows(model, kind)}
    # DeepSpeed's user policy: the named linears row parallel, the layer's other linears column parallel
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = make_model("llama").eval()
    engine = deepspeed.init_inference(model, dtype=torch.float32, tensor_parallel={"tp_size": 2},
                                      injection_policy={LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")})
    out["policy"] = (_run(engine)[0], dict(tp_info(model).plan))
    # the deprecated flat name, as DeepSpeed moves it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        engine = deepspeed.init_inference(make_model("llama").eval(), mp_size=2, dtype="fp32")
    out["mp_size"] = (engine._config.tensor_parallel.tp_size, tp_info(engine.module).size, _run(engine)[0])

    # train with hf_zero's engine (ZeRO-2, data parallel over both ranks), then infer at TP 2: the common script
    model = make_model("llama")
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}}
    train, *_ = hf_zero.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
        train.backward(train(input_ids=ids, labels=ids).loss)
        train.step()
    trained = train.module.eval()
    with torch.no_grad():
        expected = trained(input_ids=_ids()).logits  # the trained model, unsharded, on this rank
    engine = deepspeed.init_inference(trained, tensor_parallel={"tp_size": 2}, dtype=torch.float32)
    out["trained"] = (expected, _run(engine)[0], (expected - _plain("llama")[0]).abs().max().item())
    return out


register(2, "inference", _tp2_worker)


def _local_rows(model, kind: str) -> int:
    from torch.distributed.tensor import DTensor

    w = model.model.layers[0].self_attn.q_proj.weight if kind == "llama" else model.transformer.h[0].mlp.c_fc.weight
    assert isinstance(w, DTensor)
    return w.to_local().shape[0 if kind == "llama" else 1]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_tp2_logits_and_greedy_tokens_equal_the_plain_model(kind):
    for rank, out in enumerate(case(2, "inference")):
        r = out[kind]
        plain_logits, plain_tokens = r["plain"]
        assert r["logits"].shape == plain_logits.shape  # full logits on every rank (the head gathers them)
        assert (r["logits"] - plain_logits).abs().max().item() <= 1e-5, rank
        assert torch.equal(r["tokens"], plain_tokens), rank
        assert r["module_is_model"] and r["tp"] == 2 and r["head"] == "colwise_gather_output"
        assert r["q_local"] == (32 if kind == "llama" else 128)  # half of q_proj's 64 rows / c_fc's 256 columns


def test_tp2_injection_policy():
    for out in case(2, "inference"):
        logits, plan = out["policy"]
        assert (logits - out["llama"]["plain"][0]).abs().max().item() <= 1e-5
        assert plan["model.layers.1.self_attn.o_proj"] == plan["model.layers.0.mlp.down_proj"] == "rowwise"
        assert plan["model.layers.0.self_attn.q_proj"] == plan["model.layers.1.mlp.up_proj"] == "colwise"
        assert "lm_head" not in plan and len(plan) == 14


def test_tp2_mp_size_alias():
    for out in case(2, "inference"):
        cfg_tp, sharded_tp, logits = out["mp_size"]
        assert cfg_tp == sharded_tp == 2
        assert (logits - out["llama"]["plain"][0]).abs().max().item() <= 1e-5


def test_trained_model_then_init_inference_at_tp2():
    per_rank = case(2, "inference")
    for out in per_rank:
        expected, got, moved = out["trained"]
        assert moved > 1e-3  # training changed the model
        assert (got - expected).abs().max().item() <= 1e-5
    torch.testing.assert_close(per_rank[0]["trained"][0], per_rank[1]["trained"][0], rtol=0, atol=0)


# ---- this process: tensor parallel size 1 ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_tp1_equals_plain_model(kind):
    import deepspeed

    model = make_model(kind).eval()
    engine = deepspeed.init_inference(model, dtype=torch.float32)
    assert isinstance(engine, deepspeed.InferenceEngine) and engine.module is model
    assert engine.config is model.config  # DeepSpeed's engine.config: the model's config
    logits, tokens = _run(engine)
    plain_logits, plain_tokens = _plain(kind)
    assert torch.equal(logits, plain_logits)
    assert torch.equal(tokens, plain_tokens)


def test_dtype_conversion_and_default_fp16():
    import deepspeed

    assert next(deepspeed.init_inference(make_model("llama")).module.parameters()).dtype == torch.float16
    for dtype in ("bf16", torch.bfloat16, "bfloat16"):
        engine = deepspeed.init_inference(make_model("llama"), config={"dtype": dtype})
        assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    logits = engine(input_ids=_ids()).logits
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - _plain("llama")[0]).abs().max().item() < 0.1


def test_config_file_kwargs_merge_and_conflict(tmp_path):
    import json

    import deepspeed
    from deepspeed.inference.config import DeepSpeedInferenceConfig

    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp32", "max_tokens": 4}))
    engine = deepspeed.init_inference(make_model("llama"), config=str(path), dtype="fp32")
    assert engine._config.dtype is torch.float32 and engine._config.max_out_tokens == 4
    with pytest.raises(RuntimeError, match="exceeds maximum length of 4"):  # input of 8 tokens
        engine.generate(input_ids=_ids(), max_new_tokens=1)
    with pytest.raises(ValueError, match="Conflicting argument 'dtype'"):
        deepspeed.init_inference(make_model("llama"), config={"dtype": "fp16"}, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="num_beams"):
        engine.generate(_ids(), max_new_tokens=1, num_beams=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert DeepSpeedInferenceConfig(mp_size=2).tensor_parallel.tp_size == 2
    assert DeepSpeedInferenceConfig(tp={"tp_size": 2}).tensor_parallel.tp_size == 2
    assert isinstance(DeepSpeedInferenceConfig(dtype="bf16"), DeepSpeedInferenceConfig)
    assert isinstance(engine._config, DeepSpeedInferenceConfig) and not isinstance({}, DeepSpeedInferenceConfig)


@pytest.mark.parametrize("fields, key", [
    ({"dtype": torch.int8}, "dtype"),
    ({"dtype": "fp8"}, "dtype"),
    ({"quant": {"enabled": True}}, "quant"),
    ({"checkpoint": "ckpt.json"}, "checkpoint"),
    ({"set_empty_params": True}, "set_empty_params"),
    ({"tensor_parallel": {"tp_sise": 2}}, "tensor_parallel.tp_sise"),
    ({"max_out_tokens": 0}, "max_out_tokens"),
    ({"replace_with_kernel_injection": True}, "replace_with_kernel_injection"),
    ({"mp_size": 2, "tensor_parallel": {"tp_size": 2}}, "mp_size"),
])
def test_refused_fields_name_themselves(fields, key):
    import deepspeed
    from hf_zero.config.errors import ConfigError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ConfigError, match=f"^{key}: "):
            deepspeed.init_inference(make_model("llama"), **fields)


def test_speed_knobs_warn_once_naming_them():
    import deepspeed

    model = make_model("llama").eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = deepspeed.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True,
                                          enable_cuda_graph=True)
    messages = [str(w.message) for w in caught if "hf_zero" in str(w.message)]
    assert len(messages) == 1, messages
    assert "replace_with_kernel_inject" in messages[0] and "enable_cuda_graph" in messages[0]
    assert torch.equal(_run(engine)[0], _plain("llama")[0])  # the model's own modules ran
    with pytest.warns(UserWarning, match="return_tuple"):
        deepspeed.init_inference(make_model("llama"), dtype=torch.float32, return_tuple=False)


def test_profile_model_time():
    import deepspeed

    engine = deepspeed.init_inference(make_model("llama").eval(), dtype=torch.float32)
    engine.profile_model_time(use_cuda_events=False)
    with torch.no_grad():
        engine(input_ids=_ids())
        engine(input_ids=_ids())
    times = engine.model_times()
    assert len(times) == 2 and all(t > 0 for t in times)
    assert engine.model_times() == []
