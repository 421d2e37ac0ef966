"""The timer on CUDA: graph capture and its eager fallback, the settings that shape a sample (no assertion on times).

Run on a CUDA machine: ``python -m pytest tests/gpu``. Skipped without CUDA.
"""

import pytest
import torch

from convtune import timing
from convtune.settings import settings
from convtune.timing import benchmark

pytestmark = pytest.mark.gpu


def test_cuda_timing_graph_and_eager_fallback():
    a = torch.randn(1024, 1024, device="cuda")
    b = torch.randn(1024, 1024, device="cuda")
    t = benchmark(lambda: a @ b, device="cuda", budget_s=0.05, min_repeats=3, max_repeats=10)
    assert 3 <= len(t.samples_ms) <= 10 and t.median_ms > 0 and t.calls_per_sample >= 1
    # .item() synchronises, which a CUDA graph cannot capture: timed eagerly instead.
    t = benchmark(lambda: (a @ b).sum().item(), device="cuda", budget_s=0.05, min_repeats=3, max_repeats=5)
    assert t.median_ms > 0
    t = benchmark(lambda: a @ b, device="cuda", min_repeats=3, max_repeats=10, stop_above_ms=1e-6)
    assert t.stopped_early and len(t.samples_ms) == 3


@pytest.mark.parametrize("eager_above_ms, captures", [(0.0, 1), (1e-6, 0)])
def test_calls_as_long_as_the_setting_are_timed_without_a_graph(monkeypatch, eager_above_ms, captures):
    a = torch.randn(512, 512, device="cuda")
    made = []
    capture = timing._CudaSampler._capture
    monkeypatch.setattr(timing._CudaSampler, "_capture", lambda self: made.append(1) or capture(self))
    with settings.override(timing_eager_above_ms=eager_above_ms):
        t = benchmark(lambda: a @ a, device="cuda", budget_s=0.02, min_repeats=3, max_repeats=5)
    assert len(made) == captures and t.median_ms > 0 and len(t.samples_ms) >= 3


def test_a_graph_capped_by_the_setting_holds_fewer_calls_and_is_replayed_for_the_rest(monkeypatch):
    a = torch.randn(64, 64, device="cuda")
    calls, captured, replays = [], [], []

    def fn():
        calls.append(1)
        return a @ a

    capture = timing._CudaSampler._capture

    def counted_capture(self):  # the calls made while capturing: a warm-up on a side stream, then the graph's
        before = len(calls)
        graph = capture(self)
        captured.append(len(calls) - before - 1)
        return graph

    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(timing._CudaSampler, "_capture", counted_capture)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(1) or replay(graph))
    with settings.override(timing_graph_calls=4, timing_sample_ms=1.0):
        capped = benchmark(fn, device="cuda", budget_s=0.02, min_repeats=3, max_repeats=5)
    capped_replays = len(replays)
    with settings.override(timing_graph_calls=0, timing_sample_ms=1.0):
        whole = benchmark(fn, device="cuda", budget_s=0.02, min_repeats=3, max_repeats=5)
    # a 64x64 product lasts a few microseconds: a 1 ms sample holds far more than 4 calls
    assert captured[0] <= 4 < capped.calls_per_sample and capped.calls_per_sample % captured[0] == 0
    # every sample replays the graph as often as its calls need
    assert capped_replays == len(capped.samples_ms) * (capped.calls_per_sample // captured[0])
    assert captured[1] == whole.calls_per_sample > 4
    assert len(replays) - capped_replays == len(whole.samples_ms)  # one replay a sample
    assert capped.median_ms > 0 and whole.median_ms > 0
