"""gemm:1x1, gemm:im2col[_chunk{b}] and direct:taps: right results, honest workspace, honest refusals.

Every case runs on fresh random operands with the output poisoned with NaN, and is compared with
the float64 reference within ``verify.tolerance`` for the algorithm's own numeric notes. Memory
honesty: given exactly its declared workspace and a preallocated output, a run allocates nothing
beyond a small slack.
"""

from __future__ import annotations

import functools
import math
import zlib

import pytest
import torch

from convtune import verify
from convtune.algorithms.base import ALIGN_BYTES, allocate_workspace
from convtune.algorithms.gemm import CHUNKS
from convtune.algorithms.registry import get_algorithm
from convtune.problem import DIRECTIONS, LAYOUTS, ConvProblem
from fakes import slack_bytes

ALGORITHMS = ("gemm:1x1", "gemm:1x1_strided", "gemm:im2col", "gemm:im2col_chunk2", "direct:taps")
DTYPES = ("float32", "float16", "bfloat16")

SHAPES = {
    "2d_3x3_pad1": dict(n=3, c=4, k=6, input_size=(7, 6), kernel_size=3, padding=1),
    "2d_stride2": dict(n=3, c=4, k=6, input_size=(9, 8), kernel_size=3, stride=2, padding=1),
    "2d_dilation2_batch1": dict(n=1, c=6, k=4, input_size=(9, 9), kernel_size=(3, 2), dilation=2, padding=(2, 1)),
    "2d_groups2": dict(n=3, c=4, k=8, input_size=(7, 7), kernel_size=3, padding=1, groups=2),
    "2d_depthwise": dict(n=3, c=4, k=4, input_size=(7, 7), kernel_size=3, padding=1, groups=4),
    "2d_depthwise_x2_stride2": dict(n=3, c=4, k=8, input_size=(7, 7), kernel_size=3, stride=2, padding=1, groups=4),
    "2d_odd_strides_groups": dict(n=2, c=6, k=4, input_size=(9, 9), kernel_size=3, stride=(2, 3), padding=1, groups=2),
    "2d_taps_in_padding": dict(n=5, c=3, k=2, input_size=(4, 4), kernel_size=4, stride=3, padding=3),
    "2d_one_channel": dict(n=2, c=1, k=1, input_size=(6, 5), kernel_size=3, padding=1),
    "1d_stride2": dict(n=3, c=4, k=6, input_size=(11,), kernel_size=3, stride=2, padding=2),
    "3d_stride": dict(n=3, c=3, k=4, input_size=(5, 4, 6), kernel_size=(2, 3, 3), stride=(1, 2, 2), padding=1),
    "3d_dilated_groups": dict(n=2, c=4, k=4, input_size=(5, 7, 8), kernel_size=3, dilation=(1, 2, 2),
                              padding=(1, 0, 2), groups=2),
    "1x1": dict(n=3, c=4, k=6, input_size=(5, 6), kernel_size=1),
    "1x1_groups2": dict(n=3, c=4, k=6, input_size=(5, 6), kernel_size=1, groups=2),
    "1x1_1d_batch1": dict(n=1, c=5, k=3, input_size=(7,), kernel_size=1),
    "1x1_stride2_pad1": dict(n=3, c=4, k=6, input_size=(5, 6), kernel_size=1, stride=2, padding=1),
    "1x1_stride2": dict(n=3, c=4, k=6, input_size=(7, 6), kernel_size=1, stride=2),
    "1x1_3d_strides_groups": dict(n=2, c=4, k=6, input_size=(5, 6, 7), kernel_size=1, stride=(2, 1, 3), groups=2),
    "1x1_1d_stride3": dict(n=1, c=5, k=3, input_size=(10,), kernel_size=1, stride=3),
}


def should_support(name: str, p: ConvProblem) -> bool:
    """What each method can do, written down independently of its implementation."""
    if name == "gemm:1x1":
        return p.is_1x1 and all(s == 1 for s in p.stride) and not any(p.padding)
    if name == "gemm:1x1_strided":
        return p.is_1x1 and any(s != 1 for s in p.stride) and not any(p.padding)
    if name.startswith("gemm:im2col_chunk"):
        return int(name.removeprefix("gemm:im2col_chunk")) < p.n
    return True


def peak_cpu_bytes(fn) -> int:
    return verify.peak_allocated_bytes(fn, "cpu")


@functools.cache
def case(p: ConvProblem) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Random operands (never zeros) and the float64 reference, once per problem for all algorithms."""
    a, b = p.random_inputs(seed=zlib.crc32(p.key.encode()) % 1000)
    return (a, b), verify.reference(p, a, b)


def run_checked(name: str, p: ConvProblem, measure_memory: bool) -> None:
    algo = get_algorithm(name)
    (a, b), ref = case(p)
    out = p.empty(p.operand_shapes[2])
    out.fill_(math.nan)  # an element left unwritten fails the comparison
    workspace = allocate_workspace(algo.buffer_bytes(p), p.device)
    if measure_memory:
        peak = peak_cpu_bytes(lambda: algo.run(p, a, b, workspace=workspace, out=out))
        assert peak <= slack_bytes(p, workspace.numel()), (
            f"{name} allocated {peak} bytes beyond its declared {workspace.numel()} on {p.key}")
    else:
        algo.run(p, a, b, workspace=workspace, out=out)
    err, tol = verify.rel_error(out, ref), verify.tolerance(p, algo.notes(p))
    assert err <= tol, f"{name} on {p.key}: relative error {err:.2e} > {tol:.1e} ({algo.notes(p).describe()})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_reference_without_allocating(shape, direction, layout, dtype):
    p = ConvProblem(direction=direction, layout=layout, dtype=dtype, **SHAPES[shape])
    for name in ALGORITHMS:
        support = get_algorithm(name).supports(p)
        assert support.ok == should_support(name, p), f"{name} on {p.key}: {support}"
        if support:
            # bfloat16 takes the float16 code paths: its memory was measured there.
            run_checked(name, p, measure_memory=dtype != "bfloat16")


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_every_chunk_size(chunk, direction):
    # n = 65 > 64, so every sub-batch size applies; the last sub-batch is partial for all but 1.
    p = ConvProblem(direction=direction, n=65, c=2, k=3, input_size=(6,), kernel_size=3, padding=1,
                    layout="channels_last", dtype="bfloat16")
    run_checked(f"gemm:im2col_chunk{chunk}", p, measure_memory=False)


@pytest.mark.parametrize("name", ["gemm:im2col_chunk1", "gemm:1x1", "direct:taps"])
def test_filter_gradient_sums_half_terms_in_float32(name):
    # 65 sub-batches (or samples, or rows) summed in bfloat16 round 65 times (measured 1.0e-2
    # here); summed in float32 only the final rounding remains (measured 2.3e-3 to 2.5e-3).
    p = ConvProblem("bwd_filter", n=65, c=8, k=8, input_size=(9,), kernel_size=1 if name == "gemm:1x1" else 3,
                    padding=0 if name == "gemm:1x1" else 1, dtype="bfloat16", layout="channels_first")
    algo = get_algorithm(name)
    (a, b), ref = case(p)
    assert algo.notes(p).float32_inside and not algo.notes(p).reduced_precision
    err = verify.rel_error(algo.run(p, a, b), ref)
    assert err < 3.5e-3, f"{name}: {err:.2e}"


def test_chunked_workspace_scales_with_the_sub_batch():
    p = ConvProblem("fwd", n=64, c=16, k=16, input_size=(10, 10), kernel_size=3, padding=1)
    full = get_algorithm("gemm:im2col").buffer_bytes(p)
    for chunk in CHUNKS[:-1]:
        part = get_algorithm(f"gemm:im2col_chunk{chunk}").buffer_bytes(p)
        assert abs(part - full * chunk / p.n) <= ALIGN_BYTES, (chunk, part, full)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_1x1_needs_no_workspace_in_float32(direction, layout):
    p = ConvProblem(direction, n=4, c=8, k=16, input_size=(6, 6), kernel_size=1, layout=layout)
    assert get_algorithm("gemm:1x1").buffer_bytes(p) == 0
    assert get_algorithm("direct:taps").buffer_bytes(p.replace(kernel_size=3, padding=1,
                                                                  layout="channels_last")) == 0


def test_notes_say_where_half_sums_are_kept():
    p = ConvProblem("fwd", n=2, c=4, k=4, input_size=(6, 6), kernel_size=3, padding=1, dtype="float16")
    direct = get_algorithm("direct:taps")
    assert direct.notes(p).reduced_precision  # the taps' results are added in float16
    assert not direct.notes(p.with_direction("bwd_filter")).reduced_precision
    for name in ("gemm:im2col", "gemm:im2col_chunk1"):
        notes = get_algorithm(name).notes(p)
        assert notes.float32_inside and not notes.reduced_precision
    assert get_algorithm("gemm:im2col").notes(p.replace(dtype="float32")) == direct.notes(p.replace(dtype="float32"))


@pytest.mark.parametrize("changes, words, pointer", [
    (dict(kernel_size=3), "1x1 kernel", "gemm:im2col"),
    (dict(stride=2), "stride", "gemm:1x1_strided"),
    (dict(padding=1), "padding", "gemm:im2col"),
])
def test_1x1_refuses_with_a_reason(changes, words, pointer):
    p = ConvProblem("fwd", n=2, c=4, k=4, input_size=(6, 6), kernel_size=1).replace(**changes)
    support = get_algorithm("gemm:1x1").supports(p)
    assert not support and words in support.reason and pointer in support.reason


def test_chunk_refuses_a_batch_it_would_not_split():
    p = ConvProblem("fwd", n=4, c=4, k=4, input_size=(6, 6), kernel_size=3)
    support = get_algorithm("gemm:im2col_chunk4").supports(p)
    assert not support and "n > 4" in support.reason
    with pytest.raises(ValueError, match="does not support"):
        get_algorithm("gemm:im2col_chunk4").run(p, *p.random_inputs())


def test_peak_measure_sees_a_temporary_freed_inside_an_op():
    # mm copies an operand with no unit stride into a temporary and frees it before returning.
    a, w, out = torch.randn(300, 128)[:, ::2], torch.randn(64, 64), torch.empty(300, 64)
    assert peak_cpu_bytes(lambda: torch.mm(a, w, out=out)) >= a.numel() * 4


@pytest.mark.parametrize("dtype, inside", [("float32", True), ("float16", False), ("bfloat16", False)])
def test_gemms_switch_tf32_for_float32_problems_only(dtype, inside):
    # PyTorch's TF32 switch is process-wide: a half-dtype problem's GEMMs (where TF32 does not apply) leave it.
    from convtune import get_algorithm

    p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(4, 4), kernel_size=1, dtype=dtype, device="cuda",
                    allow_tf32=True)
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        with get_algorithm("gemm:1x1").tf32_settings(p).switched(p.device):
            assert matmul.allow_tf32 is inside
        assert matmul.allow_tf32 is False
    finally:
        matmul.allow_tf32 = saved
