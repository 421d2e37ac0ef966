"""The package's own exception types (misuse raises ValueError/TypeError instead), and the checks of an
argument: against the values it accepts, and of its type."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# What a candidate's own code (an algorithm's supports, buffers, notes, cost, run; a backend's
# algorithms) may raise that is that candidate's failure, never the search's: any Exception, and
# SystemExit (a plug-in calling sys.exit). KeyboardInterrupt and the like are the user's, and propagate.
CANDIDATE_FAULTS: tuple[type[BaseException], ...] = (Exception, SystemExit)


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of ``exc``'s message, at most ``limit`` characters ('' for none): what a refusal that names the
    fault quotes of it (PyTorch's messages run to many lines of advice)."""
    return (str(exc).splitlines() or [""])[0][:limit]


def not_one_of(name: str, value: Any, choices: Iterable[Any], where: str = "") -> ValueError:
    """The error for argument ``name`` (of the call ``where``, e.g. 'select()') given ``value``, none of
    ``choices``: it names the values accepted."""
    return ValueError(f"{where + ': ' if where else ''}{name}={value!r} is not supported; use one of {list(choices)}")


def check_one_of(name: str, value: Any, choices: Iterable[Any], where: str = "") -> None:
    """Raises ``not_one_of`` where ``value`` is not one of ``choices`` (a value that cannot be compared with them,
    an unhashable one or an array, is none of them)."""
    choices = list(choices)
    try:
        ok = any(value is c or (isinstance(value, type(c)) and value == c) for c in choices)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise not_one_of(name, value, choices, where)


def check_type(value: Any, kind: type, what: str, optional: bool = False) -> None:
    """Raises ``TypeError`` unless ``value`` is a ``kind`` (or None, where ``optional``), naming the argument
    ``what`` (e.g. "find()'s policy") and what it got."""
    if optional and value is None:
        return
    if not isinstance(value, kind):
        module = kind.__module__.split(".")[0]
        name = f"{module}.{kind.__name__}" if module == "convtune" else kind.__name__
        got = type(value).__name__
        raise TypeError(f"{what} must be a {name}{' or None' if optional else ''}, got "
                        f"{'None' if value is None else ('an ' if got[0] in 'aeiouAEIOU' else 'a ') + got}")


class ConvtuneError(Exception):
    """Base of the errors that tuning itself raises."""


class NoAlgorithmError(ConvtuneError):
    """No registered algorithm can serve the problem under the policy."""
