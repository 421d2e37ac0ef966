"""convtune's PyTorch integration on the CPU: custom ops, convtune.nn, optimize, explain, workspaces.

Every result is compared with PyTorch's own convolution (forward and both gradients) on fresh
random inputs; the ops' outputs are poisoned with NaN before the algorithms write them.
torch.compile mostly runs with backend="aot_eager": Inductor's C++ compile takes tens of seconds on
two cores, and the custom op's tracing (fake kernels, registered autograd) is what is under test;
one test compiles with Inductor itself.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch.autograd.gradcheck import GradcheckError

import convtune
import convtune.nn
from convtune import ConvProblem, PerfResult, Policy, Status, TuningDB, algorithms
from convtune.algorithms.base import SUPPORTED, Buffer, buffers_bytes, unsupported
from convtune.algorithms.registry import isolated
from convtune.pytorch import ops, workspace
from convtune.pytorch.explain import explain_table
from convtune.pytorch.tuning import Signature, Tuning, select_for_layer
from convtune.settings import settings
from convtune.verify import rel_error
from fakes import Fake, NoWrite, WrongResult
from twins import torch_twin

TIGHT = dict(atol=1e-5, rtol=1e-4)  # float32 against PyTorch's float32: rounding differences only


@pytest.fixture(autouse=True)
def _fast(quick_timing):
    yield


@pytest.fixture
def db(tmp_path):
    with TuningDB(tmp_path / "tuning.sqlite") as database:
        yield database


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def assert_same_training_step(model: torch.nn.Module, twin: torch.nn.Module, x: torch.Tensor) -> None:
    """Forward, input gradient and every parameter gradient of ``model`` equal ``twin``'s."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = model(xa), twin(xb)
    torch.testing.assert_close(ya, yb, **TIGHT)
    g = torch.randn_like(yb)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, **TIGHT)
    for (name, ga), gb in zip(grads(model).items(), grads(twin).values()):
        assert ga is not None and not torch.isnan(ga).any(), name
        torch.testing.assert_close(ga, gb, **TIGHT, msg=name)


# -- the custom ops ---------------------------------------------------------------------------

OP_PROBLEMS = [
    dict(n=2, c=4, k=6, input_size=(7, 6), kernel_size=3, stride=2, padding=1, groups=2),
    dict(n=3, c=4, k=4, input_size=(9,), kernel_size=3, dilation=2, padding=2),
    dict(n=2, c=3, k=5, input_size=(6, 5), kernel_size=(1, 1), layout="channels_last"),
]


def test_poisoned_results_show_the_elements_an_algorithm_left_unwritten(poisoned):
    problem = ConvProblem("fwd", n=1, c=2, k=3, input_size=(4,), kernel_size=1)
    x, w = problem.random_inputs()
    with isolated(NoWrite("fake:nowrite")):
        assert torch.isnan(ops.compute(x, w, problem.key, "fake:nowrite")).all()
        assert torch.isnan(convtune.pytorch.ops.conv(x, w, problem.key, "fake:nowrite", "", "")).all()


@pytest.mark.parametrize("spec", OP_PROBLEMS, ids=["grouped_strided", "dilated_1d", "1x1_channels_last"])
def test_op_forward_and_gradients_match_torch_for_every_algorithm(spec, poisoned):
    problem = ConvProblem("fwd", **spec)
    x, w = problem.random_inputs(seed=3)
    gy = torch.randn(problem.y_shape)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    conv = {1: F.conv1d, 2: F.conv2d}[problem.ndim]
    yr = conv(xr, wr, stride=problem.stride, padding=problem.padding, dilation=problem.dilation, groups=problem.groups)
    yr.backward(gy)
    serving = {d: [a.name for a in algorithms(problem.with_direction(d))] for d in ("fwd", "bwd_data", "bwd_filter")}
    names = sorted(set().union(*serving.values()))
    assert len(names) >= 3
    for name in names:
        fwd, bwd_data, bwd_filter = (name if name in serving[d] else "torch:native" for d in serving)
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = torch.ops.convtune.conv(xa, wa, problem.key, fwd, bwd_data, bwd_filter)
        assert convtune.problem.is_in_layout(y, problem.layout), name
        y.backward(gy)
        for got, want in ((y, yr), (xa.grad, xr.grad), (wa.grad, wr.grad)):
            assert rel_error(got.detach(), want.detach()) < 1e-5, name


def test_op_passes_torch_library_opcheck():
    problem = ConvProblem("fwd", n=2, c=4, k=6, input_size=(6, 6), kernel_size=3, padding=1, groups=2)
    x, w = problem.random_inputs()
    args = (x.requires_grad_(), w.requires_grad_(), problem.key, "gemm:im2col", "direct:taps", "direct:taps")
    torch.library.opcheck(torch.ops.convtune.conv.default, args)
    torch.library.opcheck(torch.ops.convtune.run.default, (x.detach(), w.detach(), problem.key, "direct:taps"))


def test_op_gradients_pass_gradcheck_and_a_wrong_backward_fails_it():
    # gradcheck in float32: convolution is linear in each operand, so central differences are exact
    # up to rounding, and eps=1e-2 keeps rounding far below the 1e-3 tolerance.
    problem = ConvProblem("fwd", n=1, c=2, k=3, input_size=(5, 4), kernel_size=3, padding=1)
    x, w = problem.random_inputs(seed=1)
    x, w = x.requires_grad_(), w.requires_grad_()
    check = dict(eps=1e-2, atol=1e-3, rtol=1e-3)

    def op(bwd_data: str, bwd_filter: str):
        return lambda a, b: torch.ops.convtune.conv(a, b, problem.key, "gemm:im2col", bwd_data, bwd_filter)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not of double precision", category=UserWarning)
        assert torch.autograd.gradcheck(op("direct:taps", "gemm:im2col"), (x, w), **check)
        with isolated(WrongResult("fake:wrong", scale=1.05)), pytest.raises(GradcheckError):
            torch.autograd.gradcheck(op("fake:wrong", "direct:taps"), (x, w), **check)


def test_op_without_a_backward_algorithm_names_the_fix():
    problem = ConvProblem("fwd", n=1, c=2, k=2, input_size=(4, 4), kernel_size=1)
    x, w = problem.random_inputs()
    y = torch.ops.convtune.conv(x.requires_grad_(), w, problem.key, "gemm:1x1", "", "")
    with pytest.raises(ValueError, match="no algorithm was chosen for bwd_data"):
        y.sum().backward()


@pytest.mark.parametrize("path", ["native or Python", "Python"])
def test_a_runner_takes_operands_of_any_strides_and_still_checks_the_rest(path):
    problem = ConvProblem("fwd", n=2, c=3, k=4, input_size=(5, 5), kernel_size=1, layout="channels_last")
    x, w = problem.random_inputs()
    w_other = w.clone(memory_format=torch.contiguous_format)  # (4, 3, 1, 1): dense either way
    assert w_other.stride() != w.stride()
    run = ops.runner(problem.key, "gemm:1x1") if path == "native or Python" else ops.Runner(problem.key, "gemm:1x1")
    ref = torch.nn.functional.conv2d(x, w)
    for weight in (w_other, w, w_other):  # each kind of stride, and the one seen first, again
        torch.testing.assert_close(run(x, weight), ref)
    torch.testing.assert_close(run(x.contiguous(), w), ref)  # not dense in the layout: laid out first
    with pytest.raises(ValueError, match="shape"):
        run(x, w[:2])
    with pytest.raises(ValueError, match="dtype"):
        run(x, w_other.double())


# -- convtune.nn modules ----------------------------------------------------------------------

MODULES = [
    (convtune.nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1), (2, 4, 11)),
    (convtune.nn.Conv1d, dict(in_channels=4, out_channels=4, kernel_size=4, padding="same", dilation=2), (2, 4, 9)),
    (convtune.nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, groups=2), (2, 4, 6, 7)),
    (convtune.nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=(2, 3), padding="same"), (2, 3, 6, 6)),
    (convtune.nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, padding="valid", bias=False), (1, 3, 7, 5)),
    (convtune.nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, padding=2, padding_mode="reflect"),
     (2, 3, 6, 6)),
    (convtune.nn.Conv2d, dict(in_channels=2, out_channels=4, kernel_size=3, padding=(1, 2), padding_mode="circular",
                              dilation=(1, 2)), (2, 2, 6, 7)),
    (convtune.nn.Conv3d, dict(in_channels=2, out_channels=3, kernel_size=2, stride=(1, 2, 1), padding=1,
                              padding_mode="replicate"), (1, 2, 4, 5, 4)),
]


@pytest.mark.parametrize("cls, kwargs, shape", MODULES, ids=[f"{c.__name__}-{i}" for i, (c, *_) in enumerate(MODULES)])
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
def test_module_is_a_drop_in_for_torch_nn(cls, kwargs, shape, poisoned):
    torch.manual_seed(0)
    conv = cls(**kwargs, mode="get")
    plain = getattr(torch.nn, cls.__name__)(**kwargs)
    assert isinstance(conv, getattr(torch.nn, cls.__name__))
    assert conv.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(conv.state_dict())
    assert_same_training_step(conv, plain, torch.randn(shape))
    (plan,) = conv.selections.values()
    assert not plan.on_torch and plan.fwd and plan.bwd_data and plan.bwd_filter
    assert repr(conv) == repr(plain)


def test_module_measures_in_hybrid_mode_and_stores_in_the_database(db):
    conv = convtune.nn.Conv2d(3, 4, 3, padding=1, db=db)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(conv(x), F.conv2d(x, conv.weight, conv.bias, padding=1), **TIGHT)
    (plan,) = conv.selections.values()
    assert (plan.bwd_data, plan.bwd_filter) == ("", "")  # no gradient was needed
    (direction, result), = plan.results
    assert direction == "fwd" and result.time_ms is not None
    problem = ConvProblem.from_key(plan.problem)
    assert plan.fwd in {r.algorithm for r in db.results(problem) if r.ok}  # every candidate measured and stored
    # the best stored one, unless the host-cost rule sent the layer (whose gain is smaller than its extra host
    # cost) to PyTorch's call
    assert plan.fwd == ("torch:native" if plan.host_rule else db.lookup(problem).algorithm)


def test_unbatched_and_channels_last_inputs():
    conv = convtune.nn.Conv2d(3, 4, 3, padding=1, mode="get")
    x = torch.randn(3, 5, 6)
    torch.testing.assert_close(conv(x), F.conv2d(x, conv.weight, conv.bias, padding=1), **TIGHT)
    xl = torch.randn(2, 3, 5, 6).to(memory_format=torch.channels_last)
    y = conv(xl)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, F.conv2d(xl, conv.weight, conv.bias, padding=1), **TIGHT)
    layouts = sorted(sig.layout for sig in conv.selections)
    assert layouts == ["channels_first", "channels_last"]
    assert all(plan.problem.split("|")[-3] == sig.layout for sig, plan in conv.selections.items())
    assert conv.weight.is_contiguous()  # the Parameter is not converted in place
    assert_same_training_step(conv, torch_twin(conv), xl)  # the weight's gradient flows through the conversion


def test_autocast_computes_in_the_autocast_dtype():
    conv = convtune.nn.Conv2d(3, 4, 3, padding=1, mode="get")
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv(x)
        expected = F.conv2d(x, conv.weight, conv.bias, padding=1)
    assert y.dtype == expected.dtype == torch.bfloat16
    (sig,) = conv.selections
    assert sig.dtype == torch.bfloat16
    with torch.no_grad():
        reference = F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    assert rel_error(y.float(), reference) < 2e-2


def test_inputs_convtune_cannot_describe_run_torchs_path():
    conv = convtune.nn.Conv2d(2, 3, 3, mode="get").double()
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(conv(x), F.conv2d(x, conv.weight, conv.bias))
    (plan,) = conv.selections.values()
    assert plan.on_torch and "float64" in plan.reason
    (row,) = convtune.explain(conv)
    assert row["algorithm"] is None and "float64" in row["note"]


# -- optimize -----------------------------------------------------------------------------------

class SmallCNN(torch.nn.Module):
    """Strided, depthwise, grouped+dilated 2D convolutions, a batch norm, then 1D convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.grouped = torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2, bias=False)
        self.seq = torch.nn.Conv1d(8, 4, 3, padding=1)
        self.head = torch.nn.Conv1d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        x = torch.relu(self.grouped(self.depthwise(x)))
        return self.head(torch.relu(self.seq(x.flatten(2))))


def test_optimize_for_training_then_a_backward_pass(db):
    torch.manual_seed(0)
    model = SmallCNN()
    twin = torch_twin(model)
    params = dict(model.named_parameters())
    x = torch.randn(2, 3, 8, 8)
    running_mean = model.bn.running_mean.clone()
    assert convtune.optimize(model, x, training=True, db=db) is model
    assert all(p is params[name] for name, p in model.named_parameters())  # shared, not copied
    torch.testing.assert_close(model.bn.running_mean, running_mean, rtol=0, atol=0)  # the example run left no trace
    convs = [model.stem, model.depthwise, model.grouped, model.seq, model.head]
    assert [type(m) for m in convs] == [convtune.nn.Conv2d] * 3 + [convtune.nn.Conv1d] * 2
    rows = convtune.explain(model)
    directions = {(r["module"], r["direction"]) for r in rows}
    assert ("stem", "bwd_data") not in directions  # the input needs no gradient
    assert {("stem", "fwd"), ("stem", "bwd_filter"), ("head", "bwd_data")} <= directions
    assert len(rows) == 5 * 3 - 1 and all(r["algorithm"] and r["time_ms"] is not None for r in rows)
    assert all(r["problem"].startswith(r["direction"] + "|") for r in rows)
    assert_same_training_step(model, twin, torch.randn(2, 3, 8, 8))
    model.load_state_dict(twin.state_dict())  # and back: the keys are torch's


class _Counting(torch.nn.Module):
    """A model whose forward assigns a buffer anew (a step counter), beside a spectrally normalized conv (a weight
    that reading computes: in training each read runs a power iteration, updating the parametrization's state)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.normed = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Conv2d(3, 4, 3))
        self.conv = torch.nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps = self.steps + 1
        return self.conv(self.normed(x))


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_the_example_run_changes_no_state_of_the_model(db, warm):
    # the dry run alone (warm database) and the dry run then the real one (cold): neither may leave a trace
    torch.manual_seed(0)
    model, x = _Counting(), torch.randn(2, 3, 8, 8)
    if warm:
        convtune.optimize(copy.deepcopy(model), x, training=True, db=db)
    steps = model.steps
    before = {name: t.clone() for name, t in model.state_dict().items()}
    convtune.optimize(model, x, training=True, db=db)
    assert model.steps is steps and int(model.steps) == 0  # the same buffer, as it was
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)


def test_forward_hooks_fire_in_the_example_run_once_dry_and_again_where_it_measures(db):
    # as docs/runtime.md says: a hook that collects activations sees the dry run's zeros, so it belongs after optimize
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()), torch.randn(1, 3, 6, 6)
    seen: list[float] = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(float(out.abs().sum())))
    convtune.optimize(copy.deepcopy(model), x, db=db)  # cold: a dry run, then the real one
    assert len(seen) == 2 and seen[0] == 0.0 and seen[1] > 0
    seen.clear()
    convtune.optimize(model, x, db=db)  # warm: the dry run alone
    assert seen == [0.0]


def _counting_torch_convs(monkeypatch) -> list[torch.nn.Module]:
    """The conv layers whose torch convolution runs, one entry per call."""
    calls: list[torch.nn.Module] = []
    for cls in (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d):
        real = cls._conv_forward
        monkeypatch.setattr(cls, "_conv_forward", lambda self, *a, _real=real: calls.append(self) or _real(self, *a))
    return calls


def test_a_warm_optimize_computes_no_convolution_in_its_example_run(db, monkeypatch):
    calls = _counting_torch_convs(monkeypatch)
    torch.manual_seed(0)
    cold, x = SmallCNN(), torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    convtune.optimize(cold, x, training=True, db=db)
    assert len(calls) == 5  # cold: the dry run met layers the database did not answer, so the real run ran
    calls.clear()
    warm = SmallCNN()
    twin = torch_twin(warm)
    convtune.optimize(warm, x, training=True, db=db)
    assert calls == []  # warm: the dry run met only answered layers, and it computes nothing
    assert [(r["module"], r["direction"], r["algorithm"]) for r in convtune.explain(warm)] == \
        [(r["module"], r["direction"], r["algorithm"]) for r in convtune.explain(cold)]
    assert_same_training_step(warm, twin, x)


def test_the_dry_runs_layout_rule_agrees_with_pytorchs_convolution_on_random_strides():
    # The dry run lays a result out channels_last where PyTorch would; PyTorch's convolution says what that is.
    from convtune.pytorch.optimize import _strides_like_channels_last

    g = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(500):
        shape = [int(v) for v in torch.randint(1, 5, (4,), generator=g)]
        order = torch.randperm(4, generator=g).tolist()  # the order the dimensions are laid out in memory
        stored = [shape[d] for d in order]
        if torch.rand(1, generator=g) < 0.3:  # every other element: not dense
            t = torch.randn([2 * s for s in stored])[::2, ::2, ::2, ::2].permute([order.index(d) for d in range(4)])
        else:
            t = torch.randn(stored).permute([order.index(d) for d in range(4)])
        y = F.conv2d(t, torch.randn(3, t.shape[1], 1, 1))
        if y.shape[2] * y.shape[3] == 1:  # dense in both orders: no layout to tell
            continue
        checked += 1
        pytorch = y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
        assert _strides_like_channels_last(t) == pytorch, (tuple(t.shape), t.stride())
    assert checked > 300


def test_the_dry_example_run_sees_what_the_real_one_sees():
    from convtune.pytorch.optimize import _observe_run

    torch.manual_seed(0)
    model = SmallCNN()
    for x in (torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last),
              torch.randn(3, 8, 8)[None].expand(2, 3, 8, 8)):
        for training in (False, True):
            for autocast in (False, True):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    dry = _observe_run(model, x, training, dry=True)
                    real = _observe_run(model, x, training, dry=False)
                assert {k: calls for k, (_, calls) in dry.items()} == {k: calls for k, (_, calls) in real.items()}
    assert {sig.layout for _, calls in real.values() for sig in calls} == {"channels_first"}
    class Scaled(torch.nn.Conv2d):  # a subclass whose forward differs: it runs its own even in the dry run
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)[:, :, ::2]

    padded = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding="same", padding_mode="reflect"),
                                 torch.nn.Conv2d(4, 4, 4, padding="same", padding_mode="circular"), Scaled(4, 2, 1),
                                 torch.nn.Conv2d(2, 2, 3, stride=2, dilation=2, padding=1))
    x = torch.randn(2, 3, 9, 8).to(memory_format=torch.channels_last)
    dry, real = (_observe_run(padded, x, True, dry=d) for d in (True, False))
    assert {k: c for k, (_, c) in dry.items()} == {k: c for k, (_, c) in real.items()} and len(real) == 4
    def same(model: torch.nn.Module, x: torch.Tensor, training: bool = True) -> None:
        dry, real = (_observe_run(model, x, training, dry=d) for d in (True, False))
        assert {k: c for k, (_, c) in dry.items()} == {k: c for k, (_, c) in real.items()}

    grey = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.Conv2d(8, 8, 3, groups=8), torch.nn.Conv2d(8, 4, 1))
    same(grey.to(memory_format=torch.channels_last), torch.randn(2, 1, 9, 9).to(memory_format=torch.channels_last))
    same(grey, torch.randn(2, 1, 9, 9).to(memory_format=torch.channels_last))  # one channel: both layouts at once
    same(torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Conv2d(8, 8, 1)),
         torch.randn(9, 9, 4).permute(2, 0, 1))  # unbatched, channels innermost
    bias_only = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
    for p in bias_only.parameters():
        p.requires_grad_(p.dim() == 1)  # frozen weights, trained biases: the second layer's input needs a gradient
    same(bias_only, torch.randn(2, 3, 9, 9))
    inplace = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(inplace=True), torch.nn.Conv2d(4, 2, 1))
    x = torch.randn(2, 3, 8, 8)
    assert {k: c for k, (_, c) in _observe_run(inplace, x, True, dry=True).items()} == \
        {k: c for k, (_, c) in _observe_run(inplace, x, True, dry=False).items()}
    unbatched = torch.nn.Sequential(torch.nn.Conv1d(2, 3, 3), torch.nn.Conv1d(3, 2, 1))
    x = torch.randn(2, 9)
    assert {k: c for k, (_, c) in _observe_run(unbatched, x, True, dry=True).items()} == \
        {k: c for k, (_, c) in _observe_run(unbatched, x, True, dry=False).items()}


@pytest.mark.parametrize("mode", ["get", "db_then_get", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_example_input_of_another_dtype_than_the_model_raises_torchs_error_in_every_mode(db, mode, dtype):
    # The dry run computes nothing, yet it must refuse what the real run refuses: a mode that measures nothing (or a
    # warm database) would otherwise tune float16 problems for a float32 model that cannot run on them.
    model, x = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()), torch.randn(2, 3, 8, 8, dtype=dtype)
    with pytest.raises(RuntimeError) as plain:
        model(x)
    convtune.optimize(copy.deepcopy(model).to(dtype), x, mode=mode, db=db)  # the database answers x's problem now
    with pytest.raises(RuntimeError, match=re.escape(str(plain.value))):
        convtune.optimize(model, x, mode=mode, db=db)
    assert type(model[0]) is torch.nn.Conv2d
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts the input: no mixed dtypes there
        convtune.optimize(model, torch.randn(2, 3, 8, 8), mode=mode, db=db)
    assert isinstance(model[0], convtune.nn.Conv2d)


@pytest.mark.parametrize("mode", ["get", "hybrid"])
def test_optimize_draws_nothing_from_torchs_random_generator(db, mode):
    # A seeded training run must draw the same numbers whether optimize ran, and whether the database was warm:
    # the process's first optimize measures the CPU's peaks for the cost model, which must use its own generator.
    from convtune import costmodel, hardware

    hardware._cpu_peaks.cache_clear()  # measured once a process: as the process's first optimize finds it
    costmodel._device_peaks.cache_clear()
    costmodel.clear_cache()
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1)), \
        torch.randn(2, 3, 8, 8)
    state = torch.random.get_rng_state()
    convtune.optimize(model, x, training=True, mode=mode, db=db)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_the_example_runs_put_back_a_forward_a_layer_already_had():
    from convtune.pytorch.optimize import _observe_run

    conv, calls = torch.nn.Conv2d(3, 4, 3), []
    plain = conv.forward

    def wrapped(x: torch.Tensor) -> torch.Tensor:  # as a library's hook wraps a module's forward
        calls.append(x.shape)
        return plain(x)

    conv.forward = wrapped
    for dry in (True, False):
        _observe_run(torch.nn.Sequential(conv), torch.randn(1, 3, 6, 6), False, dry=dry)
        assert conv.__dict__["forward"] is wrapped
    assert len(calls) == 1  # the real run called it; the dry one computes nothing


class ValueDependent(torch.nn.Module):
    """Code that zeros break: the dry example run fails and the real one runs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if not bool(y.abs().sum() > 0):
            raise ValueError("an all-zero activation")
        return y


def test_a_model_that_fails_on_the_dry_run_is_observed_for_real(db, monkeypatch):
    calls = _counting_torch_convs(monkeypatch)
    x = torch.randn(2, 3, 6, 6)
    convtune.optimize(ValueDependent(), x, db=db)
    calls.clear()
    model = ValueDependent()
    twin = torch_twin(model)
    convtune.optimize(model, x, db=db)  # warm: the dry run raises, the real one runs
    assert calls == [model.conv]
    assert isinstance(model.conv, convtune.nn.Conv2d) and convtune.explain(model)[0]["algorithm"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), twin(x), **TIGHT)


def test_optimize_for_inference_tunes_the_forward_only_and_matches_torch():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    twin = torch_twin(model)
    x = torch.randn(2, 3, 8, 8)
    convtune.optimize(model, x, mode="get")
    assert {r["direction"] for r in convtune.explain(model)} == {"fwd"}
    with torch.no_grad():
        torch.testing.assert_close(model(x), twin(x), **TIGHT)
    text = io.StringIO()
    Console(file=text, width=200).print(explain_table(model))
    assert "depthwise" in text.getvalue() and "fwd" in text.getvalue()


def test_a_conv_called_with_its_input_as_a_keyword_is_tuned_and_runs_so():
    class ByKeyword(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return self.b(input=self.a(x))

    torch.manual_seed(0)
    model = ByKeyword().eval()
    twin = torch_twin(model)
    x = torch.randn(1, 3, 6, 6)
    convtune.optimize(model, x, mode="get")
    assert sorted({r["module"] for r in convtune.explain(model)}) == ["a", "b"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), twin(x), **TIGHT)
    alone = convtune.optimize(torch.nn.Conv2d(3, 4, 3), {"input": x}, mode="get")  # the example as keywords
    assert len(convtune.explain(alone)) == 1


def test_profiler_ranges_name_each_runs_problem_and_algorithm():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Conv2d(4, 2, 1))
    x = torch.randn(2, 3, 6, 6)
    with isolated(convtune.get_algorithm("gemm:im2col"), builtins=False):  # not torch:native, which torch runs
        convtune.optimize(model, x, training=True, mode="get")
        chosen = {r["problem"]: r["algorithm"] for r in convtune.explain(model)}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(x).sum().backward()
    ranges = [e.name.removeprefix(ops.LABEL_PREFIX).split(ops.LABEL_SEP) for e in prof.events()
              if e.name.startswith(ops.LABEL_PREFIX) and not e.name.startswith("convtune::")]
    assert sorted(key for key, _ in ranges) == sorted(chosen)  # each tuned direction ran once, labelled
    assert all(chosen[key] == algorithm for key, algorithm in ranges)
    with isolated(convtune.get_algorithm("gemm:im2col"), builtins=False):
        model(x)  # no profiler: no range, nothing breaks


def test_state_dict_loads_into_the_plain_torch_model_and_back():
    torch.manual_seed(0)
    model = convtune.optimize(SmallCNN(), torch.randn(1, 3, 8, 8), mode="get")
    plain = SmallCNN()
    plain.load_state_dict(model.state_dict())
    other = convtune.optimize(SmallCNN(), torch.randn(1, 3, 8, 8), mode="get")
    other.load_state_dict(plain.state_dict())
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)


def test_new_input_shapes_are_tuned_on_first_use_by_the_modes_rule(db, monkeypatch):
    selecting = sys.modules["convtune.select"]  # the name convtune.select is the function
    calls = []
    real_find = selecting.find
    monkeypatch.setattr(selecting, "find", lambda *a, **kw: calls.append(a[0]) or real_find(*a, **kw))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1))
    twin = torch_twin(model)
    convtune.optimize(model, torch.randn(2, 3, 6, 6), db=db)
    assert len(calls) == 2  # hybrid: nothing stored yet, so both layers were measured
    with torch.no_grad():
        x = torch.randn(3, 3, 5, 7)
        torch.testing.assert_close(model(x), twin(x), **TIGHT)
    assert len(calls) == 4 and {p.n for p in calls[2:]} == {3}
    assert len(model[0].selections) == 2
    with torch.no_grad():
        model(x)
    assert len(calls) == 4  # cached per module per shape

    calls.clear()
    convtune.optimize(model, torch.randn(2, 3, 6, 6), mode="db_then_get", db=db)
    with torch.no_grad():
        x = torch.randn(1, 3, 4, 4)
        torch.testing.assert_close(model(x), twin(x), **TIGHT)
    assert calls == []  # db_then_get never measures
    assert all(r["time_ms"] is None for r in convtune.explain(model) if r["problem"].startswith("fwd|n1|"))


def test_gradients_needed_later_are_tuned_on_first_use():
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Conv2d(3, 2, 1))
    twin = torch_twin(model)
    x = torch.randn(1, 2, 6, 6)
    convtune.optimize(model, x, mode="get")  # inference: forward only
    assert {r["direction"] for r in convtune.explain(model)} == {"fwd"}
    assert_same_training_step(model, twin, x)
    assert {r["direction"] for r in convtune.explain(model)} == {"fwd", "bwd_data", "bwd_filter"}


class OneByOne(Fake):
    """Computes only 1x1 convolutions (every direction)."""

    def _supports(self, problem):
        return SUPPORTED if problem.is_1x1 else unsupported("1x1 kernels only")


def test_layers_no_algorithm_supports_stay_on_torchs_path():
    fake = OneByOne("fake:one_by_one")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Conv2d(4, 2, 1))
    twin = torch_twin(model)
    x = torch.randn(2, 3, 5, 5)
    with isolated(fake, builtins=False):
        convtune.optimize(model, x, training=True, mode="find")
        runs = fake.runs
        assert_same_training_step(model, twin, x)
        assert fake.runs == runs + 3  # the 1x1 layer: fwd, bwd_data, bwd_filter
    rows = {(r["module"], r["direction"]): r for r in convtune.explain(model)}
    assert rows[("0", "fwd")]["algorithm"] is None and "1x1 kernels only" in rows[("0", "fwd")]["note"]
    assert [rows[("1", d)]["algorithm"] for d in ("fwd", "bwd_data", "bwd_filter")] == ["fake:one_by_one"] * 3


def test_optimize_again_retunes_under_the_new_policy_and_keeps_shared_layers_shared():
    shared = torch.nn.Conv2d(4, 4, 3, padding=1)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 1), shared, torch.nn.ReLU(), shared)
    twin = torch_twin(model)
    x = torch.randn(1, 2, 5, 5)
    convtune.optimize(model, x, mode="get")
    assert model[1] is model[3] and isinstance(model[3], convtune.nn.Conv2d)
    convtune.optimize(model, x, policy=Policy(workspace_limit=0), mode="get")
    rows = convtune.explain(model)
    assert rows and all(r["workspace_bytes"] == 0 for r in rows)
    assert {r["module"] for r in rows} == {"0", "1"}  # a shared layer is listed once
    with torch.no_grad():
        torch.testing.assert_close(model(x), twin(x), **TIGHT)


def test_optimized_models_copy_and_pickle(db):
    model = convtune.optimize(torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3)), torch.randn(1, 2, 5, 5), db=db)
    x = torch.randn(1, 2, 5, 5)
    with torch.no_grad():
        expected = model(x)
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert isinstance(clone[0], convtune.nn.Conv2d) and clone[0].selections == model[0].selections
            torch.testing.assert_close(clone(x), expected, rtol=0, atol=0)
    assert pickle.loads(pickle.dumps(model))[0]._convtune_tuning.db.path == db.path


def test_a_model_that_ran_copies_and_pickles_though_its_algorithms_do_not():
    class Locked(Fake):  # like a cuDNN execution plan, which holds its graph and a lock
        def __init__(self):
            super().__init__("fake:locked")
            self.lock = threading.Lock()

    with isolated(Locked(), builtins=False):
        model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3))
        convtune.optimize(model, torch.randn(1, 2, 5, 5), mode="get", training=True)
        x = torch.randn(1, 2, 5, 5, requires_grad=True)
        model(x).sum().backward()  # every direction's runner now holds the algorithm
        assert {r["algorithm"] for r in convtune.explain(model)} == {"fake:locked"}
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert clone[0].selections == model[0].selections
            clone(x).sum().backward()
            assert clone[0].weight.grad is not None


def test_a_layer_runs_the_algorithm_registered_under_its_name_now():
    first, second = Fake("fake:x"), Fake("fake:x", workspace_bytes=256)
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3))
    with isolated(first, builtins=False):
        convtune.optimize(model, x, mode="get", training=True)
        model(x).sum().backward()
        assert first.runs == 3  # the layer's runners now hold ``first``
    with isolated(second, builtins=False):  # the registry changed: the runners are looked up again
        model(x).sum().backward()
    assert (first.runs, second.runs) == (3, 3)


def test_optimize_shows_progress_and_rejects_bad_arguments():
    model = torch.nn.Conv2d(2, 3, 3)
    with settings.override(progress=True):
        convtune.optimize(model, (torch.randn(1, 2, 5, 5),), mode="get")
    assert isinstance(model, convtune.nn.Conv2d)
    with pytest.raises(ValueError, match="mode='fastest'"):
        convtune.optimize(model, torch.randn(1, 2, 5, 5), mode="fastest")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        convtune.optimize(lambda x: x, torch.randn(1, 2, 5, 5))
    with pytest.raises(TypeError, match="example_inputs"):
        convtune.optimize(model, 3.0, mode="get")


# -- torch.compile ------------------------------------------------------------------------------

def test_torch_compile_traces_the_tuned_convolution_without_graph_breaks():
    torch._dynamo.reset()
    model = SmallCNN()
    twin = torch_twin(model)
    x = torch.randn(2, 3, 8, 8)
    convtune.optimize(model, x, training=True, mode="get")
    conv = torch.compile(model.depthwise, backend="aot_eager", fullgraph=True, dynamic=False)
    xd = torch.randn(2, 8, 4, 4, requires_grad=True)  # the shape the layer was tuned for
    y = conv(xd)
    y.sum().backward()
    xr = xd.detach().clone().requires_grad_()
    twin.depthwise(xr).sum().backward()
    torch.testing.assert_close(y, twin.depthwise(xd.detach()), **TIGHT)
    torch.testing.assert_close(xd.grad, xr.grad, **TIGHT)
    torch.testing.assert_close(model.depthwise.weight.grad, twin.depthwise.weight.grad, **TIGHT)

    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    model.zero_grad()
    twin.zero_grad()
    x = torch.randn(2, 3, 8, 8)
    compiled(x).sum().backward()
    twin(x).sum().backward()
    for (name, ga), gb in zip(grads(model).items(), grads(twin).values()):
        torch.testing.assert_close(ga, gb, **TIGHT, msg=name)
    layer = torch.compile(model.depthwise, backend="aot_eager", dynamic=False)
    with torch.no_grad():  # a shape not tuned yet: tuned eagerly at a graph break, then traced
        x = torch.randn(1, 8, 3, 3)
        torch.testing.assert_close(layer(x), twin.depthwise(x), **TIGHT)
    assert len(model.depthwise.selections) == 2


@pytest.mark.slow
def test_inductor_compiles_the_tuned_ops_into_one_graph_forward_and_backward():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, padding=1, groups=2), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 1))
    twin = torch_twin(model)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    portfolio = [convtune.get_algorithm(name) for name in ("gemm:im2col", "direct:taps")]  # not torch:native
    with isolated(*portfolio, builtins=False):
        convtune.optimize(model, x, mode="get", training=True)
        assert all(r["algorithm"] != "torch:native" for r in convtune.explain(model))
        compiled = torch.compile(model, fullgraph=True, dynamic=False)  # Inductor
        y = compiled(x)
        y.sum().backward()
    xr = x.detach().clone().requires_grad_()
    yr = twin(xr)
    yr.sum().backward()
    torch.testing.assert_close(y, yr, **TIGHT)
    torch.testing.assert_close(x.grad, xr.grad, **TIGHT)
    for (name, ga), gb in zip(grads(model).items(), grads(twin).values()):
        torch.testing.assert_close(ga, gb, **TIGHT, msg=name)


# -- workspaces -----------------------------------------------------------------------------------

def test_tuning_reserves_the_workspace_runs_use(fresh_workspaces):
    problem = ConvProblem("fwd", n=2, c=4, k=4, input_size=(6, 6), kernel_size=3)
    conv = torch.nn.Conv2d(4, 4, 3)
    sig = Signature((2, 4, 6, 6), torch.float32, torch.device("cpu"), "channels_first")
    plan = select_for_layer(conv, sig, Tuning(Policy(prefer="least_memory"), mode="get"), ("fwd",))
    assert plan.problem == problem.key
    need = convtune.get_algorithm("gemm:im2col").buffer_bytes(problem)
    plan = select_for_layer(conv, sig, Tuning(Policy(workspace_limit=need), mode="get"), ("fwd",))
    chosen = convtune.get_algorithm(plan.fwd).buffer_bytes(problem)
    assert workspace.buffer_bytes("cpu") >= chosen
    before = ptr(workspace.get(0, "cpu"))
    torch.ops.convtune.conv(*problem.random_inputs(), plan.problem, plan.fwd, "", "")
    assert ptr(workspace.get(0, "cpu")) == before  # nothing reallocated


@pytest.fixture
def fresh_workspaces(monkeypatch):
    for name, empty in (("_buffers", {}), ("_reserved", {}), ("_captured", set()), ("_retired", []), ("_carved", {})):
        monkeypatch.setattr(workspace, name, empty)
    monkeypatch.setattr(workspace, "_warned_capture", False)


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()  # a 0-byte view's own data_ptr() is 0


def in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_workspace_is_one_buffer_per_thread_grown_to_the_largest_need(fresh_workspaces):
    first = workspace.get(64, "cpu")
    assert first.numel() == 64 and ptr(workspace.get(32, "cpu")) == first.data_ptr()
    assert workspace.get(128, "cpu").numel() == 128 and workspace.buffer_bytes("cpu") == 128
    assert in_thread(lambda: ptr(workspace.get(16, "cpu"))) != ptr(workspace.get(16, "cpu"))
    workspace.reserve(1000, "cpu")
    assert workspace.buffer_bytes("cpu") == 1000
    workspace.release()
    assert workspace.buffer_bytes("cpu") == 0 and workspace.get(8, "cpu").numel() == 8
    assert workspace.buffer_bytes("cpu") == 1000  # allocated again at the reserved size
    assert in_thread(lambda: (workspace.get(16, "cpu"), workspace.buffer_bytes("cpu"))[1]) == 1000
    with pytest.raises(ValueError, match="nbytes=-1"):
        workspace.get(-1, "cpu")


def test_carved_views_are_made_once_per_buffer_and_follow_it_when_it_grows(fresh_workspaces):
    buffers = (Buffer("a", (4,), torch.float32), Buffer("b", (3,), torch.float64))
    need = buffers_bytes(buffers)
    views = workspace.carved(buffers, need, "cpu")
    assert workspace.carved(buffers, need, "cpu") is views  # the same views, not carved again
    assert ptr(views["a"]) == ptr(workspace.get(0, "cpu")) and views["b"].shape == (3,)
    workspace.reserve(need + 4096, "cpu")  # the buffer is replaced: its views go with it
    grown = workspace.carved(buffers, need, "cpu")
    assert grown is not views and ptr(grown["a"]) == ptr(workspace.get(0, "cpu")) != ptr(views["a"])
    workspace.release()
    assert not workspace._carved and workspace.buffer_bytes("cpu") == 0


def test_workspace_is_never_freed_once_a_capture_used_it(fresh_workspaces, monkeypatch, caplog):
    workspace.reserve(256, "cpu")
    tuned = ptr(workspace.get(0, "cpu"))
    monkeypatch.setattr(workspace, "_capturing", lambda device: True)  # as if a CUDA graph were capturing
    assert ptr(workspace.get(200, "cpu")) == tuned  # reserved: nothing allocated during the capture
    assert not caplog.records
    untuned = workspace.get(4096, "cpu")  # a need tuning never reserved: allocated, with a warning
    assert untuned.numel() == 4096 and "before capturing" in caplog.text
    assert [ptr(b) for b in workspace._retired] == [tuned]  # the graph still uses it
    monkeypatch.setattr(workspace, "_capturing", lambda device: False)
    workspace.get(8192, "cpu")
    assert [ptr(b) for b in workspace._retired] == [tuned, ptr(untuned)]
    workspace.release()  # frees the buffer no capture has seen, never the retired ones
    assert workspace.buffer_bytes("cpu") == 0 and len(workspace._retired) == 2


def test_a_layer_that_chose_torch_native_everywhere_calls_torch_directly(monkeypatch):
    native = convtune.get_algorithm("torch:native")
    with isolated(native, builtins=False):  # torch:native is the only algorithm: every direction chooses it
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1))
        twin = torch_twin(model)
        x = torch.randn(2, 3, 6, 6)
        convtune.optimize(model, x, training=True, mode="get")
        assert {r["algorithm"] for r in convtune.explain(model)} == {"torch:native"}
        assert all(plan.native_only for m in (model[0], model[2]) for plan in m.selections.values())

        def no_op_call(*args):
            raise AssertionError("a torch:native layer went through convtune's op")

        monkeypatch.setattr(ops, "compute", no_op_call)
        assert_same_training_step(model, twin, x)


def test_the_old_names_of_a_layers_selections_still_work():
    conv = convtune.nn.Conv2d(2, 3, 3, mode="get")
    conv(torch.randn(1, 2, 5, 5))
    with pytest.warns(DeprecationWarning, match="selections"):
        assert conv.plans == conv.selections and len(conv.selections) == 1
    with pytest.warns(DeprecationWarning, match="workspace_bytes"):
        algo = convtune.get_algorithm("gemm:im2col")
        p = ConvProblem("fwd", n=1, c=2, k=3, input_size=(5, 5), kernel_size=3)
        assert algo.scratch_bytes(p) == algo.workspace_bytes(p) == algo.buffer_bytes(p) + algo.library_bytes(p)
    with pytest.warns(DeprecationWarning, match="known_workspace_bytes"):
        assert algo.known_scratch_bytes(p) == algo.known_workspace_bytes(p)
    with pytest.warns(FutureWarning, match="OldPlugIn.known_scratch_bytes overrides a name convtune no longer"):
        class OldPlugIn(convtune.Algorithm):  # a plug-in written for the former names
            name = "old:plugin"

            def known_scratch_bytes(self, problem):
                return 0
    state = dict(conv.__dict__)  # as a version that called them plans pickled it
    state["_convtune_plans"] = state.pop("_convtune_selections")
    old = convtune.nn.Conv2d.__new__(convtune.nn.Conv2d)
    old.__setstate__(state)
    assert old.selections == conv.selections
    from convtune.pytorch.tuning import LayerPlan, LayerSelection
    assert LayerPlan is LayerSelection


def test_a_chosen_algorithm_that_cannot_be_built_leaves_the_layer_on_torchs_path(tmp_path):
    # A stored choice this machine can no longer build (a cuDNN plan a new cuDNN refuses): PyTorch's call, the reason
    # in explain, never an error in the user's forward.
    class Unbuildable(Fake):
        def buffers(self, problem):
            raise RuntimeError("cuDNN could not build plan")

    x = torch.randn(1, 2, 5, 5)
    problem = ConvProblem.from_module(torch.nn.Conv2d(2, 3, 3), tuple(x.shape))
    with TuningDB(tmp_path / "t.sqlite") as db, isolated(Unbuildable("fake:unbuildable"), builtins=False):
        db.store(problem, [PerfResult("fake:unbuildable", Status.OK, time_ms=0.01, deterministic=True)])
        conv = convtune.nn.Conv2d(2, 3, 3, mode="db_then_get", db=db)
        with torch.no_grad():  # the forward alone: the stored choice is the layer's
            torch.testing.assert_close(conv(x), F.conv2d(x, conv.weight, conv.bias))
        (row,) = convtune.explain(conv)
        assert row["algorithm"] is None and "cannot run here" in row["note"] and "could not build" in row["note"]


@pytest.mark.parametrize("where", ["folder", "under_a_file"])
def test_optimize_given_a_database_path_it_cannot_open_tunes_on_with_a_warning(tmp_path, caplog, where,
                                                                               monkeypatch):
    # A folder, or a path under a file: TuningDB(path) raises (ValueError, naming the path); optimize warns,
    # names the path and the fault, and remembers its choices in the process's temporary database.
    monkeypatch.setattr(convtune.db, "_fallback", None)  # this test's temporary database, not a later test's
    (tmp_path / "a_file").write_text("not a folder")
    path = tmp_path if where == "folder" else tmp_path / "a_file" / "tuning.sqlite"
    with pytest.raises(ValueError, match=re.escape(str(path))):
        TuningDB(path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1))
    x = torch.randn(1, 3, 6, 6)
    expected = model(x)
    with caplog.at_level("WARNING", logger="convtune.db"):
        convtune.optimize(model, x, mode="hybrid", db=str(path))
    assert str(path) in caplog.text and "temporary database" in caplog.text
    torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-5)
    assert convtune.explain(model)[0]["algorithm"]  # selected, and (in the temporary database) remembered


def test_a_layer_on_torch_native_in_cpu_bfloat16_runs_it_through_the_op_and_gets_every_tap(db):
    # PyTorch's own CPU bfloat16 weight gradient leaves taps that touch only padding unwritten (some CPUs, either
    # layout); torch:native computes it in float32. A layer that chose torch:native in every direction runs
    # PyTorch's own call elsewhere, but not here: it goes through convtune's op, and its gradient is right.
    from convtune.algorithms.registry import get_algorithm
    from convtune.pytorch.tuning import LayerSelection

    bf16 = ConvProblem("fwd", n=2, c=2, k=2, input_size=(1,), kernel_size=3, stride=2, padding=1, dtype="bfloat16")
    assert LayerSelection(bf16.key, fwd="torch:native", bwd_data="torch:native").runtime != "torch"
    assert LayerSelection(bf16.replace(dtype="float32").key, fwd="torch:native").runtime == "torch"
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(2, 2, 3, stride=2, padding=1, bias=False).to(torch.bfloat16)
    reference = copy.deepcopy(conv).double()
    x = torch.randn(2, 2, 1, dtype=torch.bfloat16)
    with isolated(get_algorithm("torch:native"), builtins=False):
        convtune.optimize(conv, x, training=True, db=db)
        rows = convtune.explain(conv)
        assert {r["algorithm"] for r in rows} == {"torch:native"} and "torch" not in {r["runtime"] for r in rows}
        assert all("computes this problem wrongly" in r["note"] for r in rows)  # explain says why
        conv(x).double().sum().backward()
    reference(x.double()).sum().backward()
    torch.testing.assert_close(conv.weight.grad.double(), reference.weight.grad, rtol=2e-2, atol=2e-2)


def test_optimize_warns_when_the_example_runs_no_convolution_it_tunes(caplog):
    with caplog.at_level("WARNING", logger="convtune.pytorch.optimize"):
        linear = torch.nn.Sequential(torch.nn.Linear(4, 4))
        assert convtune.optimize(linear, torch.randn(2, 4), mode="get") is linear
        up = torch.nn.Sequential(torch.nn.ConvTranspose2d(4, 4, 3))
        assert convtune.optimize(up, torch.randn(1, 4, 8, 8), mode="get") is up
    warned = [r.getMessage() for r in caplog.records if "ran no convolution that convtune tunes" in r.getMessage()]
    assert len(warned) == 2 and "transposed convolutions ('0') are left on torch's path" in warned[1]
    assert convtune.explain(up) == []


# -- a user's edits and arguments, as PyTorch takes them ---------------------------------------------------------

@pytest.mark.parametrize("attr, value", [("stride", 2), ("padding", 1), ("dilation", 2)])
def test_one_number_for_every_dimension_set_after_tuning_computes_as_torch_does(tmp_path, attr, value):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 9, 9)
    model = convtune.optimize(torch.nn.Conv2d(4, 6, 3), x, db=str(tmp_path / "t.sqlite"))
    twin = torch_twin(model)
    setattr(model, attr, value)
    setattr(twin, attr, value)
    assert getattr(model, attr) == (value, value)
    assert torch.allclose(model(x), twin(x), atol=1e-5)


@pytest.mark.parametrize("edit", ["parameter", "data", "kernel_size"])
def test_a_weight_of_another_shape_after_tuning_computes_as_torch_does(tmp_path, edit):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8)
    model = convtune.optimize(torch.nn.Conv2d(4, 6, 1), x, db=str(tmp_path / "t.sqlite"))
    twin = torch_twin(model)
    bigger = torch.randn(6, 4, 3, 3)
    for module in (model, twin):
        if edit == "parameter":
            module.weight = torch.nn.Parameter(bigger.clone())
        elif edit == "data":
            module.weight.data = bigger.clone()
        else:  # the attribute changes, the weight does not: torch computes with the weight
            module.kernel_size = (3, 3)
    expected = twin(x)
    assert model(x).shape == expected.shape and torch.allclose(model(x), expected, atol=1e-5)


def test_groups_that_do_not_fit_the_weight_raise_torchs_own_error(tmp_path):
    x = torch.randn(2, 4, 8, 8)
    model = convtune.optimize(torch.nn.Conv2d(4, 6, 1), x, db=str(tmp_path / "t.sqlite"))
    model.groups = 2
    with pytest.raises(RuntimeError, match="Given groups=2"):
        model(x)


def test_double_backward_on_the_python_path_raises_a_clear_error(tmp_path):
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with settings.override(native=False), isolated(convtune.get_algorithm("gemm:1x1"), builtins=False):
        model = convtune.optimize(torch.nn.Conv2d(3, 4, 1), x, training=True, mode="find",
                                  db=str(tmp_path / "t.sqlite"))
        assert {row["runtime"] for row in convtune.explain(model)} == {"python"}
        y = model(x).square().sum()
        with pytest.raises(NotImplementedError, match="no double backward"):
            torch.autograd.grad(y, x, create_graph=True)
        (gx,) = torch.autograd.grad(model(x).square().sum(), x)  # a plain backward still runs
    assert gx.shape == x.shape


@pytest.mark.parametrize("training", ["False", None, 0.5, torch.tensor(0.0)])
def test_optimize_takes_training_as_a_bool_only(training):
    with pytest.raises(TypeError, match="optimize\\(\\)'s training .* must be a bool"):
        convtune.optimize(torch.nn.Conv2d(3, 4, 1), torch.randn(1, 3, 4, 4), training=training)


@pytest.mark.parametrize("db", [3, True, {"path": "x.sqlite"}, b"x.sqlite"])
def test_a_database_of_another_type_is_refused_by_optimize_and_by_a_layer(db):
    with pytest.raises(TypeError, match="optimize\\(\\)'s db must be a TuningDB, a database file's path or None"):
        convtune.optimize(torch.nn.Conv2d(3, 4, 1), torch.randn(1, 3, 4, 4), db=db)
    with pytest.raises(TypeError, match="db must be a TuningDB"):
        convtune.nn.Conv2d(3, 4, 1, db=db)


def test_a_torch_layer_given_one_number_for_its_stride_is_tuned_as_torch_computes_it(tmp_path):
    conv = torch.nn.Conv2d(3, 4, 3)
    conv.stride, conv.dilation = 2, 2  # torch's functional convolution takes them so
    x = torch.randn(2, 3, 11, 11)
    expected = torch_twin(conv)(x)
    model = convtune.optimize(conv, x, mode="get", db=str(tmp_path / "t.sqlite"))
    assert torch.allclose(model(x), expected, atol=1e-5)


@pytest.mark.parametrize("edit", ["parameter", "data"])
def test_a_same_padded_layer_given_a_weight_of_another_kernel_pads_for_it(tmp_path, edit):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    conv = convtune.nn.Conv2d(3, 4, 3, padding="same", mode="get", db=str(tmp_path / "t.sqlite"))
    with torch.no_grad():
        conv(x), conv(x)  # the second call takes the hot path
        twin = torch_twin(conv)
        for module in (conv, twin):
            if edit == "parameter":
                module.weight = torch.nn.Parameter(torch.ones(4, 3, 5, 5))
            else:
                module.weight.data = torch.ones(4, 3, 5, 5)
        assert conv(x).shape == (2, 4, 8, 8) and torch.allclose(conv(x), twin(x), atol=1e-4)


def test_a_database_path_of_any_pathlike_is_opened(tmp_path):
    import pathlib

    path = pathlib.PurePosixPath(tmp_path / "t.sqlite")
    model = convtune.optimize(torch.nn.Conv2d(3, 4, 1), torch.randn(1, 3, 4, 4), mode="get", db=path)
    assert model(torch.randn(1, 3, 4, 4)).shape == (1, 4, 4, 4)


@pytest.mark.parametrize("edit", ["parameter", "data"])
@pytest.mark.parametrize("native", [True, False])
def test_compiled_code_given_a_weight_of_another_shape_computes_as_torch_does(tmp_path, edit, native):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8)
    # inference (no gradient needed): compiled code reads the layer's static entry, the executables' handles; without
    # the native runtime, it traces the full path (the Python path's call)
    with isolated(convtune.get_algorithm("gemm:1x1"), builtins=False), torch.no_grad(), \
            settings.override(native=native):
        model = convtune.optimize(torch.nn.Conv2d(4, 6, 1), x, mode="find", db=str(tmp_path / "t.sqlite"))
        if native and convtune.extension.loaded() is None:
            pytest.skip("the C++ extension is not built here")
        compiled_as = {row["compiled"] for row in convtune.explain(model)}
        assert compiled_as == ({"executables"} if native else {"by shape"})  # the path under test
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
        twin = torch_twin(model)
        assert torch.allclose(compiled(x), twin(x), atol=1e-5)
        bigger = torch.randn(6, 4, 3, 3)
        for module in (model, twin):
            if edit == "parameter":
                module.weight = torch.nn.Parameter(bigger.clone())
            else:
                module.weight.data = bigger.clone()
        # no eager call in between: the compiled code meets the new weight first (PyTorch's convolution, recompiled)
        assert torch.allclose(compiled(x), twin(x), atol=1e-5)
        model(x)  # an eager call tunes the layer it now is
        assert torch.allclose(compiled(x), twin(x), atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_a_layer_on_pytorchs_path_given_a_weight_of_another_shape_is_tuned_again(tmp_path, native):
    from convtune.pytorch.modules import TorchCall, TorchDirect

    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8)
    with settings.override(native=native):
        model = convtune.optimize(torch.nn.Conv2d(4, 6, 3, padding=1), x, mode="get", db=str(tmp_path / "t.sqlite"))
        if native and convtune.extension.loaded() is None:
            pytest.skip("the C++ extension is not built here")
        model(x), model(x)  # the second call takes the hot path: PyTorch's own call, checked in C++ or in Python
        assert isinstance(model._convtune_fast[x.shape], TorchDirect if native else TorchCall)  # the path under test
        twin = torch_twin(model)
        weight, bias = torch.randn(8, 4, 3, 3), torch.randn(8)
        for module in (model, twin):
            module.weight.data, module.bias.data = weight.clone(), bias.clone()
        for _ in range(2):  # the full path, then the hot path again
            assert torch.allclose(model(x), twin(x), atol=1e-5)
        # tuned for the convolution it now is (explain said k6 before), and its hot path kept for that weight
        assert {row["problem"].split("|")[3] for row in convtune.explain(model)} == {"k8"}
        assert model._convtune_weight_shape == (8, 4, 3, 3) and x.shape in model._convtune_fast


@pytest.mark.parametrize("older_pickle", [False, True])
def test_a_copy_made_after_a_new_weight_shape_computes_as_torch_does_compiled_and_eager(tmp_path, older_pickle):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8)
    with isolated(convtune.get_algorithm("gemm:1x1"), builtins=False), torch.no_grad():
        model = convtune.optimize(torch.nn.Conv2d(4, 6, 1), x, mode="find", db=str(tmp_path / "t.sqlite"))
        twin = torch_twin(model)
        bigger = torch.randn(6, 4, 3, 3)
        for module in (model, twin):
            module.weight = torch.nn.Parameter(bigger.clone())
        if older_pickle:  # pickled by a version that kept no weight shape of its own: its choices' shape counts
            state = copy.deepcopy(model.__dict__)
            del state["_convtune_weight_shape"]
            clone = type(model).__new__(type(model))
            clone.__setstate__(state)
        else:
            clone = copy.deepcopy(model)
        compiled = torch.compile(clone, backend="aot_eager", fullgraph=True, dynamic=False)
        assert torch.allclose(compiled(x), twin(x), atol=1e-5)
        assert torch.allclose(clone(x), twin(x), atol=1e-5)  # eager: tuned again for the new weight
        assert torch.allclose(compiled(x), twin(x), atol=1e-5)


@pytest.mark.parametrize("ask", ["use_deterministic_algorithms", "cudnn.deterministic"])
def test_a_model_tuned_where_pytorch_asks_for_determinism_gets_deterministic_choices(ask):
    # PyTorch's own convolutions compute deterministically there; a tuned layer must not pick an algorithm that may
    # differ run to run, whatever policy it was given
    def asking(on: bool) -> None:
        if ask == "use_deterministic_algorithms":
            torch.use_deterministic_algorithms(on)
        else:
            torch.backends.cudnn.deterministic = on

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1))
    x = torch.randn(2, 3, 8, 8)
    tuned = {}
    try:
        asking(True)
        for name, policy in (("default", None), ("given", Policy(deterministic=False, workspace_limit="1MiB"))):
            tuned[name] = convtune.optimize(copy.deepcopy(model), x, policy=policy, training=True, mode="get")
        alone = convtune.nn.Conv2d(3, 4, 3)
        # PyTorch's own call on CUDA computes its gradients deterministically under either flag: torch:native says so
        problem = ConvProblem("bwd_filter", n=2, c=3, k=4, input_size=(8, 8), kernel_size=3, device="cuda")
        assert convtune.get_algorithm("torch:native").is_deterministic(problem)
    finally:
        asking(False)
    assert not convtune.get_algorithm("torch:native").is_deterministic(problem)
    later = convtune.nn.Conv2d(3, 4, 3)
    layers = [m for t in tuned.values() for m in t.modules() if isinstance(m, convtune.nn.Conv2d)]
    assert len(layers) == 4
    for layer in [*layers, alone]:
        assert layer._convtune_tuning.policy.deterministic
        for _, result in (s for sel in layer.selections.values() for s in sel.results):
            assert result.deterministic, result
    assert layers[2]._convtune_tuning.policy.workspace_limit == 1 << 20  # the rest of the policy as given
    assert not later._convtune_tuning.policy.deterministic  # asked no more


def test_torch_jit_trace_leaves_no_tuning_state_behind_and_export_still_works():
    # torch.jit.trace gives sizes as tensors: the layers recorded selections for signatures made of tensors
    # (explain showed them, 'ConvProblem.n must be an int, got tensor(2)'), and torch.export failed afterwards
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.ReLU())
    x = torch.randn(2, 4, 12, 12)
    tuned = convtune.optimize(copy.deepcopy(model), x)
    traced = torch.jit.trace(tuned, torch.randn(3, 4, 12, 12), check_trace=False)
    rows = convtune.explain(tuned)
    assert rows and all("tensor(" not in str(r) for r in rows), rows
    torch.testing.assert_close(traced(x), model(x))
    exported = torch.export.export(tuned, (x,))
    torch.testing.assert_close(exported.module()(x), model(x))
