"""The native runtime's control plane: an executable per (problem, algorithm), known by an integer handle.

``prepare(problem, name, db)`` makes (once per process) the C++ executable that computes what the
algorithm ``name`` computes on ``problem`` and returns its handle: from the serialized form the
database keeps for it (a warm start: neither the algorithm nor cuDNN's heuristics are consulted),
else from the algorithm's ``native_recipe`` (``executable``). The ops ``torch.ops.convtune.tuned_conv``
and ``tuned_run`` (``convtune/csrc/ops.cpp``) run it. A handle is a hash of the problem, the
algorithm, the executable's kind and the device, so the same choice gets the same handle in every
process: code that torch.compile cached in one process names the right executable in the next,
once the layers are tuned there. An algorithm without a recipe (one of convtune's Python
algorithms) raises ``NotNative``; its layer runs on the Python path. ``host_overheads_us`` measures
what each path costs the host over PyTorch's own call (the host-cost rule, ``tuning``).

    >>> import convtune as ct
    >>> p = ct.ConvProblem("fwd", n=1, c=2, k=3, input_size=(5, 5), kernel_size=3, padding=1)
    >>> if available():
    ...     h = executable(p, ct.get_algorithm("torch:native", p))
    ...     x, w = p.random_inputs()
    ...     assert torch.ops.convtune.tuned_run(x, w, h).shape == (1, 3, 5, 5)
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import logging
import sqlite3
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from convtune import extension, forks
from convtune.algorithms.base import Algorithm, NoNativeRecipe
from convtune.algorithms.registry import algorithms, generation, get_algorithm
from convtune.problem import ConvProblem, empty_in_layout
from convtune.ranking import NATIVE
from convtune.settings import settings

log = logging.getLogger(__name__)

DIRECTION_INDEX = {"fwd": 0, "bwd_data": 1, "bwd_filter": 2}


class NotNative(Exception):
    """The algorithm (or this build) has no native executable for the problem; the message says why."""


class NotNativeNow(NotNative):
    """No native executable now, maybe later (a CUDA graph was being captured, memory ran out): ``prepare``
    does not remember it, and the op path's runners ask again on their next call (a layer selected meanwhile
    runs on the Python path, its directions through those runners, until it is selected again)."""


# What making an executable may raise that means "not here": no executable in this build or for this algorithm
# (NotNative), no such algorithm registered (KeyError), cuDNN or the CUDA driver refusing it (RuntimeError), a
# recipe this build cannot make (ValueError). The callers that fall back to the Python path catch these.
REFUSALS: tuple[type[Exception], ...] = (NotNative, KeyError, RuntimeError, ValueError)


def available() -> bool:
    """Whether the C++ extension is loaded (built on first call; False, warned once, when it cannot be)."""
    return extension.load() is not None


def handle_of(description: str) -> int:
    """The handle of the executable made from ``description``: a positive 63-bit hash, never 0 (0 means none)."""
    digest = int.from_bytes(hashlib.blake2b(description.encode(), digest_size=8).digest(), "little")
    return (digest >> 1) | 1


def _strides(problem: ConvProblem, shape: tuple[int, ...]) -> list[int]:
    return list(empty_in_layout(shape, problem.layout, problem.torch_dtype, "meta").stride())


def _geometry(module: Any, problem: ConvProblem, name: str) -> Any:
    shapes = [list(s) for s in problem.operand_shapes]
    return module.geometry(
        direction=DIRECTION_INDEX[problem.direction], dtype=problem.dtype, device=problem.device,
        channels_last=problem.layout == "channels_last", allow_tf32=problem.allow_tf32, groups=problem.groups,
        stride=list(cast(tuple[int, ...], problem.stride)),  # ConvProblem makes these tuples
        padding=list(cast(tuple[int, ...], problem.padding)),
        dilation=list(cast(tuple[int, ...], problem.dilation)), shapes=shapes,
        strides=[_strides(problem, s) for s in problem.operand_shapes], label=f"convtune:{problem.key} by {name}")


def _extension() -> Any:
    module = extension.load()
    if module is None:
        raise NotNative(f"convtune's C++ extension is not available ({extension.status()['error'] or 'disabled'})")
    return module


def _device_index(problem: ConvProblem, device: torch.device | None) -> int:
    """The CUDA device a cuDNN execution plan is built for (-1 on the CPU)."""
    if problem.device != "cuda":
        return -1
    return device.index if device is not None and device.index is not None else torch.cuda.current_device()


def _add(module: Any, problem: ConvProblem, name: str, kind: str, options: dict[str, Any], index: int,
         serialized: bytes = b"") -> int:
    """Make the executable (once) and return its handle: the hash of the problem, the algorithm, the kind and the
    device, the same in every process whichever way it is made (from a recipe, or from a serialized form)."""
    description = f"{problem.key}|{name}|{kind}|{index}"
    handle = handle_of(description)
    if module.has(handle):
        return handle
    geometry = _geometry(module, problem, name)
    if kind == "native":
        module.add_native(handle, description, geometry)
    elif kind in ("gemm_1x1", "gemm_1x1_strided"):
        module.add_gemm_1x1(handle, description, geometry, kind == "gemm_1x1_strided", options["buffers"])
    elif kind == "cudnn":
        if not module.with_cudnn():
            raise NotNative(f"{name}: this build of the extension has no cuDNN (its headers were not found when it "
                            f"was built); set CONVTUNE_CUDNN_HOME and run `convtune native --rebuild`")
        module.add_cudnn(handle, description, geometry, index, [list(s) for s in options["shapes"]],
                         [list(s) for s in options["strides"]], list(options["stride"]), list(options["padding"]),
                         list(options["dilation"]), options["tag"], serialized)
    elif kind == "cubin":
        if not module.with_cubin():
            raise NotNative(f"{name}: this build of the extension has no launcher of Triton's kernels (it is built "
                            f"where CUDA's and cuDNN's headers are found); set CUDA_HOME and CONVTUNE_CUDNN_HOME and "
                            f"run `convtune native --rebuild`")
        module.add_cubin(handle, description, geometry, index, options["buffers"], _cubin_launches(options))
    else:
        raise NotNative(f"{name}: no native executable of kind {kind!r} in this version")
    return handle


def _cubin_launches(options: dict[str, Any]) -> list[tuple]:
    """The recorded launches of a 'cubin' recipe (``convtune.kernels.recording.describe``) as ``add_cubin`` takes
    them: (kernel name, binary, shared memory, warps, grid, [(type, operand, integer, float) per argument])."""
    def param(p: list[Any]) -> tuple[str, str, int, float]:
        if p[0] == "tensor":
            return "tensor", p[1], int(p[2]), 0.0
        return (p[0], "", 0, float(p[1])) if p[0] == "f32" else (p[0], "", int(p[1]), 0.0)
    return [(launch["name"], base64.b64decode(launch["cubin"]), int(launch["shared"]), int(launch["warps"]),
             [int(g) for g in launch["grid"]], [param(p) for p in launch["params"]]) for launch in options["launches"]]


def executable(problem: ConvProblem, algorithm: Algorithm, device: torch.device | None = None) -> int:
    """The handle of the native executable of ``algorithm`` (a registered one) on ``problem``: ``prepare``'s.

    device: for a cuDNN execution plan, the CUDA device it is built for (None: the current one).
    Raises what ``prepare`` raises (``REFUSALS``): ``NotNative`` when the extension is not loaded, the algorithm
    has no recipe, or this build cannot make it (a cuDNN execution plan in a build without cuDNN);
    ``RuntimeError`` when cuDNN refuses to build the tuned execution plan; ``KeyError`` for an algorithm not
    registered under its name.
    """
    return prepare(problem, algorithm.name, device=device)[0]


def _recipe(problem: ConvProblem, algorithm: Algorithm) -> tuple[str, dict[str, Any]]:
    """(kind, options): everything ``_add`` needs to make ``algorithm``'s executable on ``problem``, in JSON
    types (the database keeps it, so a warm start makes the executable without the algorithm)."""
    try:
        recipe = algorithm.native_recipe(problem)
    except NoNativeRecipe as exc:
        raise (NotNativeNow if exc.transient else NotNative)(f"{algorithm.name} runs on the Python path: {exc}") \
            from None
    if recipe is None:
        raise NotNative(f"{algorithm.name} runs in Python only (it has no native executable)")
    options = dict(recipe.options)
    if recipe.kind in ("gemm_1x1", "gemm_1x1_strided", "cubin"):
        options["buffers"] = [[b.name, list(b.shape), str(b.dtype).removeprefix("torch.")]
                              for b in algorithm.buffers(problem)]
    return recipe.kind, options


_prepared: dict[tuple, tuple[int, str]] = {}  # (problem key, algorithm, device, registry generation) -> (handle, kind)
# The same key -> the recipe it was made from, and the databases that hold it (their paths): an executable made
# before a database was at hand (by find, say) is stored there when one is (a warm start needs it).
_recipes: dict[tuple, tuple[dict[str, Any], set[str]]] = {}
_refused: dict[tuple, Exception] = {}  # the same key -> why it has no executable (not tried again; cuDNN's
# refusals, which may be passing, such as an execution plan built out of memory, are tried again)
_prepared_lock = threading.Lock()
# (held while the background worker makes an executable; _host_costs_lock, below, while the host costs are measured)
forks.renew_after_fork(globals(), _prepared_lock=threading.Lock, _host_costs_lock=threading.Lock)


def prepare(problem: ConvProblem, name: str, db: Any = None, device: torch.device | None = None) -> tuple[int, str]:
    """(handle, kind) of the native executable of algorithm ``name`` on ``problem``.

    Made once per process: from the form ``db`` stored for it on this machine and software (a warm
    start: neither the algorithm, nor the registry that holds it, nor cuDNN's heuristics are
    consulted), else from the algorithm's recipe, which is then stored in ``db`` with the serialized
    form where there is one (a cuDNN execution plan). Raises one of ``REFUSALS``: ``NotNative`` (its
    subclass ``NotNativeNow`` where the refusal may pass, which is not remembered), ``KeyError`` (``name`` is not
    registered here), ``RuntimeError`` (cuDNN refused the execution plan, or the CUDA driver a Triton kernel's binary),
    ``ValueError`` (a recipe this build cannot make).
    """
    module = _extension()
    key, known = _made(problem, name, device)
    if known is not None:
        if db is not None:
            _keep(module, problem, name, db, key, known[0])
        return known
    try:
        known = _make(module, problem, name, db, device, key[2], key)
    except NotNativeNow:
        raise
    except (NotNative, KeyError) as exc:  # no executable in this build, or no such algorithm: so it stays
        with _prepared_lock:
            _refused[key] = exc
        raise
    with _prepared_lock:
        _prepared[key] = known
    return known


def _made(problem: ConvProblem, name: str, device: torch.device | None = None) -> tuple[tuple, tuple[int, str] | None]:
    """(key, (handle, kind)) of ``name``'s executable on ``problem`` where this process made it, else (key, None);
    raises the refusal this process remembers for it. The key: problem, algorithm, device, registry generation (a
    name registered again is made again)."""
    key = (problem.key, name, _device_index(problem, device), generation())
    with _prepared_lock:
        known, refused = _prepared.get(key), _refused.get(key)
    if known is None and refused is not None:
        raise refused.with_traceback(None)
    return key, known


def kind_of(problem: ConvProblem, name: str, db: Any = None) -> str:
    """The kind of executable that would run algorithm ``name`` on ``problem`` here, without making it: the one made
    in this process already, else the recipe ``db`` stored for it (a warm start consults no algorithm), else the
    algorithm's recipe. Raises what ``prepare`` raises where it has none (``REFUSALS``), and what the algorithm's
    description raises."""
    known = _made(problem, name)[1]
    if known is not None:
        return known[1]
    stored = db.executable(problem, name) if db is not None else None
    if stored is not None:
        return str(stored[0]["kind"])
    return _recipe(problem, get_algorithm(name, problem))[0]


def _make(module: Any, problem: ConvProblem, name: str, db: Any, device: torch.device | None,
          index: int, key: tuple) -> tuple[int, str]:
    stored = db.executable(problem, name) if db is not None else None
    handle = None
    if stored is not None:
        recipe, serialized = stored
        try:
            handle = _add(module, problem, name, recipe["kind"], recipe["options"], index, serialized)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # another cuDNN or GPU: rebuild below
            log.info("the stored executable of %s by %s does not load here (%s); rebuilding it", problem.key, name, exc)
        else:
            with _prepared_lock:
                _recipes[key] = (recipe, {str(db.path)})
    if handle is None:
        with torch.cuda.device(index) if problem.device == "cuda" else contextlib.nullcontext():  # Triton records there
            kind, options = _recipe(problem, get_algorithm(name, problem))
        handle = _add(module, problem, name, kind, options, index)
        with _prepared_lock:
            _recipes[key] = ({"kind": kind, "options": options}, set())
        if db is not None:
            _keep(module, problem, name, db, key, handle)
    return handle, module.kind(handle)


def _keep(module: Any, problem: ConvProblem, name: str, db: Any, key: tuple, handle: int) -> None:
    """Store what rebuilds the executable ``handle`` (made for ``key``) in ``db`` unless it holds it already:
    the recipe with the serialized form where there is one (a cuDNN execution plan)."""
    with _prepared_lock:
        recipe, kept = _recipes.get(key, (None, set()))
        if recipe is None or str(db.path) in kept:
            return
        kept.add(str(db.path))  # tried once per database, stored or not
    try:
        db.store_executable(problem, name, recipe, module.serialized(handle))
    except (sqlite3.Error, OSError, ValueError) as exc:  # unremembered: the next process builds it again
        log.warning("could not keep the executable of %s by %s in the tuning database: %s", problem.key, name, exc)


def tuned_conv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
               handles: tuple[int, int, int]) -> torch.Tensor:
    """``torch.ops.convtune.tuned_conv(x, w, bias, *handles)``: a layer's forward, differentiable."""
    return torch.ops.convtune.tuned_conv.default(x, w, bias, *handles)


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
    p = p or probe_problem(device)
    overheads: dict[str, float] = {}
    if available():
        kinds: dict[str, dict[str, str]] = {}  # executable kind -> an algorithm of that kind per direction
        for direction in DIRECTION_INDEX:
            q = p.with_direction(direction)
            for algo in algorithms(q):
                try:
                    recipe = algo.native_recipe(q)
                except NoNativeRecipe:
                    continue
                if recipe is None or direction in kinds.get(recipe.kind, {}):
                    continue
                try:
                    executable(q, algo)  # one that builds here (a cuDNN execution plan may not)
                except (NotNative, RuntimeError):
                    continue
                kinds.setdefault(recipe.kind, {})[direction] = algo.name
        native = kinds.pop("native", {}).get("fwd")
        if native:  # torch:native everywhere is PyTorch's own call, no executable: the op's forward alone
            x, w = p.random_inputs()
            run = functools.partial(tuned_conv, x, w, None, (prepare(p, native)[0], 0, 0))
            with torch.no_grad():
                forward = _probe("native", lambda: (_extra_us(run, lambda: torch.nn.functional.conv2d(x, w), device),))
            if forward is not None:
                overheads["native"] = forward[0]
        for kind, names in kinds.items():
            if len(names) == len(DIRECTION_INDEX):
                _add_layer_costs(overheads, kind, p, names, "native")
        if device == "cuda":  # convtune's Triton kernels launched from C++, on a depthwise layer
            depthwise = _depthwise_probe(p)
            cubins = {d: next((a.name for a in algorithms(depthwise.with_direction(d)) if a.host_kind == "triton"
                               and _kind_of(a, depthwise.with_direction(d)) == "cubin"), "") for d in DIRECTION_INDEX}
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
            kind == "triton" or a.native_recipe(problem.with_direction(d)) is None)), "") for d in DIRECTION_INDEX}
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
        return prepare(problem, algorithm.name)[1]
    except REFUSALS:
        return ""


def _compiled_call_us(p: ConvProblem, device: str) -> float:
    """Host microseconds that compiled code's call of convtune's op for one direction of a layer of static shape
    takes over its call of PyTorch's convolution, each as Inductor's generated code makes it: the op
    (``tuned_run``) through ``torch.ops`` (its arguments matched to the op's schema, then the dispatcher),
    PyTorch's through ``torch.convolution``'s own binding. The op runs the executable of PyTorch's convolution
    (torch:native), so the difference is the call's alone."""
    x, w = p.random_inputs()
    stride, padding, dilation = list(p.stride), list(p.padding), list(p.dilation)
    handle, _ = prepare(p, NATIVE)
    op = torch.ops.convtune.tuned_run.default
    with torch.no_grad():
        return _extra_us(lambda: op(x, w, handle),
                         lambda: torch.convolution(x, w, None, stride, padding, dilation, False, [0] * len(stride),
                                                   p.groups), device)


def _add_layer_costs(overheads: dict[str, float], kind: str, problem: ConvProblem, names: dict[str, str],
                     runtime: str) -> None:
    """Measure a layer of ``kind`` (``_layer_us``) into ``overheads``; for the Python path, less what its probe
    algorithm's runs cost the host over torch:native's on the Python path (``_algorithm_us``)."""
    measured = _probe(kind, lambda: _layer_us(problem, names, runtime))
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
        for direction in DIRECTION_INDEX:
            q = problem.with_direction(direction)
            a, b = q.random_inputs()
            mine, natives = ops.Runner(q.key, names[direction]), ops.Runner(q.key, "torch:native")
            extra.append(_extra_us(functools.partial(mine, a, b), functools.partial(natives, a, b), problem.device))
    return extra[0], extra[1], extra[2]


def _layer_us(problem: ConvProblem, names: dict[str, str], runtime: str) -> tuple[float, float] | None:
    """(forward, each gradient): host microseconds that a layer running ``names`` on ``problem`` (2-D,
    channels_last) adds over ``torch.nn.Conv2d``'s: its forward without autograd, and its forward and backward
    (autograd's call of the backward, the layout of the gradient, both gradients' runs), less that forward,
    halved. None where the layer would not run on ``runtime`` ('native' or 'python'; an executable cuDNN
    would not build here, say)."""
    from convtune.pytorch.modules import Conv2d
    from convtune.pytorch.tuning import LayerSelection, Signature

    def made(cls: Any, **extra: Any) -> torch.nn.Module:
        layer = cls(problem.c, problem.k, problem.kernel_size, padding=problem.padding, groups=problem.groups,
                    bias=False, **extra)
        return layer.to(problem.device, problem.torch_dtype).to(memory_format=torch.channels_last)

    selection = LayerSelection(problem.key, names["fwd"], names["bwd_data"], names["bwd_filter"])
    if selection.runtime != runtime:
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
