"""What the Triton families' tests share: where the kernels can run here, and a checked run.

The kernels run on CUDA where there is a GPU and in Triton's CPU interpreter otherwise; without
either, tests/test_triton_interpreter.py runs the families' test files again in a process with
``TRITON_INTERPRET=1`` (the switch must be on before Triton is imported).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import zlib
from collections.abc import Iterable

import pytest
import torch

from convtune import problem as problems
from convtune import verify
from convtune.algorithms.base import allocate_workspace, buffers_bytes, carve
from convtune.algorithms.registry import get_algorithm
from convtune.algorithms.triton_family import interpreting
from convtune.problem import DIRECTIONS, ConvProblem

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS_KERNELS = HAS_TRITON and (DEVICE == "cuda" or interpreting())
kernels = pytest.mark.skipif(not RUNS_KERNELS, reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1)")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
DTYPES = tuple(problems.DTYPES)  # float32, float16, bfloat16
LAYOUTS = tuple(reversed(problems.LAYOUTS))  # channels_last first: the layout the kernels are written for


# Depthwise problems (groups = c) both depthwise families check in every direction, dtype and layout: strides,
# dilations, multipliers, taps reaching into the padding, 1-D rows of 31 taps.
DEPTHWISE_SHAPES = {
    "3x3_pad1": dict(n=2, c=5, k=5, input_size=(7, 6), kernel_size=3, padding=1),
    "multiplier2_stride2": dict(n=2, c=3, k=6, input_size=(9, 8), kernel_size=3, stride=2, padding=1),
    "7x7_dilated_uneven": dict(n=1, c=4, k=4, input_size=(11, 10), kernel_size=(7, 5), dilation=(2, 1),
                               padding=(5, 2)),
    "stride3_taps_in_padding": dict(n=3, c=2, k=2, input_size=(5, 5), kernel_size=4, stride=3, padding=3),
    "1d_31_multiplier3": dict(n=1, c=2, k=6, input_size=(18,), kernel_size=31, padding=15),
    "1d_stride2_dilated": dict(n=3, c=4, k=4, input_size=(12,), kernel_size=3, stride=2, dilation=3, padding=2),
}


def depthwise_problem(shape: str, direction: str, dtype: str, layout: str) -> ConvProblem:
    """``DEPTHWISE_SHAPES[shape]`` as a depthwise problem of ``direction``, ``dtype`` and ``layout`` here."""
    spec = DEPTHWISE_SHAPES[shape]
    return ConvProblem(direction, dtype=dtype, layout=layout, device=DEVICE, groups=spec["c"], **spec)


def every_case(shapes: dict) -> pytest.MarkDecorator:
    """Every (shape, direction, dtype, layout) of ``shapes`` as the test's parameters."""
    return pytest.mark.parametrize("shape,direction,dtype,layout",
                                   list(itertools.product(shapes, DIRECTIONS, DTYPES, LAYOUTS)))


def kernel_tests(shapes: dict) -> int:
    """How many tests of a family's file need the kernels: ``every_case`` and one per direction more."""
    return len(shapes) * len(DIRECTIONS) * len(DTYPES) * len(LAYOUTS) + len(DIRECTIONS)


def check_supporting(family: list[str], p: ConvProblem) -> None:
    """Every algorithm of ``family`` that supports ``p`` checked against float64."""
    for name in family:
        if get_algorithm(name).supports(p):
            run_checked(name, p)


def check_configurations(family: list[str], p: ConvProblem, configurations: int) -> None:
    """Every tile configuration of ``family`` that supports ``p`` (all ``configurations`` of its direction,
    and only those) checked against float64."""
    names = [n for n in family if get_algorithm(n).supports(p)]
    assert len(names) == configurations, names
    for name in names:
        run_checked(name, p)


def selected_params(request: pytest.FixtureRequest, test: str) -> list[dict]:
    """The parameters of each case of the requesting module's ``test`` that pytest will run: a run of some tests by
    id (or by ``-k``) compiles ahead only theirs."""
    return [item.callspec.params for item in request.session.items
            if getattr(item, "module", None) is request.module and getattr(item, "originalname", None) == test]


def selected_problems(request: pytest.FixtureRequest, make) -> list[ConvProblem]:
    """``make(shape, direction, dtype, layout)`` for each case of ``every_case`` of the requesting module's
    ``test_matches_reference`` that pytest will run."""
    return [make(c["shape"], c["direction"], c["dtype"], c["layout"])
            for c in selected_params(request, "test_matches_reference")]


def compile_ahead(request: pytest.FixtureRequest, pairs: Iterable[tuple[str, ConvProblem]]) -> None:
    """On a GPU: the kernels of every (configuration, problem) of ``pairs`` compiled at once on threads, through
    ``Algorithm.prepare`` under Triton's ``AsyncCompileMode``, before the tests run them one by one (compiled one
    after another, they took most of a GPU run of these files). It checks nothing, the tests do; a fault here is a
    warning and costs only the head start. Nothing in the interpreter, nor for a problem off CUDA. How many pairs
    and how long goes to pytest's terminal at once (a run cut by a time limit shows where its time went)."""
    if interpreting() or not HAS_TRITON:
        return
    import concurrent.futures
    import os
    import time
    import warnings

    import triton

    start = time.perf_counter()
    pairs = [(name, p) for name, p in pairs if p.device == "cuda"]
    with concurrent.futures.ThreadPoolExecutor(min(32, os.cpu_count() or 1)) as pool, \
            triton.AsyncCompileMode(pool, ignore_errors=True):
        for name, p in pairs:
            try:
                get_algorithm(name).prepare(p)
            except Exception as exc:  # noqa: BLE001 - the test's own run compiles it, and fails there if it must
                warnings.warn(f"{name} on {p.key}: not compiled ahead ({type(exc).__name__}: {exc})", stacklevel=2)
    if pairs:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"{request.module.__name__}: {len(pairs)} (configuration, problem) pairs compiled "
                                f"ahead in {time.perf_counter() - start:.1f} s")


GUARD = 1 << 16  # elements before and after each tensor of a checked run: more than a tile's reach past an end
OUTPUT_GUARD = 7.0  # a finite value no input holds: NaN read past an input and written past the output shows
WORKSPACE_GUARD = 0xA5  # the byte the workspace and the padding after each of its buffers hold before a run


def _guarded(t: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(a view with ``t``'s values and strides, the whole buffer): ``GUARD`` elements of ``fill`` on either side."""
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    storage = torch.full((span + 2 * GUARD,), fill, dtype=t.dtype, device=t.device)
    return storage.as_strided(t.shape, t.stride(), GUARD).copy_(t), storage


def guarded(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values and strides in the middle of a larger buffer of NaN: a kernel that reads past an operand's
    ends where its mask says the element exists gets NaN, which no product with zero hides (the result fails)."""
    return _guarded(t, math.nan)[0]


def _untouched(storage: torch.Tensor, fill: float) -> bool:
    """Whether the guards on either side of a ``_guarded`` buffer still hold ``fill`` (a finite value)."""
    return bool((torch.cat([storage[:GUARD], storage[-GUARD:]]) == fill).all())


def _padding(algorithm, p: ConvProblem, workspace: torch.Tensor) -> list[tuple[int, int]]:
    """The byte ranges of ``workspace`` between each declared buffer's end and the next one's start, as ``carve``
    lays them out (its alignment): a write past a buffer's own end lands there first."""
    buffers = [buffer for buffer in algorithm.buffers(p) if buffer.nbytes]
    views = carve(workspace, buffers)
    starts = [views[b.name].data_ptr() - workspace.data_ptr() for b in buffers] + [buffers_bytes(buffers)]
    return [(start + b.nbytes, following) for b, start, following in zip(buffers, starts, starts[1:])]


def run_checked(name: str, p: ConvProblem) -> None:
    """One run of ``name`` on fresh random operands (``guarded``), its output poisoned with NaN, against float64; the
    output and the workspace lie between guards too, and a write past their ends (or past a workspace buffer's own
    end, into its alignment padding) fails the check."""
    algorithm = get_algorithm(name)
    a, b = (guarded(t) for t in p.random_inputs(seed=zlib.crc32(p.key.encode()) % 1000))
    ref = verify.reference(p, a, b)
    out, out_storage = _guarded(p.empty(p.operand_shapes[2]), OUTPUT_GUARD)
    workspace, workspace_storage = _guarded(allocate_workspace(algorithm.buffer_bytes(p), p.device), WORKSPACE_GUARD)
    workspace.fill_(WORKSPACE_GUARD)
    err, ok, message = verify.check(algorithm, p, (a, b), ref, out, workspace)
    assert ok, f"{name} on {p.key}: {message}"
    assert _untouched(out_storage, OUTPUT_GUARD), f"{name} on {p.key} wrote past its output's ends"
    assert _untouched(workspace_storage, WORKSPACE_GUARD), f"{name} on {p.key} wrote past its workspace's ends"
    for start, stop in _padding(algorithm, p, workspace):
        assert bool((workspace[start:stop] == WORKSPACE_GUARD).all()), (
            f"{name} on {p.key} wrote past a workspace buffer's end (bytes {start}-{stop} of its padding)")
