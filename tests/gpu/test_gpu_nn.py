"""convtune's PyTorch integration on CUDA: autocast float16/bfloat16, channels_last, CUDA graphs, torch.compile.

Run on a CUDA machine: ``python -m pytest tests/gpu/test_gpu_nn.py``. Skipped without CUDA.

Every comparison is a relative L2 error (``convtune.verify.rel_error``: NaN or Inf never passes)
on fresh random inputs, with the ops' result tensors poisoned with NaN before the algorithms
write them. The reference is the same model in float64 (no autocast). Under autocast the
parameter gradients are reductions over the batch whose rounding errors reach a few percent in
float16 and several in bfloat16 for PyTorch itself (measured on the CPU), so the optimized model
must be as accurate as the plain torch model under the same autocast, within a factor:
error(convtune) <= max(ACCURACY_FACTOR * error(torch), FLOOR[dtype]), for the output and every
gradient; FLOOR is verify's single-convolution tolerance (float16 2e-3, bfloat16 1.6e-2). By the
triangle inequality the optimized and plain results then differ by at most 3x torch's own error.
A CUDA graph replay runs the very same algorithms as the eager model: its forward output must
match eager within ``SAME_ALGORITHMS_TOL`` (only the summation order may differ).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

import convtune
import convtune.nn
from convtune import TuningDB
from convtune.settings import settings
from convtune.verify import rel_error
from twins import torch_twin

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
ACCURACY_FACTOR = 2.0
FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SAME_ALGORITHMS_TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}
SHAPE = (8, 3, 32, 32)  # batch 8, RGB 32x32: every layer takes well under a millisecond on a data-centre GPU


@pytest.fixture(autouse=True)
def _quick_tuning():
    # A few candidates per problem, briefly timed: the test checks what runs, not how well it was chosen.
    with settings.override(timing_budget_s=0.01, timing_max_repeats=3, find_max_candidates=6, progress=False):
        yield


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """One database for the module: the graph and compile tests reuse what the first test measured."""
    with TuningDB(tmp_path_factory.mktemp("gpu_nn") / "tuning.sqlite") as database:
        yield database


@pytest.fixture(autouse=True)
def _poisoned(poisoned):
    """Every test here: the ops' result tensors start as NaN (tests/conftest.py)."""


class SmallCNN(torch.nn.Module):
    """Strided, depthwise, grouped+dilated and 1x1 2-D convolutions, a batch norm, then 1-D convolutions."""

    def __init__(self) -> None:
        super().__init__()
        # a bias before batch norm has zero gradient
        self.stem = torch.nn.Conv2d(3, 32, 3, stride=2, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(32)
        self.depthwise = torch.nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.grouped = torch.nn.Conv2d(32, 64, 3, padding=2, dilation=2, groups=4, bias=False)
        self.pointwise = torch.nn.Conv2d(64, 64, 1)
        self.seq = torch.nn.Conv1d(64, 32, 5, padding=2)
        self.head = torch.nn.Conv1d(32, 16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        x = torch.relu(self.pointwise(self.grouped(self.depthwise(x))))
        # flatten(2) of a channels_last (N, C, H, W) tensor is channels_last (N, C, L): 1-D channels_last problems.
        return self.head(torch.relu(self.seq(x.flatten(2))))


CONVS = ("stem", "depthwise", "grouped", "pointwise", "seq", "head")



def random_input(device: str = "cuda") -> torch.Tensor:
    return torch.randn(SHAPE, device=device).to(memory_format=torch.channels_last)


def optimized_model(dtype: torch.dtype, db: TuningDB, training: bool, device: str = "cuda") -> torch.nn.Module:
    """A fresh SmallCNN on ``device``, channels_last, tuned by ``optimize`` under autocast to ``dtype``."""
    model = SmallCNN().to(device).to(memory_format=torch.channels_last).train(training)
    with torch.autocast(device, dtype=dtype):
        convtune.optimize(model, random_input(device), training=training, db=db)
    assert [type(getattr(model, name)).__module__ for name in CONVS] == ["convtune.pytorch.modules"] * len(CONVS)
    rows = convtune.explain(model)
    assert rows and all(r["algorithm"] for r in rows), [r for r in rows if not r["algorithm"]]
    assert all(f"|{str(dtype).removeprefix('torch.')}|" in r["problem"] for r in rows)  # tuned in the autocast dtype
    return model


def training_step(model, x: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype, params: torch.nn.Module | None = None):
    """(output, {parameter name: gradient}) of one forward and backward of ``model`` under autocast.

    params: the module whose parameters ``model`` trains (a compiled model's original); default ``model``.
    """
    params = model if params is None else params
    params.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=dtype):
        y = model(x)
    y.backward(dy)
    return y.detach(), {name: p.grad for name, p in params.named_parameters()}


def exact_step(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """(output, gradients) of a float64 plain-torch copy of ``model``, no autocast: the reference."""
    exact = torch_twin(model).double()
    exact.zero_grad(set_to_none=True)
    y = exact(x.double())
    y.backward(dy.double())
    return y.detach(), {name: p.grad for name, p in exact.named_parameters()}


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert got is not None, f"{what}: no result"
    err = rel_error(got.float(), want.double())
    assert err <= tol, f"{what}: relative L2 error {err:.2e} > {tol:.1e}"


def assert_as_accurate(got, plain, exact, dtype: torch.dtype) -> None:
    """Output and every gradient of ``got`` are as close to ``exact`` as ``plain``'s are, within ACCURACY_FACTOR."""
    (y, grads), (y_plain, grads_plain), (y_exact, grads_exact) = got, plain, exact
    assert grads.keys() == grads_plain.keys() == grads_exact.keys()
    pairs = [("output", y, y_plain, y_exact)] + [(f"gradient of {n}", grads[n], grads_plain[n], grads_exact[n])
                                                 for n in grads]
    for what, value, value_plain, value_exact in pairs:
        assert value is not None and value_plain is not None, f"{what}: no result"
        err_plain = rel_error(value_plain.float(), value_exact)
        tol = max(ACCURACY_FACTOR * err_plain, FLOOR[dtype])
        assert_close(value, value_exact, tol, f"{what} (plain torch: {err_plain:.2e})")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_optimized_training_step_matches_torch_under_autocast(dtype, db, device="cuda"):
    torch.manual_seed(0)
    model = optimized_model(dtype, db, training=True, device=device)
    twin = torch_twin(model)
    directions = {(r["module"], r["direction"]) for r in convtune.explain(model)}
    assert ("stem", "bwd_data") not in directions and ("head", "bwd_data") in directions
    for _ in range(2):  # a second step: nothing tuned on the first is lost, nothing re-tuned differs
        x = random_input(device)
        dy = torch.randn(SHAPE[0], 16, SHAPE[2] * SHAPE[3] // 4, device=device)
        got = training_step(model, x, dy, dtype)
        assert got[0].dtype == dtype
        assert_as_accurate(got, training_step(twin, x, dy, dtype), exact_step(twin, x, dy), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_optimized_model_replays_in_a_cuda_graph(dtype, db):
    torch.manual_seed(1)
    model = optimized_model(dtype, db, training=False)
    twin = torch_twin(model)
    static_x = random_input()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # Warm-up on a side stream, as PyTorch's CUDA graph notes require; cache_enabled=False: autocast's
    # cast cache must not hold tensors made during the capture.
    with torch.cuda.stream(side), torch.no_grad(), torch.autocast("cuda", dtype=dtype, cache_enabled=False):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad(), torch.autocast("cuda", dtype=dtype, cache_enabled=False):
        static_y = model(static_x)
    for _ in range(2):  # two inputs: a replay that ignored its input would fail the second
        x = random_input()
        static_x.copy_(x)
        graph.replay()
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            eager, plain = model(x), twin(x)
        with torch.no_grad():
            exact = torch_twin(twin).double()(x.double())
        assert_close(static_y, eager, SAME_ALGORITHMS_TOL[dtype], "graph replay against eager")
        assert_as_accurate((static_y, {}), (plain, {}), (exact, {}), dtype)


def test_optimized_training_step_replays_through_make_graphed_callables(db):
    dtype = torch.float16
    torch.manual_seed(2)
    model = optimized_model(dtype, db, training=True)
    eager = copy.deepcopy(model)  # make_graphed_callables replaces the module's forward in place
    with torch.autocast("cuda", dtype=dtype, cache_enabled=False):
        graphed = torch.cuda.make_graphed_callables(model, (random_input(),))
    for _ in range(2):
        x = random_input()
        dy = torch.randn(SHAPE[0], 16, SHAPE[2] * SHAPE[3] // 4, device="cuda")
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, cache_enabled=False):
            y = graphed(x)
        y.backward(dy)
        got = y.detach(), {name: p.grad for name, p in model.named_parameters()}
        reference = training_step(eager, x, dy, dtype)
        assert_close(got[0], reference[0], SAME_ALGORITHMS_TOL[dtype], "graphed output against eager")
        # Gradients: a backward algorithm may accumulate with atomics, so judge them by accuracy.
        assert_as_accurate(got, reference, exact_step(eager, x, dy), dtype)


def test_torch_compile_of_the_optimized_model_matches_eager(db, device="cuda"):
    dtype = torch.float16
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = optimized_model(dtype, db, training=True, device=device)
    twin = torch_twin(model)
    compiled = torch.compile(model)  # default: Inductor; the tuned convolutions stay custom ops
    for _ in range(2):
        x = random_input(device)
        dy = torch.randn(SHAPE[0], 16, SHAPE[2] * SHAPE[3] // 4, device=device)
        got = training_step(compiled, x, dy, dtype, params=model)
        # Inductor fuses the batch norm and the activations, which rounds differently: judged by accuracy.
        exact = exact_step(twin, x, dy)
        assert_as_accurate(got, training_step(model, x, dy, dtype), exact, dtype)
        assert_as_accurate(got, training_step(twin, x, dy, dtype), exact, dtype)


def test_the_dry_example_run_sees_what_the_real_one_sees_on_cuda():
    # cuDNN's own rule lays results out channels_last where the input or the weight is: the dry run's
    # zeros must follow it under every layout, autocast dtype and mode, as on the CPU (tests/test_nn.py).
    from convtune.pytorch.optimize import _observe_run

    torch.manual_seed(0)
    block = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU6(inplace=True),
        torch.nn.Conv2d(16, 16, 3, padding=1, groups=16), torch.nn.BatchNorm2d(16), torch.nn.ReLU6(inplace=True),
        torch.nn.Conv2d(16, 8, 1), torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2)).cuda()
    grey = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.Conv2d(8, 8, 3, groups=8)).cuda()
    cases = [(block, torch.randn(SHAPE, device="cuda")), (grey, torch.randn(4, 1, 16, 16, device="cuda"))]
    for model, x in cases:
        for weights_last, input_last in ((False, False), (True, True), (True, False), (False, True)):
            m = copy.deepcopy(model).to(memory_format=torch.channels_last if weights_last else torch.contiguous_format)
            xi = x.to(memory_format=torch.channels_last) if input_last else x
            for dtype in (None, *DTYPES):
                for training in (False, True):
                    m.train(training)
                    with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
                        dry, real = (_observe_run(m, xi, training, dry=d) for d in (True, False))
                    assert {k: c for k, (_, c) in dry.items()} == {k: c for k, (_, c) in real.items()}, \
                        (weights_last, input_last, dtype, training)


def test_background_mode_runs_a_new_shape_at_once_and_switches_to_the_measured_choice(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 32, 3, padding=1, groups=8)).cuda().to(
        memory_format=torch.channels_last)
    plain = copy.deepcopy(model)
    x = torch.randn(8, 16, 20, 20, device="cuda").to(memory_format=torch.channels_last)
    with TuningDB(tmp_path / "t.sqlite") as db, torch.autocast("cuda", dtype=torch.float16):
        convtune.optimize(model, x, training=True, mode="background", db=db)
        new = torch.randn(8, 16, 28, 24, device="cuda").to(memory_format=torch.channels_last)
        for phase in ("provisional", "measured"):
            y = model(new)
            y.float().sum().backward()
            ref = plain(new)
            assert rel_error(y.float(), ref.float()) < 1e-2, phase
            rows = [r for r in convtune.explain(model) if "in28x24" in r["problem"] and r["status"] != "torch"]
            # (a layer whose measurement is already stored has forgotten its provisional rows)
            assert rows or phase == "provisional"
            assert all((r["time_ms"] is None) == (phase == "provisional") for r in rows), (phase, rows)
            assert convtune.background.wait(300)


def test_the_caller_synchronizes_the_device_while_the_background_worker_measures(tmp_path):
    # The worker captures no CUDA graph: during a capture, torch.cuda.synchronize() elsewhere fails.
    problems = [convtune.ConvProblem("fwd", n=16, c=64, k=64, input_size=(28 + i, 28), kernel_size=3, padding=1,
                                     device="cuda", dtype="float16", layout="channels_last") for i in range(4)]
    x = torch.randn(1 << 22, device="cuda")
    with TuningDB(tmp_path / "t.sqlite") as db:
        for p in problems:
            convtune.background.measure(p, convtune.Policy(), db)
        while convtune.background.pending():
            x.mul_(1.0)
            torch.cuda.synchronize()
        assert convtune.background.wait(300)
        assert all(db.lookup(p) is not None for p in problems)


def test_the_background_worker_leaves_the_callers_tf32_settings_alone(tmp_path):
    # PyTorch's defaults: the convolutions may use TF32, the matrix products not. A float32 1x1 problem's GEMM
    # candidates would switch the matrix products' setting on for their runs, for the caller's work too: the worker
    # skips them (find in the foreground measures them).
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    problems = [convtune.ConvProblem("fwd", n=8, c=64, k=64, input_size=(20 + i, 20), kernel_size=1, device="cuda",
                                     dtype="float32", allow_tf32=True) for i in range(3)]
    try:
        matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
        seen = set()
        with TuningDB(tmp_path / "t.sqlite") as db:
            for p in problems:
                convtune.background.measure(p, convtune.Policy(), db)
            while convtune.background.pending():
                seen.add(matmul.allow_tf32)  # what the caller's matrix products would run under meanwhile
                time.sleep(0.001)  # (a loop that never waits would starve the worker of the interpreter)
            assert convtune.background.wait(300)
            for p in problems:
                gemm = db.result(p, "gemm:1x1")  # (skipped: for that reason, or priced out of the search)
                assert gemm is not None and gemm.status is convtune.Status.SKIPPED, gemm
                assert db.lookup(p) is not None
        assert seen <= {False}
        # in the foreground it runs, under the setting it asks for
        assert convtune.find(problems[0], candidates=[convtune.get_algorithm("gemm:1x1")])[0].ok
    finally:
        matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_the_shared_device_timer_captures_no_graph_and_waits_for_its_stream_only(monkeypatch):
    from convtune import timing

    x = torch.randn(1 << 16, device="cuda")
    sampler = timing._CudaSampler(lambda: x.mul_(1.0), shared=True)  # built before the patches below

    def forbidden(*args, **kwargs):
        raise AssertionError("a device-wide synchronization or a graph capture from the shared timer")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(torch.cuda, "graph", forbidden)
    sampler.prepare()
    assert sampler.graph is None and sampler.sample_ms() > 0
    t = timing.benchmark(lambda: x.mul_(1.0), device="cuda", shared_device=True, budget_s=0.05)
    assert t.median_ms > 0
