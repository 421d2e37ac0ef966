"""get: rank the algorithms for a problem from the cost model, running nothing.

    >>> from convtune import ConvProblem
    >>> p = ConvProblem("fwd", n=1, c=8, k=8, input_size=(8, 8), kernel_size=3, padding=1)
    >>> choices = get(p)
    >>> "torch:native" in [c.name for c in choices]
    True
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence
from typing import Any, cast

from . import costmodel, hardware
from .algorithms.base import Algorithm, NumericNotes
from .algorithms.registry import algorithms, backends, registered
from .db import as_db
from .errors import CANDIDATE_FAULTS, check_type
from .policy import DEFAULT_POLICY, Policy
from .problem import ConvProblem, pytorch_deterministic
from .ranking import rank
from .results import Choice, PerfResult, Status
from .settings import settings

log = logging.getLogger(__name__)

# Answers of get() kept for repeated questions (a whole network asks the same ones per step).
MEMO_SIZE = 4096
_memo: dict[tuple, list[Choice]] = {}


UNKNOWN_WORKSPACE = "workspace not known yet, counted as 0"  # the end of the message of a guess made so


def predict(problem: ConvProblem, algorithm: Algorithm, db: Any = None, *,
            learn_workspace: bool = True, prices: costmodel.Corrections | None = None) -> PerfResult:
    """The cost model's guess for ``algorithm`` on ``problem`` as an unmeasured ``PerfResult``.

    time_ms is the predicted time (for a candidate with a place in its backend's heuristic order,
    ``Algorithm.place``: times ``costmodel.order_factor`` and read by the learned model; corrected by
    ``db``'s measurements on this device when given); the properties the policy looks at (workspace,
    determinism, TF32, reduced precision) are the algorithm's own. learn_workspace=False takes the
    workspace only if it is known without costly work (``Algorithm.known_workspace_bytes``; an unbuilt
    cuDNN execution plan's is not) and counts an unknown one as 0, in the cost model and in the result, whose
    message then ends with ``UNKNOWN_WORKSPACE``.
    prices: the table to price with (default: ``db``'s, ``costmodel.corrections``). Exceptions of the algorithm's
    description methods propagate.
    """
    prices = costmodel.corrections(db, problem.device) if prices is None else prices
    described = _Described.of(problem, algorithm, learn_workspace, {})
    return described.guess(prices.price(algorithm.name, problem, described.base_ms, described.place))


@dataclasses.dataclass(frozen=True)
class _Described:
    """What ``predict`` reads of a candidate before pricing it: its workspace (``unknown``: not known, counted as 0),
    numeric notes, analytic price (``costmodel.roofline_ms`` of its cost), determinism and place."""

    algorithm: Algorithm
    workspace: int
    unknown: bool
    notes: NumericNotes
    base_ms: float
    deterministic: bool
    place: int | None  # in its backend's heuristic order (``Algorithm.place``)

    @staticmethod
    def of(problem: ConvProblem, algorithm: Algorithm, learn_workspace: bool,
           rooflines: dict[tuple[costmodel.Cost, bool], float]) -> _Described:
        """``algorithm`` on ``problem`` described; ``rooflines``: the analytic prices of costs met before on the
        same problem (a cuDNN problem's plans share one cost), added to. Exceptions of the algorithm's description
        methods propagate."""
        workspace = algorithm.workspace_bytes(problem) if learn_workspace else algorithm.known_workspace_bytes(problem)
        notes = algorithm.notes(problem)
        key = (algorithm.cost(problem, workspace or 0), bool(notes.tf32))
        base_ms = rooflines.get(key)
        if base_ms is None:
            base_ms = rooflines[key] = costmodel.roofline_ms(key[0], problem, notes.tf32)
        place = algorithm.place
        if place is not None and (isinstance(place, bool) or not isinstance(place, int)):
            raise TypeError(f"{algorithm.name}.place must be an int or None, got {place!r}")
        return _Described(algorithm, workspace or 0, workspace is None, notes, base_ms,
                          algorithm.is_deterministic(problem), place)

    def guess(self, ms: float) -> PerfResult:
        """The unmeasured result of a candidate priced at ``ms``."""
        return PerfResult(self.algorithm.name, Status.OK, time_ms=ms, workspace_bytes=self.workspace,
                          deterministic=self.deterministic, uses_tf32=self.notes.tf32,
                          reduced_precision=self.notes.reduced_precision,
                          message=f"predicted {ms:.4g} ms" + (f"; {UNKNOWN_WORKSPACE}" if self.unknown else ""))


@functools.lru_cache(maxsize=64)
def _ranking_policy(policy: Policy, keep_filters: bool) -> Policy:
    # Predictions carry no error estimate, so max_rel_error cannot judge them; without filters,
    # only the preference, the tie rule and whether split batches are candidates at all remain (find's
    # timing order; find gives a split candidate under a policy without micro-batching its own status).
    if keep_filters:
        return dataclasses.replace(policy, max_rel_error=None)
    return Policy(prefer=policy.prefer, tolerance=policy.tolerance, micro_batching=policy.micro_batching)


def ranked_predictions(problem: ConvProblem, candidates: Sequence[Algorithm], policy: Policy,
                       db: Any = None, *, keep_filters: bool = True, learn_workspaces: bool | None = None,
                       prices: costmodel.Corrections | None = None) -> list[tuple[Algorithm, PerfResult]]:
    """``candidates`` with their predictions, ranked like ``ranking.rank`` ranks measurements.

    keep_filters=True leaves out what the policy forbids (get); False keeps every candidate in
    the policy's preferred order (find times them in this order and gives violations a status).
    A candidate whose description raises is logged and ranked last (get leaves it out).

    A workspace not known without costly work (an unbuilt cuDNN execution plan's: a build takes 0.1 ms to a second)
    counts as 0 (``predict``) except where it is learned: for every candidate where the policy makes workspaces
    decide (a workspace limit, prefer='least_memory'); otherwise, with the filters kept, for the candidates the first
    place's tie rule compares (several predicted within ``policy.tolerance`` of the fastest: ``_settle_first``), so
    that the first is what learning them all would make it; without the filters (find's order), for none.
    learn_workspaces=True learns them all, False only where the policy makes them decide (a pick wanted at once,
    whose workspace is learned when it is built: select's 'background' mode).
    """
    prices = costmodel.corrections(db, problem.device) if prices is None else prices  # one table throughout,
    prices = prices.resolved(problem.device)  # with the installed model looked up once
    decides = policy.workspace_limit is not None or policy.prefer == "least_memory"
    learn_workspace = decides or bool(learn_workspaces)
    described: list[_Described] = []
    broken = []
    rooflines: dict[tuple[costmodel.Cost, bool], float] = {}
    for algorithm in candidates:
        try:
            described.append(_Described.of(problem, algorithm, learn_workspace, rooflines))
        except CANDIDATE_FAULTS as exc:  # a broken plug-in must not break the ranking
            _log_fault(algorithm, problem, exc)
            broken.append(algorithm)
    # priced together: the learned model looks the problem's neighbours up once
    times = prices.prices(problem, [(d.algorithm.name, d.base_ms, d.place) for d in described])
    by_name = {d.algorithm.name: d.algorithm for d in described}
    guesses = [d.guess(ms) for d, ms in zip(described, times)]
    ranking_policy = _ranking_policy(policy, keep_filters)
    ranked = [(by_name[g.algorithm], g) for g in rank(guesses, ranking_policy)]
    if keep_filters:
        if learn_workspace or learn_workspaces is False:
            return ranked
        return _settle_first(problem, ranked, ranking_policy, db, prices)
    return ranked + [(a, PerfResult(a.name, Status.OK, time_ms=math.inf)) for a in broken]


def _log_fault(algorithm: Algorithm, problem: ConvProblem, exc: BaseException) -> None:
    log.warning("cost model: %s could not describe %s (%s: %s)", algorithm.name, problem.key, type(exc).__name__, exc)


def _settle_first(problem: ConvProblem, ranked: list[tuple[Algorithm, PerfResult]], policy: Policy, db: Any,
                  prices: costmodel.Corrections) -> list[tuple[Algorithm, PerfResult]]:
    """``ranked`` (predicted with unknown workspaces counted as 0: ``unknown``) with the workspaces its first place
    depends on learned: those of the candidates predicted within ``policy.tolerance`` of the fastest, which the tie
    rule compares. A learned workspace may change a price (a plug-in's cost may count its workspace's traffic; a
    cuDNN plan's does not), so the ranking is made again until no tied candidate's guess counts an unknown
    workspace; each is learned once, and one whose workspace cannot be learned (a plan cuDNN refuses to build) is
    logged and left out, as a candidate whose description raises is. A fastest with none beside it whose price does
    not count its workspace (``priced_without_workspace``) is first whatever it needs, and is not built: a cuDNN plan's
    build is its first run's (``select`` builds its pick). Elsewhere a guess may still count an unknown workspace as 0
    (its price and place then are what needing none would give)."""
    learned_once: set[str] = set()  # asked once: a workspace_bytes that says nothing is not asked again
    while ranked:
        fastest = min(cast(float, g.time_ms) for _, g in ranked)
        tied = [(a, g) for a, g in ranked if cast(float, g.time_ms) <= fastest * (1 + policy.tolerance)]
        due = [a for a, g in tied if unknown(g) and a.name not in learned_once]
        if not due or len(tied) == 1 and priced_without_workspace(problem, due[0]):
            break  # a first with no tie, whose price its workspace cannot change, is first whatever it needs
        learned_once.update(a.name for a in due)
        learned_now: dict[str, PerfResult | None] = {}
        for algorithm in due:
            try:  # learn_workspace: a guess that counts no unknown workspace, so not learned again
                learned_now[algorithm.name] = predict(problem, algorithm, db, prices=prices)
            except CANDIDATE_FAULTS as exc:
                _log_fault(algorithm, problem, exc)
                learned_now[algorithm.name] = None
        by_name = {a.name: a for a, _ in ranked}
        guesses = [learned_now.get(g.algorithm, g) for _, g in ranked]
        ranked = [(by_name[g.algorithm], g) for g in rank([g for g in guesses if g is not None], policy)]
    return ranked


def priced_without_workspace(problem: ConvProblem, algorithm: Algorithm) -> bool:
    """Whether ``algorithm``'s cost on ``problem`` is the same whatever its workspace (a cuDNN plan's: cuDNN's own
    heuristics ranked it; ``costmodel.generic_cost``, a plug-in's default, counts the workspace's traffic)."""
    try:
        return algorithm.cost(problem, 0) == algorithm.cost(problem, 1 << 30)
    except CANDIDATE_FAULTS:
        return False


def unknown(guess: PerfResult) -> bool:
    """Whether ``guess`` (``predict``'s) counted a workspace not known as 0."""
    return guess.message.endswith(UNKNOWN_WORKSPACE)


def get(problem: ConvProblem, policy: Policy | None = None, db: Any = None) -> list[Choice]:
    """Rank the registered algorithms that support ``problem`` and respect ``policy``, best first.

    Runs nothing: an analytic cost model per algorithm family (see ``costmodel``), corrected by
    what ``db`` (a ``TuningDB``, optional) measured on this device. Ranked like measurements:
    by predicted time, times within ``policy.tolerance`` tie and go to the smaller workspace;
    ``prefer='least_memory'`` ranks by workspace. Algorithms that violate the policy (workspace
    limit, determinism, TF32, reduced precision) are left out; an empty list means none is left.
    A cuDNN execution plan's workspace is known only once the plan is built (0.1 ms to a second each): get
    builds the plans of a tie for the first place (the tie rule compares their workspaces), or every plan where
    the policy makes workspaces decide; a first place with no tie is not built where its price does not count its
    workspace, as a cuDNN plan's does not (whether cuDNN can build it is learned where it runs: ``select`` builds
    its pick and passes over one that cannot be built). A choice whose workspace is not known has
    ``workspace_bytes`` None, and is priced and placed as if it needed none (an answer is kept for the process: it
    stays None once built).
    Raises ``TypeError`` for a problem that is not a ``ConvProblem``.

        >>> from convtune import ConvProblem, Policy
        >>> p = ConvProblem("fwd", n=1, c=8, k=8, input_size=(8, 8), kernel_size=1)
        >>> best = get(p, Policy(deterministic=True))[0]
        >>> best.predicted_ms > 0
        True
    """
    check_type(policy, Policy, "get()'s policy", optional=True)
    db = as_db(db, "get()")
    check_type(problem, ConvProblem, "get()'s problem")
    policy = DEFAULT_POLICY if policy is None else policy
    # Everything the answer depends on: a repeated question costs a dictionary lookup. The registry's content and
    # the correction table are part of the key: one table for the whole ranking (find may store meanwhile), the
    # installed learned model looked up once, whose version names what it prices with (a new table once the db
    # gets measurements or the installed model changes); PyTorch's determinism flags change what torch:native
    # declares; so does the GPU that hardware.measured_on prices for.
    prices = costmodel.corrections(db, problem.device).resolved(problem.device)
    key = (problem, policy, tuple(registered()), tuple(backends()), prices.version,
           pytorch_deterministic(), hardware.assumed_gpu())
    choices = _memo.get(key)
    if choices is None:
        settings.check()
        ranked = ranked_predictions(problem, algorithms(problem), policy, db, prices=prices)
        choices = [Choice(g.algorithm, cast(float, g.time_ms), None if unknown(g) else g.workspace_bytes)
                   for _, g in ranked]  # rank keeps timed ones
        if len(_memo) >= MEMO_SIZE:
            _memo.clear()
        _memo[key] = choices
    return list(choices)
