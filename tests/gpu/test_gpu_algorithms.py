"""Every GPU algorithm against the float64 reference on real layers; workspace honesty; OOM in find.

Run on a CUDA machine: ``python -m pytest tests/gpu``. Skipped without CUDA.
"""

import pytest
import torch

import convtune as ct
from convtune.algorithms.base import allocate_workspace
from convtune.verify import element_bound, errors, reference, tolerance
from gpu_cases import case_id, cases

pytestmark = pytest.mark.gpu

# Real layers: ResNet-50's 3x3, 1x1 and strided 1x1; MobileNetV2's depthwise; a dilated 3x3; a 1-D and a 3-D conv;
# a 7x7 stride-2 first layer of 3 channels.
LAYERS = [
    dict(n=8, c=64, k=64, input_size=(56, 56), kernel_size=3, padding=1),
    dict(n=8, c=256, k=64, input_size=(56, 56), kernel_size=1),
    dict(n=8, c=512, k=1024, input_size=(28, 28), kernel_size=1, stride=2),
    dict(n=8, c=96, k=96, input_size=(56, 56), kernel_size=3, padding=1, stride=2, groups=96),
    dict(n=4, c=32, k=48, input_size=(33, 31), kernel_size=3, padding=2, dilation=2),
    dict(n=4, c=32, k=64, input_size=(200,), kernel_size=5, padding=2),
    dict(n=2, c=16, k=16, input_size=(12, 12, 12), kernel_size=3, padding=1),
    dict(n=4, c=3, k=64, input_size=(64, 64), kernel_size=7, stride=2, padding=3),
]
CASES = cases(LAYERS)
EVERY_ALGORITHM = "test_every_gpu_algorithm_matches_float64_and_keeps_to_its_workspace"


def gpu_problem(case) -> ct.ConvProblem:
    layer, direction, dtype, layout = case
    return ct.ConvProblem(direction=direction, dtype=dtype, layout=layout, device="cuda", allow_tf32=False, **layer)


@pytest.fixture(scope="module", autouse=True)
def _triton_compiled_ahead(request):
    # the Triton configurations of the cases the test below runs, compiled at once on threads; compiled one after
    # another, they took most of its time (triton_cases.compile_ahead)
    from triton_cases import compile_ahead, selected_params

    problems = [gpu_problem(c["case"]) for c in selected_params(request, EVERY_ALGORITHM)]
    compile_ahead(request, ((a.name, p) for p in problems for a in ct.algorithms(p) if a.host_kind == "triton"))


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_every_gpu_algorithm_matches_float64_and_keeps_to_its_workspace(case):
    p = gpu_problem(case)
    a, b = p.random_inputs(seed=11)
    ref = reference(p, a, b)
    algos = ct.algorithms(p)
    assert algos, ct.unsupported_reasons(p)
    failures = []
    for algo in algos:
        try:
            need = algo.buffer_bytes(p)
        except RuntimeError:  # a cuDNN execution plan that cannot be built is reported, not run
            continue
        ws = allocate_workspace(need, "cuda")
        out = p.empty(p.operand_shapes[2]).fill_(float("nan"))
        algo.run(p, a, b, workspace=ws, out=out)  # warm-up: lazy plans, cuFFT plan caches
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        algo.run(p, a, b, workspace=ws, out=out)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        err, worst = errors(out, ref)
        tol = tolerance(p, algo.notes(p))
        slack = max(1 << 20, out.numel() * out.element_size() // 50)
        if not err <= tol:
            failures.append(f"{algo.name}: rel error {err:.2e} > {tol:.1e}")
        if not worst <= element_bound(tol):  # the element bound of verify.check: a correct plan keeps to it
            failures.append(f"{algo.name}: worst element {worst:.2e} of |ref| + rms > {element_bound(tol):.1e}")
        if algo.name != "torch:native" and extra > algo.library_bytes(p) + slack:
            failures.append(f"{algo.name}: allocated {extra} bytes beyond its {need}-byte workspace")
    assert not failures, "\n".join(failures)


def test_find_reports_out_of_memory_as_a_status_and_goes_on():
    p = ct.ConvProblem("fwd", n=4, c=64, k=64, input_size=(32, 32), kernel_size=3, padding=1, device="cuda",
                       dtype="float16", layout="NHWC")
    from convtune.algorithms import registry
    from convtune.algorithms.base import Algorithm, Buffer

    free, _ = torch.cuda.mem_get_info()

    class Greedy(Algorithm):
        name = "test:greedy"
        devices = ("cuda",)

        def buffers(self, problem):
            return [Buffer("huge", (free * 4,), torch.uint8)]

        def _run(self, problem, a, b, out, ws):
            raise AssertionError("never reached: the workspace cannot be allocated")

    from convtune.settings import settings

    # No pruning by prediction: the huge workspace would make the cost model skip it unrun.
    with registry.isolated(Greedy()), settings.override(find_prune_factor=0):
        results = ct.find(p, ct.Policy(workspace_limit=None))
    by_name = {r.algorithm: r for r in results}
    assert by_name["test:greedy"].status == ct.Status.OUT_OF_MEMORY
    assert results[0].ok and results[0].algorithm != "test:greedy"


def test_cudnn_plans_launch_directly_and_agree_with_the_frontends_public_execute():
    from convtune.algorithms import cudnn as backend
    from convtune.settings import settings

    p = ct.ConvProblem("fwd", n=8, c=64, k=64, input_size=(28, 28), kernel_size=3, padding=1, device="cuda",
                       dtype="float16", layout="NHWC")
    a, b = p.random_inputs(seed=3)
    graph = backend.ProblemGraph(p)
    direct = 0
    for index in range(len(graph.names)):
        try:
            need = graph.build(index)
        except RuntimeError:
            continue
        ws = allocate_workspace(need, "cuda")
        outs = []
        for on in (True, False):
            graph._launchers.pop(index, None)
            with settings.override(cudnn_direct=on):
                out = p.empty(p.operand_shapes[2]).fill_(float("nan"))
                graph.execute(index, a, b, out, ws)
                direct += on and graph._launchers[index].__name__ == "launch"
            outs.append(out)
        torch.cuda.synchronize()
        assert torch.equal(outs[0], outs[1]), graph.names[index]
    assert direct > 0, "no plan launched directly: the frontend's internals changed; see cudnn._direct_launch"


def test_find_builds_no_cudnn_plan_that_it_skips_once_a_measured_candidate_needs_no_scratch():
    pytest.importorskip("cudnn")
    # A problem no other test asks about: its plans are built here or not at all.
    p = ct.ConvProblem("fwd", n=3, c=40, k=24, input_size=(19, 17), kernel_size=3, padding=1, device="cuda",
                       dtype="float16", layout="NHWC")
    plans = {a.name: a for a in ct.algorithms(p) if a.name.startswith("cudnn:")}
    if len(plans) < 4:
        pytest.skip(f"cuDNN offers {len(plans)} plan(s) for {p.key}")
    from convtune.settings import settings

    # torch:native (no scratch) runs among the first of each backend; then the search converges.
    with settings.override(find_patience=1, timing_budget_s=0.01):
        results = ct.find(p)
    assert any(r.ok and r.workspace_bytes == 0 for r in results)
    skipped = [r for r in results if r.algorithm in plans and r.status == ct.Status.SKIPPED]
    unbuilt = [r for r in skipped if plans[r.algorithm].known_workspace_bytes(p) is None]
    assert unbuilt, [(r.algorithm, r.status.value, r.message) for r in results]
    for r in skipped:  # one skipped before torch:native was measured may have been built to compare
        assert ("workspace not learned" in r.message) == (r in unbuilt)
        assert r in unbuilt or r.workspace_bytes == plans[r.algorithm].known_workspace_bytes(p)
    assert all(r.workspace_bytes == 0 for r in unbuilt)
    for r in results:
        if r.ok and r.algorithm in plans:
            assert plans[r.algorithm].known_workspace_bytes(p) == r.workspace_bytes
    # get builds the plans its first place depends on, not every plan: a plan's workspace is reported where it is
    # known and None where it is not, never as a made-up 0.
    choices = ct.get(p)
    assert choices[0].workspace_bytes is not None
    assert all(plans[c.name].known_workspace_bytes(p) == c.workspace_bytes for c in choices if c.name in plans)


def test_find_fails_a_plugin_that_allocates_beyond_its_declared_workspace():
    import adversaries
    from convtune import isolation
    from convtune.settings import settings

    p = ct.ConvProblem("fwd", n=2, c=8, k=8, input_size=(16, 16), kernel_size=3, padding=1, device="cuda")
    try:
        with settings.override(isolate="plugins"):  # measured in its worker, where the check is made
            results = {r.algorithm: r for r in ct.find(p, candidates=[adversaries.HiddenAllocation(),
                                                                      adversaries.Correct()])}
    finally:
        isolation._worker.close()
    hidden = results["plugin:hidden_allocation"]
    assert hidden.status is ct.Status.FAILED and "allocated 64.0 MiB" in hidden.message
    assert results["plugin:correct"].ok


def test_in_the_process_the_allocators_statistics_catch_a_hidden_allocation_and_are_left_as_they_were():
    import adversaries
    from convtune.settings import settings
    from convtune.verify import allocated_while

    p = ct.ConvProblem("fwd", n=2, c=8, k=8, input_size=(16, 16), kernel_size=3, padding=1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # Past the process's peak: the exact figure; under it: an upper bound (what was allocated in all)
    used, exact = allocated_while(lambda: torch.empty(32 << 20, dtype=torch.uint8, device="cuda"))
    assert exact and used == 32 << 20
    peak = torch.cuda.max_memory_allocated()
    used, exact = allocated_while(lambda: torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    assert not exact and used == 1 << 20
    assert torch.cuda.max_memory_allocated() == peak  # the caller's peak figure, left as it was
    with settings.override(isolate="off"):  # trusted, measured here: past the process's peak (the timer's own
        # buffers included), the allocator says exactly what it hid
        results = {r.algorithm: r for r in ct.find(p, candidates=[adversaries.HiddenAllocation(1 << 30),
                                                                  adversaries.Correct()])}
        hidden = results["plugin:hidden_allocation"]
        assert hidden.status is ct.Status.FAILED and "allocated 1.0 GiB" in hidden.message, hidden
        assert results["plugin:correct"].ok
    # A plug-in that cannot go to a worker, under a workspace limit: where its hidden allocation stays under the
    # process's earlier peak, it cannot be told, and the limit cannot hold it: skipped
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del big
    with settings.override(isolate="plugins"):
        unsendable = adversaries.HiddenAllocation()
        unsendable.handle = lambda: None  # a lambda does not pickle: measured in this process
        results = {r.algorithm: r for r in ct.find(p, ct.Policy(workspace_limit=0),
                                                   candidates=[unsendable, adversaries.Correct()])}
    assert results["plugin:hidden_allocation"].status is ct.Status.SKIPPED
    assert "could not be told" in results["plugin:hidden_allocation"].message


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_filter"])
@pytest.mark.parametrize("layer", [LAYERS[3], LAYERS[5], LAYERS[6]], ids=["2d-depthwise", "1d", "3d"])
def test_the_cuda_references_equal_the_cpus_float64_convolution_and_leave_cudnns_flags(layer, direction):
    p = ct.ConvProblem(direction=direction, device="cuda", **layer)
    a, b = (t.double() for t in p.random_inputs(seed=5))
    flags = torch.backends.cudnn.flags
    try:  # the reference (lowered or tapwise) never switches the process's cuDNN flags
        torch.backends.cudnn.flags = None
        got = reference(p, a, b)
    finally:
        torch.backends.cudnn.flags = flags
    want = reference(p.replace(device="cpu"), a.cpu(), b.cpu())
    assert errors(got.cpu(), want)[0] < 1e-12


COMPILING_AHEAD = r"""
import json, sys
import triton
import convtune as ct
from convtune.settings import settings

compiled = []
triton.knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(1)  # once a kernel is kept
p = ct.ConvProblem(sys.argv[1], n=8, c=96, k=96, input_size=(28, 28), kernel_size=5, padding=2, groups=96,
                   dtype="float16", layout="channels_last", device="cuda")
with settings.override(find_compile_threads=int(sys.argv[2]), find_patience=0, find_prune_factor=0):
    results = ct.find(p, candidates=[a for a in ct.algorithms(p) if a.name.startswith("triton:")])
print(json.dumps(dict(statuses={r.algorithm: r.status.value for r in results}, compiled=len(compiled))))
"""


@pytest.mark.parametrize("direction", ("fwd", "bwd_data", "bwd_filter"))
def test_find_compiling_ahead_verifies_and_compiles_as_compiling_on_first_run(direction, tmp_path):
    # find compiles the next Triton candidates on threads while it measures (settings.find_compile_threads). Each
    # setting in a fresh process with an empty Triton cache: every Triton candidate is still checked against float64
    # and comes out right, and the prepared compiles are the ones the runs use (as many kernels kept either way: a
    # warm-up on meta operands that missed a run's specialization would make the run compile again)
    import json
    import os
    import subprocess
    import sys

    out = {}
    for threads in (4, 0):
        env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"triton{threads}"),
                   CONVTUNE_CACHE_DIR=str(tmp_path / f"cache{threads}"), CONVTUNE_PROGRESS="0")
        done = subprocess.run([sys.executable, "-c", COMPILING_AHEAD, direction, str(threads)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        out[threads] = json.loads(done.stdout.strip().splitlines()[-1])
    assert out[4]["statuses"] and all(status == "ok" for status in out[4]["statuses"].values()), out[4]
    assert out[4]["statuses"] == out[0]["statuses"]
    assert out[4]["compiled"] == out[0]["compiled"] > 0
