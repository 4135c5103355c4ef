"""``self.apply(init_fn)`` in a model's ``__init__`` under ``zero.Init`` (nanoGPT's ``_init_weights``, timm): the
children are already partitioned when it runs, so without help ``init_fn`` sees 1-D placeholders and silently
changes nothing. With ``zero_optimization.override_module_apply`` (default true, as in DeepSpeed) each module's own
parameters are gathered around ``init_fn``, rank 0's result is kept everywhere, and the model comes out partitioned
with the values the function wrote. 2 CPU ranks."""

from __future__ import annotations

import torch

from hf_zero.testing import run_distributed


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        self.scale = torch.nn.Parameter(torch.ones(3))  # the root's own parameter, partitioned at __exit__
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.constant_(module.weight, 0.5)
            torch.nn.init.normal_(module.bias)  # random: each rank draws its own, rank 0's must win


def _build(override: bool | None):
    import hf_zero
    from hf_zero.zero.stage3.param import sharded_param_of

    torch.manual_seed(torch.distributed.get_rank())  # different draws per rank
    zero = {"stage": 3}
    if override is not None:
        zero["override_module_apply"] = override
    with hf_zero.zero.Init(config_dict_or_path={"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1}):
        net = Net()
    partitioned = all(sharded_param_of(p) is not None and p.numel() == 0 for p in net.parameters())
    leftover = [name for name, m in net.named_modules() if "apply" in m.__dict__]
    with hf_zero.zero.GatheredParameters(list(net.parameters())):
        values = {n: p.detach().clone() for n, p in net.named_parameters()}
    return values, partitioned, leftover


def _both():
    return _build(None), _build(False)


def test_apply_in_init_writes_through_partitioned_parameters():
    results = run_distributed(_both, world_size=2)
    (rank0, _), (rank1, _) = results
    for values, partitioned, leftover in (rank0, rank1):
        assert partitioned and leftover == []  # partitioned as ever, and no instance apply left behind
        for name in ("a.weight", "b.0.weight", "b.1.weight"):
            assert torch.equal(values[name], torch.full_like(values[name], 0.5)), name
        assert torch.equal(values["scale"], torch.ones(3))
    for name, value in rank0[0].items():  # the random biases: rank 0's draw on both ranks
        assert torch.equal(rank1[0][name], value), name
    # override_module_apply false: DeepSpeed's behaviour then -- the function saw placeholders, nn.Linear's own
    # initialisation stays (weights within its +-1/sqrt(8) bound, not 0.5)
    for _, off in results:
        values, partitioned, leftover = off
        assert partitioned and leftover == []
        for name in ("a.weight", "b.0.weight", "b.1.weight"):
            assert values[name].abs().max().item() <= 8 ** -0.5, name


class _BuildsInsideItsInit(torch.nn.Module):
    """Its ``__init__`` opens a nested zero.Init around a parameter of its own, then writes to it whole: a nested
    exit must not partition a module still being built."""

    def __init__(self) -> None:
        super().__init__()
        import hf_zero

        with hf_zero.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3},
                                                    "train_micro_batch_size_per_gpu": 1}):
            self.w = torch.nn.Parameter(torch.zeros(4, 3))
        self.w.data.fill_(2.0)


def _nested():
    """DeepSpeed's tests/unit/runtime/zero/test_zero_nesting_init.py (TestShutdownInNestingInit) and more."""
    import hf_zero
    from hf_zero.zero.stage3.param import sharded_param_of

    cfg = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    out = {}
    with hf_zero.zero.Init(config_dict_or_path=cfg):
        with hf_zero.zero.Init(config_dict_or_path=cfg):
            model1 = torch.nn.Linear(4, 4)
        # partitioned as the inner block closes (DeepSpeed: at the end of its __init__), so an engine can take it
        out["inner_exit"] = all(sharded_param_of(p) is not None for p in model1.parameters())
        engine, *_ = hf_zero.initialize(model=model1, config={**cfg, "gradient_clipping": 0.0,
                                                              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        with hf_zero.zero.GatheredParameters(list(model1.parameters())):
            before = [p.detach().clone() for p in model1.parameters()]
        engine.backward(engine(torch.ones(2, 4)).sum())  # d/dW = 2 everywhere (two rows of ones), d/db = 2
        engine.step()
        with hf_zero.zero.GatheredParameters(list(model1.parameters())):
            out["step"] = [(p.detach() - b).tolist() for p, b in zip(model1.parameters(), before)]
        built = _BuildsInsideItsInit()
        out["building_kept_whole"] = sharded_param_of(built.w) is None  # its parent's exit, not the nested one's
    out["outer_exit"] = sharded_param_of(built.w) is not None
    with hf_zero.zero.GatheredParameters([built.w]):
        out["written_whole"] = torch.equal(built.w.detach(), torch.full((4, 3), 2.0))
    return out


def test_nested_init_partitions_what_it_built_when_it_closes():
    for out in run_distributed(_nested, world_size=2):
        assert out["inner_exit"] and out["building_kept_whole"] and out["outer_exit"] and out["written_whole"], out
        # the engine trained it: SGD's step -lr * 2 on every element (the gradient averaged over the two ranks)
        for delta in out["step"]:
            assert torch.allclose(torch.tensor(delta), torch.full_like(torch.tensor(delta), -0.2)), delta


class _Sub(torch.nn.Module):
    def __init__(self, n: int, device=None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(n, n, device=device)
        self.module_list = torch.nn.ModuleList([torch.nn.Linear(n, n, device=device)])

    def forward(self, x):
        return self.module_list[0](self.linear(x))


class _SkipInitNet(torch.nn.Module):
    """``torch.nn.utils.skip_init`` (ChatGLM's ``empty_init``; DeepSpeed's TestParamPartitioningSkipInit): modules
    built on the meta device, their children too, then given empty storage; the weights are written afterwards."""

    def __init__(self) -> None:
        super().__init__()
        from torch.nn.utils import skip_init

        self.l1 = skip_init(_Sub, 6)
        self.l2 = skip_init(torch.nn.Linear, 6, 4)
        self.l3 = torch.nn.Linear(4, 4)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.constant_(module.weight, 0.25)
            torch.nn.init.constant_(module.bias, -0.5)

    def forward(self, x):
        return self.l3(self.l2(self.l1(x)))


def _skip_init_under_zero_init():
    import hf_zero
    from hf_zero.zero.stage3.param import sharded_param_of

    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    with hf_zero.zero.Init(config_dict_or_path=config):
        net = _SkipInitNet()
    shards = {n: (sharded_param_of(p) is not None, p.numel(), tuple(p.ds_shape)) for n, p in net.named_parameters()}
    engine, *_ = hf_zero.initialize(model=net, config=config)
    x = torch.arange(12, dtype=torch.float32).reshape(2, 6) / 10
    return shards, engine(x).detach()


def test_skip_init_modules_under_zero_init_are_partitioned_once_they_have_storage():
    reference = _SkipInitNet()
    x = torch.arange(12, dtype=torch.float32).reshape(2, 6) / 10
    expected = reference(x).detach()
    for shards, out in run_distributed(_skip_init_under_zero_init, world_size=2):
        for name, p in reference.named_parameters():
            assert shards[name] == (True, 0, tuple(p.shape)), name  # every one cut, none left whole or meta
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


class _RankDependent(torch.nn.Module):
    """Random weights from a per-rank seed, and a parameter rank 0 alone writes (DeepSpeed's
    TestZero3ParamPartitioningLargeParam): zero.Init must build rank 0's model on every rank, as DeepSpeed's
    broadcasts each parameter before partitioning it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(5, 3)
        self.param = torch.nn.Parameter(torch.zeros(101))
        if torch.distributed.get_rank() == 0:
            with torch.no_grad():
                self.param[50:].fill_(1.0)


def _rank_dependent_init():
    import hf_zero

    torch.manual_seed(100 + torch.distributed.get_rank())
    with hf_zero.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3},
                                                "train_micro_batch_size_per_gpu": 1}):
        net = _RankDependent()
    with hf_zero.zero.GatheredParameters(list(net.parameters())):
        return {n: p.detach().clone() for n, p in net.named_parameters()}


def test_zero_init_builds_rank0s_values_on_every_rank():
    rank0, rank1 = run_distributed(_rank_dependent_init, world_size=2)
    torch.manual_seed(100)
    expected = torch.nn.Linear(5, 3)  # rank 0's draw
    for values in (rank0, rank1):
        assert torch.equal(values["inner.weight"], expected.weight) and torch.equal(values["inner.bias"], expected.bias)
        assert values["param"][:50].sum().item() == 0 and values["param"][50:].sum().item() == 51


def _outside_init_rank_dependent():
    import hf_zero

    torch.manual_seed(100 + torch.distributed.get_rank())
    net = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))  # not under zero.Init
    engine, *_ = hf_zero.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_zero3_engine_cuts_a_model_built_outside_zero_init_from_rank0s_values():
    """The engine's path for a model built without zero.Init takes rank 0's values the same way zero.Init does."""
    torch.manual_seed(100)
    expected = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2)).state_dict()
    for values in run_distributed(_outside_init_rank_dependent, world_size=2):
        for name, tensor in expected.items():
            assert torch.equal(values[name], tensor), name
