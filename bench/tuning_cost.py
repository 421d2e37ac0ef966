"""Where a cold find's time goes, and what one convtune op costs the host.

Part 1, tuning: for the first layers of a network in every training direction, in the order a
cold find meets them: making the problem's cuDNN graph (the heuristics query), building each of
its plans (the slowest named), the float64 reference, then ``find`` itself (empty database; its
plans are built by then, so what remains is verification and timing). Plans are built one after
another, or by a pool of threads on every second problem (``--threads``). The per-plan means by
threads compare different problems, and ``ProblemGraph.build`` serializes the builds of one graph,
so they do not say what concurrent building would gain.

Part 2, the whole network (``--whole``): every distinct problem of the network's training step
(forward; bwd_data except the first layer's; bwd_filter) selected in 'hybrid' mode on an empty
database, as ``optimize(training=True)`` does: the wall time and the seconds of each phase (``PHASES``: cuDNN
graphs, plan builds, the ranking, references, verification with the compiles it waits for, measuring, the database,
timed by ``common.phase_clock``), and, under cProfile, convtune's costliest functions.

Then the same problems warm, in a fresh process on the database the cold run filled: each one
selected from it and its algorithm's workspace learned (a cuDNN execution plan built), as a warm ``optimize``
does (database lookups, cuDNN graphs, plan builds: ``WARM_PHASES``).

Part 3, host cost: microseconds per call, on a layer small enough that the GPU waits on the host,
of ``F.conv2d`` and of convtune's op path (``ops.compute``, ``torch.ops.convtune.run``, and
``torch.ops.convtune.conv`` with autograd) for each algorithm kind, and of an ``nn.Conv2d`` before and
after ``optimize`` (forward; forward and backward); on CUDA also a cuDNN execution plan's execute alone,
through the C++ launch and through the frontend's public call (setting ``cudnn_direct``).

    python bench/tuning_cost.py --network resnet50 --batch 128 --dtype float16 --layers 6 --whole

writes bench/results/tuning_cost.json and .md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import convtune as ct  # noqa: E402
from convtune import extension, zoo  # noqa: E402
from convtune.algorithms.base import allocate_workspace  # noqa: E402
from convtune.pytorch import ops  # noqa: E402
from convtune.settings import settings  # noqa: E402
from convtune.verify import reference_case  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _seconds(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def build_times(graph, threads: int) -> tuple[float, dict[str, float]]:
    """Wall seconds to build every plan of ``graph``, and each plan's own seconds (inf: did not build)."""
    def one(index: int) -> tuple[str, float]:
        t0 = time.perf_counter()
        try:
            graph.build(index)
        except RuntimeError:
            return graph.names[index], float("inf")
        return graph.names[index], time.perf_counter() - t0

    t0 = time.perf_counter()
    if threads > 1:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            each = dict(pool.map(one, range(len(graph.names))))
    else:
        each = dict(map(one, range(len(graph.names))))
    return time.perf_counter() - t0, each


def tuning_rows(problems, threads: int) -> list[dict]:
    """Per problem, in the order a cold find meets them: graph, plan builds, reference, then find itself."""
    try:
        from convtune.algorithms.cudnn import BACKEND
    except ImportError:  # no cuDNN frontend (a CPU check of this script): finds only
        BACKEND = None
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ct.TuningDB(os.path.join(tmp, "cost.sqlite")) as db:
        for i, p in enumerate(problems):
            pool = threads if i % 2 else 1
            t0 = time.perf_counter()
            graph = BACKEND.graph(p) if BACKEND and p.device == "cuda" else None  # find then uses these plans
            graph_s = time.perf_counter() - t0
            build_s, each = build_times(graph, pool) if graph else (0.0, {})
            built = {n: s for n, s in each.items() if s != float("inf")}
            reference_s = _seconds(lambda p=p: reference_case(p, None))
            find_s = _seconds(lambda p=p: ct.find(p, db=db))  # plans built: verification, reference and timing
            results = db.results(p)
            slowest = sorted(built.items(), key=lambda kv: -kv[1])[:3]
            rows.append(dict(problem=p.key, graph_s=graph_s, plans=len(each), built=len(built), build_threads=pool,
                             build_s=build_s, build_sum_s=sum(built.values()),
                             slowest=[(n, round(s, 4)) for n, s in slowest], reference_s=reference_s, find_s=find_s,
                             timed=sum(1 for r in results if r.time_ms is not None),
                             pick=min((r for r in results if r.ok), key=lambda r: r.time_ms).algorithm))
            print(f"{p.key}: graph {graph_s:.3f} s, {len(built)}/{len(each)} plans built in {build_s:.3f} s "
                  f"({pool} thread(s)), reference {reference_s:.3f} s, find after that {find_s:.3f} s",
                  file=sys.stderr)
    return rows


# The phases of a cold find, by the functions that do them, where find looks them up (common.phase_clock): (label,
# module, attribute). Triton's compiles are not a phase of their own: a candidate's first run (verification) waits
# for its compile, and find's compile threads compile the next ones meanwhile.
CUDNN_PHASES = (
    ("cuDNN graphs (heuristics query)", "convtune.algorithms.cudnn", "ProblemGraph.__init__"),
    ("cuDNN execution plan builds", "convtune.algorithms.cudnn", "ProblemGraph.build"),
)
PHASES = (
    *CUDNN_PHASES,
    ("cost-model ranking (get)", "convtune.find", "ranked_predictions"),
    ("float64 references", "convtune.measure", "reference_case"),
    ("verification runs (with the compiles they wait for)", "convtune.measure", "check"),
    ("measuring (verify, determinism, timing)", "convtune.measure", "Search._measure"),
    ("timer: first call, L2 flush buffer", "convtune.timing", "_CudaSampler.__init__"),
    ("timer: sizing calls and graph capture", "convtune.timing", "_CudaSampler.prepare"),
    ("timer: graph capture (a call on a side stream, the capture, its instantiation)", "convtune.timing",
     "_CudaSampler._capture"),
    ("timer: samples", "convtune.timing", "_CudaSampler.sample_ms"),
    ("database writes", "convtune.db", "TuningDB.store"),
    ("find, in all", "convtune.select", "find"),
)


def training_problems(network: str, batch: int, dtype: str, layout: str, device: str) -> list:
    """Every distinct problem of the network's training step, as ``optimize(training=True)`` meets them."""
    # (a built-in network's name, or a layer file's path)
    layers = zoo.resolve(network, batch, direction="fwd", dtype=dtype, layout=layout, device=device)
    return list(dict.fromkeys(layer.problem.with_direction(d) for i, layer in enumerate(layers)
                              for d in ("fwd", "bwd_data", "bwd_filter") if d != "bwd_data" or i > 0))


def _profiled(fn) -> tuple[float, dict]:
    """(wall seconds, cProfile stats) of ``fn()``, the device synchronized around it."""
    profiler = cProfile.Profile()
    _sync()
    t0 = time.perf_counter()
    profiler.enable()
    fn()
    _sync()
    profiler.disable()
    return time.perf_counter() - t0, pstats.Stats(profiler).stats


def _in_seconds(spent_ms: dict) -> dict:
    return {label: ms / 1e3 for label, ms in spent_ms.items()}


def whole_network(network: str, batch: int, dtype: str, layout: str, device: str,
                  compile_threads: int | None = None) -> dict:
    """The network's distinct training problems selected cold in 'hybrid' mode, under cProfile (Triton's disk
    cache empty: a folder of its own; ``compile_threads``: find's, default the setting's); then warm, in a fresh
    process on the database and Triton cache the cold run filled (``warm_child``)."""
    problems = training_problems(network, batch, dtype, layout, device)
    threads = settings.find_compile_threads if compile_threads is None else compile_threads
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "whole.sqlite")
        before = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")  # read by Triton at each lookup
        try:
            with (ct.TuningDB(path) as db, settings.override(find_compile_threads=threads),
                  common.phase_clock(PHASES) as spent):
                wall, stats = _profiled(lambda: [ct.select(p, mode="hybrid", db=db) for p in problems])
            phases, ours = _in_seconds(spent), common.costliest(stats)
            out_json = os.path.join(tmp, "warm.json")
            subprocess.run([sys.executable, __file__, "--network", network, "--batch", str(batch), "--dtype", dtype,
                            "--layout", layout, "--device", device, "--warm-child", path, "--child-out", out_json],
                           check=True)
        finally:
            if before is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = before
        warm = json.loads(Path(out_json).read_text())
    return dict(problems=len(problems), wall_s=wall, phases_s=phases, top_cumulative_s=ours, warm=warm,
                compile_threads=threads)


WARM_PHASES = (
    ("database lookups", "convtune.db", "TuningDB.results"),
    *CUDNN_PHASES,
)


def warm_child(args) -> None:
    """What a warm ``optimize`` does per problem, in this fresh process: select from the database, then
    learn the chosen algorithm's workspace (a cuDNN execution plan is built), under cProfile."""
    problems = training_problems(args.network, args.batch, args.dtype, args.layout, args.device)

    def tune() -> None:
        with ct.TuningDB(args.warm_child) as db:
            for p in problems:
                ct.get_algorithm(ct.select(p, mode="hybrid", db=db).algorithm, p).buffer_bytes(p)

    with common.phase_clock(WARM_PHASES) as spent:
        wall, stats = _profiled(tune)
    phases, ours = _in_seconds(spent), common.costliest(stats)
    Path(args.child_out).write_text(json.dumps(dict(wall_s=wall, phases_s=phases, top_cumulative_s=ours)))


def _per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync()
    return 1e6 * (time.perf_counter() - t0) / calls


def cudnn_launch_rows(p, x, w, name: str) -> list[tuple[str, float]]:
    """A cuDNN execution plan's execute alone (no Runner around it), through the C++ launch and the public call."""

    plan = ct.get_algorithm(name, p)
    graph, index = plan.graph, plan.index
    out, ws = p.empty(p.operand_shapes[2]), allocate_workspace(graph.build(index), p.device)
    rows = []
    for direct in (True, False):
        graph._launchers.pop(index, None)
        with settings.override(cudnn_direct=direct):
            us = _per_call_us(lambda: graph.execute(index, x, w, out, ws))
        rows.append((f"ProblemGraph.execute {name}, {'C++ launch' if direct else 'public execute'}", us))
    graph._launchers.pop(index, None)  # the next run makes the launcher the settings ask for
    return rows


def host_rows(device: str, dtype: str) -> list[tuple[str, float]]:
    p = ct.ConvProblem("fwd", n=1, c=8, k=8, input_size=(4, 4), kernel_size=1, dtype=dtype, layout="NHWC",
                       device=device)
    x, w = p.random_inputs()
    xg = x.clone().requires_grad_()
    rows = [("F.conv2d", _per_call_us(lambda: torch.nn.functional.conv2d(x, w)))]
    cudnn_names = [a.name for a in ct.algorithms(p) if a.name.startswith("cudnn:")]
    with settings.override(native=False):  # the Python path's ops run the Python algorithms (ops.runner)
        for name in ["gemm:1x1", "torch:native"] + cudnn_names[:1]:
            rows += [(f"ops.compute {name}", _per_call_us(lambda name=name: ops.compute(x, w, p.key, name))),
                     (f"torch.ops.convtune.run {name}",
                      _per_call_us(lambda name=name: torch.ops.convtune.run(x, w, p.key, name))),
                     (f"torch.ops.convtune.conv {name}, x needs grad",
                      _per_call_us(lambda name=name: torch.ops.convtune.conv(xg, w, p.key, name, "", "")))]
    if cudnn_names:
        rows += cudnn_launch_rows(p, x, w, cudnn_names[0])
    conv = torch.nn.Conv2d(8, 8, 1, bias=False).to(device, p.torch_dtype).to(memory_format=torch.channels_last)
    rows += [("nn.Conv2d forward", _per_call_us(lambda: conv(x))),
             ("nn.Conv2d forward+backward", _per_call_us(lambda: conv(xg).sum().backward())),
             ("nn.Conv2d backward alone", _backward_us(conv, xg))]
    with tempfile.TemporaryDirectory() as tmp, ct.TuningDB(os.path.join(tmp, "host.sqlite")) as db:
        ct.optimize(conv, xg, training=True, db=db)
    chosen = ", ".join(f"{r['direction']}={r['algorithm']}" for r in ct.explain(conv))
    rows += [(f"optimized forward ({chosen})", _per_call_us(lambda: conv(x))),
             ("optimized forward+backward", _per_call_us(lambda: conv(xg).sum().backward())),
             ("optimized backward alone", _backward_us(conv, xg))]
    rows += native_rows(p, conv, x, xg)
    rows += compiled_rows(p, x)
    if device == "cuda":  # Triton runs on the CPU only in its interpreter
        rows += triton_rows(device, dtype)
    from convtune.pytorch import host_costs
    host_costs.forget_host_costs()  # measured here, not read from a database
    rows += [(f"host-cost rule's measure: {kind}", us) for kind, us in host_costs.host_overheads_us(device).items()]
    call = next(iter(conv.selections.values())).call
    if call is not None:  # the backward's two runs without autograd around them
        dy = conv(x).detach()
        data, weights = call.runner("bwd_data"), call.runner("bwd_filter")
        rows.append(("optimized backward's runs alone (bwd_data, bwd_filter; no autograd)",
                     _per_call_us(lambda: (data(dy, conv.weight.detach()), weights(x, dy)))))
    return rows


def _interleaved(base, candidate, rounds: int = 9, calls: int = 500) -> tuple[float, float, float]:
    """(base us, candidate us, median of the per-round ratios): the two timed in alternation, so a host
    whose speed drifts during the run (a shared machine) moves both alike."""
    pairs = [(_per_call_us(base, calls), _per_call_us(candidate, calls)) for _ in range(rounds)]
    return (statistics.median(b for b, _ in pairs), statistics.median(c for _, c in pairs),
            statistics.median(c / b for b, c in pairs))


def native_rows(p, conv, x, xg) -> list[tuple[str, float]]:
    """The same layer forced onto each native executable kind, against nn.Conv2d timed in alternation with it.

    Each kind's module forward and forward+backward, and their ratio to nn.Conv2d's (median of the
    rounds' ratios; the target: at most 1.1).
    """
    from convtune.pytorch.modules import Conv2d
    from convtune.pytorch.tuning import LayerSelection, Signature, layout_of

    base = torch.nn.Conv2d(8, 8, 1, bias=False).to(p.device, p.torch_dtype).to(memory_format=torch.channels_last)
    base.weight.data.copy_(conv.weight.data)
    sig = Signature(tuple(x.shape), x.dtype, x.device, layout_of(x))
    rows = []
    for kind in ("gemm_1x1", "cudnn", "native"):
        names = {}
        for d in ("fwd", "bwd_data", "bwd_filter"):
            q = p.with_direction(d)
            names[d] = next((a.name for a in ct.algorithms(q) if (r := a.native_recipe(q)) and r.kind == kind), "")
        if not all(names.values()):
            continue
        layer = (Conv2d(8, 8, 1, bias=False, mode="get").to(p.device, p.torch_dtype)
                 .to(memory_format=torch.channels_last))
        layer.weight.data.copy_(conv.weight.data)
        plan = LayerSelection(p.key, **names)
        layer._convtune_select(sig, plan)
        label = f"{kind} executables, runtime {plan.runtime}"
        rows += _against_torch(label, f" ({names['fwd']})", base, layer, x, xg)
    return rows


def _against_torch(label: str, detail: str, base, layer, x, xg) -> list[tuple[str, float]]:
    """``layer``'s forward, forward+backward of a loss's sum() (its dy expanded), and forward+backward of a dense dy
    (as a layer inside a network gets it), each timed in alternation with ``base`` (nn.Conv2d): its microseconds
    and the median of the rounds' ratios."""
    layer(xg)
    dy = torch.randn_like(base(x))
    timed = {"forward": _interleaved(lambda: base(x), lambda: layer(x)),
             "forward+backward": _interleaved(lambda: base(xg).sum().backward(), lambda: layer(xg).sum().backward(),
                                              calls=200),
             "forward+backward, dense dy": _interleaved(lambda: base(xg).backward(dy), lambda: layer(xg).backward(dy),
                                                        calls=200)}
    rows = []
    for what, (torch_us, us, ratio) in timed.items():
        rows += [(f"{label}: {what}{detail if what == 'forward' else ''}; nn.Conv2d {torch_us:.1f}", us),
                 (f"{label}: {what} / nn.Conv2d's", ratio)]
    return rows


def _step(module, x, training: bool):
    """One call of ``module`` on ``x``: an inference, or a training step's forward+backward (of the output's sum)."""
    return (lambda: module(x).sum().backward()) if training else (lambda: module(x))


def compiled_rows(p, x) -> list[tuple[str, float]]:
    """Ten such layers in a row under torch.compile (Inductor), an optimized copy against the PyTorch one, timed
    in alternation: per layer, inference and a training step's forward+backward (of the output's sum), and the
    same networks in eager code beside them. Under Inductor a tuned layer of static shape is a call of
    ``convtune.tuned_run`` per direction from the generated Python (boxed, through ``torch.ops``) and a check of
    its result's strides; PyTorch's are ``extern_kernels.convolution`` and one ``aten.convolution_backward``.
    Tuned with the host-cost rule off: its layers gain nothing on the GPU, so the rule would send them to
    PyTorch's call (in compiled code too), and these rows measure the op's path."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Conv2d(8, 8, 1, bias=False) for _ in range(10)])
    base = base.to(p.device, p.torch_dtype).to(memory_format=torch.channels_last)
    xg = x.clone().requires_grad_()
    rows = []
    for training in (False, True):
        ours = copy.deepcopy(base)
        with tempfile.TemporaryDirectory() as tmp, ct.TuningDB(os.path.join(tmp, "compiled.sqlite")) as db:
            with settings.override(host_rule=False):
                ct.optimize(ours, xg if training else x, training=training, db=db)
        chosen = sorted({r["algorithm"] for r in ct.explain(ours)})
        what = "forward+backward" if training else "inference"
        with torch.set_grad_enabled(training):
            for style, (b, o) in (("eager", (base, ours)), ("compiled", (torch.compile(base), torch.compile(ours)))):
                base_step, our_step = (_step(m, xg if training else x, training) for m in (b, o))
                base_step(), our_step()  # compiled here, not timed
                torch_us, ours_us, ratio = _interleaved(base_step, our_step, calls=100 if training else 200)
                rows += [(f"10 layers {style}, {what}, per layer: optimized ({', '.join(chosen)}); nn.Conv2d "
                          f"{torch_us / 10:.1f}", ours_us / 10),
                         (f"10 layers {style}, {what}: optimized / nn.Conv2d's", ratio)]
        if not training:
            rows += compiled_call_rows(ours[0], x)
    return rows


def compiled_call_rows(module, x) -> list[tuple[str, float]]:
    """The calls Inductor's generated code makes for one convolution, each alone (per call, us): PyTorch's
    (``extern_kernels.convolution``, a generated binding, and the same op through ``torch.ops``, boxed), and a tuned
    layer's (``torch.ops.convtune.layer_run``: the boxed call, the layer's lookup, then its executable; the same op
    on a layer id no layer has, which runs PyTorch's convolution; the executable through ``tuned_run``)."""
    from torch._inductor.select_algorithm import extern_kernels

    layer, geometry = module._convtune_layer, module._convtune_geometry
    if not layer:
        return []
    w = module.weight.detach()
    stride, padding, dilation, groups = geometry
    entries = extension.loaded().layer_entries(layer)
    handle = entries[0][4][0] if entries else 0
    calls = {
        "extern_kernels.convolution": lambda: extern_kernels.convolution(
            x, w, stride=tuple(stride), padding=tuple(padding), dilation=tuple(dilation), transposed=False,
            output_padding=(0, 0), groups=groups, bias=None),
        "torch.ops.aten.convolution.default": lambda: torch.ops.aten.convolution.default(
            x, w, None, stride, padding, dilation, False, [0, 0], groups),
        "torch.ops.convtune.layer_run.default": lambda: torch.ops.convtune.layer_run.default(
            x, w, stride, padding, dilation, groups, layer, False, False),
        "torch.ops.convtune.layer_run.default, no such layer (PyTorch's call)":
            lambda: torch.ops.convtune.layer_run.default(x, w, stride, padding, dilation, groups, 1 << 40, False,
                                                         False),
    }
    if handle:
        calls["torch.ops.convtune.tuned_run.default (the executable)"] = \
            lambda: torch.ops.convtune.tuned_run.default(x, w, handle)
    calls["torch.empty_like (an allocation)"] = lambda: torch.empty_like(x)
    with torch.no_grad():
        return [(f"compiled code's call, alone: {name}", statistics.median(_per_call_us(fn) for _ in range(5)))
                for name, fn in calls.items()]


def triton_rows(device: str, dtype: str) -> list[tuple[str, float]]:
    """A depthwise 3x3 layer (64 channels on 4x4) on convtune's Triton kernels, layer by layer of the Python path:
    the kernel's launch with its arguments made beforehand (Triton's launcher alone), the kernels module's call,
    the algorithm's ``execute``, the op path's ``ops.compute`` (its runner: the kernels launched from C++ where
    the native runtime makes them, else the Python ``Runner``); and the module forward (float16 weights, and float32
    ones under autocast, as a network runs) and forward+backward against nn.Conv2d timed in alternation, with the
    kernels launched from C++ (runtime native, on CUDA) and on the Python path (runtime python)."""
    from convtune.kernels import depthwise
    from convtune.kernels.shared import geometry
    from convtune.pytorch.modules import Conv2d
    from convtune.pytorch.tuning import LayerSelection, Signature, layout_of

    p = ct.ConvProblem("fwd", n=1, c=64, k=64, input_size=(4, 4), kernel_size=3, padding=1, groups=64, dtype=dtype,
                       layout="NHWC", device=device)
    names = {d: next((a.name for a in ct.algorithms(p.with_direction(d)) if a.name.startswith("triton:")), "")
             for d in ("fwd", "bwd_data", "bwd_filter")}
    if not all(names.values()):
        return []
    x, w = p.random_inputs()
    y = p.empty(p.operand_shapes[2])
    algo = ct.get_algorithm(names["fwd"], p)
    tile = algo.tile
    r, s, *steps = geometry(p)
    grid = (-(-16 // tile.positions), -(-64 // tile.channels))
    launch_args = (x, w, y, 16, 4, 4, 4, 4, 64, *x.stride(), w.stride(0), w.stride(2), w.stride(3), *y.stride(), *steps)
    launch = dict(M=1, R=r, S=s, BLOCK_POS=tile.positions, BLOCK_CH=tile.channels, PATCH_W=tile.patch,
                  UNROLL=depthwise.unroll_factor(tile, p), AS_TILE=tile.as_tile, num_warps=tile.warps)
    rows = [(f"Triton {names['fwd']}: the kernel's launch, arguments made beforehand",
             _per_call_us(lambda: depthwise._forward[grid](*launch_args, **launch))),
            ("Triton: convtune.kernels.depthwise.forward", _per_call_us(lambda: depthwise.forward(p, tile, x, w, y))),
            ("Triton: Algorithm.execute", _per_call_us(lambda: algo.execute(p, x, w, y, {}))),
            ("Triton: ops.compute (the op path's Runner)",
             _per_call_us(lambda: ops.compute(x, w, p.key, names["fwd"])))]
    sig = Signature(tuple(x.shape), x.dtype, x.device, layout_of(x))
    xg = x.clone().requires_grad_()
    for native in (True, False):  # the kernels launched from C++ (where they are: CUDA), and the Python path
        for label, torch_dtype, autocast in (("float16 weights", p.torch_dtype, False),
                                            ("float32 weights under autocast", torch.float32, True)):
            base = torch.nn.Conv2d(64, 64, 3, padding=1, groups=64, bias=False).to(device, torch_dtype)
            base = base.to(memory_format=torch.channels_last)
            layer = Conv2d(64, 64, 3, padding=1, groups=64, bias=False, mode="get").to(device, torch_dtype)
            layer = layer.to(memory_format=torch.channels_last)
            layer.weight.data.copy_(base.weight.data)
            with settings.override(native=native):
                selection = LayerSelection(p.key, **names)
                layer._convtune_select(sig, selection)
                with torch.autocast(device, dtype=p.torch_dtype, enabled=autocast):
                    rows += _against_torch(f"Triton module, runtime {selection.runtime}, {label}", "", base, layer,
                                           x, xg)
    return rows


def _backward_us(module, x) -> float:
    """Host cost of one backward pass of ``module(x)`` with a dense gradient, the forward left out."""
    y = module(x)
    dy = torch.ones_like(y)  # dense in y's layout, as a network's gradients are (sum()'s would be a broadcast)
    return _per_call_us(lambda: y.backward(dy, retain_graph=True))


def markdown(payload: dict) -> str:
    """The result file's text, from its payload (so it can be written again from the JSON)."""
    env, args = payload["environment"], argparse.Namespace(**payload["config"])
    rows, host, whole = payload["tuning"], payload["host_us"], payload["whole"]
    per_plan = {int(t): s for t, s in payload["build_s_per_plan"].items()}  # JSON keys are strings
    text = (f"# Where tuning and running go\n\n{common.env_line(env)}. {args.network} b{args.batch} {args.dtype} "
            f"{args.layout}, the first {args.layers} layers in three directions.\n\n## Cold find, per problem (s)\n\n")
    text += common.md_table(
        ["problem", "graph", "plans built", "build (threads)", "sum of builds", "slowest plan", "reference", "find",
         "timed"],
        [[r["problem"], f"{r['graph_s']:.3f}", f"{r['built']}/{r['plans']}",
          f"{r['build_s']:.3f} ({r['build_threads']})", f"{r['build_sum_s']:.3f}",
          f"{r['slowest'][0][0]} {r['slowest'][0][1]:.3f}" if r["slowest"] else "-",
          f"{r['reference_s']:.3f}", f"{r['find_s']:.3f}", r["timed"]] for r in rows])
    text += ("\nBuild wall seconds per plan, by threads: " + ", ".join(f"{t}: {s:.4f}" for t, s in per_plan.items())
             + " (means over alternate problems, not the same ones; builds of one graph take turns on its lock, "
             "so this does not measure what threads gain)")
    if whole:
        text += (f"\n\n## The whole network, cold (every distinct training problem, 'hybrid' on an empty database)"
                 f"\n\n{whole['problems']} problems in {whole['wall_s']:.1f} s (Triton's disk cache empty; "
                 f"{whole.get('compile_threads', 'no')} threads compiling Triton candidates ahead). Cumulative "
                 f"seconds by phase "
                 f"(timed by wrapping the functions that do them, summed over threads, under cProfile; phases nest: "
                 f"measuring holds verification and the timer's phases, the timer's sizing holds its capture, find "
                 f"holds them all; what measuring spends outside them includes releasing each candidate's graph):\n\n")
        text += common.md_table(["phase", "s"], [[k, f"{v:.2f}"] for k, v in whole["phases_s"].items()])
        text += _top_functions(whole)
    warm = whole.get("warm") if whole else None  # files written before the warm stage existed have none
    if warm:
        text += (f"\n\nThe same problems warm, in a fresh process on the database the cold run filled (select, then "
                 f"the chosen algorithm's workspace, as optimize does): {warm['wall_s']:.2f} s.\n\n")
        text += common.md_table(["phase", "s"], [[k, f"{v:.2f}"] for k, v in warm["phases_s"].items()])
        text += _top_functions(warm)
    text += f"\n\n## Host cost per call (us; a 1x1 8->8 conv on 4x4, {args.dtype} channels_last: the GPU waits)\n\n"
    text += common.md_table(["call", "us (a ratio where the row says /)"],
                            [[name, f"{us:.2f}" if " / " in name else f"{us:.1f}"] for name, us in host])
    return text


def _top_functions(part: dict, top: int = 12) -> str:
    """convtune's costliest functions of a profiled part by cumulative seconds: they show where its time went
    where a phase reads 0 (Python 3.12's cProfile can lose the exits of functions that catch exceptions)."""
    return ("\n\nconvtune's costliest functions, cumulative s (they nest):\n\n"
            + common.md_table(["function", "s"],
                              [[f"`{name}`", f"{s:.2f}"] for s, name in part["top_cumulative_s"][:top]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.network_arguments(parser, device_help="cpu: a quick check of the script itself")
    parser.add_argument("--layers", type=int, default=6, help="the first N layers, each in three directions")
    parser.add_argument("--threads", type=int, default=8, help="plan-building threads on every second problem")
    parser.add_argument("--whole", action="store_true", help="also profile a cold tuning of the whole network "
                        "(with --layers 0, nothing compiled before it in this process)")
    parser.add_argument("--compile-threads", type=int, default=None,
                        help="find_compile_threads for the whole network's cold tuning (default: the setting's)")
    common.result_arguments(parser, "tuning_cost")
    parser.add_argument("--warm-child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warm_child:
        warm_child(args)
        return
    problems = [layer.problem.with_direction(d)
                for layer in zoo.resolve(args.network, args.batch, direction="fwd", dtype=args.dtype,
                                         layout=args.layout, device=args.device)[: args.layers]
                for d in ("fwd", "bwd_data", "bwd_filter")]
    host = host_rows(args.device, args.dtype)
    rows = tuning_rows(problems, args.threads)
    whole = (whole_network(args.network, args.batch, args.dtype, args.layout, args.device, args.compile_threads)
             if args.whole else None)
    env = common.environment()
    by_threads = {t: [r for r in rows if r["build_threads"] == t] for t in sorted({r["build_threads"] for r in rows})}
    per_plan = {t: statistics.mean(r["build_s"] / max(r["plans"], 1) for r in rs) for t, rs in by_threads.items()}
    per_plan = {t: s for t, s in per_plan.items() if s}
    payload = dict(environment=env, config=vars(args), tuning=rows, host_us=host, build_s_per_plan=per_plan,
                   whole=whole)
    text = markdown(payload)
    common.write(args.name, payload, text, args.out)
    print(text)


if __name__ == "__main__":
    main()
