"""inject(model) swaps norms and GeLUs of tiny Llama / GPT-2 / BERT models onto the fused kernels without changing
outputs beyond tolerance, parameter names, state_dict keys or the save_pretrained format."""

import copy
import pickle

import pytest
import torch
from _ops_util import requires_native
from safetensors.torch import load_file

from hf_zero.ops import inject, remove_injection

pytestmark = requires_native


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64))


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=64))


# builder, classes expected to be swapped {class name: count}
CASES = {
    "llama": (_llama, {"LlamaRMSNorm": 5}),
    "gpt2": (_gpt2, {"LayerNorm": 5, "NewGELUActivation": 2}),
    "bert": (_bert, {"LayerNorm": 6, "GELUActivation": 3}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_inject_keeps_outputs_names_and_format(name, tmp_path):
    build, expected = CASES[name]
    torch.manual_seed(0)
    model = build().eval()
    reference = copy.deepcopy(model)
    keys_before = list(model.state_dict().keys())
    names_before = [n for n, _ in model.named_parameters()]

    assert inject(model) == expected
    assert inject(model) == {}, "a second inject must be a no-op"
    assert list(model.state_dict().keys()) == keys_before
    assert [n for n, _ in model.named_parameters()] == names_before

    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)

    # gradients flow through the fused kernels to the same parameters
    model.train()
    reference.train()
    torch.manual_seed(1)
    model(ids).logits.float().pow(2).mean().backward()
    torch.manual_seed(1)
    reference(ids).logits.float().pow(2).mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=n)

    model.save_pretrained(tmp_path / "injected")
    reference.save_pretrained(tmp_path / "reference")
    saved = load_file(tmp_path / "injected" / "model.safetensors")
    saved_ref = load_file(tmp_path / "reference" / "model.safetensors")
    assert saved.keys() == saved_ref.keys()
    for key in saved_ref:
        torch.testing.assert_close(saved[key], saved_ref[key], rtol=0, atol=0)

    pickle.loads(pickle.dumps(model))  # injected classes stay picklable
    assert remove_injection(model) == sum(expected.values())
    assert "HfZeroFused" not in repr(type(model.model.norm if name == "llama" else model))


def test_inject_bf16_llama_close_to_reference():
    torch.manual_seed(0)
    model = _llama().to(torch.bfloat16).eval()
    reference = copy.deepcopy(model)
    inject(model)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), reference(ids).logits.float(), rtol=2e-2, atol=2e-2)
