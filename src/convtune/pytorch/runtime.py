"""The native runtime's control plane: an executable per (problem, algorithm), known by an integer handle.

``prepare(problem, name, db)`` makes (once per process) the C++ executable that computes what the
algorithm ``name`` computes on ``problem`` and returns its handle: from the serialized form the
database keeps for it (a warm start: neither the algorithm nor cuDNN's heuristics are consulted),
else from the algorithm's ``native_recipe`` (``executable``). The ops ``torch.ops.convtune.tuned_conv``
and ``tuned_run`` (``convtune/csrc/ops.cpp``) run it. A handle is a hash of the problem, the
algorithm, the executable's kind and the device, so the same choice gets the same handle in every
process: code that torch.compile cached in one process names the right executable in the next,
once the layers are tuned there. An algorithm without a recipe (one of convtune's Python
algorithms) raises ``NotNative``; its layer runs on the Python path. What each path costs the host
over PyTorch's own call is measured in ``host_costs`` (the host-cost rule, ``tuning``).

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
import hashlib
import logging
import sqlite3
import threading
from typing import Any, cast

import torch

from convtune import extension, forks
from convtune.algorithms.base import Algorithm, NoNativeRecipe
from convtune.algorithms.registry import generation, get_algorithm
from convtune.problem import ConvProblem, empty_in_layout

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
_prepared_lock = threading.Lock()  # (held while the background worker makes an executable)
forks.renew_after_fork(globals(), _prepared_lock=threading.Lock)


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
