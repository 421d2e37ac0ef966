"""plan: one algorithm per layer of a whole network, under one workspace budget.

Each problem's measured (time, workspace) Pareto front comes from the tuning database; the
planner picks one point per problem so that the total time is least while the workspace fits:

- ``shared``: the layers run one after another and share one buffer, so the largest chosen
  workspace must fit: each problem independently takes its fastest point within the budget.
- ``divided``: the layers run concurrently (streams), each with its own buffer, so the sum must
  fit: a multiple-choice knapsack, solved exactly by merging Pareto sets problem by problem.

    >>> from convtune import ConvProblem, PerfResult
    >>> p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(8, 8), kernel_size=3, padding=1)
    >>> class Stored:  # any object with results(problem), like a TuningDB
    ...     def results(self, problem):
    ...         return [PerfResult("a:fast", "ok", time_ms=1.0, workspace_bytes=4096),
    ...                 PerfResult("a:lean", "ok", time_ms=3.0, workspace_bytes=0)]
    >>> plan([p, p], "4KiB", db=Stored()).total_time_ms        # one buffer of 4 KiB serves both
    2.0
    >>> plan([p, p], "4KiB", mode="divided", db=Stored()).total_time_ms  # two buffers must fit in 4 KiB
    4.0
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np

from .db import as_db
from .errors import NoAlgorithmError, check_one_of, check_type
from .find import find
from .policy import DEFAULT_POLICY, Policy
from .problem import ConvProblem
from .ranking import left_untimed, usable
from .results import PerfResult
from .units import format_bytes, parse_bytes

log = logging.getLogger(__name__)

BUDGET_MODES = ("shared", "divided")


class InfeasibleBudgetError(ValueError):
    """No plan fits the workspace budget; ``smallest_feasible_bytes`` is the least budget that has one."""

    def __init__(self, message: str, smallest_feasible_bytes: int) -> None:
        super().__init__(message)
        self.smallest_feasible_bytes = smallest_feasible_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    """One choice per problem, and what it costs against the choices without a budget.

    problems, choices and unconstrained are parallel (a problem given twice appears twice).
    total_time_ms: the sum of the chosen times. workspace_bytes: the workspace the plan needs
    (shared: the largest choice; divided: the sum). fronts: each problem's Pareto front, the
    points the planner chose from (see ``pareto``).
    """

    problems: tuple[ConvProblem, ...]
    choices: tuple[PerfResult, ...]
    mode: str
    workspace_budget: int | None
    total_time_ms: float
    workspace_bytes: int
    unconstrained: tuple[PerfResult, ...]
    fronts: tuple[tuple[PerfResult, ...], ...] = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def unconstrained_time_ms(self) -> float:
        """Total time of each problem's fastest result, with no budget."""
        return sum(cast(float, r.time_ms) for r in self.unconstrained)  # a plan holds timed results only

    @property
    def unconstrained_workspace_bytes(self) -> int:
        """Workspace the unconstrained choices need, counted as this plan's mode counts it."""
        return _aggregate(self.mode, [r.workspace_bytes for r in self.unconstrained])

    def report(self) -> list[dict[str, Any]]:
        """One dict per problem: what was chosen, what would be without a budget, and the difference.

        Keys: problem (its key), algorithm, time_ms, workspace_bytes, unconstrained_algorithm,
        unconstrained_time_ms, unconstrained_workspace_bytes, time_lost_ms (chosen minus
        unconstrained time, >= 0) and memory_saved_bytes (unconstrained minus chosen workspace).
        """
        # A plan holds timed results only (pareto_front keeps usable ones).
        return [{"problem": p.key, "algorithm": c.algorithm, "time_ms": c.time_ms, "workspace_bytes": c.workspace_bytes,
                 "unconstrained_algorithm": u.algorithm, "unconstrained_time_ms": u.time_ms,
                 "unconstrained_workspace_bytes": u.workspace_bytes,
                 "time_lost_ms": cast(float, c.time_ms) - cast(float, u.time_ms),
                 "memory_saved_bytes": u.workspace_bytes - c.workspace_bytes}
                for p, c, u in zip(self.problems, self.choices, self.unconstrained)]

    def pareto(self, i: int) -> list[PerfResult]:
        """Problem ``i``'s (time, workspace) Pareto front, by increasing workspace (decreasing time)."""
        return list(self.fronts[i])


def pareto_front(results: Iterable[PerfResult], policy: Policy | None = None,
                 dtype: str | None = None) -> list[PerfResult]:
    """The usable ``ok`` results that no other beats in both time_ms and workspace_bytes, by workspace.

    policy (default ``Policy()``) filters what is usable, except its workspace_limit; dtype, the problem's,
    holds results to its default tolerance where the policy sets no error bound. Of results equal in both,
    the first by algorithm name stands for them.

        >>> front = pareto_front([PerfResult("a:big", "ok", time_ms=1.0, workspace_bytes=100),
        ...                       PerfResult("a:bad", "ok", time_ms=2.0, workspace_bytes=100),
        ...                       PerfResult("a:none", "ok", time_ms=5.0, workspace_bytes=0)])
        >>> [r.algorithm for r in front]
        ['a:none', 'a:big']
    """
    policy = _without_limit(policy)
    pool = sorted((r for r in results if usable(r, policy, dtype)),
                  key=lambda r: (r.workspace_bytes, r.time_ms, r.algorithm))
    front: list[PerfResult] = []
    for r in pool:
        if not front or cast(float, r.time_ms) < cast(float, front[-1].time_ms):  # usable: timed
            front.append(r)
    return front


def plan(problems: Sequence[ConvProblem], workspace_budget: int | str | None, db: Any = None,
         policy: Policy | None = None, *, mode: str = "shared", find_missing: bool = True) -> Plan:
    """The choice per problem that minimises the total time with the workspace within ``workspace_budget``.

    problems: the network's convolutions, in order; one listed twice counts twice. workspace_budget:
    bytes or a size like '64MiB'; None for no budget. db: where the measurements are (a ``TuningDB``, its path, or
    any object with ``results(problem)``; None: the default ``TuningDB()``). policy: which results are usable
    (determinism, TF32, error; its workspace_limit is ignored: the budget replaces it). mode (by name): 'shared' (one
    buffer for layers run one after another: the largest workspace must fit) or 'divided' (concurrent layers: the
    sum must fit). find_missing: run ``convtune.find`` (storing in ``db``) for a problem with no usable stored
    result, or whose stored find ran under a tighter policy that left untimed candidates ``policy`` allows (a
    workspace limit, determinism, no TF32 or no reduced precision: ``over_workspace_limit``, ``excluded_by_policy``).

    Raises ``InfeasibleBudgetError`` (a ``ValueError`` naming the smallest feasible budget) when
    no plan fits, ``NoAlgorithmError`` for a problem with no usable measurement (none stored and
    ``find_missing`` off, or none that find could measure), ``ValueError``/``TypeError`` for bad arguments.
    """
    budget, policy = _check(problems, workspace_budget, mode, policy, db)
    fronts = _fronts(problems, db, policy, find_missing)
    per_problem = [fronts[p] for p in problems]
    smallest = _aggregate(mode, [f[0].workspace_bytes for f in per_problem])
    if budget is not None and smallest > budget:
        raise InfeasibleBudgetError(_infeasible(problems, per_problem, budget, mode, smallest), smallest)
    if mode == "shared" or budget is None:  # each problem on its own: its fastest point within the budget
        picks = [_fastest_within(f, budget) for f in per_problem]
    else:
        ws, _, steps = _merge(per_problem, budget)
        picks = _backtrack(steps, len(ws) - 1)  # the largest total within budget is the fastest
    choices = tuple(f[i] for f, i in zip(per_problem, picks))
    result = Plan(problems=tuple(problems), choices=choices, mode=mode, workspace_budget=budget,
                  total_time_ms=sum(cast(float, c.time_ms) for c in choices),  # fronts hold timed results
                  workspace_bytes=_aggregate(mode, [c.workspace_bytes for c in choices]),
                  unconstrained=tuple(f[-1] for f in per_problem), fronts=tuple(tuple(f) for f in per_problem))
    log.info("plan (%s, budget %s): %d problem(s), %.4g ms (%.4g ms without a budget), workspace %s",
             mode, format_bytes(budget), len(problems), result.total_time_ms, result.unconstrained_time_ms,
             format_bytes(result.workspace_bytes))
    return result


def budget_curve(problems: Sequence[ConvProblem], budgets: Iterable[int | str], db: Any = None,
                 policy: Policy | None = None, *, mode: str = "shared",
                 find_missing: bool = True) -> list[tuple[int, float]]:
    """(budget in bytes, the best plan's total time in ms) per budget; ``math.inf`` where none fits.

    Arguments as in ``plan``; the measurements are read once for all budgets.

        >>> from convtune import ConvProblem, PerfResult
        >>> p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(8, 8), kernel_size=3, padding=1)
        >>> class Stored:
        ...     def results(self, problem):
        ...         return [PerfResult("a:fast", "ok", time_ms=1.0, workspace_bytes=64)]
        >>> budget_curve([p], [0, "64B"], db=Stored())
        [(0, inf), (64, 1.0)]
    """
    _, policy = _check(problems, None, mode, policy, db, "budget_curve()")
    sizes = [parse_bytes(b, "budget_curve(budgets=...)") for b in budgets]
    fronts = _fronts(problems, db, policy, find_missing, "budget_curve()")
    per_problem = [fronts[p] for p in problems]
    if mode == "divided":
        ws, times, _ = _merge(per_problem, None)
        totals = ws.tolist()
        curve = []
        for b in sizes:
            i = bisect.bisect_right(totals, b) - 1
            curve.append((b, float(times[i]) if i >= 0 else math.inf))
        return curve
    curve = []
    for b in sizes:
        if any(f[0].workspace_bytes > b for f in per_problem):
            curve.append((b, math.inf))
        else:  # fronts hold timed results
            curve.append((b, sum(cast(float, f[_fastest_within(f, b)].time_ms) for f in per_problem)))
    return curve


def _without_limit(policy: Policy | None) -> Policy:
    policy = DEFAULT_POLICY if policy is None else policy
    return dataclasses.replace(policy, workspace_limit=None) if policy.workspace_limit is not None else policy


def _check(problems: Any, workspace_budget: Any, mode: str, policy: Any, db: Any,
           who: str = "plan()") -> tuple[int | None, Policy]:
    """The budget in bytes and the policy (without a workspace limit) of a ``who`` call (plan or budget_curve), its
    arguments checked."""
    if isinstance(problems, (str, bytes, ConvProblem)) or not isinstance(problems, Sequence):
        raise TypeError(f"{who} takes a sequence of ConvProblems, got {type(problems).__name__}; "
                        f"wrap a single problem in a list")
    for p in problems:
        check_type(p, ConvProblem, f"each of {who}'s problems")
    check_one_of("mode", mode, BUDGET_MODES, who)
    check_type(policy, Policy, f"{who}'s policy", optional=True)
    if isinstance(db, str) and db in BUDGET_MODES:  # (the mode came third before: it would name a database file)
        raise TypeError(f"{who}'s third argument is the database, got {db!r}: give the mode by name, "
                        f"mode={db!r}")
    budget = None if workspace_budget is None else parse_bytes(workspace_budget, f"{who[:-2]}(workspace_budget=...)")
    return budget, _without_limit(policy)


def _fronts(problems: Sequence[ConvProblem], db: Any, policy: Policy,
            find_missing: bool, who: str = "plan()") -> dict[ConvProblem, list[PerfResult]]:
    """Each distinct problem's Pareto front, measuring the ones the database cannot answer (``who``: the function
    asked, for errors)."""
    db = as_db(db, who)
    if db is None:
        from .db import TuningDB

        db = TuningDB()
    fronts = {}
    for p in dict.fromkeys(problems):
        stored = db.results(p)
        front = pareto_front(stored, policy, p.dtype)
        if front and find_missing and left_untimed(stored, policy):  # (policy: without its limit, _check)
            # a find under a tighter policy left untimed what this one and the budget allow: its front would miss them
            log.info("plan: measuring %s again: a find under a tighter policy left candidates untimed", p.key)
            front = []
        if not front and not find_missing:
            raise NoAlgorithmError(f"the tuning database holds no usable measurement of {p.key} under {policy}; "
                                   f"tune it first (convtune.find(problem, db=db)) or plan with find_missing=True")
        if not front:
            log.info("plan: measuring %s, which the tuning database does not know", p.key)
            front = pareto_front(find(p, policy, db=db), policy, p.dtype)
        if not front:
            raise NoAlgorithmError(f"no algorithm could be measured for {p.key} under {policy}; relax the policy "
                                   f"(see convtune.find's results for each candidate's reason)")
        fronts[p] = front
    return fronts


def _aggregate(mode: str, workspaces: list[int]) -> int:
    if mode == "shared":
        return max(workspaces, default=0)
    return sum(workspaces)


def _fastest_within(front: list[PerfResult], budget: int | None) -> int:
    """Index of the fastest point of ``front`` (by increasing workspace, decreasing time) within ``budget``."""
    if budget is None:
        return len(front) - 1
    return bisect.bisect_right([r.workspace_bytes for r in front], budget) - 1


def _merge(fronts: list[list[PerfResult]], budget: int | None) -> tuple[np.ndarray, np.ndarray, list]:
    """The Pareto set of (total workspace, total time) over one choice per front, exactly.

    Returns the totals by increasing workspace (so decreasing time) and, per front, the parent
    state and the choice of each state, for ``_backtrack``. A state whose workspace plus the
    least the remaining fronts need exceeds ``budget`` can never fit, so it is dropped early.
    """
    rest = np.cumsum([0] + [f[0].workspace_bytes for f in reversed(fronts)])[::-1]  # rest[i]: least for fronts i..
    ws, times = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.float64)
    steps = []
    for i, front in enumerate(fronts):
        fw = np.array([r.workspace_bytes for r in front], dtype=np.int64)
        ft = np.array([r.time_ms for r in front], dtype=np.float64)
        cand_w, cand_t = (ws[:, None] + fw).ravel(), (times[:, None] + ft).ravel()
        parent, choice = np.repeat(np.arange(len(ws)), len(front)), np.tile(np.arange(len(front)), len(ws))
        if budget is not None:
            fits = cand_w + rest[i + 1] <= budget
            cand_w, cand_t, parent, choice = cand_w[fits], cand_t[fits], parent[fits], choice[fits]
        by = np.lexsort((cand_t, cand_w))  # by workspace, then time
        cand_w, cand_t, parent, choice = cand_w[by], cand_t[by], parent[by], choice[by]
        # Keep a state only if it is faster than every state of no more workspace.
        keep = np.ones(len(cand_t), dtype=bool)
        keep[1:] = cand_t[1:] < np.minimum.accumulate(cand_t)[:-1]
        ws, times = cand_w[keep], cand_t[keep]
        steps.append((parent[keep], choice[keep]))
    return ws, times, steps


def _backtrack(steps: list, state: int) -> list[int]:
    picks = []
    for parent, choice in reversed(steps):
        picks.append(int(choice[state]))
        state = int(parent[state])
    return picks[::-1]


def _infeasible(problems: Sequence[ConvProblem], fronts: list[list[PerfResult]], budget: int, mode: str,
                smallest: int) -> str:
    needs = [f[0].workspace_bytes for f in fronts]
    worst = max(range(len(needs)), key=needs.__getitem__)
    rule = ("the largest" if mode == "shared" else "the sum") + " of the layers' least workspaces"
    return (f"workspace_budget={budget} ({format_bytes(budget)}) is too small for these {len(problems)} problem(s) "
            f"in {mode!r} mode: the smallest feasible budget is {smallest} bytes ({format_bytes(smallest)}), "
            f"{rule} ({problems[worst].key} needs at least {needs[worst]} bytes, with {fronts[worst][0].algorithm}). "
            f"Raise the budget to at least {smallest}, relax the policy, or register an algorithm that needs less "
            f"workspace")
