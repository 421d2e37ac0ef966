"""The host time one call of a convolution costs over PyTorch's own call, on each path a layer may take (an
executable kind of ``runtime``, the Python path, compiled code's call of the op). Measured once per machine and
software, kept in the tuning database, and read by the host-cost rule (``tuning``).
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from convtune import forks
from convtune.algorithms.base import Algorithm, NoNativeRecipe
from convtune.algorithms.registry import algorithms
from convtune.problem import ConvProblem
from convtune.pytorch import runtime
from convtune.ranking import NATIVE
from convtune.settings import settings

log = logging.getLogger(__name__)


def _extra_us(fn: Callable[[], Any], base: Callable[[], Any], device: str, calls: int = 50, rounds: int = 5) -> float:
    """Host microseconds per call that ``fn`` takes over ``base`` (on CUDA the GPU waits on the host): each called
    once first, then ``rounds`` timings of ``calls`` calls of each, in alternation with the order swapped every
    round; the median of the rounds' differences, so that host drift between the two timings, which moves both
    alike within a round, does not enter it."""
    def per_call(f: Callable[[], Any]) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            f()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - started) / calls * 1e6

    fn()
    base()
    differences = []
    for r in range(rounds):
        if r % 2:
            b, a = per_call(base), per_call(fn)
        else:
            a, b = per_call(fn), per_call(base)
        differences.append(a - b)
    return statistics.median(differences)


_host_costs: dict[str, dict[str, float]] = {}  # device type -> host_overheads_us's answer, for this process
_host_costs_lock = threading.Lock()  # one measurement at a time: two at once would slow each other
forks.renew_after_fork(globals(), _host_costs_lock=threading.Lock)

# Kept with the costs in the database: costs measured by another method are measured again (7 and before: a path
# cheaper than PyTorch's call was counted as costing nothing; 8: a layer's backward timed over 5 rounds, now 9).
HOST_COST_METHOD = 9


def host_overheads_us(device: str, db: Any = None) -> dict[str, float]:
    """Host microseconds that running one direction of a convolution on each path adds over PyTorch's own call.

    Each path is measured as a layer pays it, a layer against ``torch.nn.Conv2d``: its forward without
    autograd, and, under '<kind> backward', each gradient's half of what its backward adds (a layer that
    computes one gradient pays about that half). Keys: the executable kinds this build and device have
    ('gemm_1x1', 'gemm_1x1_strided', 'cudnn', on CUDA 'cubin' (convtune's Triton kernels launched from C++,
    on a depthwise layer); 'native', PyTorch's convolution through the op, which a layer
    only runs beside other kinds: the op's forward against ``torch.nn.functional.conv2d``); the Python path
    ('python': its modules, autograd Function and runners, without what one algorithm adds: a Python
    algorithm's own host time is in the time ``find`` measures on the CPU, and on a GPU the kernels' time
    is); and on CUDA the Python path on convtune's Triton kernels ('triton', their launcher included: it
    costs more than the kernels take on small problems); with the extension, 'compiled': what compiled code's
    call of convtune's op for one direction costs over its call of PyTorch's convolution
    (``_compiled_call_us``). A path cheaper than PyTorch's call costs less than nothing: a cuDNN execution plan's
    executable (PyTorch's call checks its arguments and looks its plan up on every call), about 4-8 us less a
    forward on the H200's host (bench/results/host_probe.md). Measured once per machine, software
    and device type, on a layer of ``probe_problem``'s size (the host sets the pace), and kept in ``db`` when one
    is given: a warm start reads it. A path whose measurement fails is left out (``extra_host_us`` then charges
    the Python path's cost).
    """
    known = _host_costs.get(device)
    if known is not None:
        return known
    with _host_costs_lock:
        known = _host_costs.get(device)  # measured by another thread meanwhile
        if known is None:
            stored = db.host_costs(device) if db is not None else None
            if stored is not None and stored.pop("method", None) == HOST_COST_METHOD:
                known = stored
            else:
                known = measure_host_overheads(device)
                if db is not None:
                    try:
                        db.store_host_costs(device, {**known, "method": HOST_COST_METHOD})
                    except (sqlite3.Error, OSError, ValueError) as exc:  # measured again by the next process
                        log.warning("could not keep the host costs in the tuning database: %s", exc)
            _host_costs[device] = known
    return known


def forget_host_costs() -> None:
    """Measure (or read) the host costs again on next use (tests)."""
    _host_costs.clear()


def measure_host_overheads(device: str) -> dict[str, float]:
    """``host_overheads_us``' measurement made now (whatever the caller's autocast, gradient mode and random
    state), neither read from nor kept anywhere."""
    with torch.autocast(device, enabled=False), torch.inference_mode(False), torch.enable_grad(), \
            torch.random.fork_rng(devices=[]):  # (the layers' initialisation draws from the CPU's generator)
        overheads = _measured(device)
    for name in ("", " backward"):
        if f"gemm_1x1{name}" in overheads:
            overheads[f"gemm_1x1_strided{name}"] = overheads[f"gemm_1x1{name}"]  # the same calls and a slice copy
    return overheads


def _probe(kind: str, measure: Callable[[], tuple[float, ...] | None]) -> tuple[float, ...] | None:
    """``measure()``, or None (logged) where it raises: a path that fails here is left out, not the tuning."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001  (any fault of a probe: an algorithm or a compiler failing here)
        log.warning("could not measure the host cost of the %s path (%s: %s); it is charged the Python path's",
                    kind, type(exc).__name__, exc)
        return None


def probe_problem(device: str) -> ConvProblem:
    """The layer the host costs are measured on. On CUDA its channels are a network's (cuBLAS and cuDNN choose
    their kernels by size; on the H200 the executables' paths cost about the same on 8 and on 256 channels,
    within the measure's noise: bench/results/host_probe.md) and its batch and image are small enough that
    every path's kernels take less time than the host's calls (the GPU waits on the host, so the time
    measured is the host's); on the CPU, where the host computes the convolution, it is tiny. The Triton
    path is measured on its depthwise version (3x3)."""
    if device == "cuda":
        return ConvProblem("fwd", n=4, c=256, k=256, input_size=(14, 14), kernel_size=1, dtype="float16",
                           layout="channels_last", device=device)
    return ConvProblem("fwd", n=1, c=8, k=8, input_size=(4, 4), kernel_size=1, layout="channels_last", device=device)


def _measured(device: str, p: ConvProblem | None = None) -> dict[str, float]:
    """``measure_host_overheads``'s measurement on the probe problem ``p`` (default ``probe_problem(device)``): each
    executable kind that builds here, then the Python path, as ``host_overheads_us`` keys them."""
    p = p or probe_problem(device)
    overheads: dict[str, float] = {}
    if runtime.available():
        kinds: dict[str, dict[str, str]] = {}  # executable kind -> an algorithm of that kind per direction
        for direction in runtime.DIRECTION_INDEX:
            q = p.with_direction(direction)
            for algo in algorithms(q):
                try:
                    recipe = algo.native_recipe(q)
                except NoNativeRecipe:
                    continue
                if recipe is None or direction in kinds.get(recipe.kind, {}):
                    continue
                try:
                    runtime.executable(q, algo)  # one that builds here (a cuDNN execution plan may not)
                except (runtime.NotNative, RuntimeError):
                    continue
                kinds.setdefault(recipe.kind, {})[direction] = algo.name
        native = kinds.pop("native", {}).get("fwd")
        if native:  # torch:native everywhere is PyTorch's own call, no executable: the op's forward alone
            x, w = p.random_inputs()
            run = functools.partial(runtime.tuned_conv, x, w, None, (runtime.prepare(p, native)[0], 0, 0))
            with torch.no_grad():
                forward = _probe("native", lambda: (_extra_us(run, lambda: torch.nn.functional.conv2d(x, w), device),))
            if forward is not None:
                overheads["native"] = forward[0]
        for kind, names in kinds.items():
            if len(names) == len(runtime.DIRECTION_INDEX):
                _add_layer_costs(overheads, kind, p, names, "native")
        if device == "cuda":  # convtune's Triton kernels launched from C++, on a depthwise layer
            depthwise = _depthwise_probe(p)
            cubins = {d: next((a.name for a in algorithms(depthwise.with_direction(d)) if a.host_kind == "triton"
                               and _kind_of(a, depthwise.with_direction(d)) == "cubin"), "")
                      for d in runtime.DIRECTION_INDEX}
            if all(cubins.values()):
                _add_layer_costs(overheads, "cubin", depthwise, cubins, "native")  # (in _probe: a fault is logged)
        compiled = _probe("compiled", lambda: (_compiled_call_us(p, device),))
        if compiled is not None:
            overheads["compiled"] = compiled[0]
    for kind, problem in (("python", p), ("triton", _depthwise_probe(p))):
        if kind == "triton" and device != "cuda":  # on the CPU Triton runs only in its interpreter
            continue  # (the Python path's costs stand in)
        # The Python path on Triton's kernels: a layer whose choice has no executable here (the native runtime
        # off for the measurement), the kernels' Python launcher included.
        names = {d: next((a.name for a in algorithms(problem.with_direction(d)) if a.host_kind == kind and (
            kind == "triton" or a.native_recipe(problem.with_direction(d)) is None)), "")
            for d in runtime.DIRECTION_INDEX}
        if all(names.values()):
            with settings.override(native=kind != "triton"):
                _add_layer_costs(overheads, kind, problem, names, "python")
    return overheads


def _depthwise_probe(p: ConvProblem) -> ConvProblem:
    """The depthwise layer of ``p``'s size on which Triton's paths are measured."""
    return p.replace(k=p.c, groups=p.c, kernel_size=3, padding=1)


def _kind_of(algorithm: Algorithm, problem: ConvProblem) -> str:
    """The executable kind that runs ``algorithm`` on ``problem`` here, '' where none builds."""
    try:
        return runtime.prepare(problem, algorithm.name)[1]
    except runtime.REFUSALS:
        return ""


def _compiled_call_us(p: ConvProblem, device: str) -> float:
    """Host microseconds that compiled code's call of convtune's op for one direction of a layer of static shape
    takes over its call of PyTorch's convolution, each as Inductor's generated code makes it: the op
    (``tuned_run``) through ``torch.ops`` (its arguments matched to the op's schema, then the dispatcher),
    PyTorch's through ``torch.convolution``'s own binding. The op runs the executable of PyTorch's convolution
    (torch:native), so the difference is the call's alone."""
    x, w = p.random_inputs()
    stride, padding, dilation = list(p.stride), list(p.padding), list(p.dilation)
    handle, _ = runtime.prepare(p, NATIVE)
    op = torch.ops.convtune.tuned_run.default
    with torch.no_grad():
        return _extra_us(lambda: op(x, w, handle),
                         lambda: torch.convolution(x, w, None, stride, padding, dilation, False, [0] * len(stride),
                                                   p.groups), device)


def _add_layer_costs(overheads: dict[str, float], kind: str, problem: ConvProblem, names: dict[str, str],
                     layer_runtime: str) -> None:
    """Measure a layer of ``kind`` (``_layer_us``) into ``overheads``; for the Python path, less what its probe
    algorithm's runs cost the host over torch:native's on the Python path (``_algorithm_us``)."""
    measured = _probe(kind, lambda: _layer_us(problem, names, layer_runtime))
    if measured is None:
        return
    forward, backward = measured
    if kind == "python":
        extra = _probe(kind, lambda: _algorithm_us(problem, names))
        if extra is None:
            return
        forward, backward = forward - extra[0], backward - (extra[1] + extra[2]) / 2
    overheads[kind], overheads[f"{kind} backward"] = forward, backward


def _algorithm_us(problem: ConvProblem, names: dict[str, str]) -> tuple[float, float, float]:
    """Per direction: host microseconds that the Python path's run of ``names`` takes over its run of
    torch:native (the same runner, so what is left is the algorithm's own calls)."""
    from convtune.pytorch import ops  # the Python path's runners

    extra = []
    with torch.no_grad():
        for direction in runtime.DIRECTION_INDEX:
            q = problem.with_direction(direction)
            a, b = q.random_inputs()
            mine, natives = ops.Runner(q.key, names[direction]), ops.Runner(q.key, "torch:native")
            extra.append(_extra_us(functools.partial(mine, a, b), functools.partial(natives, a, b), problem.device))
    return extra[0], extra[1], extra[2]


def _layer_us(problem: ConvProblem, names: dict[str, str], layer_runtime: str) -> tuple[float, float] | None:
    """(forward, each gradient): host microseconds that a layer running ``names`` on ``problem`` (2-D,
    channels_last) adds over ``torch.nn.Conv2d``'s: its forward without autograd, and its forward and backward
    (autograd's call of the backward, the layout of the gradient, both gradients' runs), less that forward,
    halved. None where the layer would not run on ``layer_runtime`` ('native' or 'python'; an executable cuDNN
    would not build here, say)."""
    from convtune.pytorch.modules import Conv2d
    from convtune.pytorch.tuning import LayerSelection, Signature

    def made(cls: Any, **extra: Any) -> torch.nn.Module:
        layer = cls(problem.c, problem.k, problem.kernel_size, padding=problem.padding, groups=problem.groups,
                    bias=False, **extra)
        return layer.to(problem.device, problem.torch_dtype).to(memory_format=torch.channels_last)

    selection = LayerSelection(problem.key, names["fwd"], names["bwd_data"], names["bwd_filter"])
    if selection.runtime != layer_runtime:
        return None
    base, layer = made(torch.nn.Conv2d), cast(Conv2d, made(Conv2d, mode="get"))
    layer.load_state_dict(base.state_dict())
    x = problem.random_inputs()[0]
    layer._convtune_select(Signature(tuple(x.shape), x.dtype, x.device, "channels_last"), selection)
    xg = x.clone().requires_grad_()
    dy = torch.ones_like(base(x))  # dense in the layout, as a network's gradients are

    def forward(m: torch.nn.Module) -> Callable[[], Any]:
        return lambda: m(x)

    def step(m: torch.nn.Module) -> Callable[[], Any]:
        return lambda: m(xg).backward(dy)

    with torch.no_grad():
        fwd = _extra_us(forward(layer), forward(base), problem.device)
    # 9 rounds: the backward's figure moves more than the forward's from round to round (an H100's cuDNN backward
    # read -14.0 once in five measurements of -2.1 to +0.6, tie_paths.md as committed in 742f573; on this project's
    # CPU the spread of 8 measurements fell from 4.8-8.8 us with 5 rounds to 2.1-3.7 with 9; on the H200 at 402d6a8,
    # with 9 rounds, it still read 0.4 to 31.7 in five measurements, bench/results/tie_paths.md)
    both = _extra_us(step(layer), step(base), problem.device, calls=20, rounds=9)
    return fwd, (both - fwd) / 2


def compiled_call_us(device: str, db: Any = None) -> float:
    """Host microseconds that compiled code pays to call convtune's op for one direction (``tuned_run``) rather
    than PyTorch's convolution (``host_overheads_us``' 'compiled'; nothing where that was not measured: no
    extension, no op)."""
    return host_overheads_us(device, db).get("compiled", 0.0)


def extra_host_us(problem: ConvProblem, kind: str, db: Any = None) -> float:
    """Host microseconds one run on ``problem`` costs over PyTorch's own call on the path of ``kind``: an
    executable kind, or an algorithm's ``host_kind`` on the Python path ('python', 'triton'; a gradient's
    direction its backward share). A kind not measured here costs the Python path's (where that was not
    measured either, the highest measured; nothing, where nothing could be)."""
    overheads = host_overheads_us(problem.device, db)
    for candidate in (kind, "python"):
        if problem.direction != "fwd" and f"{candidate} backward" in overheads:
            return overheads[f"{candidate} backward"]
        if candidate in overheads:
            return overheads[candidate]
    return max((us for kind, us in overheads.items() if kind != "compiled"), default=0.0)  # 'compiled': no path
