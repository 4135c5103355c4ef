"""hf_zero.runtime.lr_schedules against DeepSpeed's numbers, formulas and error behaviour."""

from __future__ import annotations

import math

import pytest
import torch

from hf_zero.config.errors import ConfigError
from hf_zero.runtime import lr_schedules as L

# CASES: the constructor arguments and optimizer of each reference run.
CASES = {
    "warmuplr_log": (L.WarmupLR, dict(warmup_min_lr=0.0001, warmup_max_lr=0.01, warmup_num_steps=10), "adamw"),
    "warmuplr_linear": (L.WarmupLR, dict(warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=8,
                                         warmup_type="linear"), "adamw"),
    "warmupdecay_linear": (L.WarmupDecayLR, dict(total_num_steps=20, warmup_min_lr=0.0, warmup_max_lr=0.002,
                                                 warmup_num_steps=5, warmup_type="linear"), "adamw"),
    "warmupdecay_log": (L.WarmupDecayLR, dict(total_num_steps=12, warmup_num_steps=4), "adamw"),
    "warmupcosine_log": (L.WarmupCosineLR, dict(total_num_steps=20, warmup_min_ratio=0.1, warmup_num_steps=5,
                                                cos_min_ratio=0.05), "adamw"),
    "warmupcosine_linear": (L.WarmupCosineLR, dict(total_num_steps=15, warmup_num_steps=4, warmup_type="linear"),
                            "adamw"),
    "onecycle": (L.OneCycle, dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=4,
                                  cycle_second_step_size=6, decay_step_size=2, decay_lr_rate=0.5,
                                  decay_mom_rate=0.1, cycle_min_mom=0.85, cycle_max_mom=0.95), "adamw"),
    "onecycle_stairs": (L.OneCycle, dict(cycle_min_lr=0.0, cycle_max_lr=0.008, cycle_first_step_size=6,
                                         cycle_first_stair_count=3), "adamw"),
    "onecycle_sgd": (L.OneCycle, dict(cycle_min_lr=0.001, cycle_max_lr=0.003, cycle_first_step_size=2), "sgd"),
    "lrrange_cont": (L.LRRangeTest, dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=3,
                                         lr_range_test_step_rate=2.0), "adamw"),
    "lrrange_stair": (L.LRRangeTest, dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=3,
                                          lr_range_test_step_rate=2.0, lr_range_test_staircase=True), "adamw"),
}

# Generated once with the real DeepSpeed 0.19.8 (/opt/dsvenv, DS_ACCELERATOR=cpu): for each case above, an
# optimizer with one param group and lr=0.01 (AdamW; SGD momentum=0.9 for "onecycle_sgd"), the schedule built
# with those arguments, then ``step()`` called len(lrs) times. init_lr is group["lr"] right after construction,
# lrs[i] is group["lr"] after step i+1, betas0[i] is group["betas"][0] after step i+1.
DS_REFERENCE = {
    'warmuplr_log': {
        'init_lr': 0.0001,
        'lrs': [
            0.0001, 0.0030801969570734135, 0.004823500421724658, 0.0060603939141468275, 0.007019803042926586,
            0.007803697378798072, 0.008466470596141142, 0.00904059087122024, 0.009547000843449316,
            0.009999999999999998, 0.01, 0.01, 0.01, 0.01
        ],
    },
    'warmuplr_linear': {
        'init_lr': 0.0,
        'lrs': [
            0.0, 0.000125, 0.00025, 0.000375, 0.0005, 0.000625, 0.00075, 0.000875, 0.001, 0.001, 0.001
        ],
    },
    'warmupdecay_linear': {
        'init_lr': 0.0,
        'lrs': [
            0.0, 0.0004, 0.0008, 0.0012, 0.0016, 0.002, 0.0018666666666666666, 0.0017333333333333335, 0.0016,
            0.0014666666666666667, 0.0013333333333333333, 0.0012, 0.0010666666666666667, 0.0009333333333333333,
            0.0008, 0.0006666666666666666, 0.0005333333333333334, 0.0004, 0.0002666666666666667,
            0.00013333333333333334, 0.0, 0.0, 0.0, 0.0
        ],
    },
    'warmupdecay_log': {
        'init_lr': 0.0,
        'lrs': [
            0.0, 0.0005, 0.0007924812503605781, 0.001, 0.001, 0.000875, 0.00075, 0.000625, 0.0005, 0.000375,
            0.00025, 0.000125, 0.0, 0.0
        ],
    },
    'warmupcosine_log': {
        'init_lr': 0.0,
        'lrs': [
            0.001, 0.0048760890226605385, 0.007143455750373868, 0.008752178045321076, 0.01,
            0.009896201103485576, 0.009589340923802354, 0.009092830723281, 0.008428370380204577, 0.007625,
            0.006717830723281001, 0.0057465102005213545, 0.004753489799478646, 0.003782169276719,
            0.002875000000000001, 0.002071629619795425, 0.0014071692767190004, 0.0009106590761976455,
            0.000603798896514423, 0.0005, 0.0005, 0.0005, 0.0005, 0.0005
        ],
    },
    'warmupcosine_linear': {
        'init_lr': 0.0,
        'lrs': [
            0.0, 0.0025, 0.005, 0.0075, 0.00979748512158568, 0.009206347037389491, 0.008274476239359453,
            0.007077367357502932, 0.00571200303394729, 0.0042889969660527116, 0.0029236326424970692,
            0.0017265237606405477, 0.0007946529626105091, 0.00020351487841432095, 1.0000000000000002e-06,
            1.0000000000000002e-06, 1.0000000000000002e-06
        ],
    },
    'onecycle': {
        'init_lr': 0.001,
        'lrs': [
            0.0032500000000000025, 0.0055, 0.007750000000000002, 0.009999999999999998, 0.0085,
            0.006999999999999999, 0.005500000000000001, 0.004, 0.0025000000000000014, 0.001, 0.0008,
            0.0006666666666666666, 0.0005714285714285715, 0.0005, 0.00044444444444444447, 0.0004
        ],
        'betas0': [
            0.9249999999999999, 0.9, 0.875, 0.85, 0.8666666666666667, 0.8833333333333333, 0.8999999999999999,
            0.9166666666666666, 0.9333333333333332, 0.95, 0.9974999999999999, 1.045, 1.0924999999999998, 1.14,
            1.1875, 1.2349999999999999
        ],
    },
    'onecycle_stairs': {
        'init_lr': 0.0,
        'lrs': [
            0.0, 0.0026666666666666666, 0.0026666666666666666, 0.005333333333333333, 0.005333333333333333,
            0.008, 0.005333333333333333, 0.005333333333333333, 0.0026666666666666666, 0.0026666666666666666,
            0.0, 0.0, 0.0, 0.0, 0.0
        ],
        'betas0': [
            0.9, 0.8666666666666667, 0.8666666666666667, 0.8333333333333334, 0.8333333333333334, 0.8,
            0.8333333333333334, 0.8333333333333334, 0.8666666666666667, 0.8666666666666667, 0.9, 0.9, 0.9, 0.9,
            0.9
        ],
    },
    'onecycle_sgd': {
        'init_lr': 0.001,
        'lrs': [
            0.002, 0.003, 0.002, 0.001, 0.001, 0.001
        ],
    },
    'lrrange_cont': {
        'init_lr': 0.001,
        'lrs': [
            0.0016666666666666666, 0.002333333333333333, 0.003, 0.0036666666666666666, 0.004333333333333334,
            0.005, 0.005666666666666667, 0.006333333333333333
        ],
    },
    'lrrange_stair': {
        'init_lr': 0.001,
        'lrs': [
            0.001, 0.001, 0.003, 0.003, 0.003, 0.005, 0.005, 0.005
        ],
    },
}


def _optimizer(kind: str = "adamw", n_groups: int = 1, lr: float = 0.01) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(n_groups)]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    return torch.optim.AdamW(groups, lr=lr)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_deepspeed_sequence(case):
    cls, kwargs, kind = CASES[case]
    ref = DS_REFERENCE[case]
    opt = _optimizer(kind)
    sched = cls(opt, **kwargs)
    assert opt.param_groups[0]["lr"] == pytest.approx(ref["init_lr"], rel=1e-12, abs=1e-15)
    lrs, betas0 = [], []
    for _ in ref["lrs"]:
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        if "betas" in opt.param_groups[0]:
            betas0.append(opt.param_groups[0]["betas"][0])
        assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]
    assert lrs == pytest.approx(ref["lrs"], rel=1e-12, abs=1e-15)
    if "betas0" in ref:
        assert betas0 == pytest.approx(ref["betas0"], rel=1e-12)
        assert opt.param_groups[0]["betas"][1] == 0.99
    if kind == "sgd":  # DeepSpeed cycles only Adam-style betas; SGD momentum is left alone
        assert opt.param_groups[0]["momentum"] == 0.9
        assert "betas" not in opt.param_groups[0]


def test_warmup_formulas_at_chosen_steps():
    """The warmup formulas, and warmup_num_steps 0 (#26 item 9).

    DeepSpeed 0.19.8 on the same warmup_num_steps=0 calls (WarmupLR, WarmupDecayLR from deepspeed.runtime.
    lr_schedules, run directly): ValueError "warmup_num_steps must be a positive integer, got 0" -- its constructor
    refuses 0 before its max(2, n). hf_zero accepts 0 and runs max(2, 0) = 2 warm-up steps (the schedule DeepSpeed gives
    n=1 and n=2): more permissive than DeepSpeed, never a different schedule for a value DeepSpeed accepts."""
    # WarmupLR log: lr = min + (max - min) * log(step + 1) / log(warmup_num_steps)
    sched = L.WarmupLR(_optimizer(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=100)
    sched.step(49)
    assert sched.get_last_lr() == [pytest.approx(math.log(50) / math.log(100), rel=1e-12)]
    sched.step(100)
    assert sched.get_last_lr() == [1.0]
    # warmup_num_steps=1 is raised to 2, as in DeepSpeed: step 0 -> log(1)/log(2) = 0
    sched = L.WarmupLR(_optimizer(), warmup_min_lr=0.5, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert sched.warmup_num_steps == 2
    sched.step()
    assert sched.get_last_lr() == [0.5]
    sched.step()
    assert sched.get_last_lr() == [0.75]
    # warmup_num_steps=0 (accelerate's DeepSpeed tests pass it): DeepSpeed's max(2, n) -- the same lrs as 2
    for cls, extra in ((L.WarmupLR, {}), (L.WarmupDecayLR, {"total_num_steps": 6})):
        zero = cls(_optimizer(), warmup_min_lr=0.1, warmup_max_lr=1.0, warmup_num_steps=0, **extra)
        two = cls(_optimizer(), warmup_min_lr=0.1, warmup_max_lr=1.0, warmup_num_steps=2, **extra)
        lrs = []
        for _ in range(5):
            zero.step()
            two.step()
            lrs.append((zero.get_last_lr(), two.get_last_lr()))
        assert all(a == b for a, b in lrs) and lrs[1][0] == [1.0], lrs
    # warmup_max_lr=None takes each group's own lr
    opt = _optimizer(lr=0.3)
    sched = L.WarmupLR(opt, warmup_num_steps=10, warmup_type="linear")
    sched.step(5)
    assert sched.get_last_lr() == [pytest.approx(0.15)]
    # WarmupDecayLR after warmup: gamma = (total - step) / (total - warmup)
    sched = L.WarmupDecayLR(_optimizer(), total_num_steps=1000, warmup_max_lr=0.002, warmup_num_steps=100)
    sched.step(550)
    assert sched.get_last_lr() == [pytest.approx(0.002 * 450 / 900, rel=1e-12)]
    sched.step(5000)
    assert sched.get_last_lr() == [0.0]
    # WarmupCosineLR: ratio = cos_min + (1 - cos_min) * (1 + cos(pi * progress)) / 2
    sched = L.WarmupCosineLR(_optimizer(lr=2.0), total_num_steps=110, warmup_num_steps=10, cos_min_ratio=0.1)
    sched.step(59)  # progress = (59 - 10 + 1) / 100 = 0.5
    assert sched.get_last_lr() == [pytest.approx(2.0 * (0.1 + 0.9 * 0.5), rel=1e-12)]


def test_per_group_values_and_tensor_lr():
    opt = _optimizer(n_groups=2)
    sched = L.WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=4,
                       warmup_type="linear")
    sched.step(2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.15])
    with pytest.raises(ValueError, match=r"warmup_min_lr: expected one value per optimizer param group \(2\)"):
        L.WarmupLR(opt, warmup_min_lr=[0.0, 0.1, 0.2])

    # A tensor lr (capturable / compiled optimizers) is updated in place, never replaced.
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=torch.tensor(0.01))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = L.WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_type="linear")
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert lr_tensor.item() == pytest.approx(0.01 * 1 / 2)  # linear warmup, step 1 of 2
    assert sched.org_lrs[0].item() == pytest.approx(0.01)  # the base lr was copied, not aliased


def test_wrapper_optimizer_is_unwrapped():
    class Wrapper:  # an engine-side optimizer wrapper that holds the torch optimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

    opt = _optimizer()
    sched = L.LRRangeTest(Wrapper(opt), lr_range_test_min_lr=0.5)
    assert sched.optimizer is opt
    assert opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(TypeError, match="object has no param_groups"):
        L.WarmupLR(object())


def test_get_last_lr_needs_a_step_when_nothing_was_written():
    # OneCycle writes its min lr at construction but, like DeepSpeed, records no last lr until step().
    sched = L.OneCycle(_optimizer(), cycle_min_lr=0.001, cycle_max_lr=0.01)
    with pytest.raises(AssertionError, match="need to call step"):
        sched.get_last_lr()
    sched.step()
    assert sched.get_last_lr() == [pytest.approx(0.001 + 0.009 / 2000)]
    # A schedule resumed mid-run (last_batch_iteration != -1) leaves the optimizer alone until step().
    opt = _optimizer(lr=0.123)
    for cls, kwargs in [(L.WarmupLR, {}), (L.WarmupDecayLR, {"total_num_steps": 10}),
                        (L.WarmupCosineLR, {"total_num_steps": 10}), (L.LRRangeTest, {})]:
        sched = cls(opt, last_batch_iteration=5, **kwargs)
        assert opt.param_groups[0]["lr"] == 0.123
        with pytest.raises(AssertionError, match="need to call step"):
            sched.get_last_lr()
    # From scratch, the warmup schedules answer at once with the lr they wrote (transformers logs it).
    sched = L.WarmupLR(_optimizer(), warmup_min_lr=0.002)
    assert sched.get_last_lr() == [0.002]


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip(case):
    cls, kwargs, kind = CASES[case]
    first = cls(_optimizer(kind), **kwargs)
    for _ in range(7):
        first.step()
    state = first.state_dict()
    assert state == {"last_batch_iteration": 6}

    resumed_opt = _optimizer(kind)
    resumed = cls(resumed_opt, **kwargs)
    resumed.load_state_dict(state)
    for _ in range(5):
        first.step()
        resumed.step()
        assert resumed.get_last_lr() == first.get_last_lr()
        assert resumed_opt.param_groups[0].get("betas") == first.optimizer.param_groups[0].get("betas")
    assert resumed.state_dict() == {"last_batch_iteration": 11}


def test_valid_lr_schedules_matches_deepspeed():
    assert L.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    for name in L.VALID_LR_SCHEDULES:
        assert getattr(L, name).__name__ == name


def test_build_lr_scheduler_builds_each_type():
    opt = _optimizer()
    sched = L.build_lr_scheduler("WarmupDecayLR", {"total_num_steps": 20, "warmup_max_lr": 0.002,
                                                   "warmup_num_steps": 5, "warmup_type": "linear"}, opt)
    assert isinstance(sched, L.WarmupDecayLR)
    sched.step(5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.002)
    # JSON integral floats (2e3) are accepted as integers
    sched = L.build_lr_scheduler("WarmupLR", {"warmup_num_steps": 2e3}, _optimizer())
    assert sched.warmup_num_steps == 2000
    sched = L.build_lr_scheduler("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}, _optimizer())
    assert isinstance(sched, L.OneCycle)
    assert isinstance(L.build_lr_scheduler("LRRangeTest", None, _optimizer()), L.LRRangeTest)
    assert isinstance(L.build_lr_scheduler("WarmupCosineLR", {"total_num_steps": 5}, _optimizer()),
                      L.WarmupCosineLR)


@pytest.mark.parametrize("type_name, params, key, message", [
    ("WarmupLr", {}, "scheduler.type", "unknown LR schedule 'WarmupLr'.*did you mean 'WarmupLR'"),
    ("CosineAnnealing", {}, "scheduler.type", "expected one of LRRangeTest, OneCycle, WarmupLR"),
    ("WarmupLR", [1, 2], "scheduler.params", r"expected a JSON object, got \[1, 2\]"),
    ("WarmupLR", {"warmup_max_lrr": 0.1}, "scheduler.params.warmup_max_lrr",
     "not a parameter of WarmupLR; did you mean 'warmup_max_lr'"),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_max_lr": 0.1}, "scheduler.params.warmup_max_lr",
     "not a parameter of WarmupCosineLR"),
    ("WarmupDecayLR", {"warmup_num_steps": 10}, "scheduler.params.total_num_steps",
     "required by WarmupDecayLR but missing"),
    ("OneCycle", {"cycle_min_lr": 0.1}, "scheduler.params.cycle_max_lr", "required by OneCycle"),
    ("WarmupLR", {"warmup_max_lr": "auto"}, "scheduler.params.warmup_max_lr",
     "expected a number, got 'auto' \\(str\\).*set a number here"),
    ("WarmupLR", {"warmup_num_steps": -1}, "scheduler.params.warmup_num_steps",
     "expected an integer >= 0, got -1"),
    ("WarmupLR", {"warmup_num_steps": 10.5}, "scheduler.params.warmup_num_steps",
     "expected an integer >= 0, got 10.5"),
    ("WarmupLR", {"warmup_type": "cosine"}, "scheduler.params.warmup_type",
     "expected 'log' or 'linear', got 'cosine' \\(str\\) \\(DeepSpeed would warn and warm up with 'log'"),
    ("LRRangeTest", {"lr_range_test_staircase": "yes"}, "scheduler.params.lr_range_test_staircase",
     "expected true or false, got 'yes'"),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 0},
     "scheduler.params.cycle_first_step_size", "must be positive, got 0"),
])
def test_build_lr_scheduler_errors_name_the_key(type_name, params, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        L.build_lr_scheduler(type_name, params, _optimizer())
    assert info.value.key_path == key
    assert str(info.value).startswith(key + ": ")


def test_bad_value_leaves_optimizer_untouched():
    opt = _optimizer(lr=0.5)
    with pytest.raises(ConfigError):
        L.build_lr_scheduler("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": [1.0, 2.0]}, opt)
    assert opt.param_groups[0]["lr"] == 0.5
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
