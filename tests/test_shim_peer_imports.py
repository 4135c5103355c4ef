"""Names the peers' DeepSpeed test modules read from ``deepspeed`` when they are imported, before any test runs.

A missing one fails the whole module at collection (docs/peer_suites.md), so each is checked here against what
DeepSpeed 0.19.8 offers under the same name.
"""

from __future__ import annotations

import torch

from hf_zero.integrations.deepspeed_shim._finder import install

install()  # as the start-up .pth line does in an installed hf_zero


def test_compatible_ops_reports_the_aio_op_that_runs(tmp_path):
    """transformers' ``test_trainer_distributed_deepspeed.py`` decorates ``test_stage3_nvme_offload`` with
    ``require_deepspeed_aio``, which at import reads ``deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]``.
    DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``) answers ``{'async_io': False, 'cpu_adam': True, 'cpu_adagrad': True,
    'cpu_lion': True, 'fused_adam': True, ...}`` (its aio op needs libaio, not installed here), so the test skips.
    hf_zero's aio op is POSIX pread/pwrite and runs anywhere: it reports True, and the op it reports round-trips
    bytes through a file."""
    import deepspeed
    from deepspeed.ops.aio import AsyncIOBuilder

    assert hasattr(deepspeed.ops, "_hf_zero_forward"), "deepspeed is not hf_zero's compatibility layer"
    ops = deepspeed.ops.__compatible_ops__
    assert AsyncIOBuilder.NAME == "async_io"
    assert ops["async_io"] is True
    assert {name for name, ok in ops.items() if ok} == {"async_io", "cpu_adam", "cpu_adagrad", "cpu_lion",
                                                          "fused_adam"}

    handle = AsyncIOBuilder().load().aio_handle(1 << 16, 8, False, False, 1)
    path = str(tmp_path / "swap.bin")
    written = torch.arange(1000, dtype=torch.float32)
    assert handle.sync_pwrite(written, path) == 1
    read = torch.zeros(1000, dtype=torch.float32)
    assert handle.sync_pread(read, path) == 1
    assert torch.equal(read, written)
    assert (tmp_path / "swap.bin").stat().st_size == 4000


def _bf16_masters(stage: int, offload: bool):
    import hf_zero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(2):
        engine.backward(engine(torch.ones(2, 4, dtype=torch.bfloat16)).float().pow(2).mean())
        engine.step()
    masters = engine.optimizer.single_partition_of_fp32_groups
    params = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    return ([m.dtype for m in masters], sum(m.numel() for m in masters), {p.dtype for p in engine.module.parameters()},
            torch.equal(torch.cat([m.flatten() for m in masters])[:params.numel()].to(torch.bfloat16), params))


def test_single_partition_of_fp32_groups_are_the_fp32_masters():
    """transformers' ``test_mixed_precision_model_and_optimizer_dtypes_zero{2,3}`` trains with bf16 and reads
    ``trainer.model_wrapped.optimizer.single_partition_of_fp32_groups`` (ZeRO-2) or ``fp32_partitioned_groups_flat``
    (ZeRO-3), checking every master partition is fp32 and every model parameter bf16. DeepSpeed 0.19.8 cannot run
    that test (its ``_broadcast_model`` views every parameter as uint8, which fails for the test model's 0-dim
    parameters: "self.dim() cannot be 0 to view BFloat16 as Byte"). hf_zero's one optimizer class answers the
    ZeRO-1/2 name for every stage: a world of one holds all 4*3+3+3+1 = 19 elements, fp32, whose bf16 rounding is
    the model's bf16 parameters; with the optimizer offloaded too."""
    for stage, offload in ((2, False), (3, False), (2, True)):
        dtypes, numel, param_dtypes, published = _bf16_masters(stage, offload)
        assert set(dtypes) == {torch.float32}, (stage, offload)
        assert numel == 19 and param_dtypes == {torch.bfloat16}, (stage, offload, numel, param_dtypes)
        assert published, (stage, offload)


def test_optimizer_optimizer_is_the_torch_optimizer_over_the_masters_and_refused_under_offload():
    """DeepSpeed's ZeRO optimizer keeps the torch optimizer doing the math as ``.optimizer`` (DeepSpeed's checkpoint
    tests save ``engine.optimizer.optimizer.state_dict()``; accelerate's ``train()``/``eval()`` reach through it).
    hf_zero's is the optimizer over this rank's fp32 masters, sharing param_groups and state; under an optimizer
    offload its state would miss the moments, so the attribute is refused naming what reads them."""
    import hf_zero

    out = {}
    for offload in (False, True):
        model = torch.nn.Linear(4, 2)
        zero = {"stage": 2, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
        engine, opt, *_ = hf_zero.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
        engine.backward(engine(torch.ones(1, 4)).sum())
        engine.step()
        try:
            inner = opt.optimizer
            state = inner.state_dict()["state"][0]
            out[offload] = (type(inner).__name__, inner.param_groups is opt.param_groups, sorted(state),
                            state["exp_avg"].numel(), hasattr(opt, "optimizer"))
        except AttributeError as e:
            out[offload] = (str(e), hasattr(opt, "optimizer"))
        engine.destroy()
    assert out[False] == ("AdamW", True, ["exp_avg", "exp_avg_sq", "step"], 10, True)
    assert "offload_optimizer" in out[True][0] and "safe_get_full_optimizer_state" in out[True][0]
    assert out[True][1] is False


def test_initialize_logs_deepspeed_info_line_on_deepspeed_logger():
    """transformers' DeepSpeed Trainer tests (``test_basic_training`` and 8 more) capture ``deepspeed.utils.logger``
    around ``trainer.train()`` and assert "DeepSpeed info" is in it: the sign that the DeepSpeed engine was built.
    DeepSpeed 0.19.8 logs ``DeepSpeed info: version=0.19.8, git-hash=unknown, git-branch=unknown`` once per engine
    on rank 0. The shim's ``deepspeed.initialize`` logs the same prefix with its own version and says which engine
    answered; ``hf_zero.initialize`` called directly does not."""
    import io
    import logging

    import deepspeed
    import deepspeed.utils

    import hf_zero

    def captured(init) -> str:
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        log = deepspeed.utils.logger
        old_level = log.level
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        try:
            model = torch.nn.Linear(4, 2)
            init(model=model, model_parameters=model.parameters(),
                 config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        finally:
            log.removeHandler(handler)
            log.setLevel(old_level)
        return stream.getvalue()

    shim_log = captured(deepspeed.initialize)
    lines = [line for line in shim_log.splitlines() if line.startswith("DeepSpeed info: version=")]
    assert len(lines) == 1, shim_log
    assert deepspeed.__version__ in lines[0] and "hf_zero" in lines[0]
    assert "DeepSpeed info" not in captured(hf_zero.initialize)
    assert deepspeed.initialize.__wrapped__ is hf_zero.initialize
