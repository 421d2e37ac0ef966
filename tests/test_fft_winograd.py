"""fft:rfft, winograd:f2x3 and winograd:f4x3 against the float64 reference, on the CPU.

Every run gets fresh random operands, an output pre-filled with NaN and a workspace filled with
NaN bytes (so a buffer the algorithm forgets to zero shows up); the result must match
``verify.reference`` within ``verify.tolerance`` for the algorithm's numeric notes.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from convtune.algorithms.base import allocate_workspace
from convtune.algorithms.fft import smooth_size, tap_dft, transform_sizes
from convtune.algorithms.registry import get_algorithm
from convtune.algorithms.winograd import kron_transforms, transforms
from convtune.problem import DIRECTIONS, LAYOUTS, ConvProblem
from convtune.verify import peak_allocated_bytes, reference, rel_error, tolerance

DTYPES = ("float32", "float16", "bfloat16")

# Shapes both methods support: kernel 3, stride 1; odd sizes leave the last Winograd tile partial.
SHARED = {
    "2d_pad1_batch3": dict(n=3, c=4, k=6, input_size=(9, 7), kernel_size=3, padding=1),
    "2d_pad0_batch1": dict(n=1, c=3, k=5, input_size=(8, 11), kernel_size=3, padding=0),
    "2d_pad2_groups2": dict(n=2, c=4, k=6, input_size=(7, 10), kernel_size=3, padding=2, groups=2),
    "2d_depthwise": dict(n=2, c=4, k=4, input_size=(9, 9), kernel_size=3, padding=1, groups=4),
    "2d_mixed_pad": dict(n=1, c=2, k=3, input_size=(6, 13), kernel_size=3, padding=(0, 2)),
    "1d_pad1": dict(n=3, c=5, k=4, input_size=(13,), kernel_size=3, padding=1),
    "3d_pad1": dict(n=1, c=2, k=3, input_size=(5, 6, 7), kernel_size=3, padding=1),
}
# Shapes only the FFT supports: dilation, other kernel sizes.
FFT_ONLY = {
    "2d_dilation2": dict(n=2, c=3, k=4, input_size=(12, 10), kernel_size=(3, 2), padding=(2, 1), dilation=(2, 1)),
    "2d_kernel5_dilation2_groups": dict(n=1, c=4, k=2, input_size=(13, 12), kernel_size=5, padding=3, dilation=2,
                                        groups=2),
    "1d_kernel7_dilation3": dict(n=2, c=3, k=2, input_size=(30,), kernel_size=7, padding=0, dilation=3),
    "3d_dilation2": dict(n=2, c=2, k=2, input_size=(6, 7, 5), kernel_size=(3, 2, 1), padding=(1, 0, 2), dilation=2),
}
WINOGRAD = ("winograd:f2x3", "winograd:f4x3")


HALF_DTYPE_SHAPES = ("2d_pad1_batch3", "2d_pad2_groups2", "3d_pad1")  # half dtypes: same code, fewer shapes


def _cases():
    cases = [("fft:rfft", name, shape) for name, shape in {**SHARED, **FFT_ONLY}.items()]
    cases += [(algo, name, shape) for algo, (name, shape) in itertools.product(WINOGRAD, SHARED.items())]
    for algo, name, shape in cases:
        for dtype in DTYPES:
            if dtype == "float32" or name in HALF_DTYPE_SHAPES:
                yield pytest.param(algo, shape, dtype, id=f"{algo.split(':')[1]}-{name}-{dtype}")


def _poisoned(problem: ConvProblem, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An output full of NaN and a workspace whose every float reads as NaN."""
    out = problem.empty(problem.operand_shapes[2]).fill_(math.nan)
    workspace = allocate_workspace(nbytes, problem.device).fill_(0xFF)
    return out, workspace


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("name, shape, dtype", list(_cases()))
def test_matches_reference(name, shape, direction, layout, dtype):
    problem = ConvProblem(direction=direction, layout=layout, dtype=dtype, **shape)
    algo = get_algorithm(name)
    assert algo.supports(problem), algo.supports(problem).reason
    a, b = problem.random_inputs(seed=zlib.crc32(f"{name}{problem.key}".encode()))
    out, workspace = _poisoned(problem, algo.buffer_bytes(problem))
    result = algo.run(problem, a, b, workspace=workspace, out=out)
    assert result is out
    error = rel_error(out, reference(problem, a, b))
    assert error <= tolerance(problem, algo.notes(problem)), f"{name} {problem.key}: relative error {error:.3g}"


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("name", WINOGRAD)
def test_winograd_on_a_wide_layer_within_float32_tolerance(name, direction):
    # 256 input channels: F(4x4, 3x3)'s transform errors add up over C·9 = 2304 products.
    problem = ConvProblem(direction=direction, n=1, c=256, k=32, input_size=(10, 10), kernel_size=3, padding=1)
    a, b = problem.random_inputs(seed=5)
    algo = get_algorithm(name)
    error = rel_error(algo.run(problem, a, b), reference(problem, a, b))
    assert error <= tolerance(problem, algo.notes(problem))


HONESTY = [  # (shape, dtype): float16 also exercises the conversions into the float32 buffers
    pytest.param(dict(n=2, c=16, k=32, input_size=(24, 23), kernel_size=3, padding=1, groups=2), "float16",
                 id="2d_groups-float16"),
    pytest.param(dict(n=1, c=8, k=8, input_size=(10, 9, 8), kernel_size=3, padding=1), "float32", id="3d-float32"),
]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("shape, dtype", HONESTY)
@pytest.mark.parametrize("name", ("fft:rfft", *WINOGRAD))
def test_allocates_nothing_beyond_its_declared_memory(name, shape, direction, dtype):
    problem = ConvProblem(direction=direction, layout="channels_last", dtype=dtype, **shape)
    algo = get_algorithm(name)
    a, b = problem.random_inputs(seed=1)
    out, workspace = _poisoned(problem, algo.buffer_bytes(problem))
    algo.run(problem, a, b, workspace=workspace, out=out)  # warm-up: one-time library set-up
    allowance = max(64 * 1024, out.numel() * out.element_size() // 50)
    # The check must be able to fail: the scratch is far larger than what may leak.
    assert algo.buffer_bytes(problem) > 4 * allowance
    library = algo.library_bytes(problem)  # torch.fft's own result buffers: declared, not carved
    peak = peak_allocated_bytes(lambda: algo.run(problem, a, b, workspace=workspace, out=out), "cpu")
    assert peak <= library + allowance, f"{name} allocated {peak} bytes beyond its workspace on {problem.key}"
    assert peak >= library // 2, f"{name} declares {library} library bytes but allocated {peak}: stale estimate"


def test_is_deterministic():
    problem = ConvProblem("bwd_filter", n=2, c=4, k=4, input_size=(11, 9), kernel_size=3, padding=1)
    a, b = problem.random_inputs(seed=2)
    for name in ("fft:rfft", *WINOGRAD):
        algo = get_algorithm(name)
        assert algo.is_deterministic(problem)
        assert torch.equal(algo.run(problem, a, b), algo.run(problem, a, b))


@pytest.mark.parametrize("name", ("fft:rfft", *WINOGRAD))
def test_refuses_strides(name):
    problem = ConvProblem("fwd", n=1, c=2, k=2, input_size=(9, 9), kernel_size=3, stride=(2, 1), padding=1)
    support = get_algorithm(name).supports(problem)
    assert not support and "stride" in support.reason
    with pytest.raises(ValueError, match="does not support"):
        get_algorithm(name).run(problem, *problem.random_inputs())


@pytest.mark.parametrize("name", WINOGRAD)
@pytest.mark.parametrize("field, value", [("kernel_size", 5), ("kernel_size", (3, 1)), ("dilation", 2)])
def test_winograd_refuses_other_kernels(name, field, value):
    problem = ConvProblem("fwd", n=1, c=2, k=2, input_size=(12, 12), **{"kernel_size": 3, field: value})
    support = get_algorithm(name).supports(problem)
    assert not support and field in support.reason


@pytest.mark.parametrize("m", (2, 4))
def test_winograd_matrices_compute_the_correlation_exactly(m):
    b_t, g, a_t = transforms(m)
    gen = torch.Generator().manual_seed(m)
    d = torch.randn(m + 2, dtype=torch.float64, generator=gen)
    w = torch.randn(3, dtype=torch.float64, generator=gen)
    expected = torch.stack([d[i: i + 3] @ w for i in range(m)])
    assert torch.allclose(a_t @ ((g @ w) * (b_t @ d)), expected, rtol=0, atol=1e-12)
    # In 2-D the Kronecker products act on row-major flattened tiles (rounded to float32 once).
    kb, kg, ka = (t.double() for t in kron_transforms(m, 2))
    tile = torch.randn(m + 2, m + 2, dtype=torch.float64, generator=gen)
    filt = torch.randn(3, 3, dtype=torch.float64, generator=gen)
    expected = torch.nn.functional.conv2d(tile[None, None], filt[None, None])[0, 0]
    got = ka @ ((kg @ filt.flatten()) * (kb @ tile.flatten()))
    assert torch.allclose(got, expected.flatten(), rtol=0, atol=1e-5)


def test_smooth_size_is_the_next_2_3_5_smooth_length():
    def smooth(n):
        for prime in (2, 3, 5):
            while n % prime == 0:
                n //= prime
        return n == 1

    for n in range(1, 400):
        size = smooth_size(n)
        assert size >= n and smooth(size) and not any(smooth(s) for s in range(n, size))


def test_fft_transform_covers_the_padded_input():
    problem = ConvProblem("fwd", n=1, c=1, k=1, input_size=(56, 7, 1), kernel_size=(3, 3, 1), padding=(1, 2, 0))
    assert transform_sizes(problem) == (60, 12, 1)


def test_tap_dft_matches_the_fft_of_the_padded_filter():
    sizes, kernel, dilation = (12, 9), (3, 2), (2, 3)
    filt = torch.randn(kernel, dtype=torch.float64)
    padded = torch.zeros(sizes, dtype=torch.float64)
    padded[::2, ::3][:3, :2] = filt
    spectrum = torch.fft.rfftn(padded)
    forward = tap_dft(sizes, kernel, dilation, inverse=False)
    assert torch.allclose(forward.to(torch.complex128) @ filt.flatten().to(torch.complex128), spectrum.flatten(),
                          atol=1e-5)
    inverse = tap_dft(sizes, kernel, dilation, inverse=True)
    assert torch.allclose((inverse.to(torch.complex128) @ spectrum.flatten()).real, filt.flatten(), atol=1e-5)
