"""The one registry of algorithms. Built-in backends and plug-ins register through ``register``.

    >>> import convtune as ct
    >>> p = ct.ConvProblem("fwd", n=1, c=4, k=4, input_size=(8, 8), kernel_size=1)
    >>> "torch:native" in [a.name for a in ct.algorithms(p)]
    True
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Iterator

from .. import costmodel
from ..costmodel import Cost
from ..errors import CANDIDATE_FAULTS, check_type
from ..problem import ConvProblem
from ..results import backend_of
from . import cudnn_cost
from .base import Algorithm, Backend, Support

log = logging.getLogger(__name__)

# Modules whose import registers the built-in algorithms, in ranking-neutral order.
BUILTIN_MODULES = (
    "convtune.algorithms.native",
    "convtune.algorithms.gemm",
    "convtune.algorithms.direct",
    "convtune.algorithms.fft",
    "convtune.algorithms.winograd",
    "convtune.algorithms.microbatch",
    "convtune.algorithms.triton_depthwise",
    "convtune.algorithms.triton_depthwise_band",
    "convtune.algorithms.triton_depthwise_strip",
    "convtune.algorithms.triton_depthwise_rows",
    "convtune.algorithms.triton_grouped",
    "convtune.algorithms.triton_folded",
)
# Optional backends: a missing dependency (no CUDA, no cuDNN frontend) leaves them out, logged. Each with
# its names' prefix and the cost its candidates declare: where the module does not load, that still prices its
# names (another machine's measurements, judged or learned from here), as it would where it loads.
OPTIONAL_MODULES = {"convtune.algorithms.cudnn": ("cudnn", cudnn_cost.execution_plan_cost)}

_registry: dict[str, Algorithm] = {}
_backends: dict[str, Backend] = {}
_builtins_loaded = False
_builtins_lock = threading.RLock()  # other threads wait for the built-ins; the loading thread may re-enter
_builtins_ready = threading.Event()
# Prefixes of every backend registered in this process that declared splitting the batch: a stored result of
# one still splits the batch where a registry of its own (``isolated``) does not hold that backend.
_splitting_backends: set[str] = set()
_generation = 0  # bumped by every change, so caches of looked-up algorithms know when they are stale


def generation() -> int:
    """A number that changes whenever the registry's content does (register, unregister, isolated)."""
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1


def register(item: Algorithm | Backend) -> Algorithm | Backend:
    """Add an algorithm, or a backend whose algorithms depend on the problem, to the registry.

    A second item of the same name (or backend prefix) raises ``ValueError``.
    """
    if isinstance(item, Backend):
        if not item.prefix or item.prefix in _backends:
            raise ValueError(f"a backend with prefix {item.prefix!r} is already registered (or the prefix is empty)")
        _backends[item.prefix] = item
        if item.splits_batch:
            _splitting_backends.add(item.prefix)
        _changed()
        return item
    if not isinstance(item, Algorithm):
        raise TypeError(f"register() takes an Algorithm or a Backend instance, got {type(item).__name__}")
    if item.name in _registry:
        raise ValueError(f"an algorithm named {item.name!r} is already registered; pick another name")
    if item.backend in _backends:
        raise ValueError(f"the prefix {item.backend!r} of {item.name!r} belongs to a registered backend")
    _registry[item.name] = item
    _changed()
    return item


def unregister(name: str) -> None:
    """Remove a registered algorithm (plug-ins that unload; tests)."""
    _ensure_builtins()
    if name in _backends:
        del _backends[name]
    elif name in _registry:
        del _registry[name]
    else:
        raise KeyError(f"no algorithm or backend named {name!r} is registered")
    _changed()


def _ensure_builtins() -> None:
    global _builtins_loaded
    if _builtins_ready.is_set():
        return
    with _builtins_lock:
        if _builtins_loaded:  # loaded, or being loaded by this thread (a module's import asking the registry)
            return
        _builtins_loaded = True
        try:
            for module in BUILTIN_MODULES:
                importlib.import_module(module)
            for module in OPTIONAL_MODULES:
                try:
                    importlib.import_module(module)
                except ImportError as exc:
                    log.info("optional backend %s not loaded: %s", module, exc)
        finally:
            _builtins_ready.set()


def registered() -> list[Algorithm]:
    """Every registered algorithm of fixed name, in registration order (backends' candidates not included)."""
    _ensure_builtins()
    return list(_registry.values())


def backends() -> list[Backend]:
    """Every registered backend whose algorithms depend on the problem."""
    _ensure_builtins()
    return list(_backends.values())


def backend_places(problem: ConvProblem) -> dict[str, int]:
    """Each of ``problem``'s backend candidates (cuDNN's execution plans) that has a place in its backend's
    heuristic order (``Algorithm.place``): name -> place (empty where no such backend is available here)."""
    places = {}
    for backend in backends():
        try:
            places.update({a.name: a.place for a in backend.algorithms(problem) if a.place is not None})
        except CANDIDATE_FAULTS as exc:
            log.warning("backend %s lists no candidates for %s: %s: %s", backend.prefix, problem.key,
                        type(exc).__name__, exc)
    return places


def get_algorithm(name: str, problem: ConvProblem | None = None) -> Algorithm:
    """The algorithm called ``name`` (a backend's candidate needs its ``problem``); ``KeyError`` otherwise."""
    _ensure_builtins()
    if name in _registry:
        return _registry[name]
    prefix = backend_of(name)
    if prefix in _backends:
        if problem is None:
            raise KeyError(f"{name!r} belongs to the {prefix} backend: pass the problem to get_algorithm")
        return _backends[prefix].get(name, problem)
    raise KeyError(f"no algorithm named {name!r}; registered: {sorted(_registry)} and backends {sorted(_backends)}")


def declared_cost(name: str) -> Callable[[ConvProblem, int], Cost]:
    """The cost the algorithm called ``name`` declares: a registered algorithm's, else its backend's (by the
    ``backend:`` part of the name, as ``get_algorithm`` resolves names), else the generic one."""
    _ensure_builtins()
    if name in _registry:
        return _registry[name].cost
    prefix = backend_of(name)
    if prefix in _backends:
        return _backends[prefix].declared_cost(name)
    absent = {prefix: cost for prefix, cost in OPTIONAL_MODULES.values()}
    return absent.get(prefix, costmodel.generic_cost)


def splits_batch_of(name: str) -> bool:
    """Whether the algorithm called ``name`` runs the batch in parts, which only ``Policy(micro_batching=True)``
    allows: as a registered algorithm declares it, else its backend (a stored result names an algorithm that
    this process need not make)."""
    _ensure_builtins()
    if name in _registry:
        return _registry[name].splits_batch
    prefix = backend_of(name)
    backend = _backends.get(prefix)
    return backend.splits_batch if backend is not None else prefix in _splitting_backends


def algorithms(problem: ConvProblem) -> list[Algorithm]:
    """Every registered algorithm that supports ``problem`` on its device, backends' candidates included."""
    return candidates(problem)[0]


def candidates(problem: ConvProblem) -> tuple[list[Algorithm], dict[str, str]]:
    """(``algorithms(problem)``, the registered algorithms whose ``supports()`` raised on ``problem`` and the backends
    whose ``algorithms()`` did, as '<prefix>:*': name -> what it raised). ``find`` reports the second as ``failed``;
    every other question leaves them out, logged."""
    check_type(problem, ConvProblem, "algorithms()'s problem")
    found, faulty = [], {}
    for algorithm in registered():
        try:
            support = algorithm.supports(problem)
        except CANDIDATE_FAULTS as exc:  # one broken candidate must not break every question
            log.warning("%s.supports() raised %s: %s; it is left out", algorithm.name, type(exc).__name__, exc)
            faulty[algorithm.name] = f"supports() raised {type(exc).__name__}: {exc}"
            continue
        if support:
            found.append(algorithm)
    for backend in backends():
        try:
            found += backend.algorithms(problem)
        except CANDIDATE_FAULTS as exc:  # a broken plug-in backend leaves itself out, not the search
            log.warning("backend %s offers nothing for %s: algorithms() raised %s: %s", backend.prefix, problem.key,
                        type(exc).__name__, exc)
            faulty[backend.prefix + ":*"] = f"the backend's algorithms() raised {type(exc).__name__}: {exc}"
    return found, faulty


def _support(algorithm: Algorithm, problem: ConvProblem) -> Support:
    """``algorithm.supports(problem)``; an exception there (a broken plug-in) makes it unsupported, with the reason."""
    try:
        return algorithm.supports(problem)
    except CANDIDATE_FAULTS as exc:  # one broken candidate must not break every question
        log.warning("%s.supports() raised %s: %s; it is left out", algorithm.name, type(exc).__name__, exc)
        return Support(False, f"supports() raised {type(exc).__name__}: {exc}")


def unsupported_reasons(problem: ConvProblem) -> dict[str, str]:
    """For each registered algorithm (or backend) that does not support ``problem``: why not."""
    reasons = {}
    for a in registered():
        support = _support(a, problem)
        if not support:
            reasons[a.name] = support.reason
    for backend in backends():
        try:
            why = backend.unavailable(problem)
        except CANDIDATE_FAULTS as exc:  # as in algorithms()
            why = f"unavailable() raised {type(exc).__name__}: {exc}"
        if why:
            reasons[backend.prefix + ":*"] = why
    return reasons


@contextlib.contextmanager
def isolated(*extra: Algorithm, builtins: bool = True) -> Iterator[None]:
    """A registry of its own for a ``with`` block: the built-ins (or none) plus ``extra``."""
    global _registry, _backends
    _ensure_builtins()
    saved = _registry, _backends
    _registry = dict(saved[0]) if builtins else {}
    _backends = dict(saved[1]) if builtins else {}
    _changed()
    try:
        for algorithm in extra:
            register(algorithm)
        yield
    finally:
        _registry, _backends = saved
        _changed()
