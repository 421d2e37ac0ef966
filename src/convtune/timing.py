"""All benchmark hygiene in one function: ``benchmark(fn, device=...) -> Timing``.

The tuner takes the timer as a parameter (any callable of the ``Timer`` shape), so tests pass a
fake and every candidate of one comparison is timed by the same method:

- a warm-up call (first-call costs: allocator, oneDNN primitive creation, cuDNN execution plan builds);
- samples of ``inner`` back-to-back calls, ``inner`` chosen so one sample lasts about
  ``settings.timing_sample_ms`` (0.25 ms): long against the timer's resolution; a sample's fixed cost still
  reads about 2% on 15-100 us kernels (1.019x the medians of 1 ms samples on an H100), alike for the candidates
  of one problem;
- CUDA: device timestamps (events), the ``inner`` calls captured once in a CUDA graph and replayed (or at most
  ``settings.timing_graph_calls`` of them, the graph replayed back to back as often as a sample needs), so Python
  launch overhead (about 25 us a call) is out of the measurement (an eager loop when the candidate cannot be
  captured, or where a call lasts ``settings.timing_eager_above_ms`` or more: its launches then overlap its work),
  and an L2 flush (a write of 2x the L2 size) before every sample, so no sample starts with its operands already
  in cache;
- the median of the samples, their spread (p75 - p25), repeated until the spread is small,
  the budget is spent, or the median is clearly above ``stop_above_ms``.

    >>> import time
    >>> t = benchmark(lambda: time.sleep(0.001), device="cpu", budget_s=0.02, min_repeats=2, max_repeats=4)
    >>> 2 <= len(t.samples_ms) <= 4 and t.median_ms > 0
    True
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .settings import settings

log = logging.getLogger(__name__)

# Most calls in one sample (very fast functions; also bounds a CUDA graph's size).
MAX_INNER = 1000
# A warm-up call longer than this skips the sizing call (slow candidates run once per sample).
SIZING_LIMIT_MS = 50.0
# A warm-up call this many times over stop_above_ms, and at least HOPELESS_WARMUP_MS long, ends
# the timing at once. First calls run cold (plan builds, lazy initialisation: a 25 us cuDNN execution plan's
# first call takes 0.3 ms), so only a slow first call by a wide margin says a candidate is hopeless.
WARMUP_STOP_FACTOR = 3.0
HOPELESS_WARMUP_MS = 10.0
# Used when the device does not report its L2 size.
DEFAULT_L2_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class Timing:
    """What the timer measured, per call of ``fn``, in milliseconds.

    median_ms: median over samples; spread_ms: p75 - p25 of the samples; samples_ms: each
    sample's time per call; stopped_early: timing ended because the median exceeded
    ``stop_above_ms``; calls_per_sample: the ``inner`` calls one sample averaged over.
    """

    median_ms: float
    spread_ms: float
    samples_ms: tuple[float, ...]
    stopped_early: bool = False
    calls_per_sample: int = 1


class Timer(Protocol):
    """The shape of ``benchmark``: what the tuner calls to time one candidate.

    A timer must call ``fn`` (at least once): ``find`` checks the output those calls leave, which
    starts as a wrong answer, so a timer that never runs the candidate makes it a wrong result.
    """

    def __call__(self, fn: Callable[[], object], *, device: str, budget_s: float | None = None,
                 min_repeats: int | None = None, max_repeats: int | None = None,
                 stop_above_ms: float | None = None) -> Timing: ...


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` with linear interpolation (numpy's default).

    >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5)
    2.5
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of an empty list of values")
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float], *, stopped_early: bool = False, calls_per_sample: int = 1) -> Timing:
    """A ``Timing`` from per-call sample times (median and interquartile spread)."""
    return Timing(median_ms=percentile(samples_ms, 0.5),
                  spread_ms=percentile(samples_ms, 0.75) - percentile(samples_ms, 0.25),
                  samples_ms=tuple(samples_ms), stopped_early=stopped_early, calls_per_sample=calls_per_sample)


def benchmark(fn: Callable[[], object], *, device: str, budget_s: float | None = None,
              min_repeats: int | None = None, max_repeats: int | None = None,
              stop_above_ms: float | None = None, shared_device: bool = False) -> Timing:
    """Time ``fn()`` (no arguments) on ``device`` ('cpu' or 'cuda'): the median time per call.

    budget_s: seconds of sampling after which repeats end (at least ``min_repeats`` are taken);
    min_repeats/max_repeats: bounds on the number of samples; stop_above_ms: once min_repeats
    are done and the median exceeds it, stop and set ``stopped_early`` (the tuner passes a
    multiple of the best time so far). Defaults come from ``settings`` (timing_budget_s,
    timing_min_repeats, timing_max_repeats); repeats also end once (p75 - p25) / median is
    below ``settings.timing_rel_spread``. shared_device: another thread's work runs on the device
    meanwhile (the background worker's measurements beside a training step): on CUDA the calls are
    timed as an eager loop, never captured in a graph (while a capture is under way, another
    thread's ``torch.cuda.synchronize()`` fails), and only the current stream is waited for. Exceptions
    of ``fn`` propagate unchanged. Bad arguments raise ``ValueError``.

        >>> t = benchmark(lambda: sum(range(1000)), device="cpu", budget_s=0.01)
        >>> t.median_ms > 0 and t.spread_ms >= 0 and not t.stopped_early
        True
    """
    budget_s = settings.timing_budget_s if budget_s is None else budget_s
    min_repeats = settings.timing_min_repeats if min_repeats is None else min_repeats
    max_repeats = settings.timing_max_repeats if max_repeats is None else max_repeats
    rel_spread = settings.timing_rel_spread
    if not callable(fn):
        raise TypeError(f"benchmark() times a function of no arguments, got {type(fn).__name__}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"benchmark(device={device!r}) is not supported; use 'cpu' or 'cuda'")
    if min_repeats < 1 or max_repeats < min_repeats:
        raise ValueError(f"benchmark needs 1 <= min_repeats <= max_repeats, got min_repeats={min_repeats}, "
                         f"max_repeats={max_repeats}")
    if budget_s < 0:
        raise ValueError(f"benchmark(budget_s={budget_s}) must be >= 0 seconds")
    sampler = _CudaSampler(fn, shared_device) if device == "cuda" else _CpuSampler(fn)
    if (stop_above_ms is not None and sampler.warmup_ms >= HOPELESS_WARMUP_MS
            and sampler.warmup_ms > WARMUP_STOP_FACTOR * stop_above_ms):
        # Even the cold first call says it: not worth a single sample more.
        return summarize([sampler.warmup_ms], stopped_early=True)
    sampler.prepare()
    start = time.perf_counter()
    samples: list[float] = []
    stopped_early = False
    while True:
        samples.append(sampler.sample_ms())
        if len(samples) >= max_repeats:
            break
        if len(samples) < min_repeats:
            continue
        median = percentile(samples, 0.5)
        if stop_above_ms is not None and median > stop_above_ms:
            stopped_early = True
            break
        if percentile(samples, 0.75) - percentile(samples, 0.25) <= rel_spread * median:
            break
        if time.perf_counter() - start >= budget_s:
            break
    return summarize(samples, stopped_early=stopped_early, calls_per_sample=sampler.inner)


def _inner_for(per_call_ms: float) -> int:
    """Calls per sample so that one sample lasts about ``settings.timing_sample_ms``."""
    calls = settings.timing_sample_ms / per_call_ms if per_call_ms > 0 else math.inf
    return MAX_INNER if not calls < MAX_INNER else max(1, math.ceil(calls))


class _CpuSampler:
    """perf_counter around ``inner`` calls, ``inner`` sized by a second call after the warm-up."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        begin = time.perf_counter()
        fn()  # warm-up: first-call costs are not the algorithm's steady state
        self.warmup_ms = 1e3 * (time.perf_counter() - begin)
        self.inner = 1

    def prepare(self) -> None:
        """Size ``inner`` by a second call (a slow candidate gets none: one call is sample enough)."""
        if self.warmup_ms >= SIZING_LIMIT_MS:
            return
        begin = time.perf_counter()
        self.fn()
        self.inner = _inner_for(1e3 * (time.perf_counter() - begin))

    def sample_ms(self) -> float:
        fn = self.fn
        begin = time.perf_counter()
        for _ in range(self.inner):
            fn()
        return 1e3 * (time.perf_counter() - begin) / self.inner


class _CudaSampler:
    """CUDA events around ``replays`` replays of a graph of ``inner / replays`` calls (or an eager loop of ``inner``
    calls), L2 flushed before each sample.

    Every sample runs on the current stream: flush, start event, the calls, end event, then a
    synchronisation to read the events. ``fn`` must enqueue its work on the current stream.
    shared: the device is shared with another thread's work (``benchmark``'s shared_device): no graph,
    and waits for the current stream only.
    """

    graph: torch.cuda.CUDAGraph | None  # None until prepare() captures one (or when fn cannot be captured)

    def __init__(self, fn: Callable[[], object], shared: bool = False) -> None:
        self.fn, self.shared = fn, shared
        self.synchronize = torch.cuda.current_stream().synchronize if shared else torch.cuda.synchronize
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        l2_bytes = getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES
        self.flush = torch.empty(2 * l2_bytes, dtype=torch.uint8, device="cuda")
        self.synchronize()
        # Warm-up (cuDNN execution plan builds, Triton compilation, allocator growth), timed on the device.
        self.warmup_ms = self._eager_ms(1)
        self.inner, self.graph, self.replays = 1, None, 1

    def prepare(self) -> None:
        """Size ``inner`` and capture the graph of ``inner`` calls (none where calls are long enough to time eagerly:
        ``settings.timing_eager_above_ms``), or of ``inner / replays`` calls where ``settings.timing_graph_calls``
        caps a graph's calls: each sample then replays it ``replays`` times."""
        per_call_ms = self.warmup_ms
        if self.warmup_ms < SIZING_LIMIT_MS:
            # Eager calls overstate the time of host-bound kernels, so inner errs on the small side.
            per_call_ms = self._eager_ms(3) / 3
            self.inner = _inner_for(per_call_ms)
        eager_above = settings.timing_eager_above_ms
        eager = self.shared or (eager_above > 0 and per_call_ms >= eager_above)
        if eager:
            return
        cap = settings.timing_graph_calls
        if cap and self.inner > cap:
            self.replays = math.ceil(self.inner / cap)
            # a whole number of replays of at most cap calls each, no more calls than sized (nor MAX_INNER)
            self.inner = max(1, self.inner // self.replays) * self.replays
        self.graph = self._capture()
        if self.graph is None:
            self.replays = 1  # timed eagerly: inner calls a sample

    def _events(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _eager_ms(self, calls: int) -> float:
        start, end = self._events()
        self.flush.zero_()
        start.record()
        for _ in range(calls):
            self.fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        """A graph of ``inner / replays`` calls of ``fn``, or None when ``fn`` cannot be captured."""
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        try:
            # Capture needs a warmed-up fn on a side stream (lazy initialisations outside capture).
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.fn()
            torch.cuda.current_stream().wait_stream(side)
            # thread_local: this capture does not forbid other threads' CUDA calls (the worker of
            # convtune.background, or a user's threads)
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for _ in range(self.inner // self.replays):
                    self.fn()
            torch.cuda.synchronize()
            return graph
        except Exception as exc:  # noqa: BLE001 - any capture failure means: time it eagerly
            log.debug("CUDA graph capture failed (%s: %s); timing eager launches", type(exc).__name__, exc)
            torch.cuda.synchronize()
            return None

    def sample_ms(self) -> float:
        if self.graph is None:
            return self._eager_ms(self.inner) / self.inner
        start, end = self._events()
        self.flush.zero_()
        start.record()
        for _ in range(self.replays):
            self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.inner
