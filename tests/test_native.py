"""The native runtime on the CPU: the C++ extension builds, its executables compute what their Python
algorithms compute, the ops' autograd, meta kernels and torch.compile, the fallback when the build fails,
copies, threads and bad input.

The extension is built once per machine and sources (tens of seconds on two cores) and cached.
Results are compared with PyTorch's own convolution and with a float64 reference on fresh random
inputs; every executable's result starts as NaN (``poisoned``), so an element left unwritten shows.
"""

from __future__ import annotations

import copy
import io
import itertools
import math
import os
import pickle
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import convtune as ct
from convtune import extension
from convtune.problem import ConvProblem, explicit_padding, is_in_layout
from convtune.pytorch import host_costs, runtime
from convtune.pytorch.modules import TunedConv, _traced_keys
from convtune.pytorch.tuning import LayerSelection, Signature, layout_of
from convtune.settings import settings
from convtune.verify import reference, rel_error, tolerance

NATIVE_ALGORITHMS = ("torch:native", "gemm:1x1", "gemm:1x1_strided")


@pytest.fixture(scope="module")
def native():
    module = extension.load()
    assert module is not None, extension.status()
    return module


def test_the_extension_builds_here_and_reports_its_status(native):
    status = extension.status()
    assert status["enabled"] and status["loaded"] and status["error"] is None
    assert status["cudnn"] is False  # the CPU build of torch has no cuDNN to compile in
    assert torch.ops.convtune.tuned_conv.default is not None and native.count() >= 0
    out = subprocess.run([sys.executable, "-m", "convtune.cli", "native", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"loaded": true' in out.stdout


def test_a_finished_build_is_loaded_as_it_is_and_an_unfinished_one_is_not(native, tmp_path):
    folder = extension.build_dir()
    library = folder / (folder / extension.BUILT).read_text().strip()
    assert library.exists() and library.samefile(native.__file__)  # the build said what it made
    assert extension._load_finished(folder).__file__ == native.__file__
    (tmp_path / extension.BUILT).write_text("convtune_C.so")  # names a library that is not there: a cut build
    assert extension._load_finished(tmp_path) is None
    assert extension._load_finished(tmp_path / "nothing") is None  # no build at all


@pytest.mark.parametrize("dtype,layout,direction", list(itertools.product(
    ("float32", "float16", "bfloat16"), ("channels_first", "channels_last"), ("fwd", "bwd_data", "bwd_filter"))))
def test_every_native_executable_matches_its_python_algorithm_and_float64(native, poisoned, dtype, layout, direction):
    checked = 0
    for nd, (k, stride, groups) in itertools.product((1, 2, 3), ((1, 1, 1), (1, 2, 1), (1, 1, 2), (3, 2, 2))):
        p = ConvProblem(direction, n=3, c=4, k=6, input_size=(5,) * nd, kernel_size=k, stride=stride, groups=groups,
                        padding=k // 2, dtype=dtype, layout=layout)
        a, b = p.random_inputs(seed=nd + k)
        ref = reference(p, a, b)
        for name in NATIVE_ALGORITHMS:
            algo = ct.get_algorithm(name, p)
            if not algo.supports(p):
                continue
            out = torch.ops.convtune.tuned_run(a, b, runtime.executable(p, algo))
            assert out.shape == p.operand_shapes[2] and is_in_layout(out, layout), (name, p.key)
            assert torch.equal(out, algo.run(p, a, b)), (name, p.key)  # the same calls, the same numbers
            assert rel_error(out, ref) <= tolerance(p, algo.notes(p)), (name, p.key)
            checked += 1
    assert checked >= 20


# -- the ops: autograd, meta kernels, opcheck --------------------------------------------------

LAYERS = {  # (Conv class, constructor arguments, input shape)
    "grouped": (torch.nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, groups=2), (2, 4, 7, 6)),
    "depthwise": (torch.nn.Conv2d, dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, groups=4),
                  (2, 4, 6, 6)),
    "dilated": (torch.nn.Conv2d, dict(in_channels=3, out_channels=5, kernel_size=3, padding=2, dilation=2),
                (2, 3, 8, 7)),
    "strided": (torch.nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, stride=2, padding=1), (2, 3, 9, 9)),
    "1x1": (torch.nn.Conv2d, dict(in_channels=6, out_channels=4, kernel_size=1), (2, 6, 5, 5)),
    "1x1_strided": (torch.nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=1, stride=2), (2, 4, 7, 7)),
    "1d": (torch.nn.Conv1d, dict(in_channels=3, out_channels=4, kernel_size=5, padding=2), (2, 3, 12)),
    "3d": (torch.nn.Conv3d, dict(in_channels=2, out_channels=3, kernel_size=3, padding=1), (1, 2, 4, 5, 4)),
}


def _handles(module: torch.nn.Module, x: torch.Tensor, prefer: str = "gemm") -> tuple[int, int, int]:
    """Executables for ``module`` on ``x``: a GEMM where one serves the direction, else torch:native."""
    p = ConvProblem.from_module(module, tuple(x.shape), dtype=x.dtype, layout=layout_of(x))
    handles = []
    for d in ("fwd", "bwd_data", "bwd_filter"):
        q = p.with_direction(d)
        order = ("gemm:1x1", "gemm:1x1_strided", "torch:native") if prefer == "gemm" else ("torch:native",)
        algo = next(a for a in map(lambda n: ct.get_algorithm(n, q), order) if a.supports(q))
        handles.append(runtime.executable(q, algo))
    return handles[0], handles[1], handles[2]


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_the_native_op_matches_torch_forward_and_both_gradients(native, poisoned, name, layout):
    cls, kwargs, shape = LAYERS[name]
    torch.manual_seed(0)
    conv = cls(**kwargs)
    x = ct.to_layout(torch.randn(shape), layout).requires_grad_()
    handles = _handles(conv, x)
    y = torch.ops.convtune.tuned_conv(x, conv.weight, conv.bias, *handles)
    yr = conv(x)
    assert is_in_layout(y, layout)
    torch.testing.assert_close(y, yr, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(yr)
    other = "channels_first" if layout == "channels_last" else "channels_last"
    # dy as the backward gets it: dense in the layer's layout, in the other layout, or expanded (a loss's sum())
    for form, dy in (("dense", g), ("other layout", ct.to_layout(g, other)), ("expanded", g[:1].expand_as(g))):
        got = torch.autograd.grad(y, (x, conv.weight, conv.bias), dy, retain_graph=True)
        want = torch.autograd.grad(yr, (x, conv.weight, conv.bias), dy, retain_graph=True)
        for a, b, what in zip(got, want, ("dx", "dw", "db")):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=f"{what}, dy {form}")


@pytest.mark.filterwarnings("ignore:Input #")
@pytest.mark.parametrize("name", list(LAYERS))
def test_the_native_op_passes_gradcheck_and_opcheck(native, name):
    # float32 (convtune's problems have no float64): convolution is linear in each operand, so central
    # differences are exact up to rounding, and eps=1e-2 keeps rounding far below the tolerance.
    cls, kwargs, shape = LAYERS[name]
    torch.manual_seed(0)
    conv = cls(**kwargs)
    x = torch.randn(shape, requires_grad=True)
    handles = _handles(conv, x)
    w, b = conv.weight.detach().clone().requires_grad_(), conv.bias.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w, b: torch.ops.convtune.tuned_conv(x, w, b, *handles), (x, w, b),
                                    eps=1e-2, atol=1e-3, rtol=1e-2)
    torch.library.opcheck(torch.ops.convtune.tuned_conv.default, (x, w, b, *handles))
    torch.library.opcheck(torch.ops.convtune.tuned_run.default, (x.detach(), w.detach(), handles[0]))


def test_bad_input_raises_a_value_error_that_names_the_layer_and_the_mismatch(native):
    p = ConvProblem("fwd", n=2, c=4, k=6, input_size=(5, 5), kernel_size=1)
    h = runtime.executable(p, ct.get_algorithm("gemm:1x1", p))
    x, w = p.random_inputs()
    with pytest.raises(ValueError, match="no executable has handle 12345"):
        torch.ops.convtune.tuned_run(x, w, 12345)
    with pytest.raises(ValueError, match=r"operand x has shape \[2, 4, 6, 5\]"):
        torch.ops.convtune.tuned_run(torch.randn(2, 4, 6, 5), w, h)
    with pytest.raises(ValueError, match="operand w has dtype BFloat16"):
        torch.ops.convtune.tuned_run(x, w.bfloat16(), h)
    x_cl = x.to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="not the tuned problem's .* dense in the channels_first layout"):
        native.tuned_conv(x_cl, w, None, h, 0, 0)  # the hot path's input: another layout is another signature
    # The ops take any strides and lay them out, as torch's convolution does (Inductor may pick the layout, an
    # exported program may be called with another).
    torch.testing.assert_close(torch.ops.convtune.tuned_run(x_cl, w, h), torch.ops.convtune.tuned_run(x, w, h))
    torch.testing.assert_close(torch.ops.convtune.tuned_conv(x_cl, w, None, h, 0, 0),
                               torch.ops.convtune.tuned_conv(x, w, None, h, 0, 0))
    meta = torch.ops.convtune.tuned_run(x_cl.to("meta"), w.to("meta"), h)
    assert meta.shape == (2, 6, 5, 5) and meta.is_contiguous()  # its meta kernel too: the result in the layout
    for weight in (w[:1], torch.randn(3, 4, 1, 1)):  # a layer's weight of another shape: never broadcast into it
        with pytest.raises(ValueError, match="operand w has shape"):
            torch.ops.convtune.tuned_conv(x, weight, None, h, 0, 0)
    with pytest.raises(ValueError, match="gradient of the input is needed but its direction was not tuned"):
        torch.ops.convtune.tuned_conv(x.requires_grad_(), w, None, h, 0, 0)
    with pytest.raises(ValueError, match="already taken"):
        native.add_native(h, "another description", runtime._geometry(native, p, ct.get_algorithm("torch:native", p)))
    # a handle in another direction's slot: on a 1x1 layer of as many channels in as out, its operands fit, and it
    # would compute another thing without a word
    square = ConvProblem("fwd", n=2, c=4, k=4, input_size=(5, 5), kernel_size=1)
    handles = {d: runtime.executable(square.replace(direction=d), ct.get_algorithm("gemm:1x1", square))
               for d in ("fwd", "bwd_data", "bwd_filter")}
    xs, ws = square.random_inputs()
    for slots, wrong in (((handles["bwd_data"], handles["bwd_data"], handles["bwd_filter"]),
                          "forward's, but its executable computes the data gradient"),
                         ((handles["fwd"], handles["fwd"], 0), "data gradient's, but its executable computes the forw"),
                         ((handles["fwd"], 0, handles["bwd_data"]), "weight gradient's, but its executable computes")):
        with pytest.raises(ValueError, match=wrong):
            torch.ops.convtune.tuned_conv(xs.requires_grad_(), ws.requires_grad_(), None, *slots)
    for mode in (torch.no_grad, torch.inference_mode):  # inference_mode skips the autograd kernel: checked below it
        with mode(), pytest.raises(ValueError, match="forward's, but its executable computes the data gradient"):
            torch.ops.convtune.tuned_conv(xs, ws, None, handles["bwd_data"], 0, 0)


@pytest.mark.parametrize("path", ["executable", "layer op", "module, native", "module, python"])
def test_a_bias_torch_refuses_is_refused_never_broadcast(native, path):
    # torch's convolution refuses a bias that is not 1-dimensional with the output's channels, or of another dtype;
    # adding it by broadcasting (as the ops did) gave a wrong result, or another result dtype, without a word
    p = ConvProblem("fwd", n=2, c=4, k=6, input_size=(5, 5), kernel_size=1)
    x, w = p.random_inputs()
    good = torch.randn(6)
    if path == "executable":
        h = runtime.executable(p, ct.get_algorithm("gemm:1x1", p))
        def conv(bias):
            return torch.ops.convtune.tuned_conv(x, w, bias, h, 0, 0)
        label = re.escape(p.key)
    elif path == "layer op":
        layer = native.layer_new([1, 1], [0, 0], [1, 1], 1, list(w.shape))
        def conv(bias):
            return torch.ops.convtune.layer_conv(x, w, bias, [1, 1], [0, 0], [1, 1], 1, layer, False, False)
        label = f"convtune: layer {layer}"
    else:
        with settings.override(native=path == "module, native"):
            module = _forced(x, "gemm:1x1", in_channels=4, out_channels=6, kernel_size=1)
            module(x)
            assert next(iter(module.selections.values())).runtime == path.split(", ")[1]
        module.weight.data.copy_(w)

        def conv(bias):
            module.bias = torch.nn.Parameter(bias, requires_grad=False)
            with settings.override(native=path == "module, native"), torch.no_grad():
                return module(x)
        label = re.escape(p.key) if path == "module, native" else re.escape("Conv2d(4, 6, kernel_size=(1, 1)")
    torch.testing.assert_close(conv(good), F.conv2d(x, w, good), atol=1e-5, rtol=1e-4)
    for bad in (torch.randn(1), torch.randn(6, 1), torch.randn(3), good.double()):
        with pytest.raises(ValueError, match=f"{label}.*bias of shape {re.escape(str(list(bad.shape)))}.*give a "
                                             f"1-dimensional bias of 6 elements"):
            conv(bad)


# -- modules on the native path ------------------------------------------------------------------

def _forced(x: torch.Tensor, algorithm: str, **kwargs) -> ct.nn.Conv2d:
    """A convtune Conv2d whose plan for ``x`` runs ``algorithm`` in every direction (as if tuned so)."""
    torch.manual_seed(1)
    module = ct.nn.Conv2d(**kwargs, mode="get")
    sig = Signature(tuple(x.shape), x.dtype, x.device, layout_of(x))
    p = ConvProblem.from_module(module, sig.shape, dtype=sig.dtype, layout=sig.layout)
    module._convtune_select(sig, LayerSelection(p.key, algorithm, algorithm, algorithm))
    return module


def test_a_module_on_the_native_path_trains_like_torch_and_takes_the_hot_path(native, poisoned):
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    module = _forced(x, "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1)
    twin = torch.nn.Conv2d(6, 4, 1)
    twin.load_state_dict(module.state_dict())
    plan = next(iter(module.selections.values()))
    assert plan.runtime == "native" and plan.native is not None
    assert [r["runtime"] for r in ct.explain(module)] == []  # forced plans carry no measured results
    for _ in range(2):  # the first call finds the plan, the second takes the hot path
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = module(xa), twin(xb)
        torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-4)
        ya.sum().backward()
        yb.sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad, atol=1e-5, rtol=1e-4)
    assert module._convtune_fast[x.shape] == plan.native
    torch.testing.assert_close(module.weight.grad, twin.weight.grad, atol=1e-5, rtol=1e-4)
    # another signature leaves the hot path for the full one, which tunes it
    y = module(torch.randn(1, 6, 3, 3))
    assert y.shape == (1, 4, 3, 3) and len(module.selections) == 2


class _Logged(torch.Tensor):
    """A tensor subclass that records the functions __torch_function__ sees."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


class _LoggingMode(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_the_hot_path_calls_the_op_directly_yet_honours_torch_function(native):
    # Plain tensors go straight to the C++ op (no torch.ops on the way); a subclass with __torch_function__,
    # or a TorchFunctionMode, sees the op called as Python calls it, with the same result.
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    module = _forced(x, "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1)
    expected = F.conv2d(x, module.weight, module.bias)
    module(x)
    assert module._convtune_fast[x.shape] == next(iter(module.selections.values())).native
    with _LoggingMode() as mode:
        torch.testing.assert_close(module(x), expected)
    assert torch.ops.convtune.tuned_conv.default in mode.seen
    _Logged.seen = []
    y = module(x.as_subclass(_Logged))
    assert type(y) is _Logged and torch.ops.convtune.tuned_conv.default in _Logged.seen
    torch.testing.assert_close(y.as_subclass(torch.Tensor), expected)
    with _LoggingMode() as mode:
        torch.testing.assert_close(module(x.contiguous()), expected)  # other strides: the full path, then the op
    torch.testing.assert_close(module(x), expected)  # plain again: direct


@pytest.mark.parametrize("compiled", [False, True])
def test_a_layer_on_the_python_path_runs_its_other_directions_by_their_executables(native, compiled):
    from convtune.pytorch import ops

    x = torch.randn(2, 6, 5, 5)
    module = _forced(x, "torch:native", in_channels=6, out_channels=4, kernel_size=3, padding=1)
    sig, selection = next(iter(module.selections.items()))
    mixed = LayerSelection(selection.problem, "direct:taps", "torch:native", "gemm:im2col")
    module._convtune_select(sig, mixed)
    assert mixed.runtime == "python" and "direct:taps runs in Python only" in mixed.python_reason
    calls = ops.Call(*mixed.call.names())
    assert [type(calls.runner(d)).__name__ for d in ("fwd", "bwd_data", "bwd_filter")] == [
        "Runner", "NativeRunner", "Runner"]
    twin = torch.nn.Conv2d(6, 4, 3, padding=1)
    twin.load_state_dict(module.state_dict())
    run = torch.compile(module, backend="aot_eager", fullgraph=True) if compiled else module
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = run(xa), twin(xb)
    torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-4)
    (ya * ya).sum().backward()
    (yb * yb).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(module.weight.grad, twin.weight.grad, atol=1e-4, rtol=1e-4)
    with settings.override(native=False):  # switched off: every direction by its Python algorithm
        assert type(ops.Call(*mixed.call.names()).runner("bwd_data")).__name__ == "Runner"


def test_autocast_casts_in_the_native_op_as_torch_does(native):
    x = torch.randn(2, 6, 5, 5)
    module = _forced(x.bfloat16(), "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1)
    twin = torch.nn.Conv2d(6, 4, 1)
    twin.load_state_dict(module.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = module(x), twin(x)
        y = module(x)  # the hot path: the C++ autocast kernel casts
    assert y.dtype == torch.bfloat16 and module._convtune_fast[x.shape] == next(iter(module.selections.values())).native
    assert rel_error(y.detach().float(), yr.detach().float()) < 1.6e-2


def test_a_layer_that_pads_first_casts_in_the_op_under_autocast_and_trains_like_torch(native):
    # padding_mode='reflect' pads in Python on every call (never the hot path); the op casts the padded
    # input and the weight (through autocast's cache), so the weight's gradient arrives in float32.
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    module = _forced(x.bfloat16(), "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1, padding=1,
                     padding_mode="reflect").to(memory_format=torch.channels_last)
    twin = torch.nn.Conv2d(6, 4, 1, padding=1, padding_mode="reflect").to(memory_format=torch.channels_last)
    twin.load_state_dict(module.state_dict())
    assert next(iter(module.selections.values())).runtime == "native"
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, yr = module(x), twin(x)
        assert y.dtype == torch.bfloat16 and y.shape == (2, 4, 7, 7) and module._convtune_fast == {}
        assert rel_error(y.detach().float(), yr.detach().float()) < 1.6e-2
    y.float().sum().backward()
    yr.float().sum().backward()
    assert module.weight.grad.dtype == torch.float32
    assert rel_error(module.weight.grad, twin.weight.grad) < 1.6e-2


def test_copies_and_pickles_of_a_native_model_run_alike(native):
    x = torch.randn(2, 4, 7, 7)
    model = torch.nn.Sequential(_forced(x, "gemm:1x1_strided", in_channels=4, out_channels=6, kernel_size=1,
                                        stride=2), torch.nn.ReLU())
    expected = model(x)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin[0]._convtune_fast == {}
        torch.testing.assert_close(twin(x), expected)
        torch.testing.assert_close(twin(x), expected)  # the hot path
        assert next(iter(twin[0].selections.values())).runtime == "native"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=False)(x), expected)


def test_two_threads_run_native_layers_at_once(native):
    x = torch.randn(4, 6, 9, 9)
    module = _forced(x, "gemm:1x1", in_channels=6, out_channels=8, kernel_size=1)
    expected = module(x)
    wrong, errors = [], []

    def work():
        try:
            for _ in range(30):
                xa = x.clone().requires_grad_()
                y = module(xa)
                y.sum().backward()
                if not torch.allclose(y, expected, atol=1e-5):
                    wrong.append(1)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong


def test_two_threads_meet_new_shapes_in_compiled_code_at_once(native, monkeypatch):
    # Both threads' ops ask the tuner (with the GIL, from C++) for shapes no one has selected for yet, and one
    # thread's backward asks from the autograd engine's thread: every answer lands in the table, nothing
    # deadlocks, every result is right.
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    module = _forced(x, "gemm:1x1", in_channels=6, out_channels=8, kernel_size=1)
    twin = torch.nn.Conv2d(6, 8, 1)
    twin.load_state_dict(module.state_dict())
    _selecting(monkeypatch, "gemm:1x1")
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)
    compiled(x)  # traced once, before the threads
    errors: list = []

    def work(batches):
        try:
            for batch in batches:
                xa = torch.randn(batch, 6, 5, 5).to(memory_format=torch.channels_last).requires_grad_()
                y = compiled(xa)
                y.sum().backward()
                torch.testing.assert_close(y, twin(xa), atol=1e-5, rtol=1e-4)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(batches,)) for batches in ((3, 4, 5, 3), (5, 4, 3, 6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    shapes = {tuple(e[0]): e for e in native.layer_entries(module._convtune_layer)}
    assert set(shapes) == {(b, 6, 5, 5) for b in (2, 3, 4, 5, 6)}
    assert all(native.kind(h) == "gemm_1x1" for e in shapes.values() for h in e[4])


def test_torch_export_with_a_dynamic_batch_keeps_the_layer_op(native):
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    module = _forced(x, "gemm:1x1", in_channels=6, out_channels=8, kernel_size=1)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(module, (x,), dynamic_shapes=({0: batch},))
    assert [str(n.target) for n in program.graph.nodes if n.op == "call_function"] == ["convtune.layer_conv.default"]
    other = torch.randn(5, 6, 5, 5).to(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(other), F.conv2d(other, module.weight, module.bias),
                                   atol=1e-5, rtol=1e-4)


def test_a_static_entry_holds_the_handles_its_gradients_need_and_stays_when_other_directions_are_tuned(native):
    # An inference graph guards its entry: a training step tuned later (or asked for by compiled code) must not
    # change it, or the inference graph would be compiled again.
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    module = ct.nn.Conv2d(6, 8, 1, mode="get")
    sig = Signature(tuple(x.shape), x.dtype, x.device, layout_of(x))
    key = ConvProblem.from_module(module, sig.shape, dtype=sig.dtype, layout=sig.layout).key
    inference = dict(_traced_keys(sig, tuple(module.weight.shape)))[(False, False)]
    module._convtune_select(sig, LayerSelection(key, "gemm:1x1", "", ""))
    before = module._convtune_static[inference]
    assert before[0] and before[1:] == (0, 0) and len(module._convtune_static) == 1  # the gradients: not tuned
    module._convtune_from_compiled.add(sig)  # (as if compiled code had asked for the gradients)
    module._convtune_select(sig, LayerSelection(key, "gemm:1x1", "gemm:1x1", "gemm:1x1"))
    assert module._convtune_static == {inference: before}  # the graphs that asked keep the layer op
    module._convtune_from_compiled.clear()
    module._convtune_select(sig, LayerSelection(key, "gemm:1x1", "gemm:1x1", "gemm:1x1"))
    entries = {needs: module._convtune_static[k] for needs, k in _traced_keys(sig, tuple(module.weight.shape))}
    assert entries[(False, False)] == before and all(entries[(True, True)])
    assert entries[(True, False)][2] == 0 and entries[(False, True)][1] == 0


def test_torch_export_of_a_static_shape_takes_the_layer_op_not_this_processs_handles(native):
    # An exported program may run in a process that has not made the executables its handles name: the layer op,
    # which runs PyTorch's convolution where its layer does not exist, serves it, as compiled code's table does not.
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    module = _forced(x, "gemm:1x1", in_channels=6, out_channels=8, kernel_size=1)
    assert all(module._convtune_static.values())  # handles, which compiled code calls
    program = torch.export.export(module, (x,))
    assert [str(n.target) for n in program.graph.nodes if n.op == "call_function"] == ["convtune.layer_conv.default"]
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), F.conv2d(x, module.weight, module.bias), atol=1e-5, rtol=1e-4)


def test_an_inner_op_asked_for_a_gradient_names_itself_and_the_operand_not_only_double_backward(native):
    # run_decompositions traces the layer op's autograd into layer_run, which has no derivative: that program called
    # with gradients on (its weight a Parameter) raises, and the error says which op and operand, and what to do; it
    # said a double backward was asked for, where none was.
    x = torch.randn(2, 6, 5, 5)
    module = _forced(x, "gemm:1x1", in_channels=6, out_channels=8, kernel_size=1)
    program = torch.export.export(module, (x,)).run_decompositions()
    assert "convtune.layer_run.default" in [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    with pytest.raises(NotImplementedError, match=r"convtune::layer_run has no derivative, yet its operand w requires "
                                                  r"grad.*no double backward.*torch\.no_grad"):
        program.module()(x)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), F.conv2d(x, module.weight, module.bias), atol=1e-5, rtol=1e-4)
    p = ConvProblem("bwd_data", n=2, c=6, k=8, input_size=(5, 5), kernel_size=1)
    h = runtime.executable(p, ct.get_algorithm("gemm:1x1", p))
    dy, w = p.random_inputs()
    with pytest.raises(NotImplementedError, match=r"convtune::tuned_run has no derivative, yet its operand dy requires "
                                                  r"grad.*no double backward"):
        torch.ops.convtune.tuned_run(dy.requires_grad_(), w, h)


def test_a_failed_build_falls_back_to_the_python_path_with_one_warning(native, monkeypatch, tmp_path):
    monkeypatch.setattr(extension, "_state", {"module": None, "error": None, "build_s": None})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    x = torch.randn(2, 6, 5, 5)
    with settings.override(extension_dir=str(tmp_path / "ext")), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = _forced(x, "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1)
        y = module(x)
        module(x)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "Install a C++ compiler" in messages[0], messages
    plan = next(iter(module.selections.values()))
    assert plan.runtime == "python" and "extension is not available" in plan.python_reason
    torch.testing.assert_close(y, F.conv2d(x, module.weight, module.bias), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fault", ["folder is a file", "folder not writable", "no build tools"])
def test_a_build_folder_that_cannot_be_written_or_missing_build_tools_fall_back_too(native, monkeypatch, tmp_path,
                                                                                     fault):
    # a read-only cache (or a file where the folder should be) and a torch without setuptools used to raise from the
    # layer's first call, again on every call, instead of warning once and keeping the Python path
    monkeypatch.setattr(extension, "_state", {"module": None, "error": None, "build_s": None})
    (tmp_path / "file").write_text("")
    folder = tmp_path / "file" / "ext" if fault == "folder is a file" else tmp_path / "ext"
    if fault == "folder not writable":  # another user's folder (chmod would not stop root, who runs CI)
        folder.mkdir()
        monkeypatch.setattr(extension, "_writable", lambda path: not Path(path).is_relative_to(folder))
    if fault == "no build tools":
        monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", None)  # its import fails, as without setuptools
        monkeypatch.delattr(torch.utils, "cpp_extension", raising=False)
    x = torch.randn(2, 6, 5, 5)
    with settings.override(extension_dir=str(folder)), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = _forced(x, "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1)
        y = module(x)
        module(x)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    fix = "Install a C++ compiler" if fault == "no build tools" else "CONVTUNE_EXTENSION_DIR to a folder this user can"
    assert len(messages) == 1 and fix in messages[0] and "CONVTUNE_NATIVE=0" in messages[0], messages
    assert next(iter(module.selections.values())).runtime == "python"
    torch.testing.assert_close(y, F.conv2d(x, module.weight, module.bias), atol=1e-5, rtol=1e-4)


def test_the_native_runtime_can_be_switched_off(native):
    x = torch.randn(2, 6, 5, 5)
    with settings.override(native=False):
        module = _forced(x, "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1)
    plan = next(iter(module.selections.values()))
    assert plan.runtime == "python" and "CONVTUNE_NATIVE=0" in plan.python_reason


def test_import_convtune_builds_nothing_imports_no_dynamo_and_offers_nn():
    code = ("import sys, convtune as ct; assert ct.nn.Conv2d; "
            "assert 'convtune._C' not in sys.modules and 'convtune_C' not in sys.modules; "
            "assert 'torch._dynamo' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_a_finished_build_loads_without_the_build_tools(native):
    # torch.utils.cpp_extension imports setuptools: a warm start that only loads the library must not pay it.
    code = ("import sys, torch; from convtune import extension; assert extension.load() is not None; "
            "assert 'torch.utils.cpp_extension' not in sys.modules, 'the build tools were imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_cuda_toolkit_is_found_as_torch_finds_it(monkeypatch, tmp_path):
    from convtune import extension

    for name in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    bin_dir = tmp_path / "toolkit" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "nvcc").write_text("#!/bin/sh\n")
    (bin_dir / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert extension._cuda_home() == str(tmp_path / "toolkit")  # the folder above nvcc on PATH
    monkeypatch.setenv("CUDA_PATH", "/opt/a")
    assert extension._cuda_home() == "/opt/a"
    monkeypatch.setenv("CUDA_HOME", "/opt/b")  # CUDA_HOME first, as torch.utils.cpp_extension has it
    assert extension._cuda_home() == "/opt/b"


def test_optimize_and_running_a_tuned_model_import_no_dynamo():
    # Dynamo costs about a second to import: a warm optimize must not pay it (torch.compile does, later).
    code = ("import sys, torch, convtune as ct; m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()); "
            "x = torch.randn(1, 3, 6, 6); ct.optimize(m, x, mode='get', training=True); m(x).sum().backward(); "
            "c = ct.nn.Conv2d(4, 4, 1, mode='get'); c(m(x)); assert isinstance(m[0], ct.nn.Conv2d); "
            "assert 'torch._dynamo' not in sys.modules, 'Dynamo was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# -- torch.compile ---------------------------------------------------------------------------------

def _native_model(x: torch.Tensor) -> torch.nn.Module:
    first = _forced(x, "gemm:1x1", in_channels=6, out_channels=8, kernel_size=1)
    mid = torch.randn(x.shape[0], 8, *x.shape[2:]).to(memory_format=torch.channels_last)
    second = _forced(mid, "gemm:1x1_strided", in_channels=8, out_channels=4, kernel_size=1, stride=2, bias=False)
    return torch.nn.Sequential(first, torch.nn.ReLU(), second, torch.nn.Tanh())


def _native_model_and_torch_layer(x: torch.Tensor) -> torch.nn.Module:
    """``_native_model`` and a layer on PyTorch's call in every direction after it."""
    model = _native_model(x)
    torch_layer = ct.nn.Conv2d(4, 4, 3, padding=1)
    torch_layer._convtune_select(Signature((2, 4, 3, 3), x.dtype, x.device, "channels_last"),
                                 LayerSelection(ConvProblem.from_module(torch_layer, (2, 4, 3, 3),
                                                                        layout="channels_last").key,
                                                "torch:native", "torch:native", "torch:native"))
    model.append(torch_layer)
    return model


@pytest.mark.slow
def test_a_compiled_training_step_is_right_whatever_layouts_inductor_picks_between_the_layers(native):
    # channels_first layers between PyTorch's convolutions: Inductor on the CPU propagates channels_last
    # gradients there while lowering, and runs tuned_run's meta kernel on them.
    torch.manual_seed(0)
    x = torch.randn(4, 3, 12, 12)
    first = torch.nn.Conv2d(3, 16, 3, padding=1)
    mid = torch.randn(4, 16, 12, 12)
    model = torch.nn.Sequential(first, torch.nn.ReLU(),
                                _forced(mid, "gemm:1x1", in_channels=16, out_channels=32, kernel_size=1),
                                torch.nn.ReLU(),
                                _forced(torch.randn(4, 32, 12, 12), "gemm:im2col", in_channels=32, out_channels=16,
                                        kernel_size=3, padding=1),
                                torch.nn.ReLU(), torch.nn.Conv2d(16, 8, 3, stride=2))
    twin = copy.deepcopy(model)
    assert [m.selections[next(iter(m.selections))].runtime for m in (model[2], model[4])] == ["native", "python"]
    compiled = torch.compile(model)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = compiled(xa)
    y.sum().backward()
    _trains_like(model, y, xa, twin, xb, atol=1e-4)


def _trains_like(model: torch.nn.Module, y: torch.Tensor, x: torch.Tensor, twin: torch.nn.Module,
                 x_twin: torch.Tensor, atol: float) -> None:
    """``twin``'s forward and backward on ``x_twin`` give ``model``'s result ``y`` and gradients (its step on ``x``
    has run)."""
    yb = twin(x_twin)
    yb.sum().backward()
    torch.testing.assert_close(y, yb, atol=atol, rtol=1e-4)
    torch.testing.assert_close(x.grad, x_twin.grad, atol=atol, rtol=1e-4)
    for (name, pa), pb in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("backend,dynamic", [("aot_eager", False),
                                             pytest.param("inductor", False, marks=pytest.mark.slow),
                                             pytest.param("inductor", True, marks=pytest.mark.slow)])
def test_torch_compile_calls_the_native_op_in_one_graph_forward_and_backward(native, backend, dynamic, monkeypatch,
                                                                              tmp_path):
    # Inductor's caches of its own: a graph compiled for another version of the extension would be served from them
    # (its ops' C++ is not part of their keys), so the generated code read below would not be this version's.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(2, 6, 6, 6).to(memory_format=torch.channels_last)
    model = _native_model(x)
    twin = copy.deepcopy(model)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)

    def step():
        y = compiled(xa)
        y.sum().backward()
        return y

    if backend == "inductor":
        y, code = run_and_get_code(step)
        text = "\n".join(code)
        assert "convtune.pytorch" not in text  # the ops, no Python of ours
        if dynamic:  # symbolic shapes: the layer ops, which look each shape up
            assert "convtune.layer_run" in text  # the forward of both layers
            # both gradients in one call of the op per layer (the input needs its gradient, so every layer's does)
            assert "convtune.layer_backward.default" in text
            assert "convtune.layer_backward_data" not in text and "convtune.layer_backward_filter" not in text
        else:  # static shapes chosen in eager code: the executables by handle, one call per direction
            assert "convtune.tuned_run.default" in text and "convtune.layer_" not in text
            assert text.count("convtune.tuned_run.default(") == 6  # two layers, three directions each
    else:
        y = step()
    _trains_like(model, y, xa, twin, xb, atol=1e-5)


def test_compiled_code_reads_one_table_entry_per_tuned_layer_not_its_selections(native, monkeypatch):
    # Dynamo guards what the traced forward reads: a tuned layer must read its table entry only (a string key),
    # never the selections (whose keys and values would be guarded field by field on every call).
    x = torch.randn(2, 6, 6, 6).to(memory_format=torch.channels_last)
    model = _native_model_and_torch_layer(x)
    twin = copy.deepcopy(model)
    assert all(len(m._convtune_traced) == 4 for m in (model[0], model[2], model[4]))  # every gradient tuned
    assert model[4]._convtune_traced[next(iter(model[4]._convtune_traced))] == ()  # PyTorch's own call

    _traced_only(monkeypatch)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = compiled(xa)
    y.sum().backward()
    monkeypatch.undo()
    _trains_like(model, y, xa, twin, xb, atol=1e-5)

    # A layer that computes something else now (its stride) forgets its entries: the compiled code is traced
    # again, and the layer tunes its new geometry on the full path.
    model[4].stride = (2, 2)
    assert model[4]._convtune_traced == {} and model[4]._convtune_static == {} and model[4].selections == {}
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(compiled(x), expected, atol=1e-5, rtol=1e-4)
    assert expected.shape == (2, 4, 2, 2)


def test_compiled_code_guards_one_table_entry_of_a_layer_of_static_shape_and_nothing_else_of_convtunes(native):
    # Dynamo checks every guard before every call of compiled code: beyond what nn.Conv2d's forward reads, a tuned
    # layer of static shape adds its choice, one entry of one table (the executables' handles or PyTorch's call).
    x = torch.randn(2, 6, 6, 6).to(memory_format=torch.channels_last)
    model = _native_model_and_torch_layer(x)
    x.requires_grad_()
    kinds = [{bool(entry) for entry in model[i]._convtune_static.values()} for i in (0, 2, 4)]
    assert kinds == [{True}, {True}, {False}]  # the executables' handles twice, PyTorch's call
    guarded = {g.name for g in torch._dynamo.explain(model)(x).out_guards}
    ours = {name for name in guarded if name.startswith("L['fn']._modules") and "_convtune" in name}  # the layers'
    assert {name for name in guarded if name.startswith("L['fn']._modules")} - ours  # (nn.Conv2d's own: weight, ...)
    tables = {f"L['fn']._modules['{i}']._convtune_static" for i in (0, 2, 4)}
    assert tables <= ours and all(any(name.startswith(t) for t in tables) for name in ours), sorted(ours)
    assert len(ours) == 6, sorted(ours)  # each table and its one entry


def _traced_only(monkeypatch) -> None:
    """Tracing a tuned layer's full path fails from now on (the test undoes it with monkeypatch.undo())."""
    def full_path(module, input):
        raise AssertionError("the traced forward took the full path")

    monkeypatch.setattr(TunedConv, "_convtune_forward", full_path)


def test_the_traced_table_keys_what_autocast_and_the_gradients_make_of_the_input(native, monkeypatch):
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module = _forced(x.bfloat16(), "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1)
    module.weight.requires_grad_(False)  # frozen: only the input's gradient is needed
    twin = copy.deepcopy(module)
    _traced_only(monkeypatch)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=False)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = compiled(xa)  # float32 input, bfloat16 choice: the key names the dtype autocast computes in
        with torch.no_grad():
            compiled(x)
    monkeypatch.undo()
    y.float().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb = twin(xb)
    yb.float().sum().backward()
    torch.testing.assert_close(y, yb)
    torch.testing.assert_close(xa.grad, xb.grad)
    assert module.weight.grad is None


def _counting_backend(graphs: list) -> object:
    """A torch.compile backend that runs each graph as traced (autograd through the ops' own) and keeps it."""
    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward
    return backend


def _layer_shapes(module: TunedConv) -> set[tuple[int, ...]]:
    return {tuple(entry[0]) for entry in extension.loaded().layer_entries(module._convtune_layer)}


@pytest.mark.parametrize("backend", ["counting", "aot_eager"])
def test_compiled_with_dynamic_shapes_one_graph_runs_and_tunes_every_shape(native, backend):
    # Symbolic shapes: each layer's op looks its input up on every call, and a shape met first in compiled code is
    # selected for then: one graph, no break (fullgraph), no recompilation, right on every shape.
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    model = _native_model(x)
    twin = copy.deepcopy(model)
    graphs: list = []
    compiled = torch.compile(model, backend=_counting_backend(graphs) if backend == "counting" else backend,
                             fullgraph=True, dynamic=True)
    for batch, size in ((2, 5), (3, 5), (2, 9), (3, 5)):
        xa = torch.randn(batch, 6, size, size).to(memory_format=torch.channels_last).requires_grad_()
        xb = xa.detach().clone().requires_grad_()
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
        y = compiled(xa)
        y.sum().backward()
        _trains_like(model, y, xa, twin, xb, atol=1e-5)
    assert _layer_shapes(model[0]) == {(2, 6, 5, 5), (3, 6, 5, 5), (2, 6, 9, 9)}
    assert _layer_shapes(model[2]) == {(2, 8, 5, 5), (3, 8, 5, 5), (2, 8, 9, 9)}
    for module in (model[0], model[2]):  # each new shape selected for in every direction
        for shape, dtype, _device, channels_last, _handles, tuned in extension.loaded().layer_entries(
                module._convtune_layer):
            assert all(tuned) and channels_last and dtype == "float32", shape
    if backend == "counting":
        assert len(graphs) == 1
        assert str(graphs[0].code).count("convtune.layer_conv") == 2


GEOMETRIES = [  # (input shape, module): strided, dilated, grouped, depthwise, 1-D, 3-D, 'same' padding
    ((2, 4, 9, 7), lambda: torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1)),
    ((2, 4, 9, 9), lambda: torch.nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=2)),
    ((2, 6, 8, 8), lambda: torch.nn.Conv2d(6, 6, 5, padding=2, groups=6, bias=False)),
    ((2, 3, 11), lambda: torch.nn.Conv1d(3, 5, 4, stride=3)),
    ((1, 2, 5, 4, 6), lambda: torch.nn.Conv3d(2, 3, 3, padding=1)),
    ((2, 4, 7, 7), lambda: torch.nn.Conv2d(4, 3, 3, padding="same")),
]


@pytest.mark.parametrize("index", range(len(GEOMETRIES)))
def test_a_layer_without_an_answer_runs_torch_convolution_and_passes_opcheck(native, index):
    # A layer whose module is gone (or never was), a stale id, another geometry: every signature runs PyTorch's
    # convolution, forward and both gradients, with the meta kernel's shape and memory format; nothing is kept.
    # torch.library.opcheck tests the registrations (schema, fake kernel, autograd).
    shape, make = GEOMETRIES[index]
    torch.manual_seed(index)
    conv = make().double()
    geometry = (list(conv.stride), [lo for lo, _ in explicit_padding(conv)], list(conv.dilation), conv.groups)
    layer = native.layer_new(*geometry, list(conv.weight.shape))
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    try:
        for ident in (layer, layer + 10**6):  # the layer, and an id no layer has
            args = (x, conv.weight, conv.bias, *geometry, ident, True, True)
            torch.autograd.gradcheck(
                lambda x, w, *b, ident=ident: torch.ops.convtune.layer_conv(x, w, b[0] if b else None, *geometry, ident,
                                                                            True, True),
                (x, conv.weight) + (() if conv.bias is None else (conv.bias,)))
            torch.testing.assert_close(torch.ops.convtune.layer_conv(*args), conv(x))
            torch.library.opcheck(torch.ops.convtune.layer_conv.default, args)
            # one gradient alone (the input's, the weight's): the op of that direction, not the one of both
            w, xd = conv.weight.detach(), x.detach()
            torch.autograd.gradcheck(
                lambda x, w=w, ident=ident: torch.ops.convtune.layer_conv(x, w, None, *geometry, ident, True, False),
                (x,))
            torch.autograd.gradcheck(
                lambda w, xd=xd, ident=ident: torch.ops.convtune.layer_conv(xd, w, None, *geometry, ident, False, True),
                (conv.weight,))
            for operands, op in (((x, w), "layer_backward_data"), ((xd, conv.weight), "layer_backward_filter"),
                                 ((x, conv.weight), "layer_backward")):
                y = torch.ops.convtune.layer_conv(*operands, None, *geometry, ident, True, True)
                with torch.profiler.profile() as profile:
                    y.sum().backward()
                ran = {e.name for e in profile.events() if e.name.startswith("convtune::layer_backward")}
                assert ran == {f"convtune::{op}"}, ran
            dy = torch.randn_like(conv(x)).detach()
            torch.library.opcheck(torch.ops.convtune.layer_backward.default, (dy, xd, w, *geometry, ident))
        assert native.layer_entries(layer) == []  # nothing answered: no entry kept
    finally:
        native.layer_drop(layer)
    with pytest.raises(ValueError, match=f"no layer has id {layer}"):
        native.layer_entries(layer)


@pytest.mark.parametrize("bad", [dict(stride=[0, 1]), dict(dilation=[1, -1]), dict(padding=[-1, 0]),
                                 dict(groups=0), dict(stride=[1])])
def test_a_layer_op_with_a_geometry_no_convolution_has_raises_a_value_error(native, bad):
    geometry = dict(stride=[1, 1], padding=[0, 0], dilation=[1, 1], groups=1) | bad
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    for device in ("cpu", "meta"):  # the meta kernel too (what torch.compile runs): no division by a zero stride
        with pytest.raises(ValueError, match="convtune: a layer"):
            torch.ops.convtune.layer_conv(x.to(device), w.to(device), None, *geometry.values(), 0, False, False)
    with pytest.raises(ValueError, match="convtune: a layer"):
        native.layer_new(*geometry.values(), [3, 2, 3, 3])


def test_a_layer_entry_runs_its_executables_and_a_copy_makes_its_own_layer(native, poisoned):
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    module = _forced(x, "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1)
    (shape, dtype, device, channels_last, handles, tuned), = native.layer_entries(module._convtune_layer)
    assert (tuple(shape), dtype, device, channels_last) == ((2, 6, 5, 5), "float32", "cpu", True)
    assert tuple(handles) == next(iter(module.selections.values())).native and all(tuned)
    assert [native.kind(h) for h in handles] == ["gemm_1x1"] * 3
    xa = x.clone().requires_grad_()
    y = torch.ops.convtune.layer_conv(xa, module.weight, module.bias, *module._convtune_geometry,
                                      module._convtune_layer, True, True)
    y.sum().backward()
    twin = torch.nn.Conv2d(6, 4, 1)
    twin.load_state_dict(module.state_dict())
    xb = x.clone().requires_grad_()
    _trains_like(module, y, xa, twin, xb, atol=1e-5)
    module.zero_grad()  # the weight's gradient alone (an input that needs none): its executable, dy expanded
    torch.ops.convtune.layer_conv(x, module.weight, None, *module._convtune_geometry, module._convtune_layer, False,
                                  True).sum().backward()
    twin.zero_grad()
    torch.nn.functional.conv2d(x, twin.weight).sum().backward()
    torch.testing.assert_close(module.weight.grad, twin.weight.grad, atol=1e-5, rtol=1e-4)
    for copied in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert copied._convtune_layer not in (0, module._convtune_layer)
        assert _layer_shapes(copied) == {(2, 6, 5, 5)}
    layer = module._convtune_layer
    module.stride = (1, 1)  # a new geometry: its layer goes, and the next choice makes one
    assert module._convtune_layer == 0
    with pytest.raises(ValueError, match="no layer has id"):
        native.layer_entries(layer)


def test_a_layer_with_a_choice_on_the_python_path_compiles_through_its_traced_table(native, monkeypatch):
    # The layer's op cannot call the Python path: such a layer keeps the table keyed by shape under compile.
    x = torch.randn(2, 4, 6, 6)
    module = _forced(x, "direct:taps", in_channels=4, out_channels=4, kernel_size=3, padding=1)
    other = torch.randn(3, 4, 6, 6)
    sig = Signature(tuple(other.shape), other.dtype, other.device, layout_of(other))
    module._convtune_select(sig, LayerSelection(
        ConvProblem.from_module(module, sig.shape, layout=sig.layout).key, "torch:native", "torch:native",
        "torch:native"))
    assert module._convtune_full_path and module._convtune_layer
    twin = torch.nn.Conv2d(4, 4, 3, padding=1)
    twin.load_state_dict(module.state_dict())
    for dynamic in (False, True):  # symbolic shapes: each size specialized, the key a constant
        graphs: list = []
        compiled = torch.compile(module, backend=_counting_backend(graphs), dynamic=dynamic)
        with torch.no_grad():
            for inp in (x, other, torch.randn(5, 4, 7, 7)):  # the last a shape not tuned: tuned at a graph break
                torch.testing.assert_close(compiled(inp), twin(inp), atol=1e-5, rtol=1e-4)
        code = "\n".join(str(g.code) for g in graphs)
        assert "convtune.conv" in code and "layer_conv" not in code  # the Python path, traced
    assert module.selections[Signature((5, 4, 7, 7), x.dtype, x.device, "channels_first")]


def test_explain_says_what_compiled_code_traces_for_each_layer(native, monkeypatch):
    x = torch.randn(2, 4, 6, 6)
    plain = ct.nn.Conv2d(4, 4, 3, padding=1, mode="get")
    padded = ct.nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect", mode="get")  # pads first
    for conv in (plain, padded):
        conv(x)
    # on the CPU 'get' picks PyTorch's call, which compiled code calls for a static shape, padding first or not
    assert {row["compiled"] for row in ct.explain(plain)} == {"torch"}
    assert {row["compiled"] for row in ct.explain(padded)} == {"torch"}
    # (the selections below have no measurements, so explain has no rows for them: what it reads is checked)
    sig, other = (Signature(shape, x.dtype, x.device, "channels_first") for shape in ((2, 4, 6, 6), (3, 4, 6, 6)))
    _selecting(monkeypatch, "gemm:im2col")  # the Python path
    python = ct.nn.Conv2d(4, 4, 3, padding=1)
    python(x)
    assert python._convtune_compiled_as(sig) == "by shape"
    _selecting(monkeypatch, "gemm:1x1")  # an executable
    one = ct.nn.Conv2d(4, 4, 1)
    one(x)
    assert one._convtune_compiled_as(sig) == "executables"
    one._convtune_select(other, LayerSelection(ConvProblem.from_module(one, other.shape).key, "gemm:im2col", "", ""))
    # another signature on the Python path: the layer compiles shape by shape, and this one still by its handles
    assert (one._convtune_compiled_as(sig), one._convtune_compiled_as(other)) == ("executables", "by shape")


def _selecting(monkeypatch, algorithm: str) -> None:
    """Every selection from now on runs ``algorithm`` in every direction (as if tuned so)."""
    def tune(module, sig, need_dx, need_dw):
        p = ConvProblem.from_module(module, sig.shape, dtype=sig.dtype, layout=sig.layout)
        selection = LayerSelection(p.key, algorithm, algorithm, algorithm)
        module._convtune_select(sig, selection)
        return selection

    monkeypatch.setattr(TunedConv, "_convtune_tune", tune)


def test_new_shapes_met_in_compiled_code_run_their_executables_from_the_layer_table(native, monkeypatch):
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    module = _native_model(x)[0]  # a 1x1 layer on gemm:1x1
    twin = copy.deepcopy(torch.nn.Sequential(module))
    _selecting(monkeypatch, "gemm:1x1")
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)
    for batch in (3, 4):
        xa = torch.randn(batch, 6, 5, 5).to(memory_format=torch.channels_last).requires_grad_()
        xb = xa.detach().clone().requires_grad_()
        for m in (module, twin[0]):
            m.zero_grad(set_to_none=True)
        y = compiled(xa)
        y.sum().backward()
        _trains_like(module, y, xa, twin[0], xb, atol=1e-5)
    entries = {tuple(e[0]): e for e in native.layer_entries(module._convtune_layer)}
    assert set(entries) == {(2, 6, 5, 5), (3, 6, 5, 5), (4, 6, 5, 5)}
    for shape in ((3, 6, 5, 5), (4, 6, 5, 5)):
        handles = entries[shape][4]
        assert [native.kind(h) for h in handles] == ["gemm_1x1"] * 3, shape


def test_compiled_code_selects_with_autograd_on_and_autocast_off(native, monkeypatch):
    # The ops run below autograd and autocast; the selection they ask for measures as convtune does elsewhere.
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module = _forced(x.bfloat16(), "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1)
    seen = []
    original = TunedConv._convtune_tune

    def tune(self, sig, need_dx, need_dw):
        probe = torch.ones(2, requires_grad=True)
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), (probe * 2).grad_fn is not None,
                     sig.dtype))
        return original(self, sig, need_dx, need_dw)

    monkeypatch.setattr(TunedConv, "_convtune_tune", tune)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(torch.randn(3, 6, 5, 5).to(memory_format=torch.channels_last).requires_grad_()).sum().backward()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):  # a compiled call in inference mode
        torch.compile(module, backend="aot_eager", dynamic=True)(torch.randn(4, 6, 5, 5))
    assert len(seen) == 2 and all(s == (True, False, True, torch.bfloat16) for s in seen), seen


def test_a_layer_id_with_another_weight_shape_runs_torch_convolution(native):
    # What a graph compiled in another process may do: name a layer of the same geometry by an id that here
    # belongs to a layer with another weight (ResNet's 1x1 64->64 and 64->256 convolutions, say).
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    module = _forced(x, "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1)
    other = torch.randn(8, 6, 1, 1)
    y = torch.ops.convtune.layer_conv(x, other, None, *module._convtune_geometry, module._convtune_layer, False, False)
    torch.testing.assert_close(y, F.conv2d(x, other))
    assert {tuple(e[0]) for e in native.layer_entries(module._convtune_layer)} == {(2, 6, 5, 5)}


def test_a_python_path_choice_made_for_compiled_code_keeps_the_graph_whole(native, monkeypatch):
    # A new shape whose selection is on the Python path (which the op cannot call) runs PyTorch's call there; the
    # layer stays on its op, so a graph compiled whole (fullgraph) is neither recompiled nor broken.
    x = torch.randn(2, 4, 6, 6)
    module = _forced(x, "gemm:im2col", in_channels=4, out_channels=4, kernel_size=3, padding=1)
    module._convtune_selections.clear()
    module._convtune_select(Signature(tuple(x.shape), x.dtype, x.device, "channels_first"), LayerSelection(
        ConvProblem.from_module(module, x.shape).key, "torch:native", "torch:native", "torch:native"))
    assert module._convtune_layer and not module._convtune_full_path
    twin = torch.nn.Conv2d(4, 4, 3, padding=1)
    twin.load_state_dict(module.state_dict())
    _selecting(monkeypatch, "direct:taps")
    graphs: list = []
    compiled = torch.compile(module, backend=_counting_backend(graphs), fullgraph=True, dynamic=True)
    with torch.no_grad():
        for batch in (2, 3, 5, 7):
            inp = torch.randn(batch, 4, 6, 6)
            torch.testing.assert_close(compiled(inp), twin(inp), atol=1e-5, rtol=1e-4)
    assert len(graphs) == 1 and not module._convtune_full_path
    sig = Signature((5, 4, 6, 6), x.dtype, x.device, "channels_first")
    assert module.selections[sig].runtime == "python" and sig in module._convtune_from_compiled
    module._convtune_forget(sig)  # forgotten: an eager call's choice for it counts again
    assert sig not in module._convtune_from_compiled
    module.padding = (1, 1)  # a geometry change drops every choice, and with them what compiled code asked for
    assert module._convtune_from_compiled == set() and module._convtune_layer == 0


def test_a_layer_of_a_dtype_no_table_keys_runs_as_before(native):
    conv = ct.nn.Conv2d(2, 2, 3, mode="get", dtype=torch.complex64)
    x = torch.randn(1, 2, 5, 5, dtype=torch.complex64)
    torch.testing.assert_close(conv(x), F.conv2d(x, conv.weight, conv.bias))
    copied = pickle.loads(pickle.dumps(conv))
    torch.testing.assert_close(copied(x), conv(x))


def test_a_layer_tuned_for_its_forward_only_tunes_its_gradients_when_compiled_code_needs_them(native):
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    module = ct.nn.Conv2d(6, 4, 1, mode="get")
    twin = copy.deepcopy(module)
    with torch.no_grad():
        module(x)
    assert set(k[-2:] for k in module._convtune_traced) == {"00"}  # no gradient tuned, none may be asked for
    compiled = torch.compile(module, backend="aot_eager")
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = compiled(xa)
    y.sum().backward()
    assert set(k[-2:] for k in module._convtune_traced) == {"00", "10", "01", "11"}
    _trains_like(module, y, xa, twin, xb, atol=1e-5)


@pytest.mark.parametrize("padding", [{"padding": 1, "padding_mode": "reflect"}, {"padding": "same"}])
def test_a_layer_that_pads_first_keeps_no_traced_entry_and_compiles_right(native, padding):
    x = torch.randn(2, 6, 5, 5)
    module = ct.nn.Conv2d(6, 4, 3 if padding["padding"] == 1 else 2, mode="get", **padding)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():  # bfloat16 on the CPU: through the op
        expected = module(x)
        assert next(iter(module.selections.values())).native is not None
        assert module._convtune_traced == {}  # the op on the padded input: only the full path pads
        compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=False)
        torch.testing.assert_close(compiled(x), expected)


def test_a_copy_rebuilds_its_traced_table_from_its_selections(native, monkeypatch):
    x = torch.randn(2, 6, 6, 6).to(memory_format=torch.channels_last)
    model = _native_model(x)
    tables = [dict(m._convtune_traced) for m in (model[0], model[2])]
    model[0]._convtune_traced["(9, 9)|stale"] = (1, 2, 3)  # what a pickle may carry: never trusted
    with torch.no_grad():
        expected = model(x)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert [m._convtune_traced for m in (copied[0], copied[2])] == tables
        _traced_only(monkeypatch)
        with torch.no_grad():
            compiled = torch.compile(copied, backend="aot_eager", fullgraph=True, dynamic=False)
            torch.testing.assert_close(compiled(x), expected)
        monkeypatch.undo()


# -- the host-cost rule ----------------------------------------------------------------------------

def test_each_path_and_direction_pays_its_own_measured_host_cost(monkeypatch):
    monkeypatch.setattr(host_costs, "host_overheads_us", lambda device, db=None: {
        "python": 10.0, "python backward": 30.0, "triton": 40.0, "triton backward": 90.0, "native": 2.0})
    p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(5, 5), kernel_size=3)
    paid = {(kind, d): host_costs.extra_host_us(p.with_direction(d), kind)
            for kind in ("python", "triton", "native", "cudnn") for d in ("fwd", "bwd_data", "bwd_filter")}
    assert paid == {("python", "fwd"): 10.0, ("python", "bwd_data"): 30.0, ("python", "bwd_filter"): 30.0,
                    ("triton", "fwd"): 40.0, ("triton", "bwd_data"): 90.0, ("triton", "bwd_filter"): 90.0,
                    ("native", "fwd"): 2.0, ("native", "bwd_data"): 2.0, ("native", "bwd_filter"): 2.0,
                    # a kind not measured here (no cuDNN in this build) pays the Python path's
                    ("cudnn", "fwd"): 10.0, ("cudnn", "bwd_data"): 30.0, ("cudnn", "bwd_filter"): 30.0}
    assert ct.get_algorithm("triton:depthwise_fwd_p32c64w4").host_kind == "triton"
    assert ct.get_algorithm("direct:taps").host_kind == "python"


def test_the_host_cost_rule_charges_a_triton_choice_its_launcher(native, monkeypatch, tmp_path):
    from convtune.results import PerfResult, Status

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so that the Triton kernels support CPU problems
    monkeypatch.setattr(host_costs, "host_overheads_us", lambda device, db=None: {
        "python": 1.0, "python backward": 1.0, "triton": 50.0, "triton backward": 50.0})
    x = torch.randn(1, 64, 4, 4).to(memory_format=torch.channels_last)
    module = ct.nn.Conv2d(64, 64, 3, padding=1, groups=64, mode="hybrid", db=ct.TuningDB(tmp_path / "t.sqlite"))
    p = ConvProblem.from_module(module, tuple(x.shape), layout="channels_last")
    names = {"fwd": "triton:depthwise_fwd_p32c64w4", "bwd_data": "triton:depthwise_bwd_data_p32c64w4",
             "bwd_filter": "triton:depthwise_bwd_filter_p64c64w4s8"}
    for d, name in names.items():  # ahead by 3 us each: more than the Python path's 1, less than Triton's 50
        module._convtune_tuning.db.store(p.with_direction(d), [
            PerfResult(name, Status.OK, time_ms=0.01, rel_error=0.0),
            PerfResult("torch:native", Status.OK, time_ms=0.013, rel_error=0.0)])
    module(x.requires_grad_()).sum().backward()
    selection = next(iter(module.selections.values()))
    assert selection.runtime == "torch" and selection.host_rule, selection
    assert "would gain 9.0 us of GPU time a step but cost 150.0 us" in ct.explain(module)[0]["note"]


@pytest.mark.parametrize("gain_ms,expected", [(0.003, "torch"), (1.0, "native")])
def test_a_layer_that_gains_less_than_its_host_cost_calls_pytorch(native, monkeypatch, tmp_path, gain_ms, expected):
    from convtune.results import PerfResult, Status

    monkeypatch.setattr(host_costs, "host_overheads_us",
                        lambda device, db=None: {"python": 50.0, "gemm_1x1": 5.0, "native": 2.0})
    x = torch.randn(2, 6, 5, 5)
    module = ct.nn.Conv2d(6, 4, 1, mode="hybrid", db=ct.TuningDB(tmp_path / "t.sqlite"))
    p = ConvProblem.from_module(module, tuple(x.shape))
    for d in ("fwd", "bwd_data", "bwd_filter"):  # as find would have stored them: gemm:1x1 ahead by gain_ms
        module._convtune_tuning.db.store(p.with_direction(d), [
            PerfResult("gemm:1x1", Status.OK, time_ms=0.01, rel_error=0.0),
            PerfResult("torch:native", Status.OK, time_ms=0.01 + gain_ms, rel_error=0.0)])
    y = module(x.requires_grad_())
    y.sum().backward()
    plan = next(iter(module.selections.values()))
    assert plan.runtime == expected, plan
    if expected == "torch":  # 3 x 3 us of GPU time against 3 x 5 us of host time
        assert plan.fwd == plan.bwd_data == plan.bwd_filter == "torch:native"
        assert "would gain 9.0 us of GPU time a step but cost 15.0 us" in ct.explain(module)[0]["note"]
    with settings.override(host_rule=False):
        module._convtune_forget(next(iter(module.selections)))
        module._convtune_fast.clear()
        module(x)
        assert next(iter(module.selections.values())).fwd == "gemm:1x1"


@pytest.mark.parametrize("gemm_ms,host_us,expected", [
    (0.0101, -8.0, "gemm:1x1"),  # 0.1 us slower a direction, 8 us cheaper on the host: the layer's cheaper path
    (0.0101, 1.0, "torch:native"),  # costlier on the host than PyTorch's own call
    (0.0150, -8.0, "torch:native"),  # not a tie (the policy's tolerance is 2%): never considered
])
def test_a_tie_given_to_torch_native_runs_the_executable_whose_path_costs_the_layer_less(native, monkeypatch,
                                                                                         tmp_path, gemm_ms,
                                                                                         host_us, expected):
    from convtune.results import PerfResult, Status

    monkeypatch.setattr(host_costs, "host_overheads_us", lambda device, db=None: {
        "python": 50.0, "native": 5.0, "gemm_1x1": host_us, "gemm_1x1 backward": host_us})
    x = torch.randn(2, 6, 5, 5)
    module = ct.nn.Conv2d(6, 4, 1, mode="hybrid", db=ct.TuningDB(tmp_path / "t.sqlite"))
    p = ConvProblem.from_module(module, tuple(x.shape))
    for d in ("fwd", "bwd_data", "bwd_filter"):  # as find would have stored them: torch:native first by 0.1 us
        module._convtune_tuning.db.store(p.with_direction(d), [
            PerfResult("torch:native", Status.OK, time_ms=0.0100, rel_error=0.0),
            PerfResult("gemm:1x1", Status.OK, time_ms=gemm_ms, rel_error=0.0)])
    assert ct.select(p, db=module._convtune_tuning.db).algorithm == "torch:native"  # select's tie rule
    y = module(x.requires_grad_())
    y.sum().backward()
    torch.testing.assert_close(y, F.conv2d(x, module.weight, module.bias), atol=1e-5, rtol=1e-4)
    selection = next(iter(module.selections.values()))
    assert selection.fwd == selection.bwd_data == selection.bwd_filter == expected, selection
    assert selection.runtime == ("native" if expected == "gemm:1x1" else "torch")
    # off with the host-cost rule it belongs to; not where the policy prefers the least memory
    for override, policy in (({"host_rule": False}, None), ({}, ct.Policy(prefer="least_memory"))):
        other = ct.nn.Conv2d(6, 4, 1, mode="hybrid", db=module._convtune_tuning.db, policy=policy)
        with settings.override(**override):
            other(x.requires_grad_()).sum().backward()
        assert next(iter(other.selections.values())).fwd == "torch:native"


def _tied_for_training(monkeypatch, tmp_path, x, fwd_host_us, policy=None):
    """A 1x1 layer tuned for training on ``x`` whose every direction ties gemm:1x1 with torch:native (first by 0.1
    us), gemm:1x1's forward costing the host ``fwd_host_us`` over PyTorch's call and its backward 20 us a direction:
    moving the layer costs it more than the forward saves (``on_the_cheaper_path`` keeps it on PyTorch's call)."""
    from convtune.results import PerfResult, Status

    monkeypatch.setattr(host_costs, "host_overheads_us", lambda device, db=None: {
        "python": 50.0, "native": 5.0, "gemm_1x1": fwd_host_us, "gemm_1x1 backward": 20.0})
    module = ct.nn.Conv2d(6, 4, 1, mode="hybrid", db=ct.TuningDB(tmp_path / "t.sqlite"), policy=policy)
    p = ConvProblem.from_module(module, tuple(x.shape))
    for d in ("fwd", "bwd_data", "bwd_filter"):  # as find would have stored them
        module._convtune_tuning.db.store(p.with_direction(d), [
            PerfResult("torch:native", Status.OK, time_ms=0.0100, rel_error=0.0),
            PerfResult("gemm:1x1", Status.OK, time_ms=0.0101, rel_error=0.0)])
    module(x.clone().requires_grad_()).sum().backward()
    return module


@pytest.mark.parametrize("fwd_host_us,override,policy,no_grad", [
    (-8.0, {}, None, "gemm:1x1"),  # 8 us cheaper on the host, 0.1 us slower on the GPU: the cheaper forward
    (1.0, {}, None, ""),  # costlier on the host than PyTorch's own call
    (-8.0, {"host_rule": False}, None, ""),  # off with the host-cost rule
    (-8.0, {}, ct.Policy(prefer="least_memory"), ""),  # ties go to the least workspace
])
def test_a_layer_on_pytorchs_call_for_training_runs_its_forwards_cheaper_tie_member_without_gradients(
        native, monkeypatch, tmp_path, fwd_host_us, override, policy, no_grad):
    import copy

    x = torch.randn(2, 6, 5, 5)
    with settings.override(**override):
        module = _tied_for_training(monkeypatch, tmp_path, x, fwd_host_us, policy)
    selection = next(iter(module.selections.values()))
    assert selection.runtime == "torch" and selection.fwd == selection.bwd_data == "torch:native", selection
    assert selection.no_grad == no_grad and bool(selection.no_grad_handle) == bool(no_grad), selection
    expected = F.conv2d(x, module.weight.detach(), module.bias.detach())

    def ops_run(model, inp):  # the ops a call of model on inp ran, of these two
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y = model(inp)
        torch.testing.assert_close(y.detach(), expected, atol=1e-5, rtol=1e-4)
        return {e.name for e in prof.events()} & {"convtune::tuned_conv", "aten::conv2d"}

    for model in (module, copy.deepcopy(module)):  # (a copy judges nothing again: its selection is the same)
        assert next(iter(model.selections.values())).no_grad == no_grad
        model(x)  # the hot path from the next call on
        ran_no_grad = {"convtune::tuned_conv"} if no_grad else {"aten::conv2d"}
        with torch.no_grad():
            assert ops_run(model, x) == ran_no_grad
        with torch.inference_mode():
            assert ops_run(model, x) == ran_no_grad
        assert ops_run(model, x) == {"aten::conv2d"}  # the weight's gradient is needed
        model.requires_grad_(False)
        assert ops_run(model, x) == ran_no_grad  # none is
        assert ops_run(model, x.clone().requires_grad_()) == {"aten::conv2d"}  # the input's is
        model.requires_grad_(True)
    note = ct.explain(module)[0]["note"]
    assert ("a call that needs no gradient runs gemm:1x1 (eager" in note) == bool(no_grad), note


def test_a_forward_mode_tangent_takes_pytorchs_call_or_raises_never_lost(native, monkeypatch, tmp_path):
    import torch.autograd.forward_ad as fwad

    x, t = torch.randn(2, 6, 5, 5), torch.randn(2, 6, 5, 5)
    module = _tied_for_training(monkeypatch, tmp_path, x, -8.0).requires_grad_(False)
    assert next(iter(module.selections.values())).no_grad == "gemm:1x1"
    module(x)  # the hot path from the next call on, which runs gemm:1x1 for a call without gradients
    expected = F.conv2d(t, module.weight)
    with fwad.dual_level():
        tangent = fwad.unpack_dual(module(fwad.make_dual(x, t))).tangent
    torch.testing.assert_close(tangent, expected, atol=1e-5, rtol=1e-4)  # PyTorch's call: its derivative
    _, jvp = torch.func.jvp(module, (x,), (t,))
    torch.testing.assert_close(jvp, expected, atol=1e-5, rtol=1e-4)
    # a layer on its executables has no forward-mode derivative: an error, not a tangent lost
    from convtune.pytorch.tuning import LayerSelection

    sig, selection = next(iter(module.selections.items()))
    module._convtune_select(sig, LayerSelection(selection.problem, "gemm:1x1", "gemm:1x1", "gemm:1x1"))
    module._convtune_fast.clear()
    with fwad.dual_level(), pytest.raises(NotImplementedError, match="no forward-mode derivative"):
        module(fwad.make_dual(x, t))
    with fwad.dual_level(), pytest.raises(NotImplementedError, match="no forward-mode derivative"):  # compiled's op
        torch.ops.convtune.layer_conv.default(fwad.make_dual(x, t), module.weight, module.bias,
                                              *module._convtune_geometry, module._convtune_layer, False, False)


def test_torch_func_transforms_and_fx_tracing_take_pytorchs_convolution(native, monkeypatch, tmp_path):
    # grad, vmap (per-sample gradients) and vjp on a layer that runs its own executables in every direction: the
    # transforms' wrapped tensors run PyTorch's convolution, which they know; symbolic tracing records it
    from convtune.pytorch.tuning import LayerSelection

    x = torch.randn(2, 6, 5, 5)
    module = _tied_for_training(monkeypatch, tmp_path, x, -8.0)
    sig, selection = next(iter(module.selections.items()))
    module._convtune_select(sig, LayerSelection(selection.problem, "gemm:1x1", "gemm:1x1", "gemm:1x1"))
    module(x)  # the hot path from the next call on
    params = {name: p.detach() for name, p in module.named_parameters()}
    selections, fast = dict(module.selections), dict(module._convtune_fast)

    def loss(params, inp):
        return torch.func.functional_call(module, params, (inp,)).square().sum()

    def torch_loss(params, inp):
        return F.conv2d(inp, params["weight"], params.get("bias")).square().sum()

    for transform in (lambda f: torch.func.grad(f), lambda f: torch.func.grad(f, argnums=(0, 1))):
        got, expected = transform(loss)(params, x), transform(torch_loss)(params, x)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x.unsqueeze(1))
    expected = torch.func.vmap(torch.func.grad(torch_loss), in_dims=(None, 0))(params, x.unsqueeze(1))
    torch.testing.assert_close(per_sample, expected, atol=1e-4, rtol=1e-4)
    _, pull = torch.func.vjp(module, x)
    torch.testing.assert_close(pull(torch.ones(2, module.out_channels, 5, 5))[0],
                               torch.func.vjp(lambda inp: F.conv2d(inp, module.weight, module.bias), x)[1](
                                   torch.ones(2, module.out_channels, 5, 5))[0], atol=1e-4, rtol=1e-4)
    w = module.weight.detach()
    torch.testing.assert_close(torch.func.jacrev(lambda inp: module(inp).sum(0))(x[:1]),
                               torch.func.jacrev(lambda inp: F.conv2d(inp, w, module.bias).sum(0))(x[:1]),
                               atol=1e-4, rtol=1e-4)
    t = torch.randn_like(x)
    torch.testing.assert_close(torch.func.jvp(module, (x,), (t,))[1], F.conv2d(t, w), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.func.vmap(module)(x.unsqueeze(1)).squeeze(1), module(x), atol=1e-5, rtol=1e-4)
    # a shape met first under a transform is not tuned, and nothing the layer had changed
    torch.func.grad(loss)(params, torch.randn(3, 6, 7, 7))
    assert dict(module.selections) == selections and dict(module._convtune_fast) == fast
    assert module(x).requires_grad and module._convtune_fast  # the layer runs on afterwards as before

    traced = torch.fx.symbolic_trace(torch.nn.Sequential(module, torch.nn.ReLU()))
    torch.testing.assert_close(traced(x), torch.relu(F.conv2d(x, module.weight, module.bias)), atol=1e-5, rtol=1e-4)
    assert any(node.target is F.conv2d or node.target is torch.conv2d for node in traced.graph.nodes), traced.graph


def test_ties_move_direction_by_direction_to_the_cheapest_member_the_policy_allows(native, monkeypatch, tmp_path):
    from convtune.algorithms.base import Algorithm
    from convtune.algorithms.native import native_conv
    from convtune.algorithms.registry import isolated
    from convtune.results import PerfResult, Status

    class Faulty(Algorithm):  # a plug-in tied with torch:native whose recipe raises: never the layer's fault
        name = "plugin:faulty"

        def native_recipe(self, problem):
            raise TypeError("a broken recipe")

        def _run(self, problem, a, b, out, ws):
            out.copy_(native_conv(problem, a, b))

    monkeypatch.setattr(host_costs, "host_overheads_us", lambda device, db=None: {
        "python": 50.0, "native": 5.0, "gemm_1x1": -8.0, "gemm_1x1 backward": -8.0})
    x = torch.randn(2, 6, 5, 5)
    db = ct.TuningDB(tmp_path / "t.sqlite")
    p = ConvProblem.from_module(ct.nn.Conv2d(6, 4, 1), tuple(x.shape))
    stored = {  # fwd: gemm:1x1 the fastest (chosen); bwd_data: a tie with gemm:1x1 and the faulty plug-in;
        # bwd_filter: gemm:1x1 outside the tie (1.05x), so torch:native, through the op once the layer is on it
        "fwd": [("gemm:1x1", 0.0100, True), ("torch:native", 0.0200, True)],
        "bwd_data": [("torch:native", 0.0100, True), ("plugin:faulty", 0.0100, True), ("gemm:1x1", 0.0101, False)],
        "bwd_filter": [("torch:native", 0.0100, True), ("gemm:1x1", 0.0105, True)]}
    for d, rows in stored.items():
        db.store(p.with_direction(d), [PerfResult(n, Status.OK, time_ms=t, rel_error=0.0, deterministic=det)
                                       for n, t, det in rows])
    with isolated(Faulty()):
        for policy, bwd_data in ((None, "gemm:1x1"), (ct.Policy(deterministic=True), "torch:native")):
            module = ct.nn.Conv2d(6, 4, 1, mode="hybrid", db=db, policy=policy)
            y = module(x.clone().requires_grad_())
            y.sum().backward()
            torch.testing.assert_close(y, F.conv2d(x, module.weight, module.bias), atol=1e-5, rtol=1e-4)
            selection = next(iter(module.selections.values()))
            # (a non-deterministic gemm:1x1 is no member of the tie where the policy asks for determinism)
            assert (selection.fwd, selection.bwd_data, selection.bwd_filter) == (
                "gemm:1x1", bwd_data, "torch:native"), selection
            assert selection.runtime == "native"


def test_a_path_cheaper_than_pytorchs_call_keeps_its_cost_below_zero(native, monkeypatch):
    monkeypatch.setattr(host_costs, "_measured",
                        lambda device, p=None: {"cudnn": -6.5, "gemm_1x1": -0.5, "native": 4.0})
    host_costs.forget_host_costs()
    try:
        overheads = host_costs.host_overheads_us("cpu")
    finally:
        host_costs.forget_host_costs()
    assert overheads["cudnn"] == -6.5 and overheads["gemm_1x1_strided"] == -0.5 and overheads["native"] == 4.0


@pytest.mark.parametrize("gain_ms,compiled_torch", [(0.002, True), (0.02, False)])
def test_compiled_code_calls_pytorch_where_a_layer_gains_less_than_the_op_call_costs(native, monkeypatch, tmp_path,
                                                                                      gain_ms, compiled_torch):
    from convtune.results import PerfResult, Status

    # Eager code pays nothing for gemm:1x1's executables; compiled code pays 5 us a call of convtune's op.
    monkeypatch.setattr(host_costs, "host_overheads_us",
                        lambda device, db=None: {"python": 50.0, "gemm_1x1": 0.0, "native": 0.0, "compiled": 5.0})
    x = torch.randn(2, 6, 5, 5)
    module = ct.nn.Conv2d(6, 4, 1, mode="hybrid", db=ct.TuningDB(tmp_path / "t.sqlite"))
    p = ConvProblem.from_module(module, tuple(x.shape))
    for d in ("fwd", "bwd_data", "bwd_filter"):  # gemm:1x1 ahead by gain_ms in each direction
        module._convtune_tuning.db.store(p.with_direction(d), [
            PerfResult("gemm:1x1", Status.OK, time_ms=0.01, rel_error=0.0),
            PerfResult("torch:native", Status.OK, time_ms=0.01 + gain_ms, rel_error=0.0)])
    module(x.requires_grad_()).sum().backward()  # 3 x gain_ms gained against 3 calls (one a direction) x 5 us
    selection = next(iter(module.selections.values()))
    assert selection.runtime == "native" and selection.fwd == "gemm:1x1"  # eager code runs the choices
    assert selection.compiled_torch is compiled_torch
    assert pickle.loads(pickle.dumps(selection)).compiled_torch is compiled_torch
    rows = ct.explain(module)
    assert {row["compiled"] for row in rows} == {"torch" if compiled_torch else "executables"}
    if compiled_torch:
        assert "gain 6.0 us of GPU time a step, less than the 15.0 us" in rows[0]["note"]
    # a static shape: PyTorch's convolution or the executables; a symbolic one: the layer op whatever
    for dynamic, op in ((False, "conv2d" if compiled_torch else "tuned_conv"), (True, "layer_conv")):
        graphs: list = []
        compiled = torch.compile(module, backend=_counting_backend(graphs), dynamic=dynamic, fullgraph=True)
        y = compiled(x)
        y.sum().backward()
        torch.testing.assert_close(y, F.conv2d(x, module.weight, module.bias), atol=1e-5, rtol=1e-4)
        code = "\n".join(str(g.code) for g in graphs)
        assert [name for name in ("conv2d", "tuned_conv", "layer_conv") if name in code] == [op], code


@pytest.mark.parametrize("eager_us", [0.0, -4.9])
def test_compiled_inference_calls_pytorch_where_only_the_gradients_gain(native, monkeypatch, tmp_path, eager_us):
    from convtune.results import PerfResult, Status

    # gemm:1x1 gains 0.3 us in the forward (past the tie's 2%) and 20 us in each gradient; compiled code pays 5 us
    # a call of convtune's op: worth it for a training step (40.3 us against 15), not for a call without gradients;
    # what eager code saves on gemm:1x1's executables (-4.9 us a direction) is no saving in compiled code
    monkeypatch.setattr(host_costs, "host_overheads_us", lambda device, db=None: {
        "python": 50.0, "gemm_1x1": eager_us, "native": 0.0, "compiled": 5.0})
    x = torch.randn(2, 6, 5, 5)
    module = ct.nn.Conv2d(6, 4, 1, mode="hybrid", db=ct.TuningDB(tmp_path / "t.sqlite"))
    p = ConvProblem.from_module(module, tuple(x.shape))
    for d, gain_ms in (("fwd", 0.0003), ("bwd_data", 0.02), ("bwd_filter", 0.02)):
        module._convtune_tuning.db.store(p.with_direction(d), [
            PerfResult("gemm:1x1", Status.OK, time_ms=0.01, rel_error=0.0),
            PerfResult("torch:native", Status.OK, time_ms=0.01 + gain_ms, rel_error=0.0)])
    module(x.requires_grad_()).sum().backward()
    selection = next(iter(module.selections.values()))
    assert selection.runtime == "native" and selection.fwd == "gemm:1x1"  # eager code runs the choices
    assert not selection.compiled_torch and selection.compiled_torch_no_grad
    assert pickle.loads(pickle.dumps(selection)).compiled_torch_no_grad
    rows = ct.explain(module)
    assert {row["compiled"] for row in rows} == {"executables"}
    assert "the forward's choice gains 0.3 us of GPU time, less than the 5.0 us" in rows[0]["note"]
    for grad in (True, False):  # a static shape: the executables for a training step, PyTorch's call without
        graphs: list = []
        compiled = torch.compile(module, backend=_counting_backend(graphs), fullgraph=True)
        with torch.set_grad_enabled(grad):
            y = compiled(x.detach().requires_grad_(grad))
        torch.testing.assert_close(y, F.conv2d(x, module.weight, module.bias), atol=1e-5, rtol=1e-4)
        code = "\n".join(str(g.code) for g in graphs)
        expected = "tuned_conv" if grad else "conv2d"
        assert [name for name in ("conv2d", "tuned_conv", "layer_conv") if name in code] == [expected], code
        torch._dynamo.reset()
    # a layer tuned for its forward alone (calls without gradients) is judged the same way
    alone = ct.nn.Conv2d(6, 4, 1, mode="hybrid", db=module._convtune_tuning.db)
    with torch.no_grad():
        alone(x.detach())
    selection = next(iter(alone.selections.values()))
    assert (selection.fwd, selection.bwd_data, selection.runtime) == ("gemm:1x1", "", "native")
    assert selection.compiled_torch or selection.compiled_torch_no_grad  # (the first where eager code saves none)
    graphs = []
    with torch.no_grad():
        torch.compile(alone, backend=_counting_backend(graphs), fullgraph=True)(x.detach())
    code = "\n".join(str(g.code) for g in graphs)
    assert [name for name in ("conv2d", "tuned_conv", "layer_conv") if name in code] == ["conv2d"], code


def test_what_compiled_code_pays_to_call_the_op_is_measured_on_tuned_run_of_pytorchs_convolution(native,
                                                                                                 monkeypatch):
    overheads = host_costs._measured("cpu")
    assert math.isfinite(overheads["compiled"])  # (its value is the host's: that it was measured is checked)
    monkeypatch.setattr(host_costs, "host_overheads_us", lambda device, db=None: {"compiled": 50.0})
    p = ConvProblem("fwd", n=1, c=2, k=2, input_size=(3, 3), kernel_size=1)
    assert host_costs.extra_host_us(p, "cudnn") == 0.0  # not a path's cost: no path is charged it
    p = host_costs.probe_problem("cpu")
    x, w = p.random_inputs()
    with torch.no_grad():  # what is timed: tuned_run on torch:native's executable, which is PyTorch's convolution
        torch.testing.assert_close(torch.ops.convtune.tuned_run.default(x, w, runtime.prepare(p, "torch:native")[0]),
                                   F.conv2d(x, w, None, p.stride, p.padding, p.dilation, p.groups))


def test_a_static_shape_met_first_in_compiled_code_keeps_the_layer_op_and_compiles_once(native):
    torch.manual_seed(3)
    module = ct.nn.Conv2d(4, 4, 3, padding=1, mode="get")  # on the CPU 'get' picks PyTorch's call
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        module(x)  # chosen in eager code: compiled code calls PyTorch's convolution for it
    other = torch.randn(3, 4, 7, 7)
    for inp, op in ((x, False), (other, True)):  # the second shape is chosen at compiled code's request
        graphs: list = []
        compiled = torch.compile(module, backend=_counting_backend(graphs), dynamic=False)
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(compiled(inp), F.conv2d(inp, module.weight, module.bias, padding=1),
                                           atol=1e-5, rtol=1e-4)
        assert len(graphs) == 1, [str(g.code) for g in graphs]  # not compiled again once it has chosen
        assert ("layer_conv" in str(graphs[0].code)) is op
        torch._dynamo.reset()


def test_a_layer_on_pytorchs_path_calls_it_after_a_few_checks():
    from convtune.pytorch.modules import TorchCall

    torch.manual_seed(2)
    module = ct.nn.Conv2d(3, 4, 3, padding=1, mode="get")  # on the CPU, 'get' picks torch:native: PyTorch's call
    x = torch.randn(2, 3, 6, 6)
    with settings.override(native=False):  # the checks in Python (with the native runtime on: in C++, below)
        for _ in range(2):
            torch.testing.assert_close(module(x), F.conv2d(x, module.weight, module.bias, padding=1))
        fast = module._convtune_fast[x.shape]
        assert isinstance(fast, TorchCall) and fast.admits(x)
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):  # a module holding one pickles at every protocol
            torch.testing.assert_close(pickle.loads(pickle.dumps(module, protocol=protocol))(x), module(x))
        assert copy.deepcopy(fast).admits(x) and not copy.deepcopy(fast).admits(x.to(torch.float16))
        plan = next(iter(module.selections.values()))
        assert plan.runtime == "torch" and plan.bwd_data == ""
        xg = x.clone().requires_grad_()
        assert not fast.admits(xg)  # a gradient not tuned yet: the full path tunes it
        module(xg).sum().backward()
        assert next(iter(module.selections.values())).bwd_data == "torch:native" and xg.grad is not None
        fast = module._convtune_fast[x.shape]
        assert not fast.admits(x.to(memory_format=torch.channels_last)) and not fast.admits(x.to("meta"))
        assert module._convtune_fast.get(torch.Size((1, 3, 6, 6))) is None
        with torch.autocast("cpu", dtype=torch.float16):  # (CPU bfloat16 goes through convtune's op: algorithms.md)
            assert not module._convtune_fast[x.shape].admits(x)
            assert module(x).dtype == torch.float16
            assert module._convtune_fast[x.shape].admits(x)


def test_a_layer_on_pytorchs_path_checks_its_input_in_cpp_then_calls_pytorchs_convolution(native):
    from convtune.pytorch.modules import TorchCall, TorchDirect

    torch.manual_seed(3)
    module = ct.nn.Conv2d(3, 4, 3, padding=1, mode="get")  # on the CPU, 'get' picks torch:native: PyTorch's call
    x = torch.randn(2, 3, 6, 6)
    for _ in range(2):
        torch.testing.assert_close(module(x), F.conv2d(x, module.weight, module.bias, padding=1))
    entry = module._convtune_fast[x.shape]
    assert isinstance(entry, TorchDirect) and (entry.dx_tuned, entry.dw_tuned) == (False, True)  # x needs no gradient
    assert native.kind(entry.handle) == "native"  # torch:native's executable: what the signature is
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):  # the entry itself pickles at every protocol
        assert pickle.loads(pickle.dumps(entry, protocol=protocol)).handle == entry.handle
    calls = []
    real = torch.nn.Conv2d.forward
    torch.nn.Conv2d.forward = lambda self, inp: calls.append(1) or real(self, inp)
    try:
        module(x)  # the hot path: torch.nn's forward is not called, PyTorch's convolution is (from C++)
        assert calls == []
        with torch.autocast("cpu", dtype=torch.float16):  # another signature: the full path, which selects for it
            assert module(x).dtype == torch.float16
        assert calls == [1] and len(module.selections) == 2
        with torch.autocast("cpu", dtype=torch.float16):  # then the hot path, which autocast casts on
            torch.testing.assert_close(module(x), F.conv2d(x.half(), module.weight.half(), module.bias.half(),
                                                           padding=1))
        assert calls == [1] and isinstance(module._convtune_fast[x.shape], TorchDirect)
    finally:
        torch.nn.Conv2d.forward = real
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):  # pickled and copied, the module runs the same
        torch.testing.assert_close(pickle.loads(pickle.dumps(module, protocol=protocol))(x), module(x))
    torch.testing.assert_close(copy.deepcopy(module)(x), module(x))
    # a gradient not chosen for: the full path selects for it, then PyTorch's autograd runs it (double backward too)
    xg = x.clone().requires_grad_()
    y = module(xg)
    assert (module._convtune_fast[x.shape].dx_tuned, module._convtune_fast[x.shape].dw_tuned) == (True, True)
    (gx,) = torch.autograd.grad(y.square().sum(), xg, create_graph=True)
    gx.sum().backward()
    xt = x.clone().requires_grad_()
    (gt,) = torch.autograd.grad(F.conv2d(xt, module.weight, module.bias, padding=1).square().sum(), xt,
                                create_graph=True)
    torch.testing.assert_close(gx, gt)
    # inputs of another layout, device or shape, or unbatched, are other signatures
    xc = x.to(memory_format=torch.channels_last)
    torch.testing.assert_close(module(xc), F.conv2d(xc, module.weight, module.bias, padding=1))
    assert any(sig.layout == "channels_last" for sig in module.selections)
    assert module(x.to("meta")).device.type == "meta"
    x3 = torch.randn(3, 6, 6)
    torch.testing.assert_close(module(x3), F.conv2d(x3, module.weight, module.bias, padding=1))
    assert isinstance(module._convtune_fast[x3.shape], TorchCall)  # unbatched: checked in Python
    with pytest.raises(ValueError, match="computes in float16"):  # what the C++ check says of another dtype
        native.torch_conv(x.half(), module.weight.half(), None, entry.handle, False, False)
    strided = torch.randn(2, 3, 6, 12)[..., ::2]  # not dense in any layout: the Python checks, once selected for
    torch.testing.assert_close(module(strided), F.conv2d(strided, module.weight, module.bias, padding=1))
    assert isinstance(module._convtune_fast[strided.shape], TorchCall)
    with settings.override(native=False):
        module._convtune_fast.clear()
        module(x)
        assert isinstance(module._convtune_fast[x.shape], TorchCall)


def test_a_layer_on_pytorchs_path_runs_under_a_torch_function_mode_through_torch_nn(native):
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    from convtune.pytorch.modules import TorchDirect

    module = ct.nn.Conv2d(3, 4, 3, padding=1, mode="get")
    x = torch.randn(2, 3, 6, 6)
    module(x)
    assert isinstance(module._convtune_fast[x.shape], TorchDirect)
    with Seen() as seen:
        module(x)
    assert "conv2d" in seen.names  # the mode sees the convolution, as it would torch.nn's
    with Seen():  # a signature not chosen for (the input's gradient) is selected for under the mode too
        module(x.clone().requires_grad_()).sum().backward()
    assert next(iter(module.selections.values())).bwd_data == "torch:native"


def test_double_backward_through_a_native_layer_raises_a_clear_error(native):
    conv = torch.nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    y = torch.ops.convtune.tuned_conv(x, conv.weight, conv.bias, *_handles(conv, x))
    with pytest.raises(NotImplementedError, match="no double backward"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_the_database_keeps_what_rebuilds_an_executable_and_forgets_it_on_clear(tmp_path):
    p = ConvProblem("fwd", n=1, c=2, k=3, input_size=(5, 5), kernel_size=3)
    recipe = {"kind": "cudnn", "options": {"tag": "eng0", "shapes": [[1, 2, 5, 5]]}}
    with ct.TuningDB(tmp_path / "t.sqlite") as db:
        assert db.executable(p, "cudnn:eng0") is None
        db.store_executable(p, "cudnn:eng0", recipe, b"\x00serialized")
        assert db.executable(p, "cudnn:eng0") == (recipe, b"\x00serialized")
        assert db.executable(p.with_direction("bwd_data"), "cudnn:eng0") is None
        db.clear()
        assert db.executable(p, "cudnn:eng0") is None
    with pytest.raises(ValueError, match="no cuda device"):
        ct.TuningDB(tmp_path / "u.sqlite").store_executable(p.replace(device="cuda"), "cudnn:eng0", recipe, b"")


def test_stored_host_costs_that_no_measurement_gives_are_measured_again(tmp_path):
    # JSON reads NaN and Infinity (and integers no float holds): a host cost like that would make the host-cost
    # rule's comparisons meaningless; none is stored, and one found in the file is measured again
    import sqlite3

    path = tmp_path / "t.sqlite"
    with ct.TuningDB(path) as db:
        db.store_host_costs("cpu", {"native": 3.5, "method": 7})
        assert db.host_costs("cpu") == {"native": 3.5, "method": 7.0}
        with pytest.raises(ValueError):
            db.store_host_costs("cpu", {"native": float("nan"), "method": 7})
    for bad in ("NaN", "Infinity", '"3.5"', "1" + "0" * 400):
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE host_costs SET costs = ?", (f'{{"native": {bad}, "method": 7}}',))
        with ct.TuningDB(path) as db:
            assert db.host_costs("cpu") is None, bad


def test_a_damaged_stored_executable_is_rebuilt_never_run(tmp_path, caplog):
    # an executable's row says what a warm start runs without checking it again (a GEMM's buffer offsets, a Triton
    # launch's grid and offsets, a cuDNN plan): a row changed on disk that still reads as valid JSON was run as it
    # was; its checksum now binds the recipe and serialized form, and a damaged row is rebuilt
    import sqlite3

    p = ConvProblem("fwd", n=1, c=2, k=3, input_size=(5, 5), kernel_size=3)
    recipe = {"kind": "gemm_1x1_strided", "options": {"buffers": [["slice", [2, 4, 4, 0], "float32"]]}}
    path = tmp_path / "t.sqlite"
    with ct.TuningDB(path) as db:
        db.store_executable(p, "gemm:1x1_strided", recipe, b"plan")
        assert db.executable(p, "gemm:1x1_strided") == (recipe, b"plan")
    damages = {"a digit of the recipe": ("UPDATE executables SET recipe = replace(recipe, '4, 0', '8, 0')", "checksum"),
               "the serialized form": ("UPDATE executables SET serialized = x'706c616f'", "checksum"),
               "not JSON": ("UPDATE executables SET recipe = substr(recipe, 2)", "Extra data"),
               "the serialized form stored as text": ("UPDATE executables SET serialized = CAST(serialized AS TEXT)",
                                                       "string argument without an encoding"),
               "a row of before checksums": ("UPDATE executables SET recipe = '{\"kind\": \"gemm_1x1\"}'", None)}
    for damage, (statement, reason) in damages.items():
        with ct.TuningDB(path) as db:
            db.store_executable(p, "gemm:1x1_strided", recipe, b"plan")
        with sqlite3.connect(path) as conn:
            conn.execute(statement)
        caplog.clear()
        with ct.TuningDB(path) as db, caplog.at_level("INFO", logger="convtune.db"):
            assert db.executable(p, "gemm:1x1_strided") is None, damage
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        if reason is None:  # no warning for what an upgrade leaves: it is rebuilt and stored again
            assert not warnings and any("before its rows had checksums" in r.getMessage() for r in caplog.records)
        else:
            assert len(warnings) == 1 and reason in warnings[0] and "it is rebuilt" in warnings[0], (damage, warnings)


def test_an_executable_is_prepared_once_per_process(native, tmp_path):
    p = ConvProblem("bwd_filter", n=2, c=4, k=6, input_size=(5, 5), kernel_size=1, layout="channels_last")
    with ct.TuningDB(tmp_path / "t.sqlite") as db:
        handle, kind = runtime.prepare(p, "gemm:1x1", db)
        assert kind == "gemm_1x1" and runtime.prepare(p, "gemm:1x1") == (handle, kind)
        recipe, serialized = db.executable(p, "gemm:1x1")  # kept: a warm start makes it without the algorithm
        assert recipe["kind"] == "gemm_1x1" and serialized == b""
    fwd = p.with_direction("fwd")
    handle, kind = runtime.prepare(fwd, "gemm:1x1")  # made before a database is at hand (find's measurement)
    with ct.TuningDB(tmp_path / "u.sqlite") as db:
        assert db.executable(fwd, "gemm:1x1") is None
        assert runtime.prepare(fwd, "gemm:1x1", db) == (handle, kind)  # the same executable, and now kept there
        assert db.executable(fwd, "gemm:1x1")[0]["kind"] == "gemm_1x1"
    with pytest.raises(KeyError):
        runtime.prepare(p, "nonesuch:algo")
    with pytest.raises(runtime.NotNative, match="runs in Python only"):
        runtime.prepare(p, "direct:taps")
    tries = []
    real = runtime._make
    runtime._make = lambda *args: tries.append(1) or real(*args)
    try:
        for _ in range(3):  # refused once: the same answer after, without trying again
            with pytest.raises(runtime.NotNative, match="runs in Python only"):
                runtime.prepare(p.with_direction("fwd"), "direct:taps")
    finally:
        runtime._make = real
    assert tries == [1]


def test_a_warm_start_makes_each_executable_from_the_database_without_the_algorithm(native, tmp_path):
    cases = [("gemm:1x1", "channels_first"), ("gemm:1x1", "channels_last"), ("torch:native", "channels_last")]
    problems = [ConvProblem("bwd_filter", n=2, c=5, k=7, input_size=(3, 4), kernel_size=1, layout=layout)
                for _, layout in cases]  # made nowhere else in this process (prepare makes each once)
    with ct.TuningDB(tmp_path / "t.sqlite") as db:
        handles = [runtime.prepare(p, name, db)[0] for p, (name, _) in zip(problems, cases)]
    # A fresh process, whose registry would fail any lookup: the executables come from their stored recipes.
    code = f"""
import torch, convtune as ct
from convtune.pytorch import runtime
from convtune.verify import reference, rel_error
def no_registry(*args):
    raise AssertionError("a warm start looked the algorithm up")
runtime.get_algorithm = no_registry
with ct.TuningDB({str(tmp_path / "t.sqlite")!r}) as db:
    for key, name, cold in {[(p.key, name, h) for p, (name, _), h in zip(problems, cases, handles)]!r}:
        p = ct.ConvProblem.from_key(key)
        handle, kind = runtime.prepare(p, name, db)
        a, b = p.random_inputs(seed=2)
        assert handle == cold and rel_error(torch.ops.convtune.tuned_run(a, b, handle), reference(p, a, b)) < 1e-5
print("ok")
"""
    env = dict(os.environ, CONVTUNE_PROGRESS="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.parametrize("mode", ["autocast", "no_grad", "inference_mode"])
def test_the_host_cost_calibration_runs_in_any_mode_the_caller_is_in_and_is_kept(native, tmp_path, monkeypatch, mode):
    from convtune.pytorch.modules import TunedConv

    def tuned(*args, **kwargs):
        raise AssertionError("a probe layer tuned itself instead of running the selection it was given")

    monkeypatch.setattr(TunedConv, "_convtune_tune", tuned)
    host_costs.forget_host_costs()
    region = {"autocast": torch.autocast("cpu", dtype=torch.bfloat16), "no_grad": torch.no_grad(),
              "inference_mode": torch.inference_mode()}[mode]
    torch.manual_seed(0)
    drawn = torch.rand(3)
    torch.manual_seed(0)
    try:
        with region, ct.TuningDB(tmp_path / "t.sqlite") as db:
            overheads = host_costs.host_overheads_us("cpu", db)
            assert torch.equal(torch.rand(3), drawn)  # measuring drew nothing from the caller's generator
            assert db.host_costs("cpu") == {**overheads, "method": host_costs.HOST_COST_METHOD}  # kept for the next
            host_costs.forget_host_costs()
            kept = {"python": 1.0, "python backward": 2.0, "native": 0.5}
            db.store_host_costs("cpu", {**kept, "method": host_costs.HOST_COST_METHOD})
            assert host_costs.host_overheads_us("cpu", db) == kept  # read, not measured
            host_costs.forget_host_costs()
            db.store_host_costs("cpu", kept)  # as a version that measured otherwise kept it
            assert "gemm_1x1 backward" in host_costs.host_overheads_us("cpu", db)  # measured again
            assert "gemm_1x1 backward" in db.host_costs("cpu")  # and kept
    finally:
        host_costs.forget_host_costs()
    assert {"python", "python backward", "native", "gemm_1x1", "gemm_1x1 backward", "gemm_1x1_strided",
            "gemm_1x1_strided backward"} <= set(overheads)
    assert all(math.isfinite(us) for us in overheads.values())  # a path cheaper than PyTorch's call: below 0


def test_a_path_whose_host_cost_cannot_be_measured_is_left_out_not_the_tuning(native, monkeypatch, caplog):
    from convtune.pytorch import ops

    def broken(self, a, b):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(ops.Runner, "__call__", broken)  # every run on the Python path fails here
    host_costs.forget_host_costs()
    try:
        overheads = host_costs.host_overheads_us("cpu")
    finally:
        host_costs.forget_host_costs()
    assert "python" not in overheads and "gemm_1x1 backward" in overheads  # the native paths are measured
    assert "could not measure the host cost of the python path (RuntimeError: no kernel image" in caplog.text
    p = ConvProblem("bwd_data", n=1, c=4, k=4, input_size=(5, 5), kernel_size=3)
    monkeypatch.setattr(host_costs, "host_overheads_us", lambda device, db=None: overheads)
    assert host_costs.extra_host_us(p, "python") == max(us for kind, us in overheads.items() if kind != "compiled")
    monkeypatch.setattr(host_costs, "host_overheads_us", lambda device, db=None: {})
    assert host_costs.extra_host_us(p, "python") == 0.0  # nothing measurable: nothing charged, nothing raised


def test_a_python_path_layer_pays_that_path_in_its_native_directions_too(native, monkeypatch, tmp_path):
    from convtune.results import PerfResult, Status

    monkeypatch.setattr(host_costs, "host_overheads_us", lambda device, db=None: {
        "python": 4.0, "python backward": 4.0, "gemm_1x1": 0.0, "gemm_1x1 backward": 0.0})
    x = torch.randn(2, 6, 5, 5)
    module = ct.nn.Conv2d(6, 4, 1, mode="hybrid", db=ct.TuningDB(tmp_path / "t.sqlite"))
    p = ConvProblem.from_module(module, tuple(x.shape))
    for d, name in (("fwd", "gemm:1x1"), ("bwd_data", "gemm:im2col"), ("bwd_filter", "gemm:1x1")):
        module._convtune_tuning.db.store(p.with_direction(d), [  # 3 us ahead: less than 4, more than 0
            PerfResult(name, Status.OK, time_ms=0.01, rel_error=0.0),
            PerfResult("torch:native", Status.OK, time_ms=0.013, rel_error=0.0)])
    module(x.requires_grad_()).sum().backward()
    selection = next(iter(module.selections.values()))
    assert selection.runtime == "torch" and selection.host_rule  # gemm:im2col's Python path: 12 us for all three
    assert "would gain 9.0 us of GPU time a step but cost 12.0 us" in ct.explain(module)[0]["note"]


def test_a_layer_that_pads_its_input_first_never_takes_the_op_on_the_raw_input(native):
    kwargs = dict(in_channels=4, out_channels=6, kernel_size=1, padding=1, padding_mode="reflect")
    first = torch.randn(2, 4, 8, 8)
    module = _forced(first, "gemm:1x1", **kwargs)  # the problem is the 10x10 padded input's
    twin = torch.nn.Conv2d(**kwargs)
    twin.load_state_dict(module.state_dict())
    assert next(iter(module.selections.values())).runtime == "native"
    for size in (8, 10, 8, 10):  # 10x10: the shape the op's problem has, but not padded yet
        x = torch.randn(2, 4, size, size)
        torch.testing.assert_close(module(x), twin(x), atol=1e-5, rtol=1e-4)


def test_an_input_of_another_layout_on_the_hot_path_is_a_new_signature(native):
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    module = _forced(x, "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1)
    module(x)  # the hot path now holds x's shape
    z = x.contiguous()  # the same shape, channels_first
    torch.testing.assert_close(module(z), F.conv2d(z, module.weight, module.bias), atol=1e-5, rtol=1e-4)
    assert {sig.layout for sig in module.selections} == {"channels_last", "channels_first"}  # tuned for itself


def test_a_layer_keeps_a_hot_path_per_input_shape(native):
    x, z = torch.randn(2, 6, 5, 5), torch.randn(1, 6, 3, 3)
    module = _forced(x, "gemm:1x1", in_channels=6, out_channels=4, kernel_size=1)
    sig = Signature(tuple(z.shape), z.dtype, z.device, layout_of(z))
    module._convtune_select(sig, LayerSelection(
        next(iter(module.selections.values())).problem.replace("n2", "n1").replace("in5x5", "in3x3"),
        "gemm:1x1", "gemm:1x1", "gemm:1x1"))
    for t in (x, z, x, z):
        torch.testing.assert_close(module(t), F.conv2d(t, module.weight, module.bias), atol=1e-5, rtol=1e-4)
    assert set(module._convtune_fast) == {x.shape, z.shape}


def test_the_host_cost_rule_judges_every_tuned_direction_whatever_the_order(native, monkeypatch, tmp_path):
    from convtune.results import PerfResult, Status

    monkeypatch.setattr(host_costs, "host_overheads_us",
                        lambda device, db=None: {"python": 50.0, "gemm_1x1": 5.0, "native": 2.0})
    x = torch.randn(2, 6, 5, 5)
    plans = []
    for order in (("inference", "training"), ("training",)):
        module = ct.nn.Conv2d(6, 4, 1, mode="hybrid", db=ct.TuningDB(tmp_path / f"{len(order)}.sqlite"))
        p = ConvProblem.from_module(module, tuple(x.shape))
        for d, gain_ms in (("fwd", 0.003), ("bwd_data", 0.010), ("bwd_filter", 0.010)):
            module._convtune_tuning.db.store(p.with_direction(d), [
                PerfResult("gemm:1x1", Status.OK, time_ms=0.02, rel_error=0.0),
                PerfResult("torch:native", Status.OK, time_ms=0.02 + gain_ms, rel_error=0.0)])
        for step in order:
            if step == "inference":
                with torch.no_grad():
                    module(x)
                judged = next(iter(module.selections.values()))
                assert judged.runtime == "torch" and judged.host_rule  # 3 us gained, 5 us paid
                assert pickle.loads(pickle.dumps(judged)).host_rule  # a copy is judged again too
            else:
                module(x.clone().requires_grad_()).sum().backward()
        plans.append(next(iter(module.selections.values())))
    assert plans[0] == plans[1] and plans[0].runtime == "native" and plans[0].fwd == "gemm:1x1"  # 23 us against 15


def test_the_old_package_name_still_imports_and_unpickles_with_a_deprecation_warning():
    code = ("import pickle, warnings, torch, convtune\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import convtune.torch.modules as old\n"
            "assert any(issubclass(x.category, DeprecationWarning) for x in w)\n"
            "assert old.Conv2d is convtune.nn.Conv2d\n"
            "assert pickle.loads(b'cconvtune.torch.modules\\nConv2d\\n.') is convtune.nn.Conv2d\n")  # a pickled class
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("change", [dict(stride=(2, 2)), dict(padding=(1, 1)), dict(dilation=(2, 2))])
def test_changing_a_tuned_layer_drops_its_choices_and_it_computes_what_it_now_is(native, change):
    x = torch.randn(2, 4, 12, 12)
    module = _forced(x, "gemm:1x1", in_channels=4, out_channels=6, kernel_size=1)
    module(x)
    module(x)  # the hot path holds the native op now
    for name, value in change.items():
        setattr(module, name, value)
    assert module.selections == {} and module._convtune_fast == {}
    expected = F.conv2d(x, module.weight, module.bias, stride=module.stride, padding=module.padding,
                        dilation=module.dilation)
    torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("missing", ["device", "toolkit"])
def test_a_cuda_build_of_torch_without_a_device_or_toolkit_builds_for_the_cpu(monkeypatch, tmp_path, missing):
    # A CUDA wheel of PyTorch on a CPU-only machine: compiling against CUDA would fail (no device to
    # pick an architecture for, no cuda_runtime_api.h), so the extension is built for the CPU alone.
    from convtune import extension

    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    (home / "include" / "cuda_runtime_api.h").write_text("")
    (home / "include" / "cudnn.h").write_text("")
    (home / "lib").mkdir()
    (home / "lib" / "libcudnn.so.9").write_text("")
    monkeypatch.setenv("CONVTUNE_CUDNN_HOME", str(home))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert extension.cudnn_dirs() == (home / "include", home / "lib")  # everything there: the CUDA build
    if missing == "device":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    else:
        (home / "include" / "cuda_runtime_api.h").unlink()
    assert extension.cudnn_dirs() is None


def test_the_host_cost_rule_leaves_a_cpu_bfloat16_layer_on_its_choice(native, monkeypatch, tmp_path):
    # On the CPU in bfloat16 PyTorch's own call is no option (it computes some problems wrongly): the rule,
    # which would send a layer whose gain does not pay its host cost there, keeps its measured choice.
    from convtune.results import PerfResult, Status

    monkeypatch.setattr(host_costs, "host_overheads_us",
                        lambda device, db=None: {"python": 50.0, "gemm_1x1": 50.0, "native": 50.0})
    module = ct.nn.Conv2d(6, 4, 1, mode="hybrid", db=ct.TuningDB(tmp_path / "t.sqlite")).to(torch.bfloat16)
    x = torch.randn(2, 6, 5, 5, dtype=torch.bfloat16)
    p = ConvProblem.from_module(module, tuple(x.shape), dtype="bfloat16")
    module._convtune_tuning.db.store(p, [PerfResult("gemm:1x1", Status.OK, time_ms=0.02, rel_error=0.0),
                                         PerfResult("torch:native", Status.OK, time_ms=0.021, rel_error=0.0)])
    with torch.no_grad():
        module(x)
    judged = next(iter(module.selections.values()))
    assert judged.fwd == "gemm:1x1" and not judged.host_rule and judged.runtime != "torch"


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")  # (Python 3.12: fork with threads)
def test_a_child_forked_while_another_thread_runs_tuned_layers_makes_executables(native):
    import time

    from convtune.pytorch.tuning import LayerSelection

    # Another thread runs a tuned layer and the layer op (their C++ calls look executables and layers up under the
    # extension's locks, the GIL released) while this one forks; each child makes an executable, a layer and an
    # entry (which take those locks to write). A child forked while a lock was held waited for ever before the
    # extension took its locks around fork (this test then failed about 1 run in 3 on a 2-core machine: a lock is
    # held for a small part of each call); with the locks released in the child rather than made anew, at once.
    module = ct.nn.Conv2d(4, 4, 1, mode="get")
    x = torch.randn(1, 4, 3, 3)
    module(x)
    sig, selection = next(iter(module.selections.items()))
    module._convtune_select(sig, LayerSelection(selection.problem, "gemm:1x1"))  # on its executable
    module._convtune_fast.clear()
    assert next(iter(module.selections.values())).runtime == "native"
    stop = threading.Event()

    layer_op, layer = torch.ops.convtune.layer_conv.default, module._convtune_layer
    assert layer, "the module has no C++ layer here"
    native = extension.loaded()

    def run():  # the registry's lock (the hot path) and the layers' (the layer op compiled code calls)
        with torch.no_grad():
            while not stop.is_set():
                module(x)
                layer_op(x, module.weight, module.bias, *module._convtune_geometry, layer, False, False)

    worker = threading.Thread(target=run)
    worker.start()
    stuck, forks, ended = [], 0, time.monotonic() + 3.0
    try:
        while time.monotonic() < ended:
            pid = os.fork()
            if pid == 0:  # the child: an executable of a problem the parent never made, a layer, an entry, then out
                code = 1
                try:
                    runtime.prepare(ConvProblem("fwd", n=1, c=3, k=5 + forks, input_size=(2, 2), kernel_size=1),
                                    "torch:native")
                    native.layer_new([1, 1], [0, 0], [1, 1], 1, [4, 4, 1, 1])
                    native.layer_set(layer, [2, 4, 3, 3], "float32", "cpu", False, [0, 0, 0], [False] * 3)
                    code = 0
                finally:
                    os._exit(code)
            forks += 1
            waited, status = time.monotonic() + 10.0, None
            while status is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                status = None
                if time.monotonic() > waited:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    stuck.append(forks)
                    break
                time.sleep(0.001)
            if stuck:
                break
            assert os.waitstatus_to_exitcode(status) == 0, f"the child of fork {forks} failed"  # (its error above)
    finally:
        stop.set()
        worker.join()
    assert not stuck, f"a child forked while the layer ran waited for a lock (fork {stuck[0]} of {forks})"


@pytest.mark.skipif(not hasattr(torch.backends.cudnn, "conv"), reason="a PyTorch without per-operation precisions")
def test_a_model_runs_where_the_convolutions_tf32_setting_differs_from_the_rnns(native):
    # PyTorch's per-operation settings (torch.backends.cudnn.conv.fp32_precision) unlike the RNNs' make reading
    # torch.backends.cudnn.allow_tf32 raise: convtune reads the convolutions' own setting instead.
    from convtune import isolation
    from convtune.tf32 import conv_allowed

    saved = torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision
    x = torch.randn(2, 3, 8, 8)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1))
    twin = copy.deepcopy(model)
    try:
        for conv in ("ieee", "tf32"):
            torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision = (
                conv, "tf32" if conv == "ieee" else "ieee")
            with pytest.raises(RuntimeError):
                torch.backends.cudnn.allow_tf32  # noqa: B018  (the flag this test is about)
            assert conv_allowed() is (conv == "tf32")
            assert ConvProblem.from_module(model[0], tuple(x.shape)).allow_tf32 is (conv == "tf32")
            assert isolation._state()["cudnn"][1] is (conv == "tf32")
            tuned = ct.optimize(copy.deepcopy(model), x, training=True, mode="get")
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya, yb = tuned(xa), twin(xb)
            torch.testing.assert_close(ya, yb)
            ya.sum().backward()
            yb.sum().backward()
            torch.testing.assert_close(xa.grad, xb.grad)
            keys = {sel.problem for layer in tuned.modules() if isinstance(layer, TunedConv)
                    for sel in layer.selections.values()}
            assert keys and all(k.endswith(f"tf32={int(conv == 'tf32')}") for k in keys)
    finally:
        torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision = saved
    assert torch.backends.cudnn.allow_tf32  # (the default again)
