"""triton:grouped_*: every direction, dtype, layout, stride and dilation against float64, for groups of 2
to 64 channels (as the tensor cores see them: narrower than their lanes, as wide, wider).

Where the kernels run (a GPU, or Triton's interpreter: tests/test_triton_interpreter.py) and the checked
run: tests/triton_cases.py.
"""

from __future__ import annotations

import pytest

from convtune.algorithms.registry import get_algorithm, registered
from convtune.algorithms.triton_family import interpreting
from convtune.algorithms.triton_grouped import MAX_GROUP_CHANNELS, TritonGrouped
from convtune.problem import ConvProblem
from triton_cases import (
    DEVICE,
    DIRECTIONS,
    check_configurations,
    check_supporting,
    compile_ahead,
    every_case,
    kernel_tests,
    kernels,
    needs_triton,
    selected_problems,
)

FAMILY = [a.name for a in registered() if isinstance(a, TritonGrouped)]
SHAPES = {  # per group: (input channels, output channels)
    "2_to_2_3x3": dict(n=2, c=8, k=8, groups=4, input_size=(6, 5), kernel_size=3, padding=1),
    "4_to_6_stride2": dict(n=2, c=8, k=12, groups=2, input_size=(7, 7), kernel_size=3, stride=2, padding=1),
    "16_to_8_dilated": dict(n=1, c=32, k=16, groups=2, input_size=(7, 6), kernel_size=(3, 2), dilation=(2, 1),
                            padding=(2, 1)),
    "24_to_40_1x1": dict(n=2, c=48, k=80, groups=2, input_size=(4, 5), kernel_size=1),
    "1d_4_to_4_stride3": dict(n=2, c=8, k=8, groups=2, input_size=(13,), kernel_size=5, stride=3, padding=2),
    # several tiles of packed groups: 6 groups of 3 -> 6 (2 groups a tile of 16 outputs; 5 a tile of 16 inputs),
    # and 9 groups of 2 -> 1 in 1-D (16 a tile of outputs, 8 of inputs: a partial last tile)
    "3_to_6_six_groups": dict(n=1, c=18, k=36, groups=6, input_size=(5, 4), kernel_size=3, stride=2, padding=1),
    "1d_2_to_1_nine_groups": dict(n=2, c=18, k=9, groups=9, input_size=(7,), kernel_size=3, padding=1),
}
KERNEL_TESTS = kernel_tests(SHAPES) - len(SHAPES) * len(DIRECTIONS) * 2  # bfloat16 is not run in the interpreter


def reference_problem(shape: str, direction: str, dtype: str, layout: str) -> ConvProblem:
    """The problem test_matches_reference checks for one case of ``every_case(SHAPES)``."""
    return ConvProblem(direction, dtype=dtype, layout=layout, device=DEVICE, allow_tf32=False, **SHAPES[shape])


@pytest.fixture(scope="module", autouse=True)
def _compiled_ahead(request):  # what test_matches_reference runs (triton_cases.compile_ahead)
    compile_ahead(request, ((n, p) for p in selected_problems(request, reference_problem) for n in FAMILY))


@kernels
@every_case(SHAPES)
def test_matches_reference(shape, direction, dtype, layout):
    if dtype == "bfloat16" and interpreting():
        # Triton 3.6's interpreter multiplies bfloat16 matrices wrongly (tl.dot of two random 16x16 bfloat16
        # matrices is off by 1e10 there, right in float16): checked on the GPU only.
        pytest.skip("Triton's interpreter computes bfloat16 tl.dot wrongly")
    check_configurations(FAMILY, reference_problem(shape, direction, dtype, layout), 2)


@kernels
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_many_tiles_and_runs_of_positions(direction):
    # 3 groups of 20 -> 36 channels: channel tiles of 16 and 32 split the group; 2·33·37 = 2442 output
    # positions make several tiles of positions and, for the filter gradient, runs of 1024 (the last partial).
    p = ConvProblem(direction, n=2, c=60, k=108, groups=3, input_size=(33, 37), kernel_size=1,
                    dtype="float16", layout="channels_last", device=DEVICE)
    check_supporting(FAMILY, p)


@needs_triton
def test_the_family_declares_what_it_supports():
    p = ConvProblem("fwd", n=2, c=64, k=64, input_size=(9, 9), kernel_size=3, padding=1, groups=16, device="cuda",
                    dtype="float32")
    algorithm = get_algorithm("triton:grouped_fwd_p64c32w4")
    assert algorithm.supports(p) and algorithm.buffers(p) == []
    assert algorithm.notes(p).tf32 and not algorithm.notes(p.replace(allow_tf32=False)).tf32
    assert algorithm.notes(p.replace(dtype="float16")).float32_inside
    for other in (p.replace(groups=1), p.replace(groups=64),  # dense; depthwise
                  p.replace(c=2 * (MAX_GROUP_CHANNELS + 1), k=2, groups=2),  # over 64 channels a group
                  p.replace(input_size=(5, 5, 5), kernel_size=3, padding=1, stride=1, dilation=1)):
        assert not algorithm.supports(other), other.key
    wgrad = get_algorithm("triton:grouped_bwd_filter_p32c64w4s1024")
    q = p.with_direction("bwd_filter")
    assert wgrad.buffer_bytes(q) >= 1 * 64 * 4 * 9 * 4  # one run of positions: the whole gradient in float32
