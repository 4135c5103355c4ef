"""Export to real low-bit modules: int8 (PyTorch x86 kernels) and bitsandbytes 8/4-bit."""

import copy
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_zero.compression import Int8Linear, export_bnb, export_int8, init_compression, redundancy_clean
from hf_zero.compression.export import linear_weight_nbytes

torch.set_num_threads(1)


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_int8_export_size_and_outputs():
    model = tiny_llama()
    ref = logits(model)
    before = linear_weight_nbytes(model)
    export_int8(model, skip=["lm_head"])
    assert isinstance(model.model.layers[0].mlp.up_proj, Int8Linear)
    assert type(model.lm_head) is torch.nn.Linear
    assert model.model.layers[0].mlp.up_proj.weight_int8.dtype == torch.int8
    after = linear_weight_nbytes(model)
    lm_head = model.lm_head.weight.nbytes
    assert (before - lm_head) / (after - lm_head) > 3.5
    out = logits(model)
    rel = (out - ref).norm() / ref.norm()
    assert 0 < rel < 0.05
    # the state dict is plain int8 tensors: it round-trips into a freshly exported model
    fresh = export_int8(tiny_llama(seed=9), skip=["lm_head"])
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits(fresh), out)


def test_qat_int8_per_channel_exports_bit_exactly():
    model = tiny_llama()
    cfg = {"weight_quantization": {"shared_parameters": {"enabled": True, "per_channel": True},
                                   "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 8},
                                                               "modules": ["mlp"]}}}}
    init_compression(model, cfg)
    redundancy_clean(model, cfg)
    folded = model.model.layers[1].mlp.down_proj.weight.detach().clone()
    export_int8(model, modules=["mlp"])
    q = model.model.layers[1].mlp.down_proj
    torch.testing.assert_close(q.dequantized_weight(), folded, atol=0, rtol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_bnb_export(bits):
    pytest.importorskip("bitsandbytes")
    model = tiny_llama()
    ref = logits(model)
    export_bnb(model, bits=bits, modules=["mlp", "self_attn"])
    layer = model.model.layers[0].mlp.up_proj
    assert type(layer).__name__ == ("Linear8bitLt" if bits == 8 else "Linear4bit")
    assert layer.weight.dtype == (torch.int8 if bits == 8 else torch.uint8)
    rel = float((logits(model) - ref).norm() / ref.norm())
    assert rel < (0.02 if bits == 8 else 0.25)
    assert rel > 0


def test_bnb_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match="export_int8"):
        export_bnb(copy.deepcopy(tiny_llama()), bits=4)
    with pytest.raises(ValueError, match="bits=8 or bits=4"):
        export_bnb(tiny_llama(), bits=3)
