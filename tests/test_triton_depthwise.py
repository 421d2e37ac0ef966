"""triton:depthwise_*: every direction, dtype, layout, stride, dilation and multiplier against float64.

The kernels run on CUDA where there is a GPU and in Triton's CPU interpreter otherwise: without
either, ``test_in_the_interpreter`` runs this file again in a process with ``TRITON_INTERPRET=1``
(the switch must be on before Triton is imported). Every run writes into an output poisoned with
NaN and is compared with the float64 reference within ``verify.tolerance`` for its numeric notes.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from convtune import verify
from convtune.algorithms.base import allocate_workspace
from convtune.algorithms.registry import get_algorithm, registered
from convtune.algorithms.triton_depthwise import INDEX_LIMIT, TritonDepthwise, _interpreting
from convtune.problem import ConvProblem

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS_KERNELS = HAS_TRITON and (DEVICE == "cuda" or _interpreting())
kernels = pytest.mark.skipif(not RUNS_KERNELS, reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1)")

FAMILY = [a.name for a in registered() if isinstance(a, TritonDepthwise)]
DIRECTIONS = ("fwd", "bwd_data", "bwd_filter")
SHAPES = {
    "3x3_pad1": dict(n=2, c=5, k=5, input_size=(7, 6), kernel_size=3, padding=1),
    "multiplier2_stride2": dict(n=2, c=3, k=6, input_size=(9, 8), kernel_size=3, stride=2, padding=1),
    "7x7_dilated_uneven": dict(n=1, c=4, k=4, input_size=(11, 10), kernel_size=(7, 5), dilation=(2, 1),
                               padding=(5, 2)),
    "stride3_taps_in_padding": dict(n=3, c=2, k=2, input_size=(5, 5), kernel_size=4, stride=3, padding=3),
    "1d_31_multiplier3": dict(n=1, c=2, k=6, input_size=(18,), kernel_size=31, padding=15),
    "1d_stride2_dilated": dict(n=3, c=4, k=4, input_size=(12,), kernel_size=3, stride=2, dilation=3, padding=2),
}


def problem(shape: str, direction: str, dtype: str, layout: str) -> ConvProblem:
    spec = SHAPES[shape]
    return ConvProblem(direction, dtype=dtype, layout=layout, device=DEVICE, groups=spec["c"], **spec)


def run_checked(name: str, p: ConvProblem) -> None:
    algorithm = get_algorithm(name)
    a, b = p.random_inputs(seed=zlib.crc32(p.key.encode()) % 1000)
    ref = verify.reference(p, a, b)
    out = p.empty(p.operand_shapes[2])
    err, ok, message = verify.check(algorithm, p, (a, b), ref, out, allocate_workspace(algorithm.buffer_bytes(p),
                                                                                       p.device))
    assert ok, f"{name} on {p.key}: {message}"


@kernels
@pytest.mark.parametrize("layout", ("channels_last", "channels_first"))
@pytest.mark.parametrize("dtype", ("float32", "float16", "bfloat16"))
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_reference(shape, direction, dtype, layout):
    p = problem(shape, direction, dtype, layout)
    names = [n for n in FAMILY if get_algorithm(n).supports(p)]
    assert len(names) == 4, names  # every tile configuration of the direction, and only those
    for name in names:
        run_checked(name, p)


@kernels
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_partial_tiles_and_many_chunks(direction):
    # More positions than any tile holds (2·11·37 = 814) and, for the filter gradient, rows past its tile
    # (37 > 32) and 22 output rows in runs of 8 to 32, the last run partial.
    p = ConvProblem(direction, n=2, c=3, k=3, input_size=(11, 37), kernel_size=3, padding=1, groups=3,
                    dtype="bfloat16", layout="channels_last", device=DEVICE)
    for name in FAMILY:
        if get_algorithm(name).supports(p):
            run_checked(name, p)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_the_family_declares_what_it_supports():
    p = ConvProblem("fwd", n=2, c=8, k=16, input_size=(9, 9), kernel_size=5, padding=2, groups=8, device="cuda")
    name = "triton:depthwise_fwd_p32c64w4"
    algorithm = get_algorithm(name)
    assert algorithm.directions == ("fwd",) and algorithm.is_deterministic(p)
    assert algorithm.notes(p.replace(dtype="float16")).float32_inside
    assert algorithm.buffers(p) == []
    reasons = {
        "groups": p.replace(groups=4),
        "1-D and 2-D": p.replace(input_size=(5, 5, 5), kernel_size=3, padding=1, stride=1, dilation=1),
        "computes fwd": p.replace(direction="bwd_data"),
    }
    for words, other in reasons.items():
        support = algorithm.supports(other)
        assert not support and words in support.reason, (other.key, support.reason)
    # The filter gradient declares one float32 partial sum per run of output rows, channel and tap.
    wgrad = get_algorithm("triton:depthwise_bwd_filter_p16c64w4s16")
    q = p.with_direction("bwd_filter")
    parts = math.ceil(2 * 9 / 16)  # runs of 16 output rows
    assert wgrad.buffer_bytes(q) >= parts * 16 * 25 * 4


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_operands_beyond_32_bit_offsets_are_refused():
    # 2**31 elements or more: the kernels' 32-bit offsets would wrap, so the family declines it.
    p = ConvProblem("fwd", n=64, c=2048, k=2048, input_size=(128, 128), kernel_size=3, padding=1, groups=2048,
                    dtype="float16", device="cuda")
    assert math.prod(p.x_shape) >= INDEX_LIMIT
    support = get_algorithm("triton:depthwise_fwd_p32c64w4").supports(p)
    assert not support and "64-bit" in support.reason
    assert get_algorithm("triton:depthwise_fwd_p32c64w4").supports(p.replace(n=1))


def test_the_family_can_be_turned_off():
    from convtune.settings import settings

    p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(6, 6), kernel_size=3, groups=4, device="cuda")
    with settings.override(triton=False):
        support = get_algorithm("triton:depthwise_fwd_p32c64w4").supports(p)
    assert not support and "CONVTUNE_TRITON=0" in support.reason


def test_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(6, 6), kernel_size=3, groups=4)
    support = get_algorithm("triton:depthwise_fwd_p32c64w4").supports(p)
    assert not support and "TRITON_INTERPRET=1" in support.reason


@pytest.mark.skipif(RUNS_KERNELS or not HAS_TRITON, reason="the kernels run in this process")
def test_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__],
                            env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    kernel_tests = len(SHAPES) * len(DIRECTIONS) * 3 * 2 + len(DIRECTIONS)
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= kernel_tests, summary  # the kernel tests ran there, none skipped
