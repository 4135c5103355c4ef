"""The comms logger (``comms_logger``, ``deepspeed.comm.configure`` / ``log_summary``; hf_zero/comm/comms_log.py):
the bandwidth formulas on known latencies, the records of a clock the test drives, prof_ops filtering, reset, the
summary's table and dict; then 2 gloo ranks: a real engine step of stages 0, 2 and 3 and DeepSpeed's functional
collectives, with the byte sizes each must record."""

from __future__ import annotations

import contextlib
import io
import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hf_zero.comm import comms_log
from hf_zero.comm.comms_log import CommsLogger, Timing, TimedWork, bandwidths_gbps, busbw_factor, convert_size
from hf_zero.integrations.deepspeed_shim._finder import install
from hf_zero.testing import run_distributed

install()  # as the start-up .pth line does in an installed hf_zero


@pytest.fixture
def fresh_logger():
    """The process's logger with its switches at DeepSpeed's defaults and no records; restored afterwards."""
    log = comms_log.logger
    saved = (log.enabled, log.verbose, log.prof_all, log.prof_ops, log.debug)
    log.set(enabled=False, verbose=False, prof_all=True, prof_ops=[], debug=False)
    log.reset_data()
    yield log
    log.set(enabled=saved[0], verbose=saved[1], prof_all=saved[2], prof_ops=saved[3], debug=saved[4])
    log.reset_data()


class _Clock:
    """Seconds that the test sets."""

    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def __call__(self) -> float:
        return self.readings.pop(0)


# ---- the formulas -------------------------------------------------------------------------------------------------

def test_busbw_factors_per_op():
    assert busbw_factor("all_reduce", 4) == 2 * 3 / 4
    assert busbw_factor("inference_all_reduce", 4) == 1.5
    for op in ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single"):
        assert busbw_factor(op, 4) == 3 / 4, op
    for op in ("broadcast", "reduce", "send", "barrier", "log_summary_barrier"):
        assert busbw_factor(op, 4) == 1.0, op
    assert busbw_factor("all_reduce", 1) == 0.0  # a world of one moves nothing between ranks


def test_bandwidths_for_known_latencies():
    # 1 MB all-reduced on 4 ranks in 2 ms: 1e6 * 8 bits / 2e-3 s = 4 Gbps; busbw 4 * 2(n-1)/n = 6
    algbw, busbw = bandwidths_gbps("all_reduce", 1_000_000, 2.0, 4)
    assert algbw == pytest.approx(4.0) and busbw == pytest.approx(6.0)
    # an all-gather of 1 kB shards on 4 ranks moves 4 kB: 4000 * 8 / 1e-3 / 1e9 = 0.032 Gbps; busbw * 3/4
    algbw, busbw = bandwidths_gbps("all_gather", 1000, 1.0, 4)
    assert algbw == pytest.approx(0.032) and busbw == pytest.approx(0.024)
    # a reduce-scatter's message is its whole input already
    algbw, busbw = bandwidths_gbps("reduce_scatter_tensor", 4000, 1.0, 4)
    assert algbw == pytest.approx(0.032) and busbw == pytest.approx(0.024)
    algbw, busbw = bandwidths_gbps("all_to_all_single", 4000, 1.0, 2)
    assert algbw == pytest.approx(0.032) and busbw == pytest.approx(0.016)
    assert bandwidths_gbps("broadcast", 125_000_000, 1000.0, 8) == pytest.approx((1.0, 1.0))
    assert bandwidths_gbps("all_reduce", 100, 0.0, 2) == (0.0, 0.0)  # no time measured: no bandwidth claimed


def test_convert_size_as_deepspeed_prints_it():
    assert [convert_size(n) for n in (0, 1, 1023, 1024, 4096, 1536, 1024 ** 2, 5 * 1024 ** 3)] == [
        "0B", "1.0 B", "1023.0 B", "1.0 KB", "4.0 KB", "1.5 KB", "1.0 MB", "5.0 GB"]
    assert convert_size(1024 ** 5) == "1.0 PB"  # exact powers of 1024 (a float log would say 1024.0 TB)


# ---- records ------------------------------------------------------------------------------------------------------

def test_timing_records_the_clock_difference_in_ms():
    log = CommsLogger(clock=_Clock(10.0, 10.004, 20.0, 20.001))
    for _ in range(2):
        timing = Timing(log, "all_reduce", "all_reduce", 1_000_000, 4, torch.device("cpu"))
        timing.start()
        timing.stop()
    count, latencies, algbws, busbws = log.comms_dict["all_reduce"][1_000_000]
    assert count == 2 and latencies == pytest.approx([4.0, 1.0])
    assert algbws == pytest.approx([2.0, 8.0]) and busbws == pytest.approx([3.0, 12.0])


def test_records_are_kept_per_op_and_message_size_and_reset():
    log = CommsLogger()
    log.append("all_reduce", "all_reduce", 1.0, 400, world_size=2)
    log.append("all_reduce", "all_reduce", 3.0, 400, world_size=2)
    log.append("all_reduce", "all_reduce", 1.0, 800, world_size=2)
    log.append("all_gather", "all_gather", 1.0, 100, world_size=2)
    assert log.has_data() and log.get_operation_names() == ["all_reduce", "all_gather"]
    assert log.get_total_operations() == 4
    assert {op: {size: row[0] for size, row in rows.items()} for op, rows in log.get_raw_data().items()} == {
        "all_reduce": {400: 2, 800: 1}, "all_gather": {100: 1}}
    summary = log.get_operation_summary("all_reduce")
    assert summary[400]["total_latency_ms"] == 4.0 and summary[400]["avg_latency_ms"] == 2.0
    assert log.get_operation_summary("broadcast") is None
    log.reset_data()
    assert not log.has_data() and log.get_total_operations() == 0 and log.get_operation_names() == []


def test_prof_ops_select_what_is_timed_when_prof_all_is_off():
    log = CommsLogger()
    assert log.wants("anything")  # prof_all defaults to true, as DeepSpeed's
    log.set(prof_all=False, prof_ops=["all_reduce", "reduce_scatter_tensor"])
    assert log.wants("all_reduce") and log.wants("reduce_scatter_tensor")
    assert log.wants("reduce_scatter")  # hf_zero's own reduce-scatter: the same kind as DeepSpeed's name
    log.set(prof_ops=["all_gather_into_tensor"])
    assert log.wants("all_gather") and not log.wants("reduce_scatter")
    log.set(prof_ops=["all_reduce", "reduce_scatter_tensor"])
    assert not log.wants("all_gather") and not log.wants("broadcast")
    assert log.wants("broadcast", prof=True)  # the call asked for it
    log.stop_profiling_op(["all_reduce"])
    assert not log.wants("all_reduce")
    log.start_profiling_op(["all_gather"])
    assert log.prof_ops == ["reduce_scatter_tensor", "all_gather"] and log.wants("all_gather")
    log.start_profiling_comms()
    assert log.wants("broadcast")


def test_log_all_returns_the_summary_with_trimmed_means(capsys):
    log = CommsLogger()
    latencies = [1.0] * 9 + [100.0]  # one outlier in ten: trimmed (10% at each end) from the averages
    for latency in latencies:
        log.append("all_reduce", "all_reduce", latency, 1_000_000, world_size=2)
    result = log.log_all(print_log=False, return_dict=True)
    assert capsys.readouterr().out == ""
    assert set(result) == {"summary", "straggler_analysis", "metadata"}
    assert result["straggler_analysis"] is None
    assert result["metadata"]["world_size"] == 1 and result["metadata"]["rank"] == 0
    row = result["summary"]["all_reduce"][1_000_000]
    assert row == {"count": 10, "total_latency_ms": pytest.approx(109.0), "avg_latency_ms": pytest.approx(1.0),
                   "tput_avg_gbps": pytest.approx(8.0), "busbw_avg_gbps": pytest.approx(8.0),
                   "msg_size_bytes": 1_000_000, "msg_size_str": "976.56 KB"}
    assert log.log_all() is None
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "all_reduce"
    assert lines[2].split() == ["976.56", "KB", "10", "109.00", "1.00", "8.00", "8.00"]


def test_straggler_analysis_of_one_rank_has_no_wait():
    log = CommsLogger()
    log.append("broadcast", "broadcast", 2.0, 64, world_size=1)
    rows = log.log_all(print_log=False, show_straggler=True, return_dict=True)["straggler_analysis"]
    assert rows["broadcast"][64]["total_comm_lat_ms"] == 2.0 and rows["broadcast"][64]["total_straggler_ms"] == 0.0


# ---- timed_op: the DeepSpeed-signature functions ----------------------------------------------------------------

class _Work:
    def __init__(self) -> None:
        self.waited = False

    def wait(self, timeout=None) -> bool:
        self.waited = True
        return True

    def is_completed(self) -> bool:
        return self.waited


@comms_log.timed_op("tensor")
def _broadcast(tensor, src=0, group=None, async_op=False, prof=False, log_name="broadcast", debug=None):
    return _Work() if async_op else None


@comms_log.timed_op("input_list")
def _reduce_scatter(output, input_list, group=None, async_op=False, prof=False, log_name="reduce_scatter",
                    debug=None):
    return None


def test_disabled_logger_records_nothing(fresh_logger):
    _broadcast(torch.zeros(8), prof=True)
    _reduce_scatter(torch.zeros(2), [torch.zeros(2), torch.zeros(2)])
    assert not fresh_logger.has_data()


def test_timed_op_records_the_bytes_sent(fresh_logger):
    fresh_logger.set(enabled=True)
    _broadcast(torch.zeros(8))  # 8 float32
    _broadcast(torch.zeros(8, dtype=torch.bfloat16), log_name="my_broadcast")
    _reduce_scatter(torch.zeros(3), [torch.zeros(3, dtype=torch.float64)] * 2)  # the whole input: 2 x 3 x 8 bytes
    assert {op: {size: row[0] for size, row in rows.items()} for op, rows in fresh_logger.comms_dict.items()} == {
        "broadcast": {32: 1}, "my_broadcast": {16: 1}, "reduce_scatter": {48: 1}}


def test_timed_op_honours_prof_and_prof_ops(fresh_logger):
    fresh_logger.set(enabled=True, prof_all=False, prof_ops=["reduce_scatter"])
    _broadcast(torch.zeros(4))
    _reduce_scatter(torch.zeros(1), [torch.zeros(1)])
    _broadcast(torch.zeros(2), prof=True)
    assert {op: list(rows) for op, rows in fresh_logger.comms_dict.items()} == {"reduce_scatter": [4],
                                                                                "broadcast": [8]}


def test_async_op_is_recorded_when_waited_on(fresh_logger):
    fresh_logger.set(enabled=True)
    work = _broadcast(torch.zeros(4), async_op=True)
    assert isinstance(work, TimedWork) and not fresh_logger.has_data()
    assert work.is_completed() is False  # the handle's own attributes pass through
    work.wait()
    work.wait()
    assert fresh_logger.get_total_operations() == 1 and work.is_completed()


def test_debug_names_the_calling_function(fresh_logger):
    fresh_logger.set(enabled=True, debug=True)
    _broadcast(torch.zeros(1))
    assert fresh_logger.get_operation_names() == ["broadcast | [Caller Func: test_debug_names_the_calling_function]"]


def test_verbose_logs_each_op_on_rank_zero(fresh_logger, caplog):
    fresh_logger.set(enabled=True, verbose=True)
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        _broadcast(torch.zeros(256))
    messages = [r.getMessage() for r in caplog.records if r.name == "hf_zero"]
    assert len(messages) == 1 and messages[0].startswith("hf_zero comms: broadcast, 1.0 KB in ")


# ---- configuration ------------------------------------------------------------------------------------------------

def _section(**switches):
    return SimpleNamespace(**{"enabled": False, "verbose": False, "prof_all": True, "prof_ops": (), "debug": False,
                              **switches})


def test_configure_from_a_section_only_when_it_is_enabled(fresh_logger):
    comms_log.configure_from(_section(verbose=True))
    assert not fresh_logger.enabled and not fresh_logger.verbose
    comms_log.configure_from(_section(enabled=True, prof_all=False, prof_ops=("all_reduce",), debug=True))
    assert fresh_logger.enabled and not fresh_logger.prof_all and fresh_logger.prof_ops == ["all_reduce"]
    assert fresh_logger.debug
    comms_log.configure_from(_section())  # a disabled section leaves a logger switched on as it is
    assert fresh_logger.enabled


def test_deepspeed_comm_configure(fresh_logger):
    import deepspeed.comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig({"train_batch_size": 1, "comms_logger": {"enabled": True, "prof_all": False,
                                                                      "prof_ops": ["all_gather_into_tensor"]}})
    dist.configure(deepspeed_config=config, verbose=True)
    assert fresh_logger.enabled and fresh_logger.verbose and not fresh_logger.prof_all
    assert fresh_logger.prof_ops == ["all_gather_into_tensor"] and fresh_logger.wants("all_gather")
    dist.configure(enabled=False)
    assert not fresh_logger.enabled and fresh_logger.verbose  # only what is given changes
    with pytest.raises(TypeError, match="DeepSpeedConfig"):
        dist.configure(deepspeed_config={"comms_logger": {"enabled": True}})


def test_config_status_is_honoured():
    from hf_zero.config import load_config
    from hf_zero.config.status import STATUS, Status

    assert STATUS["comms_logger"].status is Status.HONOURED
    assert load_config({"train_batch_size": 1, "comms_logger": {"enabled": True}}, world_size=1).not_implemented == ()


def test_deepspeed_utils_comms_logging_is_the_logger_module():
    import deepspeed.comm
    import deepspeed.utils.comms_logging as ds_comms_logging

    assert deepspeed.comm.comms_logger is comms_log.logger
    assert ds_comms_logging.CommsLogger is CommsLogger
    assert ds_comms_logging.convert_size(2048) == "2.0 KB"
    assert ds_comms_logging.calc_bw_log("broadcast", 1_000_000, 8.0) == pytest.approx((1.0, 1.0))  # world of 1
    assert callable(ds_comms_logging.get_caller_func)


# ---- 2 gloo ranks: an engine step and DeepSpeed's functional collectives ------------------------------------------

IN, HIDDEN, OUT = 8, 16, 4
NUMEL = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT  # 212 parameters, even: no padding at world size 2


def _counts(log) -> dict[str, dict[int, int]]:
    return {op: {size: row[0] for size, row in rows.items()} for op, rows in log.get_raw_data().items()}


def _engine_step(stage: int) -> dict:
    import hf_zero

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT))
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "comms_logger": {"enabled": True, "prof_all": True}}
    engine, *_ = hf_zero.initialize(model=model, config=config)
    comms_log.logger.reset_data()  # start-up's broadcasts and checks aside: one step
    loss = engine(torch.randn(2, IN)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    raw = comms_log.logger.get_raw_data()
    return {"counts": _counts(comms_log.logger),
            "bandwidths": [(op, size, lat, alg, bus) for op, rows in raw.items() for size, (_, lats, algs, buses)
                           in rows.items() for lat, alg, bus in zip(lats, algs, buses)]}


def _functional() -> dict:
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    log = comms_log.logger
    out = {}
    dist.configure(enabled=False)
    dist.reset_log()
    dist.all_gather_into_tensor(torch.zeros(3 * world), torch.zeros(3))
    out["disabled"] = (dist.has_comm_data(), dist.get_comm_operation_count())

    dist.configure(enabled=True, prof_all=True)
    dist.all_gather_into_tensor(torch.zeros(3 * world), torch.zeros(3))  # the 12-byte shard
    dist.reduce_scatter_tensor(torch.zeros(2, dtype=torch.float64), torch.zeros(2 * world, dtype=torch.float64))
    dist.all_reduce(torch.zeros(5))
    dist.broadcast(torch.zeros(3, dtype=torch.float64), src=0)  # 24 bytes
    dist.all_to_all_single(torch.zeros(world), torch.zeros(world))
    dist.all_reduce(torch.zeros(5), async_op=True).wait()
    out["all"] = _counts(log)
    out["count"], out["ops"] = dist.get_comm_operation_count(), dist.get_logged_comm_ops()
    # hf_zero's own bounded collectives record into the same logger
    from hf_zero.comm import all_gather_packed, all_to_all_single_, barrier, reduce_scatter_packed

    dist.reset_log()
    all_gather_packed(torch.zeros(world, 10), torch.zeros(10))
    reduce_scatter_packed(torch.zeros(10), torch.ones(world, 10))
    all_to_all_single_(torch.zeros(2 * world), torch.zeros(2 * world))
    barrier()
    out["own"] = _counts(log)

    dist.reset_log()
    dist.configure(prof_all=False, prof_ops=["all_reduce"])
    dist.all_reduce(torch.zeros(1))
    dist.broadcast(torch.zeros(2), src=0)
    dist.broadcast(torch.zeros(3), src=0, prof=True)
    dist.all_gather_into_tensor(torch.zeros(world), torch.zeros(1))
    out["filtered"] = _counts(log)

    dist.configure(prof_all=True)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        out["summary"] = dist.log_summary(return_dict=True)
        out["straggler"] = dist.log_summary(show_straggler=True, return_dict=True)["straggler_analysis"]
    out["printed"] = buffer.getvalue()
    out["rank"] = rank
    dist.configure(enabled=False)
    dist.reset_log()
    return out


def _both() -> dict:
    return {"functional": _functional(), **{f"stage{stage}": _engine_step(stage) for stage in (0, 2, 3)}}


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_both, 2)


def test_engine_step_records_zero_collectives_with_their_sizes(two_ranks):
    from hf_zero.zero.stage3.divergence import TRAILER_NUMEL

    for r in two_ranks:
        stage0, stage2, stage3 = r["stage0"]["counts"], r["stage2"]["counts"], r["stage3"]["counts"]
        # stage 0 all-reduces the gradients (4 bytes each); 4-byte all-reduces: the gradient norm
        assert stage0["all_reduce"][NUMEL * 4] == 1 and 4 in stage0["all_reduce"]
        # stage 2: the whole packed gradient is reduce-scattered, each rank's half of the parameters all-gathered
        assert stage2["reduce_scatter"] == {NUMEL * 4: 1}
        assert stage2["all_gather"] == {NUMEL * 4 // 2: 1}
        assert 4 in stage2["all_reduce"]
        # stage 3: every layer's shard (plus the divergence trailer) gathered in forward and again in backward
        shard0 = (IN * HIDDEN + HIDDEN) // 2 + TRAILER_NUMEL
        shard1 = (HIDDEN * OUT + OUT) // 2 + TRAILER_NUMEL
        assert stage3["all_gather"] == {shard0 * 4: 2, shard1 * 4: 2}
        assert stage3["reduce_scatter"] == {NUMEL * 4: 1}
        for stage in ("stage0", "stage2", "stage3"):
            for op, size, latency, algbw, busbw in r[stage]["bandwidths"]:
                assert latency > 0, (stage, op)
                total = size * 2 if op == "all_gather" else size
                assert algbw == pytest.approx(total * 8 / (latency * 1e-3) / 1e9), (stage, op)
                assert busbw == pytest.approx(algbw * busbw_factor(op, 2)), (stage, op)


def test_deepspeed_comm_functions_record_their_message_sizes(two_ranks):
    for r in two_ranks:
        f = r["functional"]
        assert f["disabled"] == (False, 0)
        assert f["all"] == {"all_gather_into_tensor": {12: 1}, "reduce_scatter_tensor": {32: 1},
                            "all_reduce": {20: 2}, "broadcast": {24: 1}, "all_to_all_single": {8: 1}}
        assert f["count"] == 6 and f["ops"] == list(f["all"])
        assert f["own"] == {"all_gather": {40: 1}, "reduce_scatter": {80: 1}, "all_to_all_single": {16: 1},
                            "barrier": {4: 1}}
        assert f["filtered"] == {"all_reduce": {4: 1}, "broadcast": {12: 1}}


def test_log_summary_prints_on_rank_zero_and_returns_the_dict_everywhere(two_ranks):
    r0, r1 = (r["functional"] for r in two_ranks)
    assert r1["printed"] == ""
    printed = r0["printed"].splitlines()
    assert "all_reduce" in printed and "broadcast" in printed and "log_summary_barrier" in printed
    for f in (r0, r1):
        summary = f["summary"]
        assert set(summary) == {"summary", "straggler_analysis", "metadata"}
        assert summary["metadata"]["world_size"] == 2 and summary["metadata"]["rank"] == f["rank"]
        # the filtered ops, then the barrier that log_summary itself runs first (DeepSpeed logs it the same way)
        assert list(summary["summary"]) == ["all_reduce", "broadcast", "log_summary_barrier"]
        row = summary["summary"]["all_reduce"][4]
        assert set(row) == {"count", "total_latency_ms", "avg_latency_ms", "tput_avg_gbps", "busbw_avg_gbps",
                            "msg_size_bytes", "msg_size_str"}
        assert row["count"] == 1 and row["msg_size_bytes"] == 4 and row["msg_size_str"] == "4.0 B"
        straggler = f["straggler"]["all_reduce"][4]
        assert straggler["count"] == 1 and straggler["total_straggler_ms"] >= 0
        assert straggler["total_comm_lat_ms"] <= row["total_latency_ms"]


def _straggler_summary_is_bounded_and_not_recorded():
    import torch

    import deepspeed.comm as dist

    dist.configure(enabled=True, prof_all=True)
    dist.reset_log()
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    before = dist.get_comm_operation_count()
    out = dist.log_summary(show_straggler=True, return_dict=True)
    after = dist.get_comm_operation_count()
    dist.configure(enabled=False)
    return before, after, sorted(out["straggler_analysis"])


def test_straggler_analysis_does_not_record_its_own_all_reduces():
    """log_summary(show_straggler=True) all-reduces the latencies with hf_zero's bounded collective; those
    all-reduces are the logger's own and are not added to the records (the next summary would count them)."""
    from hf_zero.testing import run_distributed

    results = run_distributed(_straggler_summary_is_bounded_and_not_recorded, 2)
    for before, after, ops in results:
        assert ops == ["all_reduce", "log_summary_barrier"]
        assert after - before == 2  # log_summary's two barriers; its straggler all-reduces would add 2 more
