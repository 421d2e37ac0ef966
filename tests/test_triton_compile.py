"""Every Triton kernel configuration of the portfolio compiles for the H200 (CUDA, sm_90) on this machine, with
no GPU: Triton's interpreter, which runs the kernels in the other tests, accepts code its GPU compiler refuses
(a ``return`` inside a compile-time branch, say). Each configuration's launch on a few problems is caught before
it runs (the arguments, the compile-time constants and warps it would launch with) and compiled to a cubin by
Triton's own compiler and ptxas, its arguments specialized as Triton's launcher does (``bench/sass_counts.py``'s
``specialized``: an integer equal to 1 as a constant, one divisible by 16 and every PyTorch-allocated, so aligned,
pointer as such, a kernel's ``do_not_specialize`` parameters left alone). It runs in a process of its own: the
interpreter's kernels are other objects."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

pytest.importorskip("triton")

import convtune as ct  # noqa: E402
from convtune.algorithms.base import allocate_workspace, buffers_bytes, carve  # noqa: E402
from convtune.algorithms.triton_family import GRID_AXIS_LIMIT, TritonAlgorithm  # noqa: E402

SCRIPT = r"""
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

import convtune as ct
from convtune.algorithms.base import allocate_workspace, buffers_bytes, carve
from convtune.algorithms.triton_family import TritonAlgorithm

sys.path.insert(0, BENCH)
from sass_counts import specialized

PROBLEMS = [  # 2-D strided, dilated (the columns: the two-row strips' data gradient takes row dilation 1 only), 1-D,
    # a channel multiplier; grouped: 4 channels per group; dense first layers of 3 and 2 channels, output rows of 70
    # columns (the folded weight gradient steps its positions) and of 36 (it divides)
    dict(n=2, c=8, k=8, input_size=(9, 10), kernel_size=5, stride=2, padding=2, groups=8),
    dict(n=1, c=4, k=8, input_size=(11, 12), kernel_size=3, dilation=(1, 2), padding=2, groups=4),
    dict(n=2, c=6, k=6, input_size=(17,), kernel_size=7, padding=3, groups=6),
    dict(n=2, c=16, k=16, input_size=(9, 9), kernel_size=3, padding=1, groups=4),
    dict(n=2, c=3, k=16, input_size=(9, 140), kernel_size=7, stride=2, padding=3),
    dict(n=2, c=2, k=8, input_size=(40,), kernel_size=5),
]
caught = []


def run_on_the_cpu(algorithm, p):
    # algorithm's launches on CPU operands of the CUDA problem p (caught, not run, by JITFunction.run)
    cpu = p.replace(device="cpu")
    a, b = cpu.random_inputs()
    out = cpu.empty(cpu.operand_shapes[2])
    buffers = algorithm.buffers(p)
    ws = carve(allocate_workspace(buffers_bytes(buffers), "cpu"), buffers)  # as a run carves its buffers
    caught.clear()
    algorithm._run(p, a, b, out, ws)


def catch(self, *args, grid, warmup, **kwargs):
    caught.append((self, args, kwargs))


JITFunction.run = catch
compiled, launches, launched = set(), 0, set()
for algorithm in ct.registered():
    if not isinstance(algorithm, TritonAlgorithm):
        continue
    for spec in PROBLEMS:
        for dtype in ("float16", "bfloat16", "float32"):
            p = ct.ConvProblem(algorithm.directions[0], dtype=dtype, layout="channels_last", device="cuda", **spec)
            if not algorithm.supports(p):
                continue
            run_on_the_cpu(algorithm, p)
            assert caught, f"{algorithm.name} launched no kernel"
            launched.add(algorithm.name)
            for kernel, args, kwargs in caught:
                launches += 1
                signature, constants, attrs, options = specialized(kernel, args, kwargs)  # as Triton's launcher
                key = (kernel.fn.__name__, kernel.fn.__module__, tuple(sorted(signature.items())),
                       tuple(sorted(constants.items())), tuple(sorted(attrs)), tuple(sorted(options.items())))
                if key in compiled:
                    continue
                try:
                    triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                                   target=GPUTarget("cuda", 90, 32), options=options)
                except Exception as error:
                    raise SystemExit(f"{algorithm.name} on {p.key}: {kernel.fn.__name__} {kwargs} does not compile "
                                     f"for sm_90: {type(error).__name__}: {error}")
                compiled.add(key)
missing = [a.name for a in ct.registered() if isinstance(a, TritonAlgorithm) and a.name not in launched]
assert not missing, f"no test problem launches {missing}"
print(f"compiled {len(compiled)} kernels of {launches} launches")
"""


def _script(body: str) -> str:
    """``body`` with the folders of the tests and of the bench scripts (whose ``sass_counts.specialized`` it
    imports) named, to run in a process of its own."""
    tests = os.path.dirname(os.path.abspath(__file__))
    return f"import sys\nTESTS = {tests!r}\nBENCH = {os.path.join(os.path.dirname(tests), 'bench')!r}\n" + body


def _run_script(body: str, timeout: int) -> str:
    """``body`` run in a process of its own with Triton's compiler, not its interpreter; its standard output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CONVTUNE_TRITON"] = "1"
    done = subprocess.run([sys.executable, "-c", _script(body)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.mark.slow  # about 25 s on a 2-core CPU
def test_every_triton_configuration_compiles_for_the_gpu():
    out = _run_script(SCRIPT, timeout=900)
    compiled = int(out.split("compiled ")[1].split()[0])
    assert compiled >= 20, out


SIZES_SCRIPT = SCRIPT.split("JITFunction.run = catch")[0] + r"""
JITFunction.run = catch
# One layer's geometry at the image sizes and batches of a network's stages: in channels_last every configuration's
# launches must specialize alike on each (kernels.shared.IMAGE_SIZES, WIDTHS), as Triton's launcher does
# (sass_counts.specialized)
GEOMETRIES = [dict(c=144, k=144, kernel_size=3, padding=1, groups=144), dict(c=96, k=96, kernel_size=7, padding=3,
              groups=96), dict(c=64, k=64, kernel_size=3, stride=2, padding=1, groups=64),
              dict(c=128, k=128, kernel_size=3, padding=1, groups=32)]
# (batch, (height, width)): heights, widths and batches divisible by 16 and not, none giving a row of one strip or an
# image of one run of rows (a count of 1 stays specialized)
SIZES = [(2, (56, 56)), (3, (48, 32)), (16, (34, 112)), (5, (36, 36)), (8, (64, 48))]


def as_specialized(kernel, args, kwargs):
    # what Triton specializes the launch's run-time arguments on (their types, integers equal to 1 made constants,
    # divisibility by 16); the compile-time constants the host passes by keyword are left out: a tile chosen for a
    # small image (16 columns or 8, say) is a choice, not a specialization
    signature, constants, attrs, _ = specialized(kernel, args, kwargs)
    return (kernel.fn.__name__, {k: v for k, v in signature.items() if k not in kwargs},
            {k: v for k, v in constants.items() if k not in kwargs}, attrs)


compared = 0
for algorithm in ct.registered():
    if not isinstance(algorithm, TritonAlgorithm):
        continue
    for spec in GEOMETRIES:
        keys = {}
        for n, size in SIZES:
            p = ct.ConvProblem(algorithm.directions[0], n=n, input_size=size, dtype="float16", layout="channels_last",
                               device="cuda", **spec)
            if not algorithm.supports(p):
                continue
            run_on_the_cpu(algorithm, p)
            keys[p.key] = sorted(repr(as_specialized(kernel, args, kwargs)) for kernel, args, kwargs in caught)
            # channels_first's width is its contiguous axis: there every launch keeps the width's divisibility
            run_on_the_cpu(algorithm, p.replace(layout="channels_first"))
            loose = [(kernel.fn.__name__, q.name) for kernel, _, _ in caught for q in kernel.params
                     if q.name in ("W", "Q") and q.do_not_specialize_on_alignment]
            assert not loose, f"{algorithm.name} in channels_first does not specialize the width: {loose}"
        if len(set(map(tuple, keys.values()))) > 1:
            first, *rest = keys.items()
            other = next(k for k in rest if k[1] != first[1])
            raise SystemExit(f"{algorithm.name} compiles again for another image size: {first[0]} launches "
                             f"{sorted(set(first[1]) - set(other[1]))[:2]}, {other[0]} "
                             f"{sorted(set(other[1]) - set(first[1]))[:2]}")
        compared += len(keys) > 1
print(f"compared {compared}")
"""


@pytest.mark.slow  # about 10 s on a 2-core CPU
def test_a_configuration_compiles_once_for_every_image_size_in_channels_last():
    out = _run_script(SIZES_SCRIPT, timeout=600)
    assert int(out.split("compared ")[1].split()[0]) >= 40, out


PREPARE_SCRIPT = SCRIPT.split("JITFunction.run = catch")[0] + r"""
def catch_both(self, *args, grid, warmup, **kwargs):
    caught.append((self, grid, warmup, args, kwargs))


JITFunction.run = catch_both


def as_compiled(args):
    # what Triton specializes an argument on: a tensor's dtype and 16-byte alignment (and, for the launches'
    # other arguments, its shape and strides); a number's value
    return [(arg.dtype, arg.data_ptr() % 16 == 0, tuple(arg.shape), arg.stride())
            if isinstance(arg, torch.Tensor) else arg for arg in args]


checked = 0
for algorithm in ct.registered():
    if not isinstance(algorithm, TritonAlgorithm):
        continue
    for spec in PROBLEMS:
        for layout in ("channels_last", "channels_first"):
            p = ct.ConvProblem(algorithm.directions[0], dtype="float16", layout=layout, device="cuda", **spec)
            if not algorithm.supports(p):
                continue
            run_on_the_cpu(algorithm, p)
            ran = [(k, tuple(g), as_compiled(args), kw) for k, g, warm, args, kw in caught if not warm]
            caught.clear()
            algorithm.prepare(p)
            prepared = [(k, tuple(g), as_compiled(args), kw) for k, g, warm, args, kw in caught if warm]
            assert len(prepared) == len(caught) and prepared == ran, (algorithm.name, p.key, prepared, ran)
            checked += 1
print(f"checked {checked}")

# triton_cases.compile_ahead, as the families' test files call it on a GPU: every pair's launches warmed up, on the
# threads of Triton's AsyncCompileMode (caught here before they compile)
sys.path.insert(0, TESTS)
import types

from triton_cases import compile_ahead

said = []
REQUEST = types.SimpleNamespace(module=types.SimpleNamespace(__name__="script"), config=types.SimpleNamespace(
    pluginmanager=types.SimpleNamespace(get_plugin=lambda name: types.SimpleNamespace(write_line=said.append))))

caught.clear()
pairs = [(a.name, ct.ConvProblem(a.directions[0], dtype="float16", device="cuda", **PROBLEMS[0]))
         for a in ct.registered() if isinstance(a, TritonAlgorithm)]
pairs = [(name, p) for name, p in pairs if ct.get_algorithm(name).supports(p)]
compile_ahead(REQUEST, pairs + [(pairs[0][0], pairs[0][1].replace(device="cpu"))])  # the CPU problem: nothing
warmed = {kernel.fn.__name__ for kernel, _, warm, _, _ in caught if warm}
assert len(caught) >= len(pairs) and all(warm for _, _, warm, _, _ in caught), (len(caught), len(pairs))
assert len(said) == 1 and said[0].startswith(f"script: {len(pairs)} (configuration, problem) pairs compiled"), said
print(f"compiled ahead {len(pairs)} pairs, kernels {sorted(warmed)}")
"""


def test_prepare_compiles_what_a_run_launches_and_runs_nothing():
    # find compiles the next candidates ahead (Algorithm.prepare): on operands of PyTorch's meta device, each launch
    # must reach Triton as a run's would (the same kernels, grids, constants and specialization), as a warm-up; the
    # families' GPU tests compile their cases ahead the same way (triton_cases.compile_ahead)
    out = _run_script(PREPARE_SCRIPT, timeout=600)
    assert int(out.split("checked ")[1].split()[0]) >= 50, out


def test_the_test_files_compile_ahead_only_the_cases_pytest_selected():
    # a GPU run of some tests by id (the rest of a run cut at its time limit) compiles only their cases ahead: at
    # 5e58cc6 the strip file's last 44 tests never started, its fixture compiling every case of the file first
    from triton_cases import depthwise_problem, selected_problems

    here, elsewhere = types.SimpleNamespace(name="here"), types.SimpleNamespace(name="elsewhere")

    def item(module, name, **params):
        return types.SimpleNamespace(module=module, originalname=name, callspec=types.SimpleNamespace(params=params))

    case = dict(shape="3x3_pad1", direction="bwd_data", dtype="bfloat16", layout="channels_last")
    items = [item(here, "test_matches_reference", **case), item(here, "test_other", direction="fwd"),
             item(elsewhere, "test_matches_reference", **dict(case, direction="fwd"))]
    request = types.SimpleNamespace(module=here, session=types.SimpleNamespace(items=items))
    assert selected_problems(request, depthwise_problem) == [depthwise_problem(*case.values())]
    request.session.items = items[1:3]
    assert selected_problems(request, depthwise_problem) == []


def _launch_grids(algorithm: TritonAlgorithm, p: ct.ConvProblem) -> list[tuple[int, ...]]:
    """The grid of every launch one run of ``algorithm`` on ``p`` makes, on operands of PyTorch's meta device with
    every launch intercepted (``recording.intercepted``): nothing compiles, nothing runs."""
    from convtune.kernels import recording
    from convtune.problem import empty_in_layout

    grids: list[tuple[int, ...]] = []
    a, b, out = (empty_in_layout(s, p.layout, p.torch_dtype, "meta") for s in p.operand_shapes)
    buffers = algorithm.buffers(p)
    with recording.intercepted(lambda kernel, grid, *args, **kw: grids.append(grid)):
        algorithm._run(p, a, b, out, carve(allocate_workspace(buffers_bytes(buffers), "meta"), buffers))
    return grids


@pytest.mark.parametrize("case", ["many channels, depthwise", "many groups", "a long kernel, grouped",
                                  "many stride phases", "an ordinary layer"])
def test_a_supported_problem_never_asks_a_grid_axis_for_more_programs_than_cuda_holds(case):
    # CUDA holds 65535 programs on a grid's second and third axes: a configuration that would launch more must say
    # unsupported (with the reason), never fail at launch; the depthwise and grouped families did not say it
    spec = {"many channels, depthwise": dict(n=1, c=300000, k=300000, groups=300000, input_size=(8,), kernel_size=3),
            "many groups": dict(n=1, c=2400000, k=2400000, groups=1200000, input_size=(4,), kernel_size=3),
            "a long kernel, grouped": dict(n=1, c=4, k=4, groups=2, input_size=(66000,), kernel_size=66000),
            "many stride phases": dict(n=1, c=2, k=2, groups=2, input_size=(600, 600), kernel_size=3, stride=300),
            "an ordinary layer": dict(n=2, c=64, k=64, groups=64, input_size=(14, 14), kernel_size=3, padding=1)}[case]
    refused = checked = 0
    for algorithm in ct.registered():
        if not isinstance(algorithm, TritonAlgorithm):
            continue
        for direction in algorithm.directions:
            p = ct.ConvProblem(direction, dtype="float16", layout="channels_last", device="cuda", **spec)
            support = algorithm.supports(p)
            if not support:
                refused += "grid axis" in support.reason
                continue
            grids = _launch_grids(algorithm, p)
            assert grids and all(g <= GRID_AXIS_LIMIT for grid in grids for g in grid[1:]), (algorithm.name, grids)
            checked += 1
    assert (checked and not refused) if case == "an ordinary layer" else refused, (checked, refused)


@pytest.mark.parametrize("case", ["depthwise", "grouped", "first layer"])
def test_every_triton_configuration_refuses_operands_beyond_32_bit_offsets(case):
    # the kernels index with 32-bit offsets: every configuration of every family and direction refuses a problem
    # whose biggest tensor has 2**31 elements or more (here the batch makes y and dy that big, and x and dx where
    # they have as many channels), with the reason
    groups, c = {"depthwise": (64, 64), "grouped": (16, 64), "first layer": (1, 3)}[case]
    small = dict(n=2, c=c, k=64, groups=groups, input_size=(32, 32), kernel_size=3, padding=1)
    big = dict(small, n=2**31 // (64 * 32 * 32) + 1)
    refused = 0
    for algorithm in ct.registered():
        if not isinstance(algorithm, TritonAlgorithm):
            continue
        for direction in algorithm.directions:
            p = ct.ConvProblem(direction, dtype="float16", layout="channels_last", device="cuda", **small)
            if not algorithm.supports(p):
                continue
            support = algorithm.supports(p.replace(n=big["n"]))
            assert not support and "64-bit offsets" in support.reason, (algorithm.name, direction, support)
            refused += 1
    assert refused >= {"depthwise": 20, "grouped": 6, "first layer": 4}[case], refused
