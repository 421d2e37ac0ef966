"""Triton launches recorded for the C++ runtime (convtune.kernels.recording, the 'cubin' executable kind).

On the CPU the kernels run in Triton's interpreter, which compiles nothing: these tests check what is recorded
(every launch of a run, through ``launch``), how a recording is described (each run-time argument named by the
operand it lies in, constants left out, refusals) and what the runtime hands the extension. The launches
themselves run from C++ on the GPU (tests/gpu/test_gpu_native.py). The tests that run kernels need a GPU or
the interpreter set before Triton's kernels are defined (TRITON_INTERPRET=1 at start-up):
tests/test_triton_interpreter.py runs this file so.
"""

from __future__ import annotations

import types

import pytest
import torch

from convtune.algorithms.base import NoNativeRecipe
from convtune.algorithms.native import Native
from convtune.algorithms.registry import get_algorithm, register, unregister
from convtune.problem import ConvProblem
from convtune.pytorch import ops, runtime
from triton_cases import kernels

KERNELS_SKIP = kernels.kwargs["reason"]  # a kernel test's skip: test_triton_interpreter.py checks it is absent there

recording = pytest.importorskip("convtune.kernels.recording")


def _compiled(signature: dict[str, str], **meta) -> types.SimpleNamespace:
    """A stand-in for Triton's CompiledKernel: what ``describe`` reads of one."""
    metadata = dict(name="kernel_0d1d", shared=1024, num_warps=4, num_ctas=1, global_scratch_size=0,
                    profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=False)
    metadata.update(meta)
    return types.SimpleNamespace(metadata=types.SimpleNamespace(**metadata), asm={"cubin": b"\x7fELF binary"},
                                 src=types.SimpleNamespace(signature=signature))


def _kernel(*names: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(arg_names=list(names))


def test_describe_names_each_runtime_argument_by_the_operand_it_lies_in_and_leaves_constants_out():
    a, b, out = torch.zeros(8, dtype=torch.float16), torch.zeros(4), torch.zeros(6)
    partials = torch.zeros(2, 3)
    kernel = _kernel("x", "w", "y", "n", "big", "scale", "ONE", "BLOCK")
    compiled = _compiled({"x": "*fp16", "w": "*fp32", "y": "*fp32", "n": "i32", "big": "i64", "scale": "fp32",
                          "ONE": "constexpr", "BLOCK": "constexpr"})
    records = [(kernel, compiled, (3, 2), (a[2:], b, partials[1], 7, 2**40, 0.5, 1), {"BLOCK": 64, "num_warps": 4})]
    [launch] = recording.describe(records, {"a": a, "b": b, "out": out, "partials": partials})
    assert launch["name"] == "kernel_0d1d" and launch["shared"] == 1024 and launch["warps"] == 4
    assert launch["grid"] == [3, 2, 1]
    assert launch["params"] == [["tensor", "a", 4], ["tensor", "b", 0], ["tensor", "partials", 12], ["i32", 7],
                                ["i64", 2**40], ["f32", 0.5]]
    # what the runtime hands the extension: the binary back, each argument as (type, operand, integer, real)
    [(name, binary, shared, warps, grid, params)] = runtime._cubin_launches({"launches": [launch]})
    assert (name, binary, shared, warps, grid) == ("kernel_0d1d", b"\x7fELF binary", 1024, 4, [3, 2, 1])
    assert params == [("tensor", "a", 4, 0.0), ("tensor", "b", 0, 0.0), ("tensor", "partials", 12, 0.0),
                      ("i32", "", 7, 0.0), ("i64", "", 2**40, 0.0), ("f32", "", 0, 0.5)]


@pytest.mark.parametrize("case", ["made in the run", "scratch", "cluster", "type"])
def test_describe_refuses_what_the_cpp_launcher_cannot_repeat(case):
    a = torch.zeros(4)
    kernel = _kernel("x", "flag")
    signature = {"x": "*fp32", "flag": "i1" if case == "type" else "i32"}
    meta = {"scratch": dict(global_scratch_size=128), "cluster": dict(num_ctas=2)}.get(case, {})
    x = torch.zeros(4) if case == "made in the run" else a
    with pytest.raises(recording.NotRecordable):
        recording.describe([(kernel, _compiled(signature, **meta), (1,), (x, 3), {})], {"a": a})


@pytest.mark.parametrize("name,launches", [("triton:depthwise_fwd_p32c64w4", 1),
                                           ("triton:depthwise_bwd_filter_p64c64w4s8", 2),
                                           ("triton:depthwise_band_fwd_r32n16c8w4", 1),
                                           ("triton:depthwise_band_bwd_filter_r32n16c8w4s256", 2),
                                           ("triton:grouped_bwd_filter_p32c64w4s1024", 2),
                                           ("triton:folded_fwd_p128c64w4", 1),
                                           ("triton:folded_bwd_filter_p64c64w4s4096", 2)])
@kernels
def test_every_launch_of_a_run_is_recorded(name, launches):
    algo = get_algorithm(name)
    groups = {"grouped": 4, "folded": 1}.get(algo.family, 8)  # the family's kind: grouped, dense, depthwise
    p = ConvProblem(algo.directions[0], n=1, c=8, k=8, input_size=(5, 5), kernel_size=3, padding=1,
                    groups=groups, layout="channels_last")
    if not algo.supports(p):
        pytest.skip(f"{name} does not support {p.key}: {algo.supports(p).reason}")
    a, b = p.random_inputs()
    with recording.recording() as records:
        algo.run(p, a, b)
    assert len(records) == launches
    assert all(kernel is not None and grid for kernel, _, grid, _, _ in records)


@kernels
def test_weights_laid_out_tap_by_tap_are_a_launch_into_a_declared_buffer():
    p = ConvProblem("fwd", n=1, c=8, k=16, input_size=(5, 5), kernel_size=3, padding=1, groups=8,
                    layout="channels_last")
    algo = get_algorithm("triton:depthwise_fwd_p64c32w4t")
    assert [(b.name, b.shape) for b in algo.buffers(p)] == [("taps", (9, 16))]
    a, b = p.random_inputs()
    with recording.recording() as records:
        out = algo.run(p, a, b)
    assert [kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__ for kernel, *_ in records] == [
        "_lay_out_taps", "_forward"]
    torch.testing.assert_close(out, get_algorithm("triton:depthwise_fwd_p64c32w4").run(p, a, b))


class _Refusing(Native):
    """torch:native's computation under another name, whose recipe is refused as a Triton configuration's is."""

    def __init__(self, name: str, transient: bool) -> None:
        super().__init__()
        self.name, self.transient, self.asked = name, transient, 0

    def native_recipe(self, problem):
        self.asked += 1
        raise NoNativeRecipe("its launches are recorded outside a CUDA graph capture" if self.transient
                             else "its launches cannot be repeated from C++: a tensor made in the run",
                             transient=self.transient)


@pytest.mark.parametrize("transient", [True, False])
def test_a_refused_recipe_says_why_and_is_asked_again_only_where_the_refusal_may_pass(transient):
    if not runtime.available():
        pytest.skip("convtune's C++ extension is not built here")
    algo = _Refusing(f"test:refusing_{'now' if transient else 'always'}", transient)
    register(algo)
    try:
        p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(5, 5), kernel_size=3, padding=1)
        for _ in range(2):
            with pytest.raises(runtime.NotNative, match="runs on the Python path: its launches") as raised:
                runtime.prepare(p, algo.name)
            assert isinstance(raised.value, runtime.NotNativeNow) == transient
        assert algo.asked == (2 if transient else 1)  # a lasting refusal is remembered, a passing one asked again
    finally:
        unregister(algo.name)


def test_the_op_paths_runner_asks_again_after_a_passing_refusal_and_runs_the_python_path_meanwhile():
    if not runtime.available():
        pytest.skip("convtune's C++ extension is not built here")
    algo = _Refusing("test:refusing_for_now", transient=True)
    register(algo)
    try:
        p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(5, 5), kernel_size=3, padding=1)
        a, b = p.random_inputs()
        run = ops.runner(p.key, algo.name)
        asked = algo.asked
        for _ in range(2):
            torch.testing.assert_close(run(a, b), torch.nn.functional.conv2d(a, b, padding=1))
        assert isinstance(run, ops.NativeRunner) and algo.asked == asked + 2  # asked on every call
    finally:
        unregister(algo.name)


def test_a_value_none_of_the_choices_names_the_argument_and_the_choices():
    import numpy as np

    from convtune.errors import check_one_of

    check_one_of("mode", "find", ("find", "get"))
    for value in ("fastest", ["find"], np.array(["find", "get"]), 1):
        with pytest.raises(ValueError, match=r"select\(\): mode=.* is not supported; use one of \['find', 'get'\]"):
            check_one_of("mode", value, ("find", "get"), "select()")
