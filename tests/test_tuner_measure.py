"""Measurement statistics and bookkeeping that need no GPU: summaries, repetitions, roofline
fraction, failure classification, unsupported candidates."""

from __future__ import annotations

import pytest
import torch

from drafter_attn.kernels.nvrtc import CompileError
from drafter_attn.kernels.spec import Geometry, Problem
from drafter_attn.tuner import measure
from drafter_attn.tuner.spec import Candidate
from drafter_attn.tuner.step import CorrectnessError
from drafter_attn.tuner.timing import steady, summarize


def test_summary_statistics():
    t = summarize([float(x) for x in range(1, 102)])  # 1..101
    assert t.median_us == 51 and t.count == 101 and t.min_us == 1 and t.mean_us == 51
    assert t.p10_us == pytest.approx(11) and t.p90_us == pytest.approx(91)
    one = summarize([7.0])
    assert (one.median_us, one.p10_us, one.p90_us, one.count) == (7.0, 7.0, 7.0, 1)
    skewed = summarize([10.0] * 95 + [1000.0] * 5)  # a few slow outliers move the mean, not the median
    assert skewed.median_us == 10 and skewed.p90_us == 10 and skewed.mean_us > 50
    assert summarize([3.0, 1.0, 2.0]).median_us == 2.0  # order does not matter
    with pytest.raises(ValueError):
        summarize([])


def test_steady_times_again_only_when_disturbed():
    calls = []

    def timings(*medians_and_spreads):
        it = iter(medians_and_spreads)

        def once():
            median, p90 = next(it)
            calls.append(median)
            return summarize([median * 0.99] * 10 + [median] * 70 + [p90] * 20)
        return once

    # a steady first timing is the only one
    calls.clear()
    assert steady(timings((14.0, 14.5))).median_us == 14.0 and calls == [14.0]
    # a disturbed one (p90 twice p10) is timed again; the lowest median is kept
    calls.clear()
    t = steady(timings((20.5, 30.0), (14.1, 14.5), (99.0, 99.0)))
    assert t.median_us == 14.1 and calls == [20.5, 14.1]
    # at most `retries` more, keeping the lowest even when all are disturbed
    calls.clear()
    t = steady(timings((20.0, 40.0), (18.0, 40.0), (25.0, 50.0), (1.0, 1.0)), retries=2)
    assert t.median_us == 18.0 and calls == [20.0, 18.0, 25.0]
    # a later timing that is slower never replaces a faster, disturbed one
    calls.clear()
    assert steady(timings((15.0, 30.0), (16.0, 16.5), (1.0, 1.0))).median_us == 15.0
    assert calls == [15.0, 16.0]  # and a steady retry ends the retries


def test_choose_reps():
    assert measure.choose_reps(1000.0) == 250  # 0.25 s of 1 ms steps
    assert measure.choose_reps(1.0) == measure.MAX_REPS
    assert measure.choose_reps(1e6) == measure.MIN_REPS
    assert measure.choose_reps(0.0) == measure.MAX_REPS


def test_roofline_row():
    r = measure.roofline_row(median_us=100.0, nbytes=300_000_000, copy_bytes_per_s=4.0e12)
    assert r["bandwidth_gbs"] == pytest.approx(3000.0)
    assert r["copy_bandwidth_gbs"] == pytest.approx(4000.0)
    assert r["roofline_fraction"] == pytest.approx(0.75)
    assert r["bytes_moved"] == 300_000_000


def test_failure_classification():
    assert measure.failure(CompileError("NVRTC said no"))[0] == "failed_compile"
    assert measure.failure(CorrectnessError("rel err 1"))[0] == "failed_correctness"
    try:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    except RuntimeError as exc:
        status, reason = measure.failure(exc)
    assert status == "failed_runtime" and "illegal memory access" in reason
    assert "test_tuner_measure.py" in reason  # where it happened


def test_unsupported_candidates_are_recorded_not_run():
    g = Geometry(8, 2, 96, 8)  # head_dim 96: not compiled by the cupy kernels
    c = Candidate(Problem(g, "paged", 16, 1, 100), "cupy", ())
    row = measure.measure_candidate(c.to_wire())
    assert row["status"] == "unsupported" and "head_dim 96" in row["reason"]
    assert row["elapsed_s"] >= 0
    from drafter_attn.bench.steps import measure_context  # the context step goes through the same path

    row = measure_context(c.to_wire(), chunk=64)
    assert row["status"] == "unsupported" and "head_dim 96" in row["reason"]


class _FakeEvent:
    """A CUDA event stand-in: each pair of events times `ms`; the last one is done after `polls`
    queries."""
    polls = 0

    def __init__(self, enable_timing=True):
        self.t = 0.0

    def record(self):
        _FakeEvent.clock += 1.0
        self.t = _FakeEvent.clock

    def elapsed_time(self, other):
        return 0.5 * (other.t - self.t)  # 0.5 ms a replay (start and end one tick apart)

    def query(self):
        _FakeEvent.polls += 1
        return _FakeEvent.polls > 3


def test_a_timing_records_the_sm_clock_sampled_while_it_runs(monkeypatch):
    """`_each_timed`: the SM clock before the replays, while waiting for the last one, and after,
    averaged into Timing.sm_mhz; without NVML the field is None and the timing is unchanged."""
    from drafter_attn.tuner import timing

    monkeypatch.setattr(timing.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing.time, "sleep", lambda s: None)
    clocks = iter([1980.0, 1700.0, 1600.0, 1500.0, 1400.0])
    monkeypatch.setattr(timing, "sm_clock_mhz", lambda: next(clocks))
    _FakeEvent.clock, _FakeEvent.polls = 0.0, 0
    calls = []
    t = timing._each_timed(lambda: calls.append(1), reps=4, cold_l2=False)
    assert len(calls) == 4 and t.count == 4 and t.median_us == 500.0
    # one before, three while the last replay was not done, one after
    assert t.sm_mhz == pytest.approx((1980 + 1700 + 1600 + 1500 + 1400) / 5)
    monkeypatch.setattr(timing, "sm_clock_mhz", lambda: None)
    _FakeEvent.polls = 0
    t = timing._each_timed(lambda: None, reps=4, cold_l2=False)
    assert t.sm_mhz is None and t.median_us == 500.0


def test_work_between_replays_runs_outside_the_events(monkeypatch):
    """`_each_timed(between=...)`: the other work runs once before each replay, after the
    previous replay's end event and before the next start event, so it is never timed; the L2
    is flushed after it even where the step alone would not be (its dirty lines would be
    written back inside the next replay's events)."""
    from drafter_attn.tuner import timing

    monkeypatch.setattr(timing, "flush_l2", lambda: order.append("flush"))
    monkeypatch.setattr(timing.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing.time, "sleep", lambda s: None)
    monkeypatch.setattr(timing, "sm_clock_mhz", lambda: None)
    _FakeEvent.clock, _FakeEvent.polls = 0.0, 0
    order = []
    record = _FakeEvent.record

    def traced_record(self):
        order.append("event")
        record(self)

    monkeypatch.setattr(_FakeEvent, "record", traced_record)
    t = timing._each_timed(lambda: order.append("call"), reps=3, cold_l2=False,
                           between=lambda: order.append("load"))
    assert order == ["load", "flush", "event", "call", "event"] * 3
    assert t.count == 3 and t.median_us == 500.0
    order.clear()
    timing._each_timed(lambda: order.append("call"), reps=2, cold_l2=False)
    assert order == ["event", "call", "event"] * 2  # no other work: no flush where none was asked


def test_sustain_calls_back_to_back_for_the_time_asked(monkeypatch):
    from drafter_attn.tuner import timing

    syncs = []
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: syncs.append(1))
    calls = []
    timing.sustain(lambda: calls.append(1), 0.0)
    assert calls == [] and syncs == []
    timing.sustain(lambda: calls.append(1), 0.01)
    assert len(calls) >= 32 and len(calls) == 32 * len(syncs)


def test_a_co_runner_holds_the_load_and_runs_between_replays(monkeypatch):
    """`time_graph(load=...)` with `sustain_s`: the co-runner, not the graph, runs for the
    sustain seconds, then once before every timed replay; without `sustain_s` (a burst) it
    never runs. `co_load` names the loads it knows and refuses others."""
    from drafter_attn.tuner import timing

    monkeypatch.setattr(timing.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing.time, "sleep", lambda s: None)
    monkeypatch.setattr(timing, "sm_clock_mhz", lambda: None)
    monkeypatch.setattr(timing, "flush_l2", lambda: None)

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    for sustain_s, expect_load in ((0.01, True), (0.0, False)):
        _FakeEvent.clock, _FakeEvent.polls, Graph.replays = 0.0, 0, 0
        loads = []
        t = timing.time_graph(Graph(), reps=5, warmup=2, cold_l2=False, sustain_s=sustain_s,
                              load=lambda: loads.append(Graph.replays))
        assert t.count == 5 and Graph.replays == 2 + 5  # warm-up and timed replays only
        if expect_load:  # the hold (before any replay: 32 a chunk), then one before each replay
            held = loads.count(0)
            assert held >= 32 and held % 32 == 0 and loads == [0] * held + [2, 3, 4, 5, 6]
        else:
            assert loads == []
    assert timing.co_load("self") is None and timing.co_load("") is None and timing.co_load(None) is None
    with pytest.raises(ValueError, match="not one of self, gemm"):
        timing.co_load("heavy")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where no GPU is visible")
def test_no_gpu_no_clock():
    from drafter_attn.tuner import timing

    assert timing.sm_clock_mhz() is None
