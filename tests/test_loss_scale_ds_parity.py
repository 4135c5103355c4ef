"""fp16 dynamic loss scaling: hf_zero's scale sequence equals DeepSpeed's, step for step.

The reference below restates DeepSpeed's ZeRO scaler rule (``DynamicLossScaler.update_scale`` in
deepspeed/runtime/fp16/loss_scaler.py) in its own bookkeeping -- an iteration counter and the iteration of the last
overflow -- so it checks hf_zero's ``good_steps`` form rather than repeating it. Tests cannot import DeepSpeed; the
reference was checked once by hand against DeepSpeed 0.19.8's class over the same grid of settings and patterns.
"""

import itertools
import random

import pytest

from hf_zero.config.policies import LossScalePolicy
from hf_zero.zero.loss_scaler import LossScaler


class AtMinimum(Exception):
    """DeepSpeed raises when an overflow lands on the minimum scale with the hysteresis budget spent."""


def reference_scales(overflows, *, init_scale, window, hysteresis, consecutive, min_scale):
    """The scale after each step of ``overflows`` under DeepSpeed's rule; ends with AtMinimum where DeepSpeed raises.

    Rule: iterations count from 0 and the last overflow starts at -1. An overflow at iteration i lowers the scale
    (by 2, floored at min_scale) only when the delay budget is 1 (or the configured delay is 1), otherwise spends one
    unit of the budget; either way it records i. A clean iteration i raises the scale by 2 when
    s = i - last_overflow - 1 is positive and divisible by the window, refilling the budget; with consecutive
    hysteresis each clean iteration refills the budget first.
    """
    scale, budget, last_overflow, seq = float(init_scale), hysteresis, -1, []
    for i, overflow in enumerate(overflows):
        if overflow:
            if hysteresis == 1 or budget == 1:
                if scale == min_scale:
                    seq.append(AtMinimum)
                    return seq
                scale = max(scale / 2, min_scale)
            else:
                budget -= 1
            last_overflow = i
        else:
            if consecutive:
                budget = hysteresis
            s = i - last_overflow - 1
            if s > 0 and s % window == 0:
                if not consecutive:
                    budget = hysteresis
                scale *= 2
        seq.append(scale)
    return seq


def hf_scales(overflows, *, init_power, window, hysteresis, consecutive, min_scale):
    scaler = LossScaler.from_policy(LossScalePolicy(static_scale=0.0, initial_scale_power=init_power, window=window,
                                                    hysteresis=hysteresis, consecutive_hysteresis=consecutive,
                                                    min_scale=min_scale))
    seq = []
    for overflow in overflows:
        try:
            scaler.update(overflow)
        except RuntimeError as e:
            assert "fp16.min_loss_scale" in str(e)
            seq.append(AtMinimum)
            return seq
        seq.append(scaler.scale)
    return seq


SETTINGS = list(itertools.product((1, 2, 3, 5), (1, 2, 3), (False, True), (1.0, 3.0, 0.25), (0, 2, 4)))


def _patterns(seed, n_random=12, length=40):
    rng = random.Random(seed)
    pats = [tuple(p) for n in range(1, 9) for p in itertools.product((False, True), repeat=n)]
    for density in (0.1, 0.3, 0.6):
        pats += [tuple(rng.random() < density for _ in range(length)) for _ in range(n_random // 3)]
    return pats


@pytest.mark.parametrize("window,hysteresis,consecutive,min_scale,init_power", SETTINGS)
def test_scale_sequence_matches_deepspeed_rule(window, hysteresis, consecutive, min_scale, init_power):
    for pattern in _patterns(seed=hash((window, hysteresis, consecutive, min_scale, init_power)) & 0xFFFF):
        want = reference_scales(pattern, init_scale=2.0 ** init_power, window=window, hysteresis=hysteresis,
                                consecutive=consecutive, min_scale=min_scale)
        got = hf_scales(pattern, init_power=init_power, window=window, hysteresis=hysteresis,
                        consecutive=consecutive, min_scale=min_scale)
        assert got == want, f"pattern {''.join('x' if o else '.' for o in pattern)}"


def test_first_raise_after_window_plus_one_clean_steps():
    # the probe's case: window 2, hysteresis 1, start 2**16, overflow at step 0 and step 4 (DeepSpeed 0.19.8 prints
    # cur_scale 32768, 32768, 32768, 65536, 32768 for ZeRO stage 2)
    got = hf_scales([True, False, False, False, True], init_power=16, window=2, hysteresis=1, consecutive=False,
                    min_scale=1.0)
    assert got == [32768.0, 32768.0, 32768.0, 65536.0, 32768.0]
    # no overflow at all: steps 0..window-1 keep the scale; step `window` (the window+1-th) doubles it, then every
    # `window` steps
    got = hf_scales([False] * 7, init_power=4, window=3, hysteresis=2, consecutive=False, min_scale=1.0)
    assert got == [16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 64.0]


def test_hysteresis_absorbs_then_every_overflow_halves_until_a_raise():
    got = hf_scales([True, True, True, False, False, True], init_power=4, window=1, hysteresis=2,
                    consecutive=False, min_scale=1.0)
    # overflow 1 spends the budget (2 -> 1), 2 and 3 halve; the raise at the second clean step refills it to 2,
    # so the last overflow is absorbed
    assert got == [16.0, 8.0, 4.0, 4.0, 8.0, 8.0]


def test_overflow_at_minimum_scale_raises_naming_the_key():
    scaler = LossScaler(scale=2.0, dynamic=True, window=10, hysteresis=1, min_scale=1.0, hysteresis_left=1)
    scaler.update(True)
    assert scaler.scale == 1.0
    with pytest.raises(RuntimeError, match="fp16.min_loss_scale"):
        scaler.update(True)


def test_state_dict_resumes_the_same_sequence():
    pattern = [True, False, False, True, True, False, False, False, False, True, False, False, False]
    kw = dict(init_power=8, window=2, hysteresis=2, consecutive=False, min_scale=1.0)
    full = hf_scales(pattern, **kw)
    for cut in range(1, len(pattern)):
        first = LossScaler.from_policy(LossScalePolicy(0.0, 8, 2, 2, False, 1.0))
        for o in pattern[:cut]:
            first.update(o)
        state = first.state_dict()
        assert set(state) == {"scale", "good_steps", "hysteresis_left"}
        second = LossScaler.from_policy(LossScalePolicy(0.0, 8, 2, 2, False, 1.0))
        second.load_state_dict(state)
        rest = []
        for o in pattern[cut:]:
            second.update(o)
            rest.append(second.scale)
        assert full[:cut] + rest == full, f"resumed after step {cut}"


def test_static_scale_never_moves():
    scaler = LossScaler.from_policy(LossScalePolicy(128.0, 16, 1, 1, False, 1.0))
    for o in (True, True, False, True):
        scaler.update(o)
    assert scaler.scale == 128.0
