"""Ranking measured results under a policy: the one rule that find, select and the database share."""

from __future__ import annotations

from collections.abc import Iterable

from .algorithms.registry import splits_batch_of
from .policy import Policy
from .results import PerfResult, Status

NATIVE = "torch:native"  # PyTorch's own path: no workspace of convtune's and the least host time per call


def usable(result: PerfResult, policy: Policy, dtype: str | None = None) -> bool:
    """An ``ok`` result that the policy allows.

    dtype: the problem's, where the caller knows it. A result measured under a looser
    ``Policy.max_rel_error`` is stored ``ok`` with its error; under a policy without one it is usable
    only within the dtype's default tolerance (``verify.default_tolerance``).
    """
    if result.status is not Status.OK or result.time_ms is None:
        return False
    if not policy.micro_batching and splits_batch_of(result.algorithm):
        return False  # a stored split answers only a policy that allows splitting the batch
    if not within_error(result, policy, dtype):
        return False
    return violation_of(result, policy) is None


def violation_of(result: PerfResult, policy: Policy) -> tuple[str, str] | None:
    """(status, reason) where what ``result`` declares (workspace, determinism, TF32, reduced precision) breaks
    ``policy`` (``Policy.violation``), else None."""
    return policy.violation(workspace_bytes=result.workspace_bytes, deterministic=result.deterministic,
                            uses_tf32=result.uses_tf32, reduced_precision=result.reduced_precision)


# The statuses of candidates a find did not time because its policy refused them: a wider policy may allow them.
POLICY_EXCLUDED = (Status.OVER_WORKSPACE_LIMIT, Status.EXCLUDED_BY_POLICY)


def left_untimed(results: Iterable[PerfResult], policy: Policy) -> bool:
    """Whether a find under a tighter policy (a smaller workspace limit, determinism, no TF32, no reduced precision)
    left untimed a candidate that ``policy`` allows: the best ``policy`` can use may be that one, so the results
    cannot answer it."""
    return any(r.status in POLICY_EXCLUDED and violation_of(r, policy) is None for r in results)


def within_error(result: PerfResult, policy: Policy, dtype: str | None = None) -> bool:
    """Whether ``result``'s relative error is within ``policy.max_rel_error``; where the policy sets none, within
    the default tolerance of ``dtype`` (any result where dtype is not given: the checks held that tolerance)."""
    if policy.max_rel_error is not None:
        return result.rel_error is not None and result.rel_error <= policy.max_rel_error
    return dtype is None or result.rel_error is None or result.rel_error <= _default_bound(dtype, result)


def _default_bound(dtype: str, result: PerfResult) -> float:
    from .verify import default_tolerance  # verify needs the algorithms, which need this module

    return default_tolerance(dtype, result.uses_tf32, result.reduced_precision)


def rank(results: Iterable[PerfResult], policy: Policy, dtype: str | None = None) -> list[PerfResult]:
    """The usable results, best first.

    prefer='fastest': by time; results within ``policy.tolerance`` of the fastest remaining tie,
    and a tie goes to the smaller workspace, then to PyTorch's own path (torch:native costs the
    least host time per call, which decides host-bound eager code; a model whose layers chose it
    calls torch directly). prefer='least_memory': by workspace, then by time.
    """
    pool = _pool(results, policy, dtype)
    if policy.prefer == "least_memory":
        return sorted(pool, key=lambda r: (r.workspace_bytes, r.time_ms, r.algorithm))
    ranked = []
    while pool:
        best = _first(pool, policy.tolerance)
        ranked.append(best)
        pool.remove(best)
    return ranked


def best(results: Iterable[PerfResult], policy: Policy, dtype: str | None = None) -> PerfResult | None:
    """``rank(results, policy, dtype)[0]``, or None when nothing is usable, without ranking the rest (a database
    lookup asks this of every stored problem)."""
    pool = _pool(results, policy, dtype)
    if not pool:
        return None
    if policy.prefer == "least_memory":
        return min(pool, key=lambda r: (r.workspace_bytes, r.time_ms, r.algorithm))
    return _first(pool, policy.tolerance)


def _pool(results: Iterable[PerfResult], policy: Policy, dtype: str | None = None) -> list[PerfResult]:
    """The usable results by time (usable() keeps only timed ones)."""
    return sorted((r for r in results if usable(r, policy, dtype)),
                  key=lambda r: (r.time_ms, r.workspace_bytes, r.algorithm))


def _first(pool: list[PerfResult], tolerance: float) -> PerfResult:
    """The best of ``pool`` (sorted by time): within ``tolerance`` of the fastest, the least workspace, then
    torch:native. The window is a prefix of the pool."""
    limit = pool[0].time_ms * (1 + tolerance)  # type: ignore[operator]  # timed: see _pool
    end = 1
    while end < len(pool) and pool[end].time_ms <= limit:  # type: ignore[operator]
        end += 1
    return min(pool[:end], key=lambda r: (r.workspace_bytes, r.algorithm != NATIVE, r.time_ms, r.algorithm))


def order(results: Iterable[PerfResult], policy: Policy, dtype: str | None = None) -> list[PerfResult]:
    """All results: the usable ones ranked, then the rest (failures, policy violations) by name."""
    results = list(results)
    ranked = rank(results, policy, dtype)
    chosen = {id(r) for r in ranked}
    rest = sorted((r for r in results if id(r) not in chosen), key=lambda r: (r.status.value, r.algorithm))
    return ranked + rest
