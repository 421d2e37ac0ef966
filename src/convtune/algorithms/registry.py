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
from collections.abc import Iterator

from ..problem import ConvProblem
from .base import Algorithm

log = logging.getLogger(__name__)

# Modules whose import registers the built-in algorithms, in ranking-neutral order.
BUILTIN_MODULES = (
    "convtune.algorithms.native",
    "convtune.algorithms.gemm",
    "convtune.algorithms.direct",
    "convtune.algorithms.fft",
    "convtune.algorithms.winograd",
)
# Optional backends: a missing dependency (no CUDA, no cuDNN frontend) leaves them out, logged.
OPTIONAL_MODULES: tuple[str, ...] = ()

_registry: dict[str, Algorithm] = {}
_builtins_loaded = False


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to the registry; a second algorithm of the same name raises ``ValueError``."""
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"register() takes an Algorithm instance, got {type(algorithm).__name__}")
    if algorithm.name in _registry:
        raise ValueError(f"an algorithm named {algorithm.name!r} is already registered; pick another name")
    _registry[algorithm.name] = algorithm
    return algorithm


def unregister(name: str) -> None:
    """Remove a registered algorithm (plug-ins that unload; tests)."""
    _ensure_builtins()
    if name not in _registry:
        raise KeyError(f"no algorithm named {name!r} is registered")
    del _registry[name]


def _ensure_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    for module in OPTIONAL_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            log.info("optional backend %s not loaded: %s", module, exc)


def registered() -> list[Algorithm]:
    """Every registered algorithm, in registration order."""
    _ensure_builtins()
    return list(_registry.values())


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm called ``name``; ``KeyError`` listing the known names otherwise."""
    _ensure_builtins()
    try:
        return _registry[name]
    except KeyError:
        raise KeyError(f"no algorithm named {name!r}; registered: {sorted(_registry)}") from None


def algorithms(problem: ConvProblem) -> list[Algorithm]:
    """Every registered algorithm that supports ``problem`` on its device."""
    if not isinstance(problem, ConvProblem):
        raise TypeError(f"algorithms() takes a ConvProblem, got {type(problem).__name__}")
    return [a for a in registered() if a.supports(problem)]


def unsupported_reasons(problem: ConvProblem) -> dict[str, str]:
    """For each registered algorithm that does not support ``problem``: why not."""
    reasons = {}
    for a in registered():
        support = a.supports(problem)
        if not support:
            reasons[a.name] = support.reason
    return reasons


@contextlib.contextmanager
def isolated(*extra: Algorithm, builtins: bool = True) -> Iterator[None]:
    """A registry of its own for a ``with`` block: the built-ins (or none) plus ``extra``."""
    global _registry
    _ensure_builtins()
    saved = _registry
    _registry = dict(saved) if builtins else {}
    try:
        for algorithm in extra:
            register(algorithm)
        yield
    finally:
        _registry = saved
