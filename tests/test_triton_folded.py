"""triton:folded_*: the forward and the weight gradient in every dtype, layout, stride and dilation against float64,
for dense layers of 1 to 8 input channels (folded reductions shorter than a tile, a tile exactly, several tiles).

Where the kernels run (a GPU, or Triton's interpreter: tests/test_triton_interpreter.py) and the checked
run: tests/triton_cases.py.
"""

from __future__ import annotations

import itertools

import pytest

from convtune.algorithms.registry import get_algorithm, registered
from convtune.algorithms.triton_family import interpreting
from convtune.algorithms.triton_folded import (
    BACKWARD_FILTER_TILES,
    FORWARD_TILES,
    MAX_CHANNELS,
    MAX_FOLDED,
    TritonFolded,
)
from convtune.kernels.folded import fold_block
from convtune.problem import ConvProblem
from triton_cases import (
    DEVICE,
    DTYPES,
    LAYOUTS,
    check_configurations,
    compile_ahead,
    kernels,
    needs_triton,
    selected_problems,
)

FAMILY = [a.name for a in registered() if isinstance(a, TritonFolded)]
TILES = {"fwd": FORWARD_TILES, "bwd_filter": BACKWARD_FILTER_TILES}
SHAPES = {  # folded = taps × channels, the reduction's length
    "stem_7x7_stride2": dict(n=2, c=3, k=20, input_size=(11, 9), kernel_size=7, stride=2, padding=3),  # 147: 5 x 32
    "1_channel_3x3": dict(n=2, c=1, k=8, input_size=(6, 5), kernel_size=3, padding=1),  # 9: one tile, mostly padding
    "patch_4x4_stride4": dict(n=2, c=3, k=16, input_size=(8, 8), kernel_size=4, stride=4),  # 48: 3 x 16 exactly
    "4_channels_dilated_uneven": dict(n=1, c=4, k=12, input_size=(9, 8), kernel_size=(3, 5), dilation=(2, 1),
                                      padding=(2, 2)),
    "8_channels_stride3_into_padding": dict(n=2, c=8, k=40, input_size=(7, 7), kernel_size=4, stride=3, padding=3),
    "1d_2_channels_stride2": dict(n=2, c=2, k=6, input_size=(13,), kernel_size=5, stride=2, padding=2),
    # output rows of 64 columns and more: the weight gradient steps its positions turn by turn, carrying rows (here 3
    # of 130 columns) into images; 1-D: each row an image
    "rows_of_130": dict(n=2, c=3, k=8, input_size=(3, 130), kernel_size=3, padding=1),
    "1d_rows_of_296": dict(n=3, c=1, k=4, input_size=(300,), kernel_size=5),
}
CASES = list(itertools.product(SHAPES, TILES, DTYPES, LAYOUTS))
# test_matches_reference's (bfloat16 is not run in the interpreter), test_many_tiles_and_runs_of_positions' and the
# two that run no kernel: every test of the file passes in the interpreter but those skipped for bfloat16
KERNEL_TESTS = len(SHAPES) * len(TILES) * (len(DTYPES) - 1) * len(LAYOUTS) + len(TILES) + 2


def reference_problem(shape: str, direction: str, dtype: str, layout: str) -> ConvProblem:
    """The problem test_matches_reference checks for one of ``CASES``."""
    return ConvProblem(direction, dtype=dtype, layout=layout, device=DEVICE, allow_tf32=False, **SHAPES[shape])


@pytest.fixture(scope="module", autouse=True)
def _compiled_ahead(request):  # what test_matches_reference runs (triton_cases.compile_ahead)
    compile_ahead(request, ((n, p) for p in selected_problems(request, reference_problem) for n in FAMILY))


@kernels
@pytest.mark.parametrize("shape,direction,dtype,layout", CASES)
def test_matches_reference(shape, direction, dtype, layout):
    if dtype == "bfloat16" and interpreting():
        # as in tests/test_triton_grouped.py: Triton 3.6's interpreter multiplies bfloat16 matrices wrongly
        pytest.skip("Triton's interpreter computes bfloat16 tl.dot wrongly: the GPU runs it")
    check_configurations(FAMILY, reference_problem(shape, direction, dtype, layout), len(TILES[direction]))


@kernels
@pytest.mark.parametrize("direction", TILES)
def test_many_tiles_and_runs_of_positions(direction):
    # 70 output channels: tiles of 64 and 32 leave a partial last one; 2·50·45 = 4500 output positions make tiles of
    # positions and, for the weight gradient, two runs of 4096 (the last partial).
    p = ConvProblem(direction, n=2, c=3, k=70, input_size=(50, 45), kernel_size=3, padding=1,
                    dtype="float16", layout="channels_last", device=DEVICE)
    check_configurations(FAMILY, p, len(TILES[direction]))


def test_the_reduction_tile_pads_least():
    assert [fold_block(f) for f in (9, 27, 48, 147, 392)] == [16, 32, 16, 32, 16]


@needs_triton
def test_the_family_declares_what_it_supports():
    p = ConvProblem("fwd", n=2, c=3, k=64, input_size=(32, 32), kernel_size=7, stride=2, padding=3, device="cuda",
                    dtype="float32")
    algorithm = get_algorithm("triton:folded_fwd_p128c64w4")
    assert algorithm.supports(p) and algorithm.buffers(p) == []
    assert algorithm.notes(p).tf32 and not algorithm.notes(p.replace(allow_tf32=False)).tf32
    assert algorithm.notes(p.replace(dtype="bfloat16")).float32_inside
    for other in (p.replace(c=MAX_CHANNELS + 1),  # wide enough for cuDNN's implicit GEMMs
                  p.replace(c=8, groups=2),  # grouped
                  p.replace(c=5, kernel_size=15, padding=7),  # 1125 taps × channels: past MAX_FOLDED
                  p.replace(input_size=(9, 9, 9), kernel_size=3, padding=1, stride=1, dilation=1)):  # 3-D
        assert not algorithm.supports(other), other.key
    assert {a.directions[0] for a in map(get_algorithm, FAMILY)} == {"fwd", "bwd_filter"}  # no data gradient
    wgrad = get_algorithm("triton:folded_bwd_filter_p64c64w4s4096")
    q = p.with_direction("bwd_filter")
    assert wgrad.buffer_bytes(q) >= 1 * 64 * 3 * 49 * 4  # one run of positions: the whole gradient in float32
    assert algorithm.supports(p.replace(c=3, kernel_size=16, stride=16, padding=0)) and 3 * 16 * 16 <= MAX_FOLDED
    assert wgrad.supports(q.replace(c=1)) and not wgrad.supports(q.replace(k=8, groups=1, c=12))
