"""PEFT LoRA on a tensor-parallel model: a tiny Llama (grouped-query attention) with adapters on q/k/v/o/gate/up/down
trains under ``hf_zero.initialize`` with ``tensor_parallel.autotp_size 2`` (2 ranks), against the same PEFT model
in one process. The adapters start non-zero (``init_lora_weights=False``) so both factors get gradients from the
first step, and clipping is active so the norm must count each adapter element once (lora_A of a column-parallel
layer and lora_B of a row-parallel one are whole on both TP ranks, the other factor is split). A tiny GPT-2 beside
it covers Conv1D base layers and the fused q|k|v projection (lora_B's rows follow the base's rank-major order).
Both also train with ``tensor_parallel.sequence_parallel`` (the row-parallel adapters' outputs split along the
sequence like their base layer's), and under ZeRO-3 on 4 ranks (DP 2 x TP 2, both replicas on the same batches, every
parameter -- frozen base weights too -- partitioned over the data-parallel pair)."""

from __future__ import annotations

import functools

import pytest
import torch

from _tp_spawns import SHARED_DIR, case, register
from _tp_util import engine_steps, make_model, rel, token_data

STEPS, CLIP = 3, 0.05
# GPT-2 trains with SGD: Adam turns an element's rounding noise into an O(lr) step when its gradient is near zero
# (see _tp_util.make_optimizer)
OPTIMIZER = {"llama": ("AdamW", {"lr": 1e-2, "weight_decay": 0.0}), "gpt2": ("SGD", {"lr": 0.1, "momentum": 0.9})}
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "gpt2": ["c_attn", "c_proj", "c_fc"]}  # c_proj: attention (row) and MLP (row) output projections


def make_peft_model(kind: str):
    from peft import LoraConfig, get_peft_model

    model = make_model(kind)
    torch.manual_seed(11)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[kind],
                                            init_lora_weights=False, fan_in_fan_out=kind == "gpt2"))


def _adapters(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


@functools.lru_cache(maxsize=None)
def reference(kind: str):
    model = make_peft_model(kind)
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    params = [p for p in model.parameters() if p.requires_grad]
    opt_type, opt_params = OPTIMIZER[kind]
    opt = getattr(torch.optim, opt_type)(params, **opt_params)
    data, losses, norms = token_data(STEPS), [], []
    for s in range(STEPS):
        loss = model(input_ids=data[s], labels=data[s]).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, _adapters(model), base


def _worker(root: str):
    out = {kind: _train(kind, f"{root}/lora-{kind}") for kind in TARGETS}
    out.update({f"{kind}-sp": _train(kind, f"{root}/lora-{kind}-sp", sequence_parallel=True) for kind in TARGETS})
    return out


def _worker_z3(root: str):
    return {kind: _train(kind, f"{root}/lora-z3-{kind}", stage=3) for kind in TARGETS}


def _train(kind: str, path: str, sequence_parallel: bool = False, stage: int = 1):
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    import hf_zero
    from hf_zero.tensor_parallel.state import local_of

    model = make_peft_model(kind)
    engine, *_ = hf_zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": CLIP,
        "optimizer": {"type": OPTIMIZER[kind][0], "params": dict(OPTIMIZER[kind][1])},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "steps_per_print": 1000,
        "tensor_parallel": {"autotp_size": 2, "sequence_parallel": sequence_parallel}})
    losses, norms = engine_steps(engine, token_data(STEPS))
    layout = {n.rsplit(".0.", 1)[1]: (isinstance(p, DTensor), tuple(local_of(p).shape), p.requires_grad)
              for n, p in model.named_parameters() if ".layers.0.self_attn." in n or ".h.0.attn.c_attn" in n}
    full = engine.module_state_dict()  # gathered over the TP group, on every rank
    if dist.get_rank() == 0:  # what the Trainer does with a PEFT model: adapters only, from the gathered weights
        model.save_pretrained(path, state_dict=full)
    dist.barrier()
    saved = load_file(f"{path}/adapter_model.safetensors")
    base = {k: v.clone() for k, v in full.items() if "lora_" not in k}
    return {"losses": losses, "norms": norms, "layout": layout, "saved": saved, "base": base}


register(2, "lora", _worker, (SHARED_DIR,))  # in the shared 2-rank process group (tests/_tp_spawns.py)
register(4, "lora_z3", _worker_z3, (SHARED_DIR,))


@pytest.fixture(scope="module")
def results():
    return case(2, "lora")


@pytest.mark.parametrize("mode", ["tp", "tp+sp", "dp2xtp2-zero3"])
@pytest.mark.parametrize("kind", list(TARGETS))
def test_lora_tp2_matches_one_process(results, kind, mode):
    ref_losses, ref_norms, ref_adapters, ref_base = reference(kind)
    assert min(ref_norms) > CLIP  # clipping changes every step
    runs = case(4, "lora_z3") if mode.endswith("zero3") else results
    for rank, per in enumerate(runs):
        out = per[f"{kind}-sp" if mode == "tp+sp" else kind]
        for s in range(STEPS):
            assert abs(out["losses"][s] - ref_losses[s]) <= 1e-5 * ref_losses[s], (rank, s, out["losses"], ref_losses)
            assert abs(out["norms"][s] - ref_norms[s]) <= 1e-5 * ref_norms[s], (rank, s, out["norms"], ref_norms)
        if mode.endswith("zero3"):  # the adapters saved from the gathered weights, the base untouched
            assert set(out["saved"]) == set(ref_adapters)
            for name, ref in ref_adapters.items():
                assert rel(out["saved"][name], ref) <= 1e-5, (rank, name)
            for name, ref in ref_base.items():
                assert torch.equal(out["base"][name], ref), (rank, name)


def test_adapters_split_with_their_base_layer(results):
    # Llama hidden 64, 8 heads of 8, 4 kv heads: q_proj 64 -> 64 (column: 32 rows per rank), o_proj 64 -> 64 (row)
    # GPT-2 c_attn (Conv1D, weight stored in x out) 64 -> 3 x 64, column parallel per part
    for per in results:
        h = 64
        assert per["llama"]["layout"] == {
            "self_attn.q_proj.base_layer.weight": (True, (h // 2, h), False),
            "self_attn.q_proj.lora_A.default.weight": (False, (4, h), True),   # replicated
            "self_attn.q_proj.lora_B.default.weight": (True, (h // 2, 4), True),    # split like the base output
            "self_attn.k_proj.base_layer.weight": (True, (h // 4, h), False),
            "self_attn.k_proj.lora_A.default.weight": (False, (4, h), True),
            "self_attn.k_proj.lora_B.default.weight": (True, (h // 4, 4), True),
            "self_attn.v_proj.base_layer.weight": (True, (h // 4, h), False),
            "self_attn.v_proj.lora_A.default.weight": (False, (4, h), True),
            "self_attn.v_proj.lora_B.default.weight": (True, (h // 4, 4), True),
            "self_attn.o_proj.base_layer.weight": (True, (h, h // 2), False),
            "self_attn.o_proj.lora_A.default.weight": (True, (4, h // 2), True),    # split like the base input
            "self_attn.o_proj.lora_B.default.weight": (False, (h, 4), True)}, per["llama"]["layout"]
        assert per["gpt2"]["layout"] == {
            "attn.c_attn.base_layer.weight": (True, (h, 3 * h // 2), False),
            "attn.c_attn.base_layer.bias": (True, (3 * h // 2,), False),
            "attn.c_attn.lora_A.default.weight": (False, (4, h), True),
            "attn.c_attn.lora_B.default.weight": (True, (3 * h // 2, 4), True)}, per["gpt2"]["layout"]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", list(TARGETS))
def test_saved_adapters_are_complete_and_equal_the_reference(results, kind, sp):
    _, _, ref_adapters, ref_base = reference(kind)
    n_modules = {"llama": 7, "gpt2": 4}[kind]  # per layer
    assert len(ref_adapters) == 2 * n_modules * 2  # A and B per module, 2 layers
    for per in results:
        out = per[f"{kind}-sp" if sp else kind]
        saved = out["saved"]
        assert set(saved) == set(ref_adapters)
        for name, ref in ref_adapters.items():
            assert saved[name].shape == ref.shape, name
            assert rel(saved[name], ref) <= 1e-5, (name, rel(saved[name], ref))
        # the frozen base weights did not move
        assert set(out["base"]) == set(ref_base)
        for name, ref in ref_base.items():
            assert torch.equal(out["base"][name], ref), name
