"""select: the one algorithm to use for a problem: the tuning database first, then find or get.

    >>> from convtune import ConvProblem
    >>> p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(8, 8), kernel_size=3, padding=1)
    >>> select(p, mode="get").status.value
    'ok'
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import background
from .algorithms.registry import algorithms, get_algorithm, unsupported_reasons
from .db import as_db
from .errors import CANDIDATE_FAULTS, NoAlgorithmError, check_one_of, check_type
from .find import find
from .get import ranked_predictions
from .policy import DEFAULT_POLICY, Policy
from .problem import ConvProblem
from .ranking import NATIVE, best, left_untimed, rank, violation_of
from .results import PerfResult, Status
from .settings import settings

SELECTION_MODES = ("get", "find", "hybrid", "db_then_get", "background")
READS_DB = ("hybrid", "db_then_get", "background")  # the modes that answer from the database first
MEASURES = ("hybrid", "find")  # the modes that measure what the database does not know


def select(problem: ConvProblem, policy: Policy | None = None, mode: str = "hybrid", db: Any = None) -> PerfResult:
    """The best algorithm for ``problem`` under ``policy``, as a ``PerfResult``.

    mode: 'get' (the cost model's first choice, nothing measured: time_ms is None and the message
    gives the predicted time; the pick is built, as a cuDNN plan must be to run), 'find' (always
    measure; stored when ``db`` is given), 'hybrid' (a database hit, else find and store),
    'db_then_get' (a database hit, else get's choice; never measures), 'background' (a database
    hit, else PyTorch's own call at once where ``policy`` allows it, get's choice where not, while a
    worker thread measures the problem with find and stores it, so that a later select reads it:
    ``convtune.background``). db: a ``TuningDB``; None
    means the default ``TuningDB()`` for the modes that read one, and no database for the others.
    Raises ``ValueError`` for an unknown mode, ``NoAlgorithmError`` (naming the problem and why
    each candidate was refused) when no algorithm can serve the problem under the policy.

        >>> from convtune import ConvProblem, Policy
        >>> p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(6, 6), kernel_size=1)
        >>> select(p, Policy(deterministic=True), mode="find").status.value
        'ok'
    """
    check_one_of("mode", mode, SELECTION_MODES, "select()")
    check_type(problem, ConvProblem, "select()'s problem")
    check_type(policy, Policy, "select()'s policy", optional=True)
    db = as_db(db, "select()")
    policy = DEFAULT_POLICY if policy is None else policy
    if mode in READS_DB:
        if db is None:
            from .db import opened

            db = opened()
        hit = stored(problem, policy, db)
        if hit is not None:
            return hit
    if mode in ("get", "db_then_get"):
        return _from_model(problem, policy, db)
    if mode == "background":
        # At once: PyTorch's own call, which asks cuDNN nothing more than PyTorch would and builds nothing (get's
        # answer to a problem new to the process asks cuDNN's heuristics, about 5 ms, and builds its pick); where the
        # policy refuses that call, get's choice, without building the cuDNN execution plans to learn workspaces
        # that only break ties here. The measurement settles the choice.
        chosen = _pytorch_at_once(problem, policy) or _from_model(problem, policy, db, learn_workspaces=False)
        if db is not None:  # where nothing would keep the measurement, nothing measures
            background.measure(problem, policy, db)
        return chosen
    return _from_measurements(problem, policy, db)


def _pytorch_at_once(problem: ConvProblem, policy: Policy) -> PerfResult | None:
    """PyTorch's own call (``torch:native``) as an answer not measured, where it supports ``problem`` and ``policy``
    allows what it declares (workspace, determinism, TF32, reduced precision), else None."""
    try:
        algorithm = get_algorithm(NATIVE, problem)
    except KeyError:  # (the registry always holds it; a process that replaced it answers from the model)
        return None
    if not algorithm.supports(problem):
        return None
    notes = algorithm.notes(problem)
    result = PerfResult(NATIVE, Status.OK, workspace_bytes=algorithm.known_workspace_bytes(problem) or 0,
                        deterministic=bool(algorithm.is_deterministic(problem)), uses_tf32=notes.tf32,
                        reduced_precision=notes.reduced_precision,
                        message="not measured: PyTorch's own call until the measurement in the background lands")
    return result if violation_of(result, policy) is None else None


def stored(problem: ConvProblem, policy: Policy, db: Any) -> PerfResult | None:
    """What the modes that read ``db`` select for ``problem`` from it alone: its best stored result that
    ``policy`` can use, or None (then they measure or predict). None too where a find under a tighter policy
    (workspace limit, determinism, TF32, reduced precision) left untimed a candidate that ``policy`` allows: its best
    may be that one."""
    if db is None:
        return None
    results = db.results(problem)  # (read once: the lookup's best and the rule both need them)
    hit = best(results, policy, problem.dtype)  # (a usable result, or None)
    return None if hit is None or left_untimed(results, policy) else hit


def _from_model(problem: ConvProblem, policy: Policy, db: Any, learn_workspaces: bool | None = None) -> PerfResult:
    """get's first place, built: the pick is built to run anyway, and one that cannot be built (a cuDNN execution plan
    cuDNN refuses) is passed over by ranking the rest again (its tie rule then settles among them); learn_workspaces
    as ``ranked_predictions`` takes it. ``NoAlgorithmError`` naming why each candidate was refused when none is left."""
    settings.check()  # before algorithms() asks each candidate, where a bad setting would be its fault
    candidates = algorithms(problem)
    unbuildable: dict[str, str] = {}
    while True:
        ranked = ranked_predictions(problem, candidates, policy, db, learn_workspaces=learn_workspaces)
        if not ranked:
            raise NoAlgorithmError(_no_algorithm(problem, policy, _refused_by_model(problem, policy, db) | unbuildable))
        algorithm, best = ranked[0]
        try:
            known = algorithm.known_workspace_bytes(problem)
            workspace = algorithm.workspace_bytes(problem) if known is None else known
            break
        except CANDIDATE_FAULTS as exc:
            unbuildable[algorithm.name] = f"cannot be built ({type(exc).__name__}: {exc})"
            candidates = [c for c in candidates if c is not algorithm]
    # Unknown determinism (None, a cuDNN execution plan never run) is no promise of determinism.
    return dataclasses.replace(best, time_ms=None, workspace_bytes=workspace, deterministic=bool(best.deterministic),
                               message=f"not measured: the cost model predicts {best.time_ms:.4g} ms")


def _refused_by_model(problem: ConvProblem, policy: Policy, db: Any) -> dict[str, str]:
    """Why each candidate is out of the cost model's ranking: unsupported, or what of the policy it breaks."""
    refused = unsupported_reasons(problem)
    for _, guess in ranked_predictions(problem, algorithms(problem), policy, db, keep_filters=False):
        violation = violation_of(guess, policy)
        refused[guess.algorithm] = violation[1] if violation else "could not describe itself (see the log)"
    return refused


def _from_measurements(problem: ConvProblem, policy: Policy, db: Any) -> PerfResult:
    results = find(problem, policy, db)
    ranked = rank(results, policy, problem.dtype)
    if ranked:
        return ranked[0]
    refused = unsupported_reasons(problem)
    for r in results:
        if r.ok:
            refused[r.algorithm] = f"relative error {r.rel_error} above Policy.max_rel_error={policy.max_rel_error}"
        else:
            refused[r.algorithm] = f"{r.status.value}: {r.message}"
    raise NoAlgorithmError(_no_algorithm(problem, policy, refused))


def _no_algorithm(problem: ConvProblem, policy: Policy, refused: dict[str, str]) -> str:
    lines = "".join(f"\n  {name}: {reason}" for name, reason in sorted(refused.items()))
    return (f"no algorithm can compute {problem.key} under {policy}; "
            f"relax the policy or register an algorithm that supports the problem. "
            f"Candidates:{lines or ' none registered'}")
