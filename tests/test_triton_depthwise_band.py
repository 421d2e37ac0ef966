"""triton:depthwise_band_*: every direction, dtype, layout, stride, dilation and multiplier against float64.

Where the kernels run (a GPU, or Triton's interpreter: tests/test_triton_interpreter.py) and the checked
run: tests/triton_cases.py.
"""

from __future__ import annotations

import math

import pytest

from convtune import hardware
from convtune.algorithms.registry import get_algorithm, registered
from convtune.algorithms.triton_depthwise_band import BACKWARD_FILTER_TILES, TILES, TritonDepthwiseBand
from convtune.algorithms.triton_family import interpreting
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
    run_checked,
    selected_problems,
)

FAMILY = [a.name for a in registered() if isinstance(a, TritonDepthwiseBand)]
# In the interpreter (a CPU, one thread) every case runs two configurations, a tile of channels and a single
# channel (the tile sizes are compile-time constants of the same code); on a GPU every configuration runs.
SAMPLED = ("r32n16c8w4", "r64n32c1w4")

SHAPES = DEPTHWISE_SHAPES
# every case but bfloat16's (not run in the interpreter), the wide window, the three wide strided rows
KERNEL_TESTS = kernel_tests(SHAPES) - len(SHAPES) * len(DIRECTIONS) * 2 + 1 + 3


def checked(direction: str) -> list[str]:
    """The configurations of ``direction`` a case runs here: ``SAMPLED`` in the interpreter, every one on a GPU."""
    names = [n for n in FAMILY if get_algorithm(n).directions == (direction,)]
    assert len(names) == len(BACKWARD_FILTER_TILES if direction == "bwd_filter" else TILES)
    return [n for n in names if n.rsplit("_", 1)[1].startswith(SAMPLED)] if interpreting() else names


@pytest.fixture(scope="module", autouse=True)
def _compiled_ahead(request):  # what test_matches_reference runs (triton_cases.compile_ahead)
    compile_ahead(request, ((n, p) for p in selected_problems(request, depthwise_problem)
                            for n in checked(p.direction)))


@kernels
@every_case(SHAPES)
def test_matches_reference(shape, direction, dtype, layout):
    if dtype == "bfloat16" and interpreting():
        # Triton 3.6's interpreter multiplies bfloat16 matrices wrongly (tests/test_triton_grouped.py): float16 takes
        # the same code there; the GPU runs both.
        pytest.skip("Triton's interpreter computes bfloat16 tl.dot wrongly")
    problem = depthwise_problem(shape, direction, dtype, layout)
    # each of them supports it; on a GPU of less shared memory a block than the H200's, a tile whose float32 operands
    # do not fit it may refuse
    smaller = hardware.shared_memory_per_block() < hardware.H200_SHARED_MEMORY_PER_BLOCK
    names = [n for n in checked(direction)
             if not (smaller and "shared memory" in get_algorithm(n).supports(problem).reason)]
    check_configurations(names, problem, len(names))


@kernels
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_partial_tiles_and_many_runs(direction):
    # More output rows (3·23 = 69) than a tile's 16, 32 or 64 and than a run of 64, more columns (37) than a tile's
    # 16 or 32, 21 channels (a partial tile of 16 and of 8 after whole ones, of 4 after five): every configuration.
    p = ConvProblem(direction, n=3, c=21, k=21, input_size=(23, 37), kernel_size=5, padding=2, groups=21,
                    dtype="float16", layout="channels_last", device=DEVICE)
    check_supporting(FAMILY, p)


@kernels
def test_a_wide_window():
    # A kernel row of 31 taps at stride 2: 16 output columns read 61 input columns (a window of 64), 32 read 93 (128)
    p = ConvProblem("fwd", n=1, c=2, k=2, input_size=(3, 70), kernel_size=(1, 31), stride=2, padding=(0, 15), groups=2,
                    dtype="float32", layout="channels_first", device=DEVICE)
    for name in ("triton:depthwise_band_fwd_r32n16c8w4", "triton:depthwise_band_fwd_r64n32c1w4"):
        run_checked(name, p)
        run_checked(name.replace("fwd", "bwd_filter") + "s256", p.with_direction("bwd_filter"))
    run_checked("triton:depthwise_band_bwd_filter_r16n16c16w4s256", p.with_direction("bwd_filter"))


@kernels
@pytest.mark.parametrize("stride, dilation, kernel", [((1, 2), (1, 1), (3, 7)), ((1, 3), (1, 2), (3, 5)),
                                                      ((2, 2), (2, 3), (3, 4))])
def test_strided_and_dilated_rows_wider_than_a_tile(stride, dilation, kernel):
    # 75 input columns: several column tiles, so that the data gradient's first dy column is floored from a column
    # the stride does not divide; a channel multiplier of 2; every configuration, every direction.
    for direction in DIRECTIONS:
        p = ConvProblem(direction, n=2, c=3, k=6, input_size=(5, 75), kernel_size=kernel, stride=stride,
                        dilation=dilation, padding=(1, 3), groups=3, dtype="float32", layout="channels_first",
                        device=DEVICE)
        check_supporting(FAMILY, p)


@needs_triton
def test_shared_memory_decides_the_pipeline_stages(monkeypatch):
    from convtune.kernels import banded

    # float32 operands of a 128-column window in tiles of 8 channels: 196,608 bytes a turn (what the kernel compiled
    # for sm_90 with one stage takes, counted with bench/sass_counts.py): one stage on the H200, the default where
    # two turns fit.
    p = ConvProblem("fwd", n=2, c=8, k=8, groups=8, input_size=(9, 200), kernel_size=(3, 97), padding=(1, 48),
                    dtype="float32", device="cuda")
    tile = get_algorithm("triton:depthwise_band_fwd_r32n16c8w4").tile
    assert banded.window(p, tile) == 128 and banded.operand_bytes(p, tile) == 196_608
    assert banded.stages(p, tile, 232_448) == 1 and banded.stages(p, tile, 400_000) == 0
    assert banded.stages(p, tile, 101_376) is None
    monkeypatch.setattr(hardware, "shared_memory_per_block", lambda: 101_376)
    support = get_algorithm("triton:depthwise_band_fwd_r32n16c8w4").supports(p)
    assert not support and "196608 bytes of operands in shared memory" in support.reason
    assert get_algorithm("triton:depthwise_band_fwd_r64n32c1w4").supports(p.replace(kernel_size=(3, 9), padding=(1, 4)))
    # the data gradient reads as many dy columns as the stride needs, from a floored first one
    q = p.replace(direction="bwd_data", kernel_size=(3, 113), padding=(1, 56), dtype="float16")
    assert banded.window(q, tile) == 128 and banded.window(q.replace(stride=(1, 4)), tile) == 64  # 33 columns


@needs_triton
def test_a_result_narrower_than_a_tile_reads_a_narrower_window():
    from convtune.kernels import banded

    # 5x5 on 7x7 (the last stage of many networks): 7 output columns read 11 input columns, a window of 16 where a
    # whole tile of 16 columns would read 20 (32); the data gradient's 7 input columns take 11 dy columns. Rows of 28
    # fill the tile, and read the whole tile's window. (The checked runs of this file's small shapes, all narrower
    # than a tile, show the narrower window's results.)
    p = ConvProblem("fwd", n=2, c=8, k=8, groups=8, input_size=(7, 7), kernel_size=5, padding=2, dtype="float16",
                    device="cuda")
    tile = get_algorithm("triton:depthwise_band_fwd_r32n16c8w4").tile
    for direction in DIRECTIONS:
        assert banded.window(p.with_direction(direction), tile) == 16
        assert banded.window(p.replace(direction=direction, input_size=(28, 28)), tile) == 32


@needs_triton
def test_the_family_declares_what_it_supports():
    p = ConvProblem("fwd", n=2, c=8, k=16, input_size=(9, 9), kernel_size=5, padding=2, groups=8, device="cuda")
    algorithm = get_algorithm("triton:depthwise_band_fwd_r64n32c1w4")
    assert algorithm.directions == ("fwd",) and algorithm.is_deterministic(p)
    half = algorithm.notes(p.replace(dtype="float16"))
    assert half.tensor_cores and half.float32_inside and not half.tf32
    assert algorithm.notes(p.replace(allow_tf32=True)).tf32 and not algorithm.notes(p.replace(allow_tf32=False)).tf32
    assert algorithm.buffers(p) == []
    reasons = {
        "groups": p.replace(groups=4),
        "1-D and 2-D": p.replace(input_size=(5, 5, 5), kernel_size=3, padding=1, stride=1, dilation=1),
        "computes fwd": p.replace(direction="bwd_data"),
        "window of up to 128 columns": p.replace(input_size=(9, 300), kernel_size=(5, 129), padding=(2, 64)),
        "grid axis that holds 65535": p.replace(c=70000, k=70000, groups=70000, n=1, input_size=(2, 2),
                                                kernel_size=1, padding=0),
    }
    for words, other in reasons.items():
        support = algorithm.supports(other)
        assert not support and words in support.reason, (other.key, support.reason)
    # in tiles of 8 channels: 8750 programs along that axis
    many = p.replace(c=70000, k=70000, groups=70000, n=1, input_size=(2, 2), kernel_size=1, padding=0)
    assert get_algorithm("triton:depthwise_band_fwd_r32n16c8w4").supports(many)
    # 32 output columns of a 1x97 row read 128 columns: the widest window; 16 of a 1x129 row need 256.
    assert get_algorithm("triton:depthwise_band_fwd_r64n32c1w4").supports(p.replace(kernel_size=(1, 97),
                                                                                    padding=(0, 48)))
    # The weight gradient declares one float32 partial sum per (run of output rows × tile of columns, channel, tap).
    wgrad = get_algorithm("triton:depthwise_band_bwd_filter_r32n16c8w4s64")
    q = p.with_direction("bwd_filter").replace(n=20, input_size=(9, 40))
    parts = math.ceil(20 * 9 / 64) * math.ceil(40 / 16)
    assert wgrad.buffers(q)[0].shape == (parts, 16, 25)


@needs_triton
def test_every_configuration_is_registered_once_per_direction():
    assert len(FAMILY) == 2 * len(TILES) + len(BACKWARD_FILTER_TILES) == len(set(FAMILY))
    # runs of 64 rows only for tiles of several channels (a single channel's programs are many already)
    short_runs = [n for n in FAMILY if n.endswith("s64")]
    assert short_runs == [f"triton:depthwise_band_bwd_filter_{tile}s64" for tile in ("r32n16c8w4", "r16n16c16w4")]
