"""Fakes for tests of the tuner: algorithms with every behaviour, a timer on a fake clock, a database.

A fake algorithm computes the true result (through PyTorch) unless it is meant to fail, and
advances the shared fake ``CLOCK`` by its ``time_ms`` each run; ``FakeTimer`` times by that
clock, so a test decides candidates' times exactly without sleeping. ``Fake(..., sleep=True)``
also sleeps for real, for the wall-clock budget and the real timer. ``CostlyWorkspace`` counts
how often its workspace had to be learned (a cuDNN execution plan's build).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from convtune.algorithms.base import SUPPORTED, Algorithm, Buffer, NumericNotes, Support, unsupported
from convtune.algorithms.native import native_conv
from convtune.algorithms.registry import get_algorithm
from convtune.policy import Policy
from convtune.ranking import rank
from convtune.timing import Timing, percentile, summarize


class FakeClock:
    """Milliseconds that only fake algorithms advance."""

    def __init__(self) -> None:
        self.ms = 0.0

    def advance(self, ms: float) -> None:
        self.ms += ms


CLOCK = FakeClock()


class FakeTimer:
    """A ``Timer`` that reads ``CLOCK``: one warm-up call, then samples of one call each.

    Honours min_repeats/max_repeats (defaults 3 and 5) and stop_above_ms like ``benchmark``;
    records the keyword arguments of every call in ``calls``.
    """

    def __init__(self, min_repeats: int = 3, max_repeats: int = 5) -> None:
        self.min_repeats, self.max_repeats = min_repeats, max_repeats
        self.calls: list[dict[str, Any]] = []

    def __call__(self, fn, *, device: str, budget_s: float | None = None, min_repeats: int | None = None,
                 max_repeats: int | None = None, stop_above_ms: float | None = None) -> Timing:
        self.calls.append(dict(device=device, budget_s=budget_s, stop_above_ms=stop_above_ms))
        lo = min_repeats or self.min_repeats
        hi = max_repeats or self.max_repeats
        fn()
        samples: list[float] = []
        while len(samples) < hi:
            before = CLOCK.ms
            fn()
            samples.append(CLOCK.ms - before)
            if len(samples) >= lo and stop_above_ms is not None and percentile(samples, 0.5) > stop_above_ms:
                return summarize(samples, stopped_early=True)
        return summarize(samples)


class Fake(Algorithm):
    """A correct algorithm with chosen properties; counts its runs in ``runs``.

    time_ms: what it adds to ``CLOCK`` per run; sleep: also sleep that long for real;
    workspace_bytes: declared (and touched) scratch; deterministic, tf32, reduced_precision:
    what it declares; devices, directions: where it runs; unsupported_reason: refuse every problem.
    """

    def __init__(self, name: str = "fake:ok", *, time_ms: float = 1.0, sleep: bool = False, workspace_bytes: int = 0,
                 deterministic: bool = True, tf32: bool = False, reduced_precision: bool = False,
                 devices: tuple[str, ...] = ("cpu", "cuda"),
                 directions: tuple[str, ...] = ("fwd", "bwd_data", "bwd_filter"),
                 unsupported_reason: str | None = None, priced_like: str | None = None) -> None:
        self.name = name
        super().__init__()
        self.time_ms, self.sleep, self.declared_bytes = time_ms, sleep, workspace_bytes
        self.deterministic, self.tf32, self.reduced_precision = deterministic, tf32, reduced_precision
        self.devices, self.directions, self.unsupported_reason = devices, directions, unsupported_reason
        self.runs = 0
        # the cost model prices it as this built-in algorithm (None: the generic cost of an unknown family)
        self.priced_like = None if priced_like is None else get_algorithm(priced_like)

    def cost(self, problem, workspace_bytes):
        if self.priced_like is None:
            return super().cost(problem, workspace_bytes)
        return self.priced_like.cost(problem, workspace_bytes)

    def _supports(self, problem) -> Support:
        return unsupported(self.unsupported_reason) if self.unsupported_reason else SUPPORTED

    def buffers(self, problem) -> list[Buffer]:
        return [Buffer("scratch", (self.declared_bytes,), torch.uint8)] if self.declared_bytes else []

    def notes(self, problem) -> NumericNotes:
        return NumericNotes(tf32=self.tf32, reduced_precision=self.reduced_precision)

    def is_deterministic(self, problem) -> bool:
        return self.deterministic

    def _run(self, problem, a, b, out, ws) -> None:
        self.runs += 1
        CLOCK.advance(self.time_ms)
        if self.sleep:
            time.sleep(self.time_ms / 1e3)
        if "scratch" in ws:
            ws["scratch"][:64].fill_(7)
        self.compute(problem, a, b, out)

    def compute(self, problem, a, b, out) -> None:
        out.copy_(native_conv(problem, a, b))


class Raising(Fake):
    """Raises ``exc`` on every run."""

    def __init__(self, name: str = "fake:raising", exc: BaseException | None = None, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.exc = exc if exc is not None else ValueError("boom")

    def compute(self, problem, a, b, out) -> None:
        raise self.exc


class OutOfMemory(Raising):
    """Raises torch.OutOfMemoryError, as the CUDA caching allocator does."""

    def __init__(self, name: str = "fake:oom", **kw: Any) -> None:
        super().__init__(name, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), **kw)


class WrongResult(Fake):
    """Off by ``scale`` (1% by default): far beyond any float32 tolerance."""

    def __init__(self, name: str = "fake:wrong", scale: float = 1.01, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.scale = scale

    def compute(self, problem, a, b, out) -> None:
        out.copy_(native_conv(problem, a, b) * self.scale)


class NaNResult(Fake):
    """The correct result with one NaN in it."""

    def __init__(self, name: str = "fake:nan", **kw: Any) -> None:
        super().__init__(name, **kw)

    def compute(self, problem, a, b, out) -> None:
        super().compute(problem, a, b, out)
        out[(0,) * out.dim()] = float("nan")


class NoWrite(Fake):
    """Never writes its output."""

    def __init__(self, name: str = "fake:nowrite", **kw: Any) -> None:
        super().__init__(name, **kw)

    def compute(self, problem, a, b, out) -> None:
        pass


class InputWriter(Fake):
    """Computes the right result, then scribbles on its first operand."""

    def __init__(self, name: str = "fake:inputwriter", **kw: Any) -> None:
        super().__init__(name, **kw)

    def compute(self, problem, a, b, out) -> None:
        super().compute(problem, a, b, out)
        a.mul_(2)


class UnknownDeterminism(Fake):
    """Does not know whether it is deterministic (like a cuDNN execution plan); ``noisy`` makes runs differ slightly."""

    def __init__(self, name: str = "fake:unknown", noisy: bool = False, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.noisy = noisy

    def is_deterministic(self, problem) -> bool | None:
        return None

    def compute(self, problem, a, b, out) -> None:
        super().compute(problem, a, b, out)
        if self.noisy:  # far within tolerance, but not bit for bit the same as any of its last 49 runs: atomics-like
            out.mul_(1 + 1e-6 * (self.runs % 50 + 1))


class CostlyWorkspace(Fake):
    """A workspace learned only by costly work, like a cuDNN execution plan's by its build.

    ``known_workspace_bytes`` is None for a problem until ``workspace_bytes``, ``workspace_bytes`` or a
    run learned it; ``builds`` counts the learnings (once per problem, as a plan is built once).
    """

    def __init__(self, name: str = "fake:costly", **kw: Any) -> None:
        super().__init__(name, **kw)
        self.built: set[Any] = set()
        self.builds = 0

    def known_workspace_bytes(self, problem) -> int | None:
        return self.declared_bytes if problem in self.built else None

    def buffers(self, problem) -> list[Buffer]:
        if problem not in self.built:
            self.built.add(problem)
            self.builds += 1
        return super().buffers(problem)


class FakeDB:
    """An in-memory ``TuningDB``: store, results, lookup, measurements; counts what is asked of it."""

    def __init__(self) -> None:
        self.stored: dict[str, tuple[Any, list[Any]]] = {}
        self.store_calls = 0
        self.lookups = 0
        self.measurement_calls = 0

    def store(self, problem, results) -> None:
        self.store_calls += 1
        self.stored[problem.key] = (problem, list(results))

    def results(self, problem) -> list[Any]:
        return list(self.stored.get(problem.key, (problem, []))[1])

    def lookup(self, problem, policy: Policy | None = None):
        self.lookups += 1
        ranked = rank(self.results(problem), policy or Policy())
        return ranked[0] if ranked else None

    def measurements(self, device: str) -> list[tuple[Any, Any]]:
        self.measurement_calls += 1
        return [(p, r) for p, results in self.stored.values() if p.device == device for r in results if r.ok]


class FirstCallOnly(Fake):
    """Correct on its first run, garbage on every later one (what the timed calls run)."""

    def __init__(self, name: str = "fake:firstonly", after: int = 1, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.after = after

    def compute(self, problem, a, b, out) -> None:
        if self.runs <= self.after:
            super().compute(problem, a, b, out)
        else:
            out.fill_(1.0)


class PoisonSniffer(Fake):
    """Computes only when its output buffer holds NaN (the poison it expects); garbage otherwise."""

    def __init__(self, name: str = "fake:sniffer", **kw: Any) -> None:
        super().__init__(name, **kw)

    def compute(self, problem, a, b, out) -> None:
        if torch.isnan(out).all():
            super().compute(problem, a, b, out)
        else:
            out.zero_()


class UniformSniffer(Fake):
    """Computes only when its output buffer looks poisoned (all NaN, or one value everywhere); otherwise it
    returns at once, as if the buffer held its answer already: fast on every timed call."""

    def __init__(self, name: str = "fake:uniform_sniffer", **kw: Any) -> None:
        super().__init__(name, **kw)

    def compute(self, problem, a, b, out) -> None:
        if torch.isnan(out).all() or bool((out == out.reshape(-1)[0]).all()):
            super().compute(problem, a, b, out)


class OneWrongElement(Fake):
    """Right everywhere but at one element of typical magnitude (the one nearest the RMS), which it zeroes:
    on a large output a norm-wise check alone lets that through in half precision."""

    def __init__(self, name: str = "fake:one_wrong", **kw: Any) -> None:
        super().__init__(name, **kw)

    def compute(self, problem, a, b, out) -> None:
        super().compute(problem, a, b, out)
        flat = out.view(-1)  # out is dense (Algorithm.run checks), so the view is of it
        rms = flat.double().pow(2).mean().sqrt()
        flat[(flat.double().abs() - rms).abs().argmin()] = 0


class Memoising(Fake):
    """Computes its first result and returns it for every later input."""

    def __init__(self, name: str = "fake:memo", **kw: Any) -> None:
        super().__init__(name, **kw)
        self.first = None

    def compute(self, problem, a, b, out) -> None:
        if self.first is None:
            super().compute(problem, a, b, out)
            self.first = out.clone()
        else:
            out.copy_(self.first)


class HandsOver(Fake):
    """Hands over a result of its own from ``execute`` (as torch:native hands over PyTorch's), which ``run``
    copies into its output at ``copy_ms`` more; from run number ``wrong_after`` on, that result is garbage;
    ``memoise``: every run hands over the first run's result."""

    def __init__(self, name: str = "fake:handsover", copy_ms: float = 5.0, wrong_after: int | None = None,
                 memoise: bool = False, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.copy_ms, self.wrong_after, self.memoise, self.first = copy_ms, wrong_after, memoise, None

    def execute(self, problem, a, b, out, ws):
        self.runs += 1
        CLOCK.advance(self.time_ms)
        if self.memoise and self.first is not None:
            return self.first
        result = native_conv(problem, a, b)
        self.first = result
        return result.fill_(1.0) if self.wrong_after is not None and self.runs >= self.wrong_after else result

    def run(self, problem, a, b, workspace=None, out=None):
        result = super().run(problem, a, b, workspace=workspace, out=out)
        CLOCK.advance(self.copy_ms)  # what run's copy of the handed-over result costs
        return result


def slack_bytes(problem, workspace_bytes: int = 0) -> int:
    """What an algorithm may allocate beyond its declared workspace while it runs ``problem`` on the CPU or
    GPU without that being hidden workspace: 64 KiB or 2% of the result, and on the CPU in half precision
    what its matrix products take of their own."""
    slack = max(64 * 1024, int(0.02 * problem.element_bytes * torch.Size(problem.operand_shapes[2]).numel()))
    if problem.device == "cpu" and problem.dtype != "float32":
        # The CPU's half-precision matrix products reorder their operands into float32 blocks of their own:
        # 50-200 KB for small ones (torch.bmm (2, 3, 375) @ (2, 375, 2) takes 100016 bytes in bfloat16), and up
        # to ~5x an im2col column matrix (55808 bytes of columns, 268356 of scratch). bfloat16 everywhere;
        # float16 on some CPUs (213120 bytes for 51968 of columns). Hidden workspace in half precision on the
        # CPU is therefore caught only beyond that; float32's slack is the test's bound.
        slack += 256 * 1024 + 6 * workspace_bytes
    return slack
