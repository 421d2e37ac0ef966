"""triton:depthwise_strip_*: every direction, dtype, layout, stride, dilation and multiplier against float64.

Where the kernels run (a GPU, or Triton's interpreter: tests/test_triton_interpreter.py) and the checked
run: tests/triton_cases.py.
"""

from __future__ import annotations

import math
import zlib

import pytest

from convtune.algorithms.registry import get_algorithm, registered
from convtune.algorithms.triton_depthwise_strip import BACKWARD_FILTER_TILES, TILES, TritonDepthwiseStrip
from convtune.algorithms.triton_family import interpreting
from convtune.problem import ConvProblem
from triton_cases import (
    DEPTHWISE_SHAPES,
    DEVICE,
    DIRECTIONS,
    check_supporting,
    compile_ahead,
    depthwise_problem,
    every_case,
    kernel_tests,
    kernels,
    needs_triton,
    run_checked,
    selected_problems,
)

FAMILY = [a.name for a in registered() if isinstance(a, TritonDepthwiseStrip)]
SHAPES = DEPTHWISE_SHAPES
KERNEL_TESTS = kernel_tests(SHAPES) - len(SHAPES) * len(DIRECTIONS) * 2  # float16 is not run in the interpreter


def of_direction(direction: str) -> list[str]:
    names = [n for n in FAMILY if get_algorithm(n).directions == (direction,)]
    assert len(names) == len(BACKWARD_FILTER_TILES if direction == "bwd_filter" else TILES)
    return names


def sampled(p: ConvProblem) -> list[str]:
    """The configurations a case of several runs checks here: every one that computes ``p`` on a GPU; in the
    interpreter (a CPU, one thread) the first and the last, strips of 4 and of 2 or 8 (the tile sizes are
    compile-time constants of the same code)."""
    names = computing(p)
    return [names[0], names[-1]] if interpreting() and names else names


def computing(p: ConvProblem) -> list[str]:
    """The configurations that compute ``p`` (of these shapes): the data gradient's whose strip length the column
    stride (``stride[-1]``) divides, the weight gradient's of kernel rows of up to 8 taps, the forward's always; of
    two output rows a strip, only where there are two rows whose kernel rows read the same input rows (a row stride
    that is a whole number of row dilations, below the kernel's rows; the data gradient: a row stride and dilation
    of 1)."""
    names = of_direction(p.direction)
    if p.direction != "bwd_filter":
        two_d = len(p.stride) == 2
        shift = 1 if p.direction == "bwd_data" else (p.stride[0] // p.dilation[0] if two_d else 0)
        rows = (p.input_size if p.direction == "bwd_data" else p.output_size)[0] if two_d else 1
        shared = two_d and rows >= 2 and shift < p.kernel_size[0] and (
            p.stride[0] == p.dilation[0] == 1 if p.direction == "bwd_data" else p.stride[0] % p.dilation[0] == 0)
        names = [n for n in names if get_algorithm(n).tile_args[5] == 1 or shared]
    if p.direction == "bwd_data":
        return [n for n in names if get_algorithm(n).tile_args[0] % p.stride[-1] == 0]
    return names if p.direction == "fwd" or p.kernel_size[-1] <= 8 else []


@kernels
@every_case(SHAPES)
def test_matches_reference(shape, direction, dtype, layout):
    if dtype == "float16" and interpreting():
        # float16 and bfloat16 take the same code (loads widened to float32, one rounding at the store): the
        # interpreter runs bfloat16's; the GPU runs both.
        pytest.skip("float16 runs the same kernels as bfloat16: checked on the GPU")
    p = depthwise_problem(shape, direction, dtype, layout)
    names = [n for n in of_direction(direction) if get_algorithm(n).supports(p)]
    assert names == computing(p), names
    for name in reference_checked(p, names):
        run_checked(name, p)


def reference_checked(p: ConvProblem, names: list[str]) -> list[str]:
    """Which of ``names`` (the configurations computing ``p``) test_matches_reference runs: one a case, a different
    one from case to case, in the interpreter (a CPU, one thread) and, on a GPU, for every dtype and layout but
    float16 channels_last, which runs them all: the tile sizes are compile-time constants of one code, and compiling
    each for every case took most of a GPU run's time."""
    if names and (interpreting() or (p.dtype, p.layout) != ("float16", "channels_last")):
        return [names[zlib.crc32(p.key.encode()) % len(names)]]
    return names


@pytest.fixture(scope="module", autouse=True)
def _compiled_ahead(request):  # what test_matches_reference runs (triton_cases.compile_ahead)
    compile_ahead(request, ((n, p) for p in selected_problems(request, depthwise_problem)
                            for n in reference_checked(p, computing(p))))


@kernels
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_partial_tiles_and_many_runs(direction):
    # 37 output columns (a partial strip of 2, 4 and 8 at a row's end), more strips than a program's (2·9·10 = 180 >
    # 64), 21 channels (a partial tile of 16 and of 5 after whole ones), 18 output rows in runs of 2, of 4, 8 and 16
    # (the last partial) and one partial run of 32: every configuration.
    p = ConvProblem(direction, n=2, c=21, k=21, input_size=(9, 37), kernel_size=5, padding=2, groups=21,
                    dtype="bfloat16", layout="channels_last", device=DEVICE)
    assert all(get_algorithm(n).supports(p) for n in of_direction(direction))
    check_supporting(FAMILY, p)


@kernels
@pytest.mark.parametrize("stride, dilation, kernel", [((1, 2), (1, 1), (3, 7)), ((1, 3), (1, 2), (3, 5)),
                                                      ((2, 2), (2, 3), (3, 4))])
def test_strided_and_dilated_rows(stride, dilation, kernel):
    # A strip's outputs read columns `stride` apart through taps `dilation` apart: the compile-time pairing of
    # columns with outputs and taps; the data gradient reads dy's columns as spread `stride` apart, and its rows in
    # one launch per phase; a channel multiplier of 2; channels_first; every configuration (two of each direction
    # in the interpreter: ``sampled``).
    for direction in DIRECTIONS:
        p = ConvProblem(direction, n=1, c=3, k=6, input_size=(4, 45), kernel_size=kernel, stride=stride,
                        dilation=dilation, padding=(1, 3), groups=3, dtype="float32", layout="channels_first",
                        device=DEVICE)
        names = sampled(p)
        # none computes the data gradient of column stride 3 (no strip length of 2, 4 or 8 is a multiple of it)
        assert bool(names) != (direction == "bwd_data" and stride[-1] == 3), (direction, names)
        for name in names:
            run_checked(name, p)


@kernels
@pytest.mark.parametrize("stride, dilation, kernel, padding, size", [
    ((3, 2), (2, 1), (5, 7), (4, 3), (10, 23)),  # three row phases, one meeting kernel rows 1 and 4 only
    ((2, 4), (1, 3), (3, 3), (1, 5), (9, 30)),  # strips of 4 and 8 over four column phases, dilated
    ((2, 4), (1, 1), (3, 3), (3, 3), (5, 13)),  # padding past the kernel's reach: dx's border reads no dy
    ((4, 2), (1, 1), (2, 5), (0, 2), (3, 11)),  # fewer rows than the row stride: a phase without rows
])
def test_strided_data_gradient_by_phases(stride, dilation, kernel, padding, size):
    # dx's rows one stride phase a launch, each looping over the kernel rows that meet dy's rows from it, and its
    # columns in strips that span whole phases: every configuration whose strips the column stride divides (the
    # others are refused), channels_last with a multiplier of 3.
    p = ConvProblem("bwd_data", n=2, c=5, k=15, input_size=size, kernel_size=kernel, stride=stride,
                    dilation=dilation, padding=padding, groups=5, dtype="float32", layout="channels_last",
                    device=DEVICE)
    assert computing(p) and [n for n in of_direction("bwd_data") if get_algorithm(n).supports(p)] == computing(p)
    for name in sampled(p):
        run_checked(name, p)


@kernels
@pytest.mark.parametrize("padding", [0, 4])
def test_no_padding_and_padding_wider_than_the_kernel_reaches(padding):
    # The data gradient runs the forward's loop with padding dilation·(size - 1) - padding: 2 without padding, and
    # negative with padding 4 on a 3-wide kernel (dx's border positions read no dy at all); the forward's outputs at
    # padding 4 read only zeros at the border. A multiplier of 4: the data gradient sums 4 dy channels a channel.
    for direction in DIRECTIONS:
        p = ConvProblem(direction, n=1, c=3, k=12, input_size=(6, 9), kernel_size=3, padding=padding, groups=3,
                        dtype="float32", layout="channels_last", device=DEVICE)
        for name in sampled(p):
            run_checked(name, p)


@needs_triton
def test_the_family_declares_what_it_supports():
    p = ConvProblem("fwd", n=2, c=8, k=16, input_size=(9, 9), kernel_size=5, padding=2, groups=8, device="cuda")
    algorithm = get_algorithm("triton:depthwise_strip_fwd_t4b32c32w4")
    assert algorithm.directions == ("fwd",) and algorithm.is_deterministic(p)
    half = algorithm.notes(p.replace(dtype="float16"))
    assert half.float32_inside and not half.tensor_cores and not algorithm.notes(p).float32_inside
    # the forward's weights in float32, one row a tap, its 16 output channels padded to a tile of 32
    assert [(b.name, b.shape, str(b.dtype)) for b in algorithm.buffers(p)] == [("weights", (25, 32), "torch.float32")]
    # the data gradient's grouped by input channel: a row per (multiple, tap), 8 input channels padded to 32
    data = get_algorithm("triton:depthwise_strip_bwd_data_t4b32c32w4").buffers(p.with_direction("bwd_data"))
    assert data[0].shape == (2 * 25, 32)
    reasons = {
        "groups": p.replace(groups=4),
        "1-D and 2-D": p.replace(input_size=(5, 5, 5), kernel_size=3, padding=1, stride=1, dilation=1),
        "computes fwd": p.replace(direction="bwd_data"),
        "unrolls a load for each of the 130 input columns a strip of 4": p.replace(
            input_size=(9, 300), kernel_size=(5, 127), padding=(2, 63)),
        "grid axis that holds 65535": p.replace(c=3_000_000, k=3_000_000, groups=3_000_000, n=1, input_size=(2, 2),
                                                kernel_size=1, padding=0),
    }
    for words, other in reasons.items():
        support = algorithm.supports(other)
        assert not support and words in support.reason, (other.key, support.reason)
    # 128 columns, the most a strip unrolls: 4 outputs and 125 taps; the 2-output strips take 127 taps
    assert algorithm.supports(p.replace(input_size=(9, 300), kernel_size=(5, 125), padding=(2, 62)))
    assert get_algorithm("triton:depthwise_strip_fwd_t2b64c16w4").supports(p.replace(
        input_size=(9, 300), kernel_size=(5, 127), padding=(2, 63)))
    data = get_algorithm("triton:depthwise_strip_bwd_data_t4b32c32w4")
    assert data.supports(p.replace(direction="bwd_data", stride=(3, 2))) and \
        data.supports(p.replace(direction="bwd_data", stride=(1, 4)))
    support = data.supports(p.replace(direction="bwd_data", stride=(1, 3)))
    assert not support and support.reason.startswith(
        "computes the data gradient of column stride 3 (the stride's last entry) only with strips of a multiple of 3 "
        "outputs, this configuration's strips have 4; triton:depthwise_bwd_data_*ph (by stride phase), cuDNN")
    # the data gradient's tiles run over the input channels (the multiplier of 2 summed in the kernel): 1.5 million
    # of them (3 million output channels) need 46875 tiles of 32, but 3 million need more than the axis holds
    fits = p.replace(direction="bwd_data", c=1_500_000, k=3_000_000, groups=1_500_000, n=1, input_size=(2, 2),
                     kernel_size=1, padding=0)
    assert data.supports(fits)
    wide = fits.replace(c=3_000_000, groups=3_000_000)
    support = data.supports(wide)
    assert not support and "grid axis that holds 65535" in support.reason
    # a float32 copy of the weights of 2**31 elements or more: its offsets would overflow
    big = p.replace(c=2_147_483, k=2_147_483, groups=2_147_483, n=1, input_size=(1, 1), kernel_size=(1000, 1),
                    padding=(500, 0))
    support = get_algorithm("triton:depthwise_strip_fwd_t4b16c64w4").supports(big)
    assert not support and "float32 buffer of 2147520000 elements" in support.reason
    with pytest.raises(ValueError, match="1 to 8 outputs a strip"):
        TritonDepthwiseStrip("fwd", 9, 16, 32, 4)
    with pytest.raises(ValueError, match="the weight gradient's 1"):
        TritonDepthwiseStrip("bwd_filter", 8, 16, 32, 4, 8, 2)
    with pytest.raises(ValueError, match="1 or 2 output rows"):
        algorithm.module().StripTile(8, 16, 32, rows=3)
    # two output rows a strip share their input rows only where the row stride is a whole number of row dilations
    # (the data gradient's: 1) below the kernel's rows, and where there are two rows
    two = get_algorithm("triton:depthwise_strip_fwd_t8x2b16c32w4")
    assert two.supports(p) and two.supports(p.replace(stride=2)) and two.supports(p.replace(stride=4, dilation=2))
    support = two.supports(p.replace(input_size=(50,), kernel_size=5, padding=2, stride=1, dilation=1))
    assert not support and "1 output row: no second row" in support.reason
    support = two.supports(p.replace(stride=(5, 1)))
    assert not support and "row stride 5 reaches past the kernel's 5 rows (dilation 1)" in support.reason
    support = two.supports(p.replace(stride=3, dilation=2))
    assert not support and "row stride 3 is not a whole number of row dilations (2)" in support.reason
    data_two = get_algorithm("triton:depthwise_strip_bwd_data_t8x2b16c32w4")
    assert data_two.supports(p.replace(direction="bwd_data", stride=(1, 2)))
    support = data_two.supports(p.replace(direction="bwd_data", stride=(2, 2)))
    assert not support and "row stride 2: the data gradient of a row stride above 1 runs a launch" in support.reason
    support = data_two.supports(p.replace(direction="bwd_data", dilation=2, padding=4))
    assert not support and "row stride 1 is not a whole number of row dilations (2)" in support.reason
    with pytest.raises(ValueError, match="1 to 8 outputs a strip"):
        algorithm.module().StripTile(9, 16, 32)
    wgrad = get_algorithm("triton:depthwise_strip_bwd_filter_t4b32c32w4s8")
    q = p.with_direction("bwd_filter")
    support = wgrad.supports(q.replace(kernel_size=(3, 9), padding=(1, 4)))
    assert not support and "up to 8 taps" in support.reason
    assert wgrad.supports(q.replace(kernel_size=(9, 8), padding=(4, 4)))  # 9 rows of 8 taps
    # one float32 partial sum per (run of 8 output rows, channel, tap)
    assert wgrad.buffers(q.replace(n=20))[0].shape == (math.ceil(20 * 9 / 8), 16, 25)


@needs_triton
def test_every_configuration_is_registered_once_per_direction():
    assert len(FAMILY) == 2 * len(TILES) + len(BACKWARD_FILTER_TILES) == len(set(FAMILY))
    assert all(tile[0] <= 8 for tile in TILES + BACKWARD_FILTER_TILES)  # the kernels keep up to 8 outputs a strip
    assert {tile[5] if len(tile) > 5 else 1 for tile in TILES} == {1, 2}  # one and two output rows a strip
