"""triton:depthwise_*: every direction, dtype, layout, stride, dilation and multiplier against float64.

Where the kernels run (a GPU, or Triton's interpreter: tests/test_triton_interpreter.py) and the checked
run: tests/triton_cases.py.
"""

from __future__ import annotations

import math

import pytest

from convtune.algorithms.registry import get_algorithm, registered
from convtune.algorithms.triton_depthwise import TritonDepthwise
from convtune.algorithms.triton_family import INDEX_LIMIT, interpreting
from convtune.problem import ConvProblem
from triton_cases import (
    DEPTHWISE_SHAPES,
    DEVICE,
    DIRECTIONS,
    check_configurations,
    check_supporting,
    compile_ahead,
    depthwise_problem,
    every_case,
    kernel_tests,
    kernels,
    needs_triton,
    selected_problems,
)

FAMILY = [a.name for a in registered() if isinstance(a, TritonDepthwise)]


def configurations(p: ConvProblem) -> int:
    """How many of the family's configurations compute ``p``: 7 forwards and data gradients (4 tiles, and 3 with a
    kernel row's taps unrolled or the weights laid out tap by tap or both), 1 more forward over 2-D patches of
    positions (not of a 1-D problem), 4 more data gradients of a strided problem (by stride phase, one with the
    weights tap by tap), 3 weight gradients."""
    if p.direction == "bwd_filter":
        return 3
    if p.direction == "fwd":
        return 8 if p.ndim == 2 else 7
    return 11 if any(s > 1 for s in p.stride) else 7


SHAPES = DEPTHWISE_SHAPES
KERNEL_TESTS = kernel_tests(SHAPES) - len(SHAPES) * len(DIRECTIONS) * 2  # float16 is not run in the interpreter


@pytest.fixture(scope="module", autouse=True)
def _compiled_ahead(request):  # what test_matches_reference runs (triton_cases.compile_ahead)
    compile_ahead(request, ((n, p) for p in selected_problems(request, depthwise_problem) for n in FAMILY))


@kernels
@every_case(SHAPES)
def test_matches_reference(shape, direction, dtype, layout):
    if dtype == "float16" and interpreting():
        # float16 and bfloat16 take the same code (loads widened to float32, one rounding at the store): the
        # interpreter, a third of CI's time, runs bfloat16's; the GPU runs both.
        pytest.skip("float16 runs the same kernels as bfloat16: checked on the GPU")
    p = depthwise_problem(shape, direction, dtype, layout)
    check_configurations(FAMILY, p, configurations(p))


@kernels
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_partial_tiles_and_many_chunks(direction):
    # More positions than any tile holds (2·11·37 = 814) and, for the filter gradient, rows past the row tile of two
    # of its three configurations (37 > 16 and 32) and 22 output rows in runs of 8, the last run partial.
    p = ConvProblem(direction, n=2, c=3, k=3, input_size=(11, 37), kernel_size=3, padding=1, groups=3,
                    dtype="bfloat16", layout="channels_last", device=DEVICE)
    check_supporting(FAMILY, p)


@kernels
@pytest.mark.parametrize("stride, dilation", [((2, 2), (1, 1)), ((3, 2), (2, 3)), ((2, 2), (2, 2))])
def test_strided_data_gradient_over_many_tiles_and_phases(stride, dilation):
    # 2·23·19 input positions in up to 6 phases, more than one tile of each (but p256's); a dilation sharing no factor
    # with the stride (every phase reached, by every stride-th tap) and one sharing it (half the phases receive
    # nothing).
    p = ConvProblem("bwd_data", n=2, c=3, k=3, input_size=(23, 19), kernel_size=5, stride=stride, dilation=dilation,
                    padding=(4, 4), groups=3, dtype="bfloat16", layout="channels_last", device=DEVICE)
    assert sum(bool(get_algorithm(n).supports(p)) for n in FAMILY if "ph" in n.rsplit("_", 1)[1]) == 4
    check_supporting(FAMILY, p)


@needs_triton
def test_the_hosts_launch_arithmetic_matches_tritons():
    # shared.cdiv and next_power_of_2 stand in for triton.cdiv and triton.next_power_of_2 in host code (Triton's
    # are compile-time functions, slow to call from Python): the same values, 0 and 1 included
    import triton

    from convtune.kernels.shared import cdiv, next_power_of_2

    assert [next_power_of_2(n) for n in range(2049)] == [triton.next_power_of_2(n) for n in range(2049)]
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(300) for b in (1, 2, 3, 7, 16, 128, 256))


@needs_triton
def test_a_configuration_still_pickles_once_it_has_made_its_tile_and_imported_its_kernels():
    # the tile is kept on the algorithm, the kernels' module is not: an algorithm goes to a worker process by pickle
    import pickle

    from convtune.isolation import sendable

    p = ConvProblem("fwd", n=2, c=8, k=8, input_size=(8, 8), kernel_size=3, padding=1, groups=8, device=DEVICE)
    for name in FAMILY:
        algorithm = get_algorithm(name)
        algorithm.supports(p)
        assert algorithm.tile is algorithm.tile and algorithm.module().__name__ == "convtune.kernels.depthwise"
        assert sendable(algorithm), name
        assert pickle.loads(pickle.dumps(algorithm)).tile == algorithm.tile


@kernels
@pytest.mark.parametrize("parts, size", [(1, 5), (16, 128), (37, 300), (0, 7)])
def test_the_weight_gradients_partial_sums_add_up_the_same_every_time(parts, size):
    # shared.sum_partials, which every family's weight gradient ends with: 16 rows a turn (37: two whole turns and a
    # partial one), elements beyond whole blocks of 128 (300), no rows at all (zeros), rounded once into float16.
    import torch

    from convtune.kernels.shared import sum_partials

    partials = torch.randn(parts, size, generator=torch.Generator().manual_seed(parts), dtype=torch.float32).to(DEVICE)
    outs = [torch.full((size,), float("nan"), dtype=dtype, device=DEVICE) for dtype in (torch.float32, torch.float32,
                                                                                        torch.float16)]
    for out in outs:
        sum_partials(partials, out)
    expected = partials.double().sum(0)
    assert torch.equal(outs[0], outs[1])  # deterministic: the same order every run
    assert torch.allclose(outs[0].double(), expected, rtol=1e-6, atol=1e-5)
    assert torch.allclose(outs[2].double(), expected, rtol=1e-3, atol=1e-3)  # one rounding into float16


@needs_triton
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
    wgrad = get_algorithm("triton:depthwise_bwd_filter_p64c64w4s8")
    q = p.with_direction("bwd_filter")
    parts = math.ceil(2 * 9 / 8)  # runs of 8 output rows
    assert wgrad.buffer_bytes(q) >= parts * 16 * 25 * 4


@needs_triton
def test_the_weight_gradient_refuses_kernel_rows_longer_than_its_tile():
    # p64c64 holds 64 positions × taps per turn: a row of 63 taps (padded to 64) fits, one of 65 does not.
    name = "triton:depthwise_bwd_filter_p64c64w4s8"
    p = ConvProblem("bwd_filter", n=1, c=4, k=4, input_size=(80,), kernel_size=63, padding=31, groups=4, device="cuda")
    assert get_algorithm(name).supports(p)
    support = get_algorithm(name).supports(p.replace(kernel_size=65, padding=32))
    assert not support and "up to 64 taps" in support.reason and "got 65" in support.reason
    assert get_algorithm("triton:depthwise_bwd_filter_p128c32w4s8").supports(p.replace(kernel_size=65, padding=32))


@needs_triton
def test_the_phases_form_is_for_strided_problems_only():
    p = ConvProblem("bwd_data", n=1, c=4, k=4, input_size=(9, 9), kernel_size=3, padding=1, groups=4, device="cuda")
    support = get_algorithm("triton:depthwise_bwd_data_p64c32w4ph").supports(p)
    assert not support and "strided problems" in support.reason
    assert get_algorithm("triton:depthwise_bwd_data_p64c32w4ph").supports(p.replace(stride=(1, 2)))


@needs_triton
def test_patches_of_positions_are_for_2d_problems_only():
    p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(40,), kernel_size=7, padding=3, groups=4, device="cuda")
    support = get_algorithm("triton:depthwise_fwd_p16c128w4q4").supports(p)
    assert not support and "2-D problems" in support.reason
    two_d = p.replace(input_size=(9, 40), kernel_size=(3, 7), padding=(1, 3), stride=1, dilation=1)
    assert get_algorithm("triton:depthwise_fwd_p16c128w4q4").supports(two_d)


@needs_triton
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
