"""hf_zero's on/off environment switches read one way (hf_zero.util.env.env_flag): every spelling, the default,
and a typo refused with the variable's name, for each switch that uses it."""

from __future__ import annotations

import pytest

from hf_zero.comm import shm_ring
from hf_zero.util.env import env_flag


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("Yes", True), (" ON ", True),
                                            ("0", False), ("false", False), ("NO", False), ("off", False)])
def test_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("HF_ZERO_TEST_FLAG", value)
    assert env_flag("HF_ZERO_TEST_FLAG", not expected) is expected


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(monkeypatch, default):
    monkeypatch.delenv("HF_ZERO_TEST_FLAG", raising=False)
    assert env_flag("HF_ZERO_TEST_FLAG", default) is default
    monkeypatch.setenv("HF_ZERO_TEST_FLAG", "  ")
    assert env_flag("HF_ZERO_TEST_FLAG", default) is default


def test_typo_names_the_variable(monkeypatch):
    monkeypatch.setenv("HF_ZERO_TEST_FLAG", "of")
    with pytest.raises(ValueError, match=r"HF_ZERO_TEST_FLAG='of': expected one of 1, true"):
        env_flag("HF_ZERO_TEST_FLAG", True)


def test_shm_ring_switch(monkeypatch):
    monkeypatch.delenv("HF_ZERO_SHM_COMM", raising=False)
    assert shm_ring.enabled() is True
    monkeypatch.setenv("HF_ZERO_SHM_COMM", "off")
    assert shm_ring.enabled() is False
    monkeypatch.setenv("HF_ZERO_SHM_COMM", "2")  # before: silently on
    with pytest.raises(ValueError, match="HF_ZERO_SHM_COMM='2'"):
        shm_ring.enabled()


def test_host_cache_huge_pages_switch(monkeypatch):
    from hf_zero.zero import host_memory

    monkeypatch.setenv(host_memory.HOST_CACHE_HUGE_PAGES_ENV, "maybe")
    with pytest.raises(ValueError, match="HF_ZERO_HOST_CACHE_HUGE_PAGES='maybe'"):
        host_memory.tune_cpu_training_memory(stage3=False)
