"""Sequence parallelism with tensor parallelism (``tensor_parallel.sequence_parallel``): TP 2 through
hf_zero.initialize against one process (tiny Llama with grouped-query attention, tiny GPT-2), clipping at 1.0; the
residual stream really is split (each rank's decoder layers and norms see seq / tp rows, and the activations
autograd saves shrink); the sequence length must be a multiple of the TP size; families without a plan are refused.
DP 2 x TP 2 with it: test_tp_engine.py; LoRA adapters with it: test_tp_lora.py."""

from __future__ import annotations

import functools

import pytest
import torch

from _tp_spawns import case, register
from _tp_util import BATCH, SEQ, engine_steps, make_model, rel, token_data
from hf_zero.config.errors import ConfigError
from hf_zero.tensor_parallel.config import parse_tp_config
from hf_zero.tensor_parallel.plans import resolve_plan

STEPS, CLIP = 3, 1.0
# GPT-2 trains with SGD (its key bias has an exactly zero true gradient; see _tp_util.make_optimizer)
RUNS = (("llama", 1), ("gpt2", 0))
OPTIMIZER = {"llama": ("AdamW", {"lr": 1e-3, "weight_decay": 0.01}), "gpt2": ("SGD", {"lr": 0.5, "momentum": 0.9})}


def _config(kind: str, stage: int) -> dict:
    opt_type, opt_params = OPTIMIZER[kind]
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": CLIP,
            "optimizer": {"type": opt_type, "params": dict(opt_params)}, "zero_optimization": {"stage": stage},
            "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}, "steps_per_print": 1000}


@functools.lru_cache(maxsize=None)
def reference(kind: str):
    model = make_model(kind)
    opt_type, opt_params = OPTIMIZER[kind]
    opt = getattr(torch.optim, opt_type)(model.parameters(), **opt_params)
    data = token_data(STEPS)
    losses, norms = [], []
    for s in range(STEPS):
        loss = model(input_ids=data[s], labels=data[s]).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: t.detach().clone() for n, t in model.state_dict().items()}


def _train(kind: str, stage: int):
    import hf_zero
    from hf_zero.tensor_parallel import tp_info
    from hf_zero.tensor_parallel.state import full_state_dict

    engine, *_ = hf_zero.initialize(model=make_model(kind), config=_config(kind, stage))
    data = token_data(STEPS)
    losses, norms = engine_steps(engine, data)
    out = {"losses": losses, "norms": norms, "state": full_state_dict(engine.module),
           "sp": tp_info(engine.module).sequence_parallel}
    try:  # 15 tokens over 2 ranks
        engine(input_ids=data[0][:, :15], labels=data[0][:, :15])
        out["odd_length"] = None
    except ValueError as e:
        out["odd_length"] = str(e)
    return out


def _layer_rows(model, kind: str) -> dict[str, tuple]:
    """Local shapes of what the first decoder layer and its first norm compute on, from hooks registered after
    the tensor-parallel ones (so they see what the layer's code sees)."""
    seen = {}
    layer = model.model.layers[0] if kind == "llama" else model.transformer.h[0]
    norm = layer.input_layernorm if kind == "llama" else layer.ln_1

    def local(t):
        return tuple(t.to_local().shape) if hasattr(t, "to_local") else tuple(t.shape)

    def record(key, t):
        seen.setdefault(key, local(t))  # returns None: the hooks change nothing

    hooks = [layer.register_forward_pre_hook(lambda m, a, kw: record("layer_in", a[0] if a else kw["hidden_states"]),
                                             with_kwargs=True),
             norm.register_forward_hook(lambda m, a, o: record("norm_out", o))]
    model(input_ids=token_data(1)[0])
    for h in hooks:
        h.remove()
    return seen


def _saved_bytes(model) -> int:
    """Bytes of the activations autograd saves for backward in one forward of the LM loss (this rank's storage,
    each storage once; parameters left out)."""
    def storage(t):
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        try:
            return local.untyped_storage().data_ptr(), local.numel() * local.element_size()
        except RuntimeError:  # a wrapper without storage of its own: count it alone
            return ("wrapper", id(t)), local.numel() * local.element_size()

    params = {storage(p)[0] for p in model.parameters()}
    saved = {}

    def pack(t):
        key, nbytes = storage(t)
        if key not in params:
            saved[key] = nbytes
        return t

    ids = token_data(1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss
    return sum(saved.values())


def _activations(kind: str):
    from hf_zero.tensor_parallel import apply_tp, build_mesh

    mesh = build_mesh(2).tp_mesh
    sp = apply_tp(make_model(kind), mesh, sequence_parallel=True)
    plain = apply_tp(make_model(kind), mesh)
    ids = token_data(1)[0]
    embeds = sp.get_input_embeddings().weight.full_tensor()[ids].detach()  # whole inputs_embeds are sharded too
    return {"sp": _layer_rows(sp, kind), "plain": _layer_rows(plain, kind),
            "sp_bytes": _saved_bytes(sp), "plain_bytes": _saved_bytes(plain),
            "embeds": (sp(input_ids=ids, labels=ids).loss.item(), sp(inputs_embeds=embeds, labels=ids).loss.item())}


FAMILIES = ("mistral", "qwen2", "qwen3")  # share the Llama family's sequence-parallel plan


def _family_model(model_type: str):
    import transformers

    name = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[model_type]
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{name}Config")(vocab_size=128, hidden_size=64, intermediate_size=96,
                                                 num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
                                                 head_dim=8, max_position_embeddings=64)
    return getattr(transformers, f"{name}ForCausalLM")(cfg).train()


def _loss_and_norm_grad(model):
    """The loss and the first decoder layer's input-norm gradient (summed over the TP group under SP)."""
    ids = token_data(1)[0]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grad = model.model.layers[0].input_layernorm.weight.grad
    return loss.item(), (grad.full_tensor() if hasattr(grad, "full_tensor") else grad)


def _padded():
    """A padded batch (left and right padding, masked labels): the mask is built from the full sequence."""
    ids = token_data(1)[0]
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, 12:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _combinations():
    from hf_zero.tensor_parallel import apply_tp, build_mesh

    mesh = build_mesh(2).tp_mesh
    ids = token_data(1)[0]
    # DeepSpeed's default head (full logits gathered on every rank) on the sequence-sharded final norm
    gathered = apply_tp(make_model("llama"), mesh, vocab_parallel_head=False, sequence_parallel=True)
    out = {"full_logits_loss": gathered(input_ids=ids, labels=ids).loss.item()}
    ids_p, mask, labels = _padded()
    for kind in ("llama", "gpt2"):
        model = apply_tp(make_model(kind), mesh, sequence_parallel=True)
        out[f"padded-{kind}"] = model(input_ids=ids_p, attention_mask=mask, labels=labels).loss.item()
    for model_type in FAMILIES:
        out[model_type] = _loss_and_norm_grad(apply_tp(_family_model(model_type), mesh, sequence_parallel=True))
    # deepspeed.tp_model_init with the config (what transformers' Trainer calls), then a disagreeing second call
    from hf_zero.tensor_parallel import tp_info, tp_model_init

    model = tp_model_init(make_model("llama"), 2, config={"tensor_parallel": {"autotp_size": 2,
                                                                               "sequence_parallel": True}})
    out["tp_model_init"] = tp_info(model).sequence_parallel
    try:
        tp_model_init(model, 2, sequence_parallel=False)
    except ValueError as e:
        out["disagree"] = str(e)
    return out


def _worker():
    out = {f"{kind}-{stage}": _train(kind, stage) for kind, stage in RUNS}
    out.update({f"act-{kind}": _activations(kind) for kind in ("llama", "gpt2")})
    out["combinations"] = _combinations()
    return out


register(2, "sequence_parallel", _worker)  # in the shared 2-rank process group (tests/_tp_spawns.py)


@pytest.fixture(scope="module")
def results():
    return case(2, "sequence_parallel")


@pytest.mark.parametrize("kind,stage", RUNS)
def test_tp2_sequence_parallel_matches_single_process(results, kind, stage):
    ref_losses, ref_norms, ref_state = reference(kind)
    assert max(ref_norms) > CLIP  # clipping was active: a norm weight's gradient not summed would show
    for rank, out in enumerate(results):
        run = out[f"{kind}-{stage}"]
        assert run["sp"] is True
        for s in range(STEPS):
            assert abs(run["losses"][s] - ref_losses[s]) <= 1e-5 * ref_losses[s], (rank, s, run["losses"])
            assert abs(run["norms"][s] - ref_norms[s]) <= 1e-5 * ref_norms[s], (rank, s, run["norms"])
        assert set(run["state"]) == set(ref_state)
        for name, ref in ref_state.items():
            assert rel(run["state"][name], ref) <= 1e-5, (rank, name, rel(run["state"][name], ref))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_residual_stream_is_split_along_the_sequence(results, kind):
    for out in results:
        act = out[f"act-{kind}"]
        # the decoder layer and its norm work on seq / tp rows of the batch; without SP on all of them
        assert act["sp"] == {"layer_in": (BATCH, SEQ // 2, 64), "norm_out": (BATCH, SEQ // 2, 64)}
        assert act["plain"] == {"layer_in": (BATCH, SEQ, 64), "norm_out": (BATCH, SEQ, 64)}
        # what autograd keeps for backward shrinks: each norm (2 per layer and the final one) saves at least its
        # input, now half the rows (the attention / MLP interiors are split by heads / units either way)
        half_hidden = BATCH * (SEQ // 2) * 64 * 4
        assert act["plain_bytes"] - act["sp_bytes"] >= 5 * half_hidden, (act["sp_bytes"], act["plain_bytes"])
        ids_loss, embeds_loss = act["embeds"]
        assert abs(ids_loss - embeds_loss) <= 1e-6 * ids_loss


def test_sequence_length_must_divide(results):
    for out in results:
        msg = out["llama-1"]["odd_length"]
        assert msg is not None and "tensor_parallel.sequence_parallel" in msg
        assert "sequence length 15" in msg and "tensor-parallel size 2" in msg and "pad" in msg


def test_other_families_head_padding_and_tp_model_init(results):
    ids = token_data(1)[0]
    ref = make_model("llama")(input_ids=ids, labels=ids).loss.item()
    for out in results:
        got = out["combinations"]
        assert abs(got["full_logits_loss"] - ref) <= 1e-5 * ref
        for kind in ("llama", "gpt2"):
            ids_p, mask, labels = _padded()
            padded = make_model(kind)(input_ids=ids_p, attention_mask=mask, labels=labels).loss.item()
            assert abs(got[f"padded-{kind}"] - padded) <= 1e-5 * padded, kind
        for model_type in FAMILIES:
            ref_loss, ref_grad = _loss_and_norm_grad(_family_model(model_type))
            loss, grad = got[model_type]
            assert abs(loss - ref_loss) <= 1e-5 * ref_loss and rel(grad, ref_grad) <= 1e-5, model_type
        assert got["tp_model_init"] is True and "sequence_parallel=True, not False" in got["disagree"]


def test_pipeline_stages_refuse_it():
    from types import SimpleNamespace

    from hf_zero.runtime.tp_setup import setup_tensor_parallel

    stage = torch.nn.Linear(2, 2)
    stage.cross_entropy_sum = None  # what hf_zero.pipeline.wrap gives a stage
    grid = SimpleNamespace(model_parallel_size=2, device_mesh=object())
    with pytest.raises(ConfigError) as err:
        setup_tensor_parallel(stage, parse_tp_config({"autotp_size": 2, "sequence_parallel": True}), world_size=8,
                              pipeline_grid=grid)
    assert str(err.value).startswith("tensor_parallel.sequence_parallel") and "pipeline" in str(err.value)


@pytest.mark.parametrize("section", [
    {"autotp_size": 2, "sequence_parallel": True}, {"autotp_size": 2, "tp": {"sequence_parallel": True}},
    {"autotp_size": 2, "sequence_parallel_size": 2}, {"autotp_size": 2, "enable_sequence_parallel": True},
    {"autotp_size": 2, "sp_size": 2}])
def test_sequence_parallel_spellings(section):
    assert parse_tp_config(section).sequence_parallel is True


def test_sequence_parallel_off_and_refusals():
    assert parse_tp_config({"autotp_size": 2, "sequence_parallel": False}).sequence_parallel is False
    assert parse_tp_config({"autotp_size": 2, "sequence_parallel_size": 1}).sequence_parallel is False
    for section, key, words in [
            ({"autotp_size": 2, "sp_size": 4}, "tensor_parallel.sp_size", "autotp_size=2"),
            ({"sequence_parallel": True}, "tensor_parallel.sequence_parallel", "autotp_size"),
            ({"autotp_size": 2, "sequence_parallel": "yes"}, "tensor_parallel.sequence_parallel", "true / false")]:
        with pytest.raises(ConfigError) as err:
            parse_tp_config(section)
        assert str(err.value).startswith(key) and words in str(err.value), str(err.value)


def test_family_without_a_plan_is_refused():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=64))
    resolve_plan(model)  # tensor parallelism alone is fine (its config declares a plan)
    with pytest.raises(ValueError) as err:
        resolve_plan(model, sequence_parallel=True)
    msg = str(err.value)
    assert "tensor_parallel.sequence_parallel" in msg and "GPTNeoXForCausalLM" in msg and "gpt_neox" in msg


def test_sequence_parallel_plan_style_needs_the_option():
    # transformers' style name in a plan: a norm on sequence shards only makes sense with the whole layout
    with pytest.raises(ValueError) as err:
        resolve_plan(make_model("llama"), {"model.layers.*.input_layernorm": "sequence_parallel",
                                           "model.layers.*.self_attn.q_proj": "colwise"})
    msg = str(err.value)
    assert "model.layers.*.input_layernorm" in msg and "tensor_parallel.sequence_parallel: true" in msg
    resolved, _ = resolve_plan(make_model("llama"), sequence_parallel=True)
    assert resolved["model.layers.*.input_layernorm"] == "sequence_parallel"
    assert resolved["model.norm"] == "sequence_parallel" and resolved["model.layers.*"] == "sequence_sharded_block"
