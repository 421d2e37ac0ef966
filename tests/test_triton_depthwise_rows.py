"""triton:depthwise_rows_bwd_filter_*: every dtype, layout, stride, dilation and multiplier against float64.

Where the kernels run (a GPU, or Triton's interpreter: tests/test_triton_interpreter.py) and the checked
run: tests/triton_cases.py.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest

from convtune.algorithms.registry import get_algorithm, registered
from convtune.algorithms.triton_depthwise_rows import TILES, TritonDepthwiseRows
from convtune.algorithms.triton_family import interpreting
from convtune.problem import ConvProblem
from triton_cases import (
    DEPTHWISE_SHAPES,
    DEVICE,
    DTYPES,
    LAYOUTS,
    check_configurations,
    compile_ahead,
    depthwise_problem,
    kernels,
    needs_triton,
    run_checked,
    selected_params,
)

FAMILY = [a.name for a in registered() if isinstance(a, TritonDepthwiseRows)]
SHAPES = DEPTHWISE_SHAPES
CASES = list(itertools.product(SHAPES, DTYPES, LAYOUTS))
# test_matches_reference's (bfloat16 is not run in the interpreter), test_partial_tiles_and_many_runs' and
# test_strided_and_dilated_rows'
KERNEL_TESTS = len(SHAPES) * (len(DTYPES) - 1) * len(LAYOUTS) + len(LAYOUTS) + 6


def checked(p: ConvProblem) -> list[str]:
    """Which of the configurations that compute ``p`` a case runs: one, a different one from case to case, in the
    interpreter (a CPU, one thread: the tile sizes are compile-time constants of one code); on a GPU, all of them."""
    names = [n for n in FAMILY if get_algorithm(n).supports(p)]
    return names[zlib.crc32(p.key.encode()) % len(names):][:1] if interpreting() and names else names


@kernels
@pytest.mark.parametrize("shape,dtype,layout", CASES)
def test_matches_reference(shape, dtype, layout):
    # The shared depthwise shapes: strides of 2 and 3 (dy rows met by some input rows only), dilations, a multiplier
    # of 2 and of 3, taps reaching into the padding, a 1-D row of 31 taps (padded to 32) and a 1-D strided one.
    if dtype == "bfloat16" and interpreting():
        # as in tests/test_triton_grouped.py: Triton 3.6's interpreter multiplies bfloat16 matrices wrongly
        pytest.skip("Triton's interpreter computes bfloat16 tl.dot wrongly: the GPU runs it")
    p = depthwise_problem(shape, "bwd_filter", dtype, layout)
    assert all(get_algorithm(n).supports(p) for n in FAMILY), p.key
    for name in checked(p):
        run_checked(name, p)


@pytest.fixture(scope="module", autouse=True)
def _compiled_ahead(request):  # what test_matches_reference runs (triton_cases.compile_ahead)
    compile_ahead(request, ((n, p) for c in selected_params(request, "test_matches_reference")
                            for p in [depthwise_problem(c["shape"], "bwd_filter", c["dtype"], c["layout"])]
                            for n in checked(p)))


@kernels
@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_tiles_and_many_runs(layout):
    # 37 output columns (a partial block of 16 after whole ones), 21 channels (a partial tile of 16 and of 8), 18
    # input rows in runs of 8 (the last partial) and one partial run of 32, two images: every configuration.
    p = ConvProblem("bwd_filter", n=2, c=21, k=21, input_size=(18, 37), kernel_size=5, padding=2, groups=21,
                    dtype="float16", layout=layout, device=DEVICE)
    check_configurations(FAMILY, p, len(TILES))


@kernels
@pytest.mark.parametrize("stride, dilation, kernel, padding, size", [
    ((3, 2), (2, 1), (5, 7), (4, 3), (10, 23)),  # three row phases: an input row meets kernel rows 3 apart
    ((2, 4), (1, 3), (3, 3), (1, 5), (9, 30)),  # dilated columns four apart
    ((4, 2), (1, 1), (2, 5), (0, 2), (3, 11)),  # fewer rows than the row stride
    ((1, 1), (1, 1), (16, 3), (7, 1), (20, 9)),  # 16 kernel rows: no padding of the rows
    ((1, 1), (1, 1), (17, 3), (8, 1), (20, 9)),  # 17 kernel rows, padded to 32
    ((1, 1), (1, 1), (31, 31), (15, 15), (33, 34)),  # 31x31, padded to 32x32: tiles of 8 channels only
])
def test_strided_and_dilated_rows(stride, dilation, kernel, padding, size):
    # The dy rows an input row meets (p·stride_h = h + pad_h - r·dil_h, where it divides), and the windows' columns
    # stride and dilation apart; channels_last with a multiplier of 3; float32 (TF32 allowed or not).
    for allow_tf32 in (False, True):
        p = ConvProblem("bwd_filter", n=2, c=5, k=15, input_size=size, kernel_size=kernel, stride=stride,
                        dilation=dilation, padding=padding, groups=5, dtype="float32", layout="channels_last",
                        device=DEVICE, allow_tf32=allow_tf32)
        names = checked(p)
        assert names, p.key
        for name in names:
            run_checked(name, p)


@needs_triton
def test_the_family_declares_what_it_supports():
    p = ConvProblem("bwd_filter", n=2, c=8, k=16, input_size=(9, 9), kernel_size=5, padding=2, groups=8,
                    device="cuda")
    algorithm = get_algorithm("triton:depthwise_rows_bwd_filter_r8q16c16w4")
    assert algorithm.directions == ("bwd_filter",) and algorithm.is_deterministic(p)
    half = algorithm.notes(p.replace(dtype="float16"))
    assert half.tensor_cores and half.float32_inside and not half.tf32
    assert algorithm.notes(p.replace(allow_tf32=True)).tf32 and not algorithm.notes(p.replace(allow_tf32=False)).tf32
    # one float32 partial sum per (run of 8 input rows of an image, channel, tap): 20 images of 9 rows, 2 runs each
    assert algorithm.buffers(p.replace(n=20))[0].shape == (20 * math.ceil(9 / 8), 16, 25)
    assert algorithm.supports(p.replace(kernel_size=(32, 16), padding=(15, 7), input_size=(40, 20)))
    # a 31x31 kernel (padded to 32x32) in tiles of 8 channels, not of 16
    large = p.replace(kernel_size=31, padding=15, input_size=(40, 40))
    assert get_algorithm("triton:depthwise_rows_bwd_filter_r8q16c8w4").supports(large)
    assert not algorithm.supports(large)
    reasons = {
        "groups": p.replace(groups=4),
        "1-D and 2-D": p.replace(input_size=(5, 5, 5), kernel_size=3, padding=1, stride=1, dilation=1),
        "computes bwd_filter": p.replace(direction="fwd"),
        "16 channels × 64 × 16 taps (the 33x3 kernel's, padded) = 16384 float32 sums a program, more than 8192":
            p.replace(kernel_size=(33, 3), padding=(16, 1), input_size=(40, 9)),
        "grid axis that holds 65535": p.replace(c=3_000_000, k=3_000_000, groups=3_000_000, n=1, input_size=(2, 2),
                                                kernel_size=1, padding=0),
        "64-bit offsets": p.replace(n=2**31 // (8 * 81) + 1),
    }
    for words, other in reasons.items():
        support = algorithm.supports(other)
        assert not support and words in support.reason, (other.key, support.reason)
    with pytest.raises(ValueError, match="products over a power of two of at least 16 columns"):
        algorithm.module().RowsTile(8, 24, 16)


@needs_triton
def test_every_configuration_is_registered_once():
    assert len(FAMILY) == len(TILES) == len(set(FAMILY))
    assert all(name.startswith("triton:depthwise_rows_bwd_filter_r") for name in FAMILY)
