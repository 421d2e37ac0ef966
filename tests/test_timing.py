"""The timer: structure of its answers, its stopping rules, its errors (no assertion on times)."""

import time

import pytest
import torch

from convtune import timing
from convtune.settings import settings
from convtune.timing import SIZING_LIMIT_MS, Timer, Timing, benchmark, percentile, summarize


def sleeper(ms: float):
    calls = []

    def fn():
        calls.append(1)
        time.sleep(ms / 1e3)

    fn.calls = calls
    return fn


def test_cpu_timing_structure():
    fn = sleeper(1.0)
    t = benchmark(fn, device="cpu", budget_s=0.05, min_repeats=3, max_repeats=10)
    assert isinstance(t, Timing)
    assert 3 <= len(t.samples_ms) <= 10
    assert all(s > 0 for s in t.samples_ms)
    assert t.median_ms == percentile(t.samples_ms, 0.5)
    assert t.spread_ms == pytest.approx(percentile(t.samples_ms, 0.75) - percentile(t.samples_ms, 0.25))
    assert not t.stopped_early
    # warm-up, sizing call, then inner calls per sample
    assert len(fn.calls) == 2 + t.calls_per_sample * len(t.samples_ms)


def test_slow_function_gets_no_sizing_call():
    fn = sleeper(SIZING_LIMIT_MS + 5)
    t = benchmark(fn, device="cpu", budget_s=0.0, min_repeats=2, max_repeats=2)
    assert t.calls_per_sample == 1 and len(fn.calls) == 1 + 2


def test_stop_above_stops_after_min_repeats(monkeypatch):
    # (no warm-up hopeless here: on a loaded machine a 2 ms sleep can take over HOPELESS_WARMUP_MS)
    monkeypatch.setattr(timing, "HOPELESS_WARMUP_MS", 1e9)
    t = benchmark(sleeper(2.0), device="cpu", budget_s=5.0, min_repeats=3, max_repeats=20, stop_above_ms=1.5)
    assert t.stopped_early
    assert len(t.samples_ms) == 3


def test_a_hopeless_warm_up_ends_the_timing_at_once():
    t = benchmark(sleeper(12.0), device="cpu", budget_s=5.0, min_repeats=3, max_repeats=20, stop_above_ms=0.5)
    assert t.stopped_early and len(t.samples_ms) == 1 and t.median_ms >= 12.0


def test_a_slow_cold_first_call_of_a_fast_function_is_not_hopeless(monkeypatch):
    # a cold call far over 3x stop_above_ms but under HOPELESS_WARMUP_MS (raised here to 400 ms, so that a loaded
    # machine's delays cannot carry the 40 ms call over it)
    monkeypatch.setattr(timing, "HOPELESS_WARMUP_MS", 400.0)
    calls = []

    def cold_then_fast():  # 40 ms the first time (a plan build), then 0.1 ms
        time.sleep(0.04 if not calls else 0.0001)
        calls.append(1)

    t = benchmark(cold_then_fast, device="cpu", budget_s=0.05, min_repeats=3, max_repeats=5, stop_above_ms=0.5)
    assert len(t.samples_ms) >= 3 and t.median_ms < 5.0


def test_stop_above_not_reached():
    t = benchmark(sleeper(1.0), device="cpu", budget_s=0.02, min_repeats=2, max_repeats=4, stop_above_ms=1e6)
    assert not t.stopped_early


def test_max_repeats_bounds_samples():
    with settings.override(timing_rel_spread=-1.0):  # spread never small enough: only the bounds stop
        t = benchmark(sleeper(0.5), device="cpu", budget_s=10.0, min_repeats=2, max_repeats=4)
    assert len(t.samples_ms) == 4


def test_budget_ends_repeats():
    with settings.override(timing_rel_spread=-1.0):
        t = benchmark(sleeper(1.0), device="cpu", budget_s=0.02, min_repeats=2, max_repeats=1000)
    assert 2 <= len(t.samples_ms) < 1000


def test_defaults_come_from_settings():
    with settings.override(timing_min_repeats=2, timing_max_repeats=2, timing_budget_s=10.0):
        t = benchmark(sleeper(0.2), device="cpu")
    assert len(t.samples_ms) == 2


def test_fast_function_runs_many_calls_per_sample():
    x = torch.randn(16)
    t = benchmark(lambda: x.sum(), device="cpu", budget_s=0.02, min_repeats=2, max_repeats=3)
    assert t.calls_per_sample > 1
    assert t.median_ms > 0


def test_exceptions_propagate():
    def boom():
        raise KeyError("broken candidate")

    with pytest.raises(KeyError, match="broken candidate"):
        benchmark(boom, device="cpu")


@pytest.mark.parametrize("kwargs, match", [
    (dict(device="tpu"), "device"),
    (dict(device="cpu", min_repeats=5, max_repeats=2), "min_repeats"),
    (dict(device="cpu", min_repeats=0), "min_repeats"),
    (dict(device="cpu", budget_s=-1.0), "budget_s"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        benchmark(lambda: None, **kwargs)


def test_percentile_and_summarize():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.25) == 2.0
    with pytest.raises(ValueError):
        percentile([], 0.5)
    t = summarize([1.0, 2.0, 3.0, 4.0, 5.0], stopped_early=True)
    assert (t.median_ms, t.spread_ms, t.stopped_early) == (3.0, 2.0, True)


def test_benchmark_fits_the_timer_protocol():
    timer: Timer = benchmark  # what find() takes; a type checker holds this line to the Protocol
    assert callable(timer)


def test_the_sample_length_setting_sizes_the_calls_per_sample():
    with settings.override(timing_sample_ms=6.0):
        long = benchmark(sleeper(0.5), device="cpu", budget_s=0.01, min_repeats=1, max_repeats=1)
    with settings.override(timing_sample_ms=0.1):
        short = benchmark(sleeper(0.5), device="cpu", budget_s=0.01, min_repeats=1, max_repeats=1)
    assert long.calls_per_sample >= 3 and short.calls_per_sample == 1
    with settings.override(timing_sample_ms=1e308):  # a finite setting whose calls would overflow: capped
        assert timing._inner_for(1e-300) == timing.MAX_INNER and timing._inner_for(0.0) == timing.MAX_INNER
