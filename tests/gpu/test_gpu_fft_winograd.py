"""fft:rfft, winograd:f2x3 and winograd:f4x3 on CUDA against the float64 reference, within the memory they declare
(the CPU's checks: tests/test_fft_winograd.py).

Run on a CUDA machine: ``python -m pytest tests/gpu``. Skipped without CUDA.
"""

import pytest

from convtune.algorithms.registry import get_algorithm
from convtune.problem import DIRECTIONS, LAYOUTS, ConvProblem
from convtune.verify import peak_allocated_bytes, reference, rel_error, tolerance
from test_fft_winograd import WINOGRAD, _poisoned

pytestmark = pytest.mark.gpu

GPU_SHAPES = {
    "resnet_3x3": dict(n=8, c=64, k=64, input_size=(56, 56), kernel_size=3, padding=1),
    "groups_odd": dict(n=3, c=32, k=48, input_size=(29, 31), kernel_size=3, padding=2, groups=4),
    "3d": dict(n=2, c=16, k=16, input_size=(12, 11, 10), kernel_size=3, padding=1),
}


@pytest.mark.parametrize("dtype", ("float32", "float16"))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("shape", GPU_SHAPES.values(), ids=GPU_SHAPES.keys())
@pytest.mark.parametrize("name", ("fft:rfft", *WINOGRAD))
def test_on_cuda_matches_reference_within_declared_memory(name, shape, direction, layout, dtype):
    problem = ConvProblem(direction=direction, layout=layout, dtype=dtype, device="cuda", **shape)
    algo = get_algorithm(name)
    a, b = problem.random_inputs(seed=3)
    out, workspace = _poisoned(problem, algo.buffer_bytes(problem))
    algo.run(problem, a, b, workspace=workspace, out=out)  # warm-up: cuFFT plans
    error = rel_error(out, reference(problem, a, b))
    assert error <= tolerance(problem, algo.notes(problem)), f"{name} {problem.key}: relative error {error:.3g}"
    library = algo.library_bytes(problem)  # cuFFT's own buffers: declared, measured on an H200
    allowance = max(64 * 1024, out.numel() * out.element_size() // 50)
    peak = peak_allocated_bytes(lambda: algo.run(problem, a, b, workspace=workspace, out=out), "cuda")
    assert peak <= library + allowance, f"{name} allocated {peak} bytes beyond its workspace ({library} declared)"
