"""Random layer-token drop (``data_efficiency.data_routing.random_ltd``, hf_zero/runtime/random_ltd.py), imported as
DeepSpeedExamples' data-efficiency scripts import it (``deepspeed.runtime.data_pipeline.data_routing.helper``).

- the schedule equals DeepSpeed 0.19.8's ``RandomLTDScheduler`` (its numbers recorded below: the example's config,
  min 128, max 1024, 400 steps, 8 per step, global batch 4);
- a wrapped layer computes exactly the kept tokens and passes the others, in both hidden-state orders, with the
  gradients of that function (a per-sample loop over the recorded indices is the reference), and cuts a decoder's
  and an encoder's mask as DeepSpeed does;
- on 2 ranks a tiny GPT-2 under the engine (ZeRO-2) trains with its middle layers wrapped: the layers get the
  reserved length of each step, ``save_without_random_ltd`` gives the plain model's keys, the schedule resumes from a
  checkpoint, and with the whole sequence kept the run equals the unwrapped one.
(DeepSpeed's own random-LTD needs its CUDA ``random_ltd`` op: it cannot run on this CPU machine.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_zero.config import ConfigError
from hf_zero.runtime.random_ltd import RandomLayerTokenDrop, RandomLTDScheduler, random_ltd_policy
from hf_zero.testing import run_distributed


def _section(**over) -> dict:
    ltd = {"enabled": True, "total_layer_num": 12, "random_ltd_layer_num": 10,
           "random_ltd_layer_id": list(range(1, 11)), "model_mask_name": "attention_mask", "model_type": "decoder",
           "hidden_state_order": "batch_seq_dim",
           "random_ltd_schedule": {"min_value": 128, "max_value": 1024, "schedule_type": "fixed_linear",
                                   "schedule_config": {"require_steps": 400, "seq_per_step": 8}}}
    ltd.update(over)
    return {"enabled": True, "data_routing": {"enabled": True, "random_ltd": ltd}}


# DeepSpeed 0.19.8's RandomLTDScheduler with the config above (update_seq(step), then get_current_seq() and
# state['consumed_layer_tokens']), recorded 2026-11-29
DEEPSPEED_SCHEDULE = [(0, 128, 13312), (1, 128, 26624), (2, 128, 39936), (3, 128, 53248), (50, 240, 71040),
                      (100, 352, 93312), (101, 352, 115584), (399, 1016, 164416), (400, 1024, 213568),
                      (401, 1024, 262720), (500, 1024, 311872)]


def test_schedule_is_deepspeeds():
    sched = RandomLTDScheduler(random_ltd_policy(_section()), global_batch_size=4)
    got = []
    for step, _, _ in DEEPSPEED_SCHEDULE:
        sched.update_seq(step)
        got.append((step, sched.get_current_seq(), sched.state["consumed_layer_tokens"]))
    assert got == DEEPSPEED_SCHEDULE
    sched.update_seq(500)  # the same step again consumes nothing more
    assert sched.state_dict() == {"consumed_layer_tokens": 311872, "current_steps": 500, "current_value": 1024,
                                  "min_value": 128, "max_value": 1024}
    assert (sched.get_random_ltd_layer_num(), sched.model_layer_num) == (10, 12)


@pytest.mark.parametrize("over, start", [
    ({"random_ltd_layer_num": 3}, "data_efficiency.data_routing.random_ltd.random_ltd_layer_num: 3 must equal"),
    ({"model_type": "seq2seq"}, "data_efficiency.data_routing.random_ltd.model_type: 'seq2seq'"),
    ({"layer_token_lr_schedule": {"enabled": True}},
     "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled: true is not implemented"),
    ({"random_ltd_layerid": [1]}, "data_efficiency.data_routing.random_ltd.random_ltd_layerid: unknown key"),
])
def test_config_errors_name_the_key(over, start):
    with pytest.raises(ConfigError) as err:
        random_ltd_policy(_section(**over))
    assert str(err.value).startswith(start), str(err.value)


class _TokenLayer(nn.Module):
    """Mixes each token with the sequence's mean (so a dropped token would change the kept ones' output) and returns
    a tuple, as HF layers do."""

    def __init__(self, hidden: int, batch_first: bool):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
        self.batch_first = batch_first

    def forward(self, x, attention_mask=None):
        seq_dim = 1 if self.batch_first else 0
        self.seen_mask = attention_mask
        return (torch.tanh(self.lin(x) + x.mean(dim=seq_dim, keepdim=True)), "extra")


def _wrapped(order: str, model_type: str = "decoder", reserved: int = 5):
    torch.manual_seed(0)
    layer = _TokenLayer(4, order == "batch_seq_dim")
    wrapper = RandomLayerTokenDrop(layer)
    section = _section(total_layer_num=1, random_ltd_layer_num=1, random_ltd_layer_id=[0], hidden_state_order=order,
                       model_type=model_type)
    sched = RandomLTDScheduler(random_ltd_policy(section), global_batch_size=3)
    sched.set_current_seq(reserved)
    wrapper.init_config(sched, 0)
    return wrapper, layer, sched


@pytest.mark.parametrize("order", ["batch_seq_dim", "seq_batch_dim"])
def test_layer_computes_the_kept_tokens_and_passes_the_rest(order):
    wrapper, layer, sched = _wrapped(order)
    batch_first = order == "batch_seq_dim"
    x = torch.randn(3, 9, 4) if batch_first else torch.randn(9, 3, 4)
    x.requires_grad_(True)
    out, extra = wrapper(x)
    kept = sched.sample[0][0]  # (batch, reserved), sorted
    assert extra == "extra" and kept.shape == (3, 5)
    assert all(torch.equal(k, k.sort().values) and len(set(k.tolist())) == 5 for k in kept)
    # the reference: sample by sample, the kept tokens through the layer, the others unchanged
    xb = x if batch_first else x.transpose(0, 1)
    ref = xb.clone()
    for b in range(3):
        part = xb[b:b + 1, kept[b]]
        y = layer(part if batch_first else part.transpose(0, 1))[0]
        ref[b, kept[b]] = (y if batch_first else y.transpose(0, 1))[0]
    ref = ref if batch_first else ref.transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    skipped = [t for t in range(9) if t not in kept[0].tolist()]
    assert torch.equal((out if batch_first else out.transpose(0, 1))[0, skipped],
                       (x if batch_first else x.transpose(0, 1))[0, skipped])
    # gradients: those of the reference function
    w = torch.randn_like(out)
    g_out = torch.autograd.grad((out * w).sum(), [x, layer.lin.weight])
    g_ref = torch.autograd.grad((ref * w).sum(), [x, layer.lin.weight])
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # evaluation, or the whole sequence kept: the layer as it is
    wrapper.eval()
    torch.testing.assert_close(wrapper(x)[0], layer(x)[0])
    wrapper.train()
    sched.set_current_seq(9)
    torch.testing.assert_close(wrapper(x)[0], layer(x)[0])


def test_masks_are_cut_as_deepspeed_cuts_them():
    mask = torch.randn(3, 1, 9, 9)
    wrapper, layer, sched = _wrapped("batch_seq_dim", "decoder")
    wrapper(torch.randn(3, 9, 4), attention_mask=mask)
    assert torch.equal(layer.seen_mask, mask[:, :, :5, :5])  # a decoder's: its first rows and columns
    wrapper, layer, sched = _wrapped("batch_seq_dim", "encoder")
    wrapper(torch.randn(3, 9, 4), attention_mask=mask)
    kept = sched.sample[0][0]
    for b in range(3):  # an encoder's: the kept tokens' rows and columns
        assert torch.equal(layer.seen_mask[b], mask[b][:, kept[b]][:, :, kept[b]])


# ---- the engine, 2 ranks ------------------------------------------------------------------------------------------


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=3, n_head=2,
                                      use_cache=False, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0))


def _engine_config(min_value: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2},
            "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
                "enabled": True, "total_layer_num": 3, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
                "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
                "random_ltd_schedule": {"min_value": min_value, "max_value": 16, "schedule_type": "fixed_linear",
                                        "schedule_config": {"require_steps": 4, "seq_per_step": 4}}}}}}


def _train(engine, steps: int, start: int = 0):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 64, (4, 16), generator=g) for _ in range(start + steps)]
    rank = dist.get_rank()
    losses, reserved = [], []
    for ids in data[start:]:
        ids = ids[2 * rank:2 * rank + 2]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        reserved.append([m.reserved_length for m in engine.module.modules() if isinstance(m, RandomLayerTokenDrop)])
    return losses, reserved


def _engine_runs(root: str) -> dict:
    import deepspeed
    from deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd, save_without_random_ltd
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    out = {}
    torch.manual_seed(1)
    engine, *_ = deepspeed.initialize(model=_gpt2(), config=_engine_config(4))
    engine = convert_to_random_ltd(engine, GPT2Block)  # after initialize, as the examples do
    ids_of = {n: m.random_ltd_layer_id for n, m in engine.module.named_modules()
              if isinstance(m, RandomLayerTokenDrop)}
    out["ids"] = ids_of
    out["losses"], out["reserved"] = _train(engine, 4)
    out["api"] = (engine.random_ltd_enabled(), engine.random_ltd_scheduler.get_random_ltd_layer_num(),
                  engine.random_ltd_scheduler.model_layer_num, engine.random_ltd_scheduler.state_dict())
    out["keys"] = sorted(save_without_random_ltd(engine))
    out["plain_keys"] = sorted(_gpt2().state_dict())
    engine.save_checkpoint(root, tag="t")
    resumed, *_ = deepspeed.initialize(model=_gpt2(), config=_engine_config(4))
    resumed = convert_to_random_ltd(resumed, GPT2Block)
    resumed.load_checkpoint(root, tag="t")
    out["resumed_state"] = resumed.random_ltd_scheduler.state_dict()
    # the whole sequence kept (min_value = max_value = the sequence): the unwrapped model's run
    for wrap in (True, False):
        torch.manual_seed(1)
        e, *_ = deepspeed.initialize(model=_gpt2(), config=_engine_config(16))
        if wrap:
            e = convert_to_random_ltd(e, GPT2Block)
        out[f"full_{wrap}"] = _train(e, 3)[0]
    return out


def test_engine_trains_a_wrapped_gpt2_and_resumes_its_schedule(tmp_path):
    for out in run_distributed(_engine_runs, 2, args=(str(tmp_path),)):
        # DeepSpeed's matching: ids 1 and 2 go to the wrappers named with them, h.0 stays unconfigured
        assert out["ids"] == {"transformer.h.0": -1, "transformer.h.1": 0, "transformer.h.2": 1}
        # the layers' reserved length at each step: global_steps 0..3 over 4 steps from 4 to 16, by 4
        assert out["reserved"] == [[-1, 4, 4], [-1, 4, 4], [-1, 8, 8], [-1, 12, 12]]
        assert all(torch.isfinite(torch.tensor(out["losses"])))
        enabled, layers, total, state = out["api"]
        assert (enabled, layers, total) == (True, 2, 3)
        # consumed: global batch 4 x (reserved x 2 layers + 16 x 1 layer), steps 0-3
        assert state == {"consumed_layer_tokens": 4 * sum(r * 2 + 16 for r in (4, 4, 8, 12)), "current_steps": 3,
                         "current_value": 12, "min_value": 4, "max_value": 16}
        assert out["resumed_state"] == state
        assert out["keys"] == out["plain_keys"]
        assert out["full_True"] == out["full_False"]
