"""Every registered algorithm against the float64 reference, on random valid problems.

The other test files go deep into one family each; this one sweeps the whole registry the way a
user meets it: whatever ``algorithms(problem)`` offers must be right and honest about workspace.
"""

import contextlib
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import convtune as ct
from convtune.algorithms import registry
from convtune.algorithms.base import Algorithm, allocate_workspace
from convtune.algorithms.native import native_conv
from convtune.verify import lowered_reference, peak_allocated_bytes, reference, rel_error, tapwise_reference, tolerance
from fakes import slack_bytes


@st.composite
def small_problems(draw):
    nd = draw(st.sampled_from([1, 2, 2, 2, 3]))
    g = draw(st.sampled_from([1, 1, 2, 3]))
    depthwise = draw(st.booleans()) and g > 1
    cg = 1 if depthwise else draw(st.integers(1, 5))
    kg = draw(st.integers(1, 5))
    r = draw(st.sampled_from([1, 1, 2, 3, 3, 5])) if nd < 3 else draw(st.sampled_from([1, 3]))
    dil = draw(st.sampled_from([1, 1, 2]))
    pad = draw(st.integers(0, 2))
    stride = draw(st.sampled_from([1, 1, 2, 3]))
    extent = dil * (r - 1) + 1
    size = draw(st.integers(max(1, extent - 2 * pad), extent + (9 if nd < 3 else 4)))
    return ct.ConvProblem(
        direction=draw(st.sampled_from(["fwd", "bwd_data", "bwd_filter"])), n=draw(st.integers(1, 3)),
        c=cg * g, k=kg * g, groups=g, input_size=(size,) * nd, kernel_size=r, stride=stride, padding=pad,
        dilation=dil, dtype=draw(st.sampled_from(["float32", "float32", "float16", "bfloat16"])),
        layout=draw(st.sampled_from(["channels_first", "channels_last"])),
    )


@given(small_problems(), st.integers(0, 2**16))
@hsettings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_supporting_algorithm_matches_the_float64_reference(problem, seed):
    a, b = problem.random_inputs(seed)
    ref = reference(problem, a, b)
    # A result that cancels to nearly zero (a one-element weight gradient, say) falls into the
    # half formats' subnormal range, where relative error says nothing about the algorithm.
    assume(float(torch.linalg.vector_norm(ref)) > 1e-2 * ref.numel() ** 0.5)
    # Nor does one whose terms mostly cancel (a single output summing 9 products to a tenth of their
    # size, say): rounding errors scale with the terms, not the sum. Judge well-conditioned cases.
    magnitude = reference(problem, a.abs(), b.abs())
    assume(float(torch.linalg.vector_norm(ref)) > 0.1 * float(torch.linalg.vector_norm(magnitude)))
    for algo in ct.algorithms(problem):
        out = problem.empty(problem.operand_shapes[2]).fill_(float("nan"))
        algo.run(problem, a, b, out=out)
        err = rel_error(out, ref)
        assert err <= tolerance(problem, algo.notes(problem)), (algo.name, problem.key, err)


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("input_size,kernel,stride,padding", [(1, 3, 2, 1), (2, 2, 3, 1), (1, 2, 1, 1)])
def test_native_bfloat16_channels_last_weight_gradient_writes_every_tap(nd, input_size, kernel, stride, padding):
    # Taps that the stride lets touch only padding: PyTorch's own CPU kernel leaves them unwritten
    # for bfloat16 channels_last operands, whatever their strides at size-1 dimensions.
    problem = ct.ConvProblem("bwd_filter", n=2, c=2, k=2, input_size=(input_size,) * nd, kernel_size=kernel,
                             stride=stride, padding=padding, dtype="bfloat16", layout="channels_last")
    algo = registry.get_algorithm("torch:native", problem)
    for seed in range(6):
        a, b = problem.random_inputs(seed)
        out = problem.empty(problem.operand_shapes[2]).fill_(float("nan"))
        algo.run(problem, a, b, out=out)
        assert rel_error(out, reference(problem, a, b)) <= tolerance(problem, algo.notes(problem)), seed


@pytest.mark.parametrize("groups", [1, 2])
def test_native_bfloat16_channels_last_grouped_3d_forward_matches_float64(groups, native_module):
    # PyTorch's own CPU kernel is 5-50 % off here (a 1x1x1 input under a 3x3x3 kernel, groups 2);
    # torch:native and its native executable compute it in float32.
    problem = ct.ConvProblem("fwd", n=1, c=2, k=4, input_size=(1, 1, 1), kernel_size=3, padding=1, groups=groups,
                             dtype="bfloat16", layout="channels_last")
    algo = registry.get_algorithm("torch:native", problem)
    handle = native_module.executable(problem, algo)
    for seed in range(4):
        a, b = problem.random_inputs(seed)
        ref = reference(problem, a, b)
        for out in (algo.run(problem, a, b), torch.ops.convtune.tuned_run(a, b, handle)):
            assert rel_error(out, ref) <= tolerance(problem, algo.notes(problem)), seed


@pytest.fixture
def native_module():
    from convtune.pytorch import runtime

    if not runtime.available():
        pytest.skip("the C++ extension is not available here")
    return runtime


@given(small_problems())
@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_exactly_the_declared_workspace_is_enough_and_nothing_large_is_allocated_beside_it(problem):
    a, b = problem.random_inputs(1)
    for algo in ct.algorithms(problem):
        if algo.name == "torch:native":
            continue  # PyTorch manages its own scratch; its notes say so
        need = algo.buffer_bytes(problem)
        ws = allocate_workspace(need, "cpu")
        out = problem.empty(problem.operand_shapes[2])
        algo.run(problem, a, b, workspace=ws, out=out)  # warm any lazy state first
        extra = peak_allocated_bytes(lambda algo=algo, ws=ws, out=out: algo.run(problem, a, b, workspace=ws, out=out),
                                     "cpu")
        # library_bytes: what a library allocates by itself (torch.fft's results), declared apart.
        assert extra <= algo.library_bytes(problem) + slack_bytes(problem, need), (algo.name, problem.key, need, extra)


def test_registry_rejects_duplicates_and_non_algorithms():
    native = ct.get_algorithm("torch:native")
    with pytest.raises(ValueError, match="already registered"):
        ct.register(native)
    with pytest.raises(TypeError):
        ct.register("torch:native")


class Doubling(Algorithm):
    name = "test:doubling"
    directions = ("fwd",)

    def _run(self, problem, a, b, out, ws):
        out.copy_(2 * torch.nn.functional.conv2d(a, b))


def test_plugins_register_through_the_same_call_and_are_offered():
    p = ct.ConvProblem("fwd", n=1, c=2, k=2, input_size=(5, 5), kernel_size=3)
    with registry.isolated(Doubling()):
        assert "test:doubling" in [a.name for a in ct.algorithms(p)]
        assert "test:doubling" not in [a.name for a in ct.algorithms(p.with_direction("bwd_data"))]
        assert "fwd" in ct.unsupported_reasons(p.with_direction("bwd_data"))["test:doubling"]
    assert "test:doubling" not in [a.name for a in ct.registered()]


def test_algorithms_lists_only_supporting_ones_and_reasons_cover_the_rest():
    p = ct.ConvProblem("fwd", n=2, c=4, k=4, input_size=(9, 9), kernel_size=3, stride=2)
    offered = {a.name for a in ct.algorithms(p)}
    reasons = ct.unsupported_reasons(p)
    assert offered and offered.isdisjoint(reasons)
    assert offered | set(reasons) == {a.name for a in ct.registered()}
    assert all(reasons.values())
    assert "torch:native" in offered


def test_algorithm_names_are_backend_colon_variant():
    with pytest.raises(ValueError, match="backend:variant"):
        type("Bad", (Doubling,), {"name": "no colon"})()


@pytest.fixture
def fwd():
    p = ct.ConvProblem("fwd", n=2, c=4, k=6, input_size=(8, 8), kernel_size=3, padding=1, layout="NHWC")
    return p, *p.random_inputs(0)


@pytest.mark.parametrize("algo_name", [a.name for a in ct.registered()])
def test_run_validates_its_tensors_with_clear_errors(fwd, algo_name):
    p, x, w = fwd
    algo = ct.get_algorithm(algo_name)
    if not algo.supports(p):
        pytest.skip(algo.supports(p).reason)
    with pytest.raises(ValueError, match="operand x has shape"):
        algo.run(p, x[:1], w)
    with pytest.raises(ValueError, match="operand w has dtype"):
        algo.run(p, x, w.half())
    with pytest.raises(ValueError, match="channels_last"):
        algo.run(p, x.contiguous(), w)
    with pytest.raises(TypeError, match="operand w must be a torch.Tensor"):
        algo.run(p, x, w.numpy())
    with pytest.raises(ValueError, match="operand y has shape"):
        algo.run(p, x, w, out=torch.empty(1))
    need = algo.buffer_bytes(p)
    if need:
        with pytest.raises(ValueError, match="smaller than"):
            algo.run(p, x, w, workspace=allocate_workspace(need - 1, "cpu"))
    with pytest.raises(ValueError, match="uint8"):
        algo.run(p, x, w, workspace=torch.empty(need + 8, dtype=torch.float32))


def test_run_refuses_an_unsupported_problem_with_the_reason():
    p = ct.ConvProblem("fwd", n=1, c=2, k=2, input_size=(5, 5), kernel_size=3)
    with registry.isolated(Doubling()):
        with pytest.raises(ValueError, match="does not support"):
            ct.get_algorithm("test:doubling").run(p.with_direction("bwd_data"),
                                                  *p.with_direction("bwd_data").random_inputs())


@given(small_problems(), st.integers(0, 2**16), st.sampled_from([None, 1]))
@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_lowered_reference_equals_pytorchs_float64_convolution(problem, seed, chunk_bytes):
    # The CUDA reference path, checked here on the CPU against PyTorch's own float64 convolution;
    # chunk_bytes=1: one sample at a time, so the sub-batch split is covered too.
    assume(problem.ndim <= 2)
    a, b = (t.double() for t in problem.random_inputs(seed))
    want = native_conv(problem, a, b)
    kwargs = {} if chunk_bytes is None else dict(chunk_bytes=chunk_bytes)
    got = lowered_reference(problem, a, b, **kwargs)
    assert got.shape == want.shape and got.dtype == torch.float64
    assert rel_error(got, want) < 1e-12, problem.key


def test_the_lowered_reference_refuses_3d_problems():
    p = ct.ConvProblem("fwd", n=1, c=2, k=2, input_size=(3, 3, 3), kernel_size=1)
    with pytest.raises(ValueError, match="1-D and 2-D"):
        lowered_reference(p, *p.random_inputs())


@given(small_problems(), st.integers(0, 2**16))
@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_tapwise_reference_equals_pytorchs_float64_convolution(problem, seed):
    # CUDA's 3-D reference path (it never touches cuDNN's flags), checked on the CPU in every dimension.
    a, b = (t.double() for t in problem.random_inputs(seed))
    want = native_conv(problem, a, b)
    got = tapwise_reference(problem, a, b)
    assert got.shape == want.shape and got.dtype == torch.float64
    assert rel_error(got, want) < 1e-12, problem.key


def test_the_cpu_reference_leaves_cudnns_flags_alone(monkeypatch):
    # PyTorch's own call on the CPU (the CPU reference, torch:native) switches no process-wide cuDNN flag,
    # even for a problem whose TF32 setting is not the process's; CUDA's: tests/gpu/test_gpu_algorithms.py.
    p = ct.ConvProblem("bwd_data", n=1, c=2, k=2, input_size=(3, 4, 3), kernel_size=3, padding=1,
                       allow_tf32=not torch.backends.cudnn.allow_tf32)
    seen = []
    monkeypatch.setattr(torch.backends.cudnn, "flags", lambda *a, **k: seen.append(k) or contextlib.nullcontext())
    reference(p, *p.random_inputs())
    assert seen == []


def test_an_algorithm_that_assumes_aligned_operands_gets_them():
    # cuDNN's plans assume 16-byte aligned operands (their tensors are declared so): a tuned layer's Python path
    # copies a view that starts elsewhere (x[1:]), as torch's convolution takes it and the native plans copy it;
    # run, the library's call on the caller's own tensors, refuses one (out too) naming the operand
    from convtune.pytorch import ops
    from fakes import Fake

    seen = []

    class Aligned(Fake):
        alignment = 16

        def compute(self, problem, a, b, out):
            seen.append(a.data_ptr() % 16)
            super().compute(problem, a, b, out)

    aligned = Aligned("fake:aligned")
    registry.register(aligned)
    try:
        p = ct.ConvProblem("fwd", n=2, c=4, k=4, input_size=(5, 5), kernel_size=3, padding=1)
        x, w = p.random_inputs()
        shifted = torch.empty(x.numel() + 1)[1:].view_as(x).copy_(x)  # 4 bytes past an aligned address
        torch.testing.assert_close(ops.Runner(p.key, "fake:aligned")(shifted, w), native_conv(p, x, w))
        assert seen == [0]
        with pytest.raises(ValueError, match=r"by fake:aligned: operand x starts at an address not aligned to 16"):
            aligned.run(p, shifted, w)
        out = torch.empty(math.prod(p.operand_shapes[2]) + 1)[1:]
        with pytest.raises(ValueError, match=r"by fake:aligned: operand y starts at an address not aligned to 16"):
            aligned.run(p, x, w, out=out.view(p.operand_shapes[2]))
        torch.testing.assert_close(aligned.run(p, shifted.clone(), w), native_conv(p, x, w))
        assert seen == [0, 0]
    finally:
        registry.unregister("fake:aligned")
