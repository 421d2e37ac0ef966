"""The native runtime on the GPU: every native executable (cuDNN execution plans, GEMM, torch:native) in every
direction and dtype against float64, bit for bit against its Python algorithm, CUDA-graph capture and
torch.compile of a tuned model. Skipped without CUDA.
"""

import re
import subprocess
import sys
import threading

import pytest
import torch

import convtune as ct
from convtune import extension
from convtune.algorithms.base import allocate_workspace
from convtune.pytorch import host_costs, runtime
from convtune.settings import settings
from convtune.verify import reference, rel_error, tolerance
from gpu_cases import case_id, cases

pytestmark = pytest.mark.gpu

LAYERS = [
    dict(n=4, c=64, k=64, input_size=(28, 28), kernel_size=3, padding=1),
    dict(n=4, c=128, k=64, input_size=(14, 14), kernel_size=1),
    dict(n=4, c=64, k=128, input_size=(14, 14), kernel_size=1, stride=2),
    dict(n=4, c=32, k=32, input_size=(14, 14), kernel_size=3, padding=1, groups=32),
    dict(n=2, c=16, k=32, input_size=(50,), kernel_size=5, padding=2),
    dict(n=2, c=8, k=8, input_size=(6, 6, 6), kernel_size=3, padding=1),
]
CASES = cases(LAYERS)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_every_native_executable_matches_float64_and_its_python_algorithm(case):
    layer, direction, dtype, layout = case
    p = ct.ConvProblem(direction=direction, dtype=dtype, layout=layout, device="cuda", allow_tf32=False, **layer)
    a, b = p.random_inputs(seed=5)
    ref = reference(p, a, b)
    failures, ran = [], 0
    for algo in ct.algorithms(p):
        if algo.host_kind == "triton" or algo.native_recipe(p) is None:  # Triton's: the test below
            continue
        try:  # the Python run first: a plan the frontend cannot build here (TF32 deselected) is never chosen
            python = algo.run(p, a, b, workspace=allocate_workspace(algo.buffer_bytes(p), "cuda"))
        except RuntimeError:
            continue
        handle = runtime.executable(p, algo)
        ran += 1
        out = torch.ops.convtune.tuned_run(a, b, handle)
        err = rel_error(out, ref)
        if not err <= tolerance(p, algo.notes(p)):
            failures.append(f"{algo.name}: relative error {err:.3g}")
        if algo.is_deterministic(p) is True and not torch.equal(out, python):
            failures.append(f"{algo.name}: differs from its Python run (max {(out - python).abs().max().item():.3g})")
        elif not rel_error(out, python) <= tolerance(p, algo.notes(p)):  # atomics: the same up to summation order
            failures.append(f"{algo.name}: relative error {rel_error(out, python):.3g} against its Python run")
    assert ran >= 2, f"only {ran} native executables for {p.key}"
    assert not failures, "\n".join(failures)


TRITON_LAYERS = [
    dict(n=4, c=32, k=32, input_size=(14, 14), kernel_size=7, padding=3, groups=32),
    dict(n=4, c=48, k=48, input_size=(15, 15), kernel_size=3, stride=2, padding=1, groups=48),
    dict(n=2, c=16, k=16, input_size=(50,), kernel_size=5, padding=2, groups=16),
    dict(n=4, c=64, k=64, input_size=(14, 14), kernel_size=3, padding=1, groups=8),
]


@pytest.fixture(scope="module", autouse=True)
def _triton_compiled_ahead(request):
    # the Triton configurations the test below launches, compiled at once on threads (triton_cases.compile_ahead)
    from triton_cases import compile_ahead, selected_params

    problems = [ct.ConvProblem(c["direction"], dtype="float16", layout="channels_last", device="cuda", **c["layer"])
                for c in selected_params(request, "test_triton_kernels_launched_from_cpp_compute_what_their_python_"
                                                  "launches_do")]
    compile_ahead(request, ((a.name, p) for p in problems for a in ct.algorithms(p) if a.host_kind == "triton"))


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_filter"])
@pytest.mark.parametrize("layer", TRITON_LAYERS, ids=lambda layer: "x".join(map(str, layer["input_size"])) +
                         f"r{layer['kernel_size']}g{layer['groups']}s{layer.get('stride', 1)}")
def test_triton_kernels_launched_from_cpp_compute_what_their_python_launches_do(layer, direction, poisoned):
    p = ct.ConvProblem(direction=direction, dtype="float16", layout="channels_last", device="cuda", **layer)
    a, b = p.random_inputs(seed=7)
    ref = reference(p, a, b)
    failures, ran = [], 0
    for algo in ct.algorithms(p):
        if algo.host_kind != "triton":
            continue
        python = algo.run(p, a, b, workspace=allocate_workspace(algo.buffer_bytes(p), "cuda"))
        assert algo.native_recipe(p) is not None, algo.name  # every configuration records (NoNativeRecipe says why not)
        handle = runtime.executable(p, algo)
        assert extension.loaded().kind(handle) == "cubin"
        ran += 1
        for _ in range(2):  # the same kernels and arguments: the same bits, run after run (results start as NaN)
            out = torch.ops.convtune.tuned_run(a, b, handle)
            if not torch.equal(out, python):
                failures.append(f"{algo.name}: differs from its Python launches (max "
                                f"{(out.float() - python.float()).abs().max().item():.3g})")
        if not rel_error(out, ref) <= tolerance(p, algo.notes(p)):
            failures.append(f"{algo.name}: relative error {rel_error(out, ref):.3g}")
        # an operand at an address Triton did not compile for (one element on: not 16-byte aligned), copied first
        shifted = torch.empty(a.numel() + 1, dtype=a.dtype, device="cuda")[1:].as_strided(a.shape, a.stride())
        shifted.copy_(a)
        assert torch.equal(torch.ops.convtune.tuned_run(shifted, b, handle), python)
        thread_out: list = []  # and from a thread whose first CUDA call it is (as autograd's backward threads)
        worker = threading.Thread(target=lambda thread_out=thread_out, handle=handle: thread_out.append(
            torch.ops.convtune.tuned_run(a, b, handle)))
        worker.start()
        worker.join()
        assert torch.equal(thread_out[0], python)
    assert ran >= 2, f"only {ran} Triton kernels launched from C++ for {p.key}"
    assert not failures, "\n".join(failures)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, padding=1, groups=32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 1), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 64, 1, stride=2, bias=False),
    ).cuda().to(memory_format=torch.channels_last)


def _tuned(dtype=torch.float16):
    model = _model()
    twin = _model()
    x = torch.randn(8, 16, 16, 16, device="cuda").to(memory_format=torch.channels_last).requires_grad_()
    with torch.autocast("cuda", dtype=dtype):
        ct.optimize(model, x, training=True, mode="find")
    return model, twin, x


def test_a_tuned_model_runs_natively_and_trains_like_torch():
    model, twin, x = _tuned()
    rows = ct.explain(model)
    assert any(r["runtime"] == "native" for r in rows), rows
    with torch.autocast("cuda", dtype=torch.float16):
        y, yt = model(x), twin(x)
    assert rel_error(y.float(), yt.float()) < 2e-2
    y.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_tuned_model_is_captured_and_replayed_in_a_cuda_graph():
    model, _, x = _tuned()
    x = x.detach()
    static = x.clone()
    with torch.autocast("cuda", dtype=torch.float16):
        expected = model(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                model(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(static)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("host_rule", [False, True], ids=["every-choice", "host-rule"])
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_a_tuned_model_compiles_fullgraph_with_inductor(training, host_rule):
    from torch._inductor.utils import run_and_get_code

    with settings.override(host_rule=host_rule):  # on: layers that gain less than the op call costs trace PyTorch's
        model, twin, x = _tuned()
    compiled_as = {row["compiled"] for row in ct.explain(model)}
    assert "layer op" not in compiled_as  # every shape was chosen for in eager code: static, no lookup
    assert "executables" in compiled_as or host_rule
    model.train(training)
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(model, fullgraph=True)
    x = x.detach().requires_grad_(training)

    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            y = compiled(x)
        if training:
            y.float().sum().backward()
        return y

    with settings.override(native=True):
        y, code = run_and_get_code(step)
    text = "\n".join(code)
    assert ("convtune.tuned_run" in text) is ("executables" in compiled_as) and "convtune.pytorch" not in text
    assert "convtune.layer_" not in text
    with torch.autocast("cuda", dtype=torch.float16):
        assert rel_error(y.float(), model(x).float()) < 1e-2


def test_a_tuned_model_compiled_with_dynamic_shapes_selects_for_new_shapes_and_trains_right():
    # Layers on their layer op look every shape up and select for new ones; a layer with a choice on the Python
    # path (find may pick a Triton kernel for the depthwise layer) compiles shape by shape (docs/runtime.md).
    from convtune.pytorch.modules import TunedConv

    model, twin, _ = _tuned()
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(model, dynamic=True)
    for batch, size in ((8, 16), (6, 16), (8, 24)):
        x = torch.randn(batch, 16, size, size, device="cuda").to(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.float16):
            y, expected = compiled(x), twin(x)
        assert rel_error(y.float(), expected.float()) < 2e-2, (batch, size)
        y.float().sum().backward()
    on_op = [m for m in model.modules() if isinstance(m, TunedConv) and not m._convtune_full_path]
    assert on_op and all(m._convtune_layer for m in on_op)
    entries = [e for m in on_op for e in extension.loaded().layer_entries(m._convtune_layer)]
    assert {tuple(e[0])[0::2] for e in entries} == {(8, 16), (6, 16), (8, 24)}
    assert all(e[5][0] and e[5][2] for e in entries)  # every new shape selected for, forward and weight gradient


def test_a_tuned_model_compiled_with_cuda_graphs_replays_its_layer_ops_and_new_shapes():
    # mode="reduce-overhead": Inductor's CUDA graphs record the layer ops after warm-up runs, in which a new
    # shape is selected for; a capture never asks the tuner (it would measure inside the capture).
    model, twin, _ = _tuned()
    model.eval()
    twin.load_state_dict(model.state_dict())
    twin.eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    for batch in (8, 6, 8, 6):
        x = torch.randn(batch, 16, 16, 16, device="cuda").to(memory_format=torch.channels_last)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            y, expected = compiled(x).clone(), twin(x)
        assert rel_error(y.float(), expected.float()) < 2e-2, batch


def test_a_cudnn_plan_is_rebuilt_from_its_serialized_form_and_computes_the_same(tmp_path):
    import time

    module = extension.load()
    p = ct.ConvProblem("fwd", n=4, c=64, k=64, input_size=(28, 28), kernel_size=3, padding=1, dtype="float16",
                       layout="channels_last", device="cuda")
    a, b = p.random_inputs(seed=3)
    rebuilt = 0
    for algo in ct.algorithms(p)[:12]:
        recipe = algo.native_recipe(p)
        if recipe is None or recipe.kind != "cudnn":
            continue
        started = time.perf_counter()
        handle = runtime.executable(p, algo)
        built_s = time.perf_counter() - started
        serialized = module.serialized(handle)
        assert serialized, algo.name
        options = dict(recipe.options)
        started = time.perf_counter()
        again = runtime.handle_of(f"rebuilt {algo.name}")
        module.add_cudnn(again, f"rebuilt {algo.name}", runtime._geometry(module, p, algo.name), 0,
                         [list(s) for s in options["shapes"]], [list(s) for s in options["strides"]],
                         list(options["stride"]), list(options["padding"]), list(options["dilation"]), options["tag"],
                         serialized)
        loaded_s = time.perf_counter() - started
        print(f"{algo.name}: built in {built_s * 1e3:.1f} ms, rebuilt from its serialized form in "
              f"{loaded_s * 1e3:.1f} ms")
        first = torch.ops.convtune.tuned_run(a, b, handle)
        assert torch.equal(torch.ops.convtune.tuned_run(a, b, again), first) or algo.is_deterministic(p) is not True
        assert rel_error(torch.ops.convtune.tuned_run(a, b, again), first) < 1e-2
        rebuilt += 1
    assert rebuilt >= 2
    # through the database: a fresh process (here: a forgotten preparation) rebuilds from the stored form
    db = ct.TuningDB(tmp_path / "t.sqlite")
    name = next(a.name for a in ct.algorithms(p) if (r := a.native_recipe(p)) and r.kind == "cudnn")
    handle, kind = runtime.prepare(p, name, db)
    assert kind == "cudnn" and db.executable(p, name) is not None
    runtime._prepared.clear()
    assert runtime.prepare(p, name, db) == (handle, kind)
    # a stored form that cuDNN does not take (damaged, or made by another cuDNN or GPU): asked directly, the
    # extension raises naming what it was making, never crashes; a fresh process that finds it in the database
    # rebuilds the plan from cuDNN's heuristics, computes what the plan did, and stores the good form in its place
    # (in this process the plan's handle is made already, so the stored form is not read again)
    expected = torch.ops.convtune.tuned_run(a, b, handle)
    recipe, stored = db.executable(p, name)
    options = recipe["options"]
    for damaged in (stored[: len(stored) // 2], b"{}", b"\x00" * 64):
        label = f"damaged {name} {len(damaged)}"
        with pytest.raises(RuntimeError, match="execution plan from its serialized form"):
            module.add_cudnn(runtime.handle_of(label), label, runtime._geometry(module, p, name), 0,
                             [list(s) for s in options["shapes"]], [list(s) for s in options["strides"]],
                             list(options["stride"]), list(options["padding"]), list(options["dilation"]),
                             options["tag"], damaged)
    damaged = stored[: len(stored) // 2]
    db.store_executable(p, name, recipe, damaged)
    script = (f"import torch, convtune as ct\nfrom convtune.pytorch import runtime\n"
              f"p = ct.ConvProblem.from_key({p.key!r})\n"
              f"handle, kind = runtime.prepare(p, {name!r}, ct.TuningDB({str(db.path)!r}))\n"
              f"a, b = p.random_inputs(seed=3)\n"
              f"torch.save(torch.ops.convtune.tuned_run(a, b, handle).cpu(), {str(tmp_path / 'out.pt')!r})\n"
              f"print(kind)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.split()[-1:] == ["cudnn"], done.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected.cpu(), rtol=1e-2, atol=1e-2)
    assert db.executable(p, name)[1] not in (damaged, b"")


def test_operands_on_another_device_raise_a_value_error_that_names_the_layer():
    p = ct.ConvProblem("fwd", n=2, c=64, k=64, input_size=(8, 8), kernel_size=3, padding=1, dtype="float16",
                       layout="channels_last", device="cuda")
    x, w = p.random_inputs(seed=4)
    handles = {}
    for algo in ct.algorithms(p):
        recipe = algo.native_recipe(p)
        if recipe is not None and recipe.kind not in handles:
            try:
                handles[recipe.kind] = runtime.executable(p, algo)
            except RuntimeError:  # an execution plan cuDNN does not build here
                continue
    assert {"cudnn", "native"} <= set(handles), handles
    layer = re.escape(f"convtune:{p.key}")
    for handle in handles.values():
        with pytest.raises(ValueError, match=layer + ".*: operand x is on cpu, the tuned problem is on cuda"):
            torch.ops.convtune.tuned_run(x.cpu(), w.cpu(), handle)
        with pytest.raises(ValueError, match="operand w is on cpu.*the same device as the first operand"):
            torch.ops.convtune.tuned_run(x, w.cpu(), handle)


def test_a_misaligned_operand_is_copied_and_a_stale_handle_raises_a_value_error_not_a_crash():
    # cuDNN's plans assume 16-byte aligned operands: a view that starts elsewhere (x[1:]) is copied by the native
    # plan and by a tuned layer's Python path, as torch's convolution takes it; Algorithm.run, the library's own
    # call on the caller's tensors, refuses it naming the operand
    from convtune.pytorch import ops

    p = ct.ConvProblem("fwd", n=2, c=64, k=64, input_size=(8, 8), kernel_size=3, padding=1, dtype="float16",
                       layout="channels_last", device="cuda")
    x, w = p.random_inputs(seed=4)
    handle = plan = None
    for algo in ct.algorithms(p):
        recipe = algo.native_recipe(p)
        if recipe is not None and recipe.kind == "cudnn":
            try:
                handle, plan = runtime.executable(p, algo), algo
                break
            except RuntimeError:  # an execution plan cuDNN does not build here
                continue
    assert handle is not None
    storage = torch.empty(x.numel() + 8, dtype=x.dtype, device="cuda")
    shifted = storage[1:1 + x.numel()].view(2, 8, 8, 64).permute(0, 3, 1, 2)  # channels_last, 2 bytes off
    shifted.copy_(x)
    expected = torch.ops.convtune.tuned_run(x, w, handle)
    torch.testing.assert_close(torch.ops.convtune.tuned_run(shifted, w, handle), expected, rtol=0, atol=0)
    torch.testing.assert_close(ops.Runner(p.key, plan.name)(shifted, w), expected)
    with pytest.raises(ValueError, match=re.escape(f"by {plan.name}: operand x starts at an address not aligned")):
        plan.run(p, shifted, w, workspace=allocate_workspace(plan.buffer_bytes(p), "cuda"))
    with pytest.raises(ValueError, match="no executable has handle 12345"):
        torch.ops.convtune.tuned_run(x, w, 12345)


def test_a_layer_on_the_python_path_runs_its_cudnn_direction_by_its_executable():
    from convtune.pytorch import ops
    from convtune.pytorch.tuning import LayerSelection, Signature, layout_of

    torch.manual_seed(0)
    module = ct.nn.Conv2d(32, 32, 3, padding=1, groups=32, mode="get").cuda().half().to(
        memory_format=torch.channels_last)
    x = torch.randn(4, 32, 14, 14, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    sig = Signature(tuple(x.shape), x.dtype, x.device, layout_of(x))
    p = ct.ConvProblem.from_module(module, sig.shape, dtype=sig.dtype, layout=sig.layout, device="cuda")
    dx = p.with_direction("bwd_data")
    plans = [a.name for a in ct.algorithms(dx) if (a.native_recipe(dx) or ()) and a.native_recipe(dx).kind == "cudnn"]
    assert plans, f"no cuDNN execution plan for {dx.key}"
    selection = LayerSelection(p.key, "direct:taps", plans[0], "torch:native")
    module._convtune_select(sig, selection)
    assert selection.runtime == "python"
    assert type(ops.Call(*selection.call.names()).runner("bwd_data")).__name__ == "NativeRunner"
    twin = torch.nn.Conv2d(32, 32, 3, padding=1, groups=32).cuda().half().to(memory_format=torch.channels_last)
    twin.load_state_dict(module.state_dict())
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = module(xa), twin(xb)
    torch.testing.assert_close(ya, yb, atol=2e-2, rtol=2e-2)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    torch.testing.assert_close(xa.grad, xb.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(module.weight.grad, twin.weight.grad, atol=5e-1, rtol=2e-2)


def test_a_layer_on_pytorchs_call_for_training_runs_a_cudnn_plan_for_calls_without_gradients(tmp_path, monkeypatch):
    from convtune.results import PerfResult, Status

    # The plan's backward costs 20 us a direction over PyTorch's call, its forward 8 us less: the layer stays on
    # PyTorch's call for training, and a call without gradients runs the plan (tuning.for_calls_without_gradients).
    monkeypatch.setattr(host_costs, "host_overheads_us", lambda device, db=None: {
        "python": 50.0, "native": 5.0, "cudnn": -8.0, "cudnn backward": 20.0})
    torch.manual_seed(0)
    db = ct.TuningDB(tmp_path / "t.sqlite")
    module = ct.nn.Conv2d(32, 32, 3, padding=1, mode="hybrid", db=db).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(4, 32, 14, 14, device="cuda").to(memory_format=torch.channels_last)
    p = ct.ConvProblem.from_module(module, tuple(x.shape), dtype="float16", layout="channels_last", device="cuda")
    plans = {}
    for d in ("fwd", "bwd_data", "bwd_filter"):
        q = p.with_direction(d)
        for algo in ct.algorithms(q):
            if (algo.native_recipe(q) or ()) and algo.native_recipe(q).kind == "cudnn":
                try:
                    runtime.prepare(q, algo.name)
                except runtime.REFUSALS:
                    continue
                plans[d] = algo.name
                break
        assert d in plans, f"no cuDNN execution plan builds for {q.key}"
        db.store(q, [PerfResult("torch:native", Status.OK, time_ms=0.0100, rel_error=0.0),
                     PerfResult(plans[d], Status.OK, time_ms=0.0101, rel_error=0.0)])
    with torch.autocast("cuda", dtype=torch.float16):
        module(x.clone().requires_grad_()).sum().backward()
    selection = next(iter(module.selections.values()))
    assert selection.runtime == "torch" and selection.no_grad == plans["fwd"], selection
    expected = torch.nn.functional.conv2d(x.double(), module.weight.double(), module.bias.double(), padding=1)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        module(x)  # the hot path from the next call on
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y = module(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = module(x)
    names = {e.name for e in prof.events()}
    assert "convtune::tuned_conv" in names and "aten::conv2d" not in names, sorted(names)[:20]
    assert y.dtype == torch.float16
    assert rel_error(y.double(), expected) < 1e-2  # float16 on 288 products a result
    captured.zero_()
    graph.replay()
    assert rel_error(captured.double(), expected) < 1e-2  # (not bit for bit: the plan may split its sums otherwise)
