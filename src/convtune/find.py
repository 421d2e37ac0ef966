"""find: run the candidates of a problem, check their results, time them, return a perf list.

The candidates are tried in ``get``'s order (``search_order``), each measured by ``measure.Search``: held against
the policy (a violation is a status, nothing runs), given its declared workspace, run on the shared random inputs
with its output poisoned and compared with the float64 reference (a wrong result is recorded, not timed), then
timed. Whatever goes wrong becomes a status on its result; the search goes on until the candidates, the patience
or the budget run out. Neither the ordering nor a skip learns a workspace that costs work to learn (an unbuilt cuDNN
execution plan's) unless the decision depends on it (``find``).

    >>> from convtune import ConvProblem, get_algorithm
    >>> p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(8, 8), kernel_size=3, padding=1)
    >>> results = find(p, candidates=[get_algorithm("torch:native")])
    >>> results[0].algorithm, results[0].status.value
    ('torch:native', 'ok')
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import math
import sqlite3
from collections.abc import Sequence
from typing import Any, cast

from . import background, costmodel, hardware, isolation
from .algorithms.base import Algorithm
from .algorithms.registry import candidates as registered_candidates
from .db import as_db
from .errors import CANDIDATE_FAULTS, check_type
from .get import ranked_predictions
from .measure import Search, declared_props, describe
from .microbatch_search import micro_batch_offers
from .policy import DEFAULT_POLICY, Policy
from .problem import ConvProblem
from .ranking import NATIVE, POLICY_EXCLUDED, best, order, usable, within_error
from .results import PerfResult, Status
from .search_rules import SearchPrices, SearchRules, families_first
from .settings import check_seed, settings
from .timing import Timer, benchmark
from .units import format_bytes, format_ms

log = logging.getLogger(__name__)

CONFIRM_PICKS = 3  # picks timed so, at most, where each round changes the pick


def _confirm(search: Search, results: list[PerfResult], algorithms: dict[str, Algorithm]) -> list[PerfResult]:
    """On the CPU, where the load of other processes can slow one candidate's timing and not the next one's: the
    policy's pick, where it is not PyTorch's own call, timed again against it (``Search.time_again``); again while
    the pick changes to one not timed so (``CONFIRM_PICKS`` at most). Left as measured: a search with a time budget
    or a deadline, and one where PyTorch's call is not usable or the two cannot be timed again."""
    policy, dtype = search.policy, search.problem.dtype
    if policy.budget_s is not None or policy.deadline_s is not None or search.budget.exhausted():
        return results
    timed_again: set[str] = set()
    for _ in range(CONFIRM_PICKS):
        pick = best(results, policy, dtype)
        native = next((r for r in results if r.algorithm == NATIVE and usable(r, policy, dtype)), None)
        if pick is None or native is None or pick.algorithm in (NATIVE, *timed_again):
            break
        again = search.time_again(pick, native, algorithms)
        if again is None:
            break
        timed_again.add(pick.algorithm)
        results = [again.get(r.algorithm, r) if r is pick or r is native else r for r in results]
    search.rebase(results)
    return results


def _slow_but_right(results: list[PerfResult], policy: Policy) -> list[PerfResult]:
    """Where no candidate finished within the deadline, the fastest of those right on both input sets (and within
    ``policy``'s error), as ``ok`` (its slower checked run's time): a slow answer rather than none."""
    slow = [r for r in results if r.status is Status.TIMEOUT and r.time_ms is not None and within_error(r, policy)]
    if not slow:
        return results
    best = min(slow, key=lambda r: cast(float, r.time_ms))  # slow holds timed results only
    answer = dataclasses.replace(best, status=Status.OK, message=f"timed once, over the deadline: no candidate "
                                                                 f"finished within it ({best.message})")
    return [answer if r is best else r for r in results]


def _log_result(index: int, total: int, result: PerfResult, best_ms: float) -> None:
    if result.ok:
        # (of the best this policy can use; none yet, or a fake timer's 0 ms: no share)
        share = f" ({100 * cast(float, result.time_ms) / best_ms:.0f}% of best)" if 0 < best_ms < math.inf else ""
        log.info("[%d/%d] %s: %.4g ms%s, workspace %s", index, total, result.algorithm, result.time_ms, share,
                 format_bytes(result.workspace_bytes))
    else:
        log.info("[%d/%d] %s: %s (%s), workspace %s", index, total, result.algorithm, result.status,
                 result.message, format_bytes(result.workspace_bytes))


def search_order(ranked: Sequence[Algorithm]) -> tuple[list[Algorithm], int]:
    """``get``'s ranking with the best-ranked candidate of every family (``results.family_of``: a backend, or one
    of convtune's Triton kernel families) first, and how many those are.

    The cost model ranks families against each other less surely than candidates within one
    family (and a family its measurements have not met yet no better than their typical candidate), so each
    family gets one early try (skipped like any candidate where ``get`` predicts it over the prune factor times
    the best measured, unless the learned model priced it by a guess: ``search_rules.SearchPrices``); the rest follow in
    ``get``'s order.

        >>> class A:
        ...     def __init__(self, name): self.name = name
        >>> order, head = search_order([A("cudnn:1"), A("triton:depthwise_fwd_p64"), A("cudnn:2"), A("gemm:1x1"),
        ...                             A("triton:depthwise_fwd_p32"), A("triton:depthwise_strip_fwd_t8")])
        >>> [a.name for a in order], head  # doctest: +NORMALIZE_WHITESPACE
        (['cudnn:1', 'triton:depthwise_fwd_p64', 'gemm:1x1', 'triton:depthwise_strip_fwd_t8', 'cudnn:2',
          'triton:depthwise_fwd_p32'], 4)
    """
    return families_first(ranked, lambda algorithm: algorithm.name)


def _refuse_what_cannot_fit(problem: ConvProblem) -> None:
    """``ValueError`` before anything runs where the problem's operands alone exceed its device's memory."""
    capacity = hardware.memory_bytes(problem.device)
    if capacity is not None and problem.min_bytes > capacity:
        raise ValueError(f"{problem.key}: its operands take {format_bytes(problem.min_bytes)} ({problem.min_bytes} "
                         f"bytes), more than the {format_bytes(capacity)} of memory of {problem.device}; no "
                         f"algorithm can run it there: measure a smaller batch or spatial size")


def find(problem: ConvProblem, policy: Policy | None = None, db: Any = None, *, timer: Timer = benchmark,
         candidates: Sequence[Algorithm] | None = None, seed: int | None = None) -> list[PerfResult]:
    """Run, check and time the candidates for ``problem``; a perf list, fastest usable first.

    policy: constraints (violations are not run and get their status: over_workspace_limit, or
    excluded_by_policy with the reason) and the budget (max_candidates, budget_s; else the settings
    find_max_candidates, find_budget_s; 0 = none): once spent, the rest are skipped "budget".
    db: a ``TuningDB``; every result is stored in it (a candidate not timed this time, for the
    policy or the budget, keeps the ok result the database had; one the policy refuses, any other verdict of an
    earlier search that tried it). timer: how candidates are timed (``benchmark``;
    tests pass a fake). candidates: the algorithms to try (default: every registered algorithm
    supporting the problem; given ones that do not support it come back ``unsupported``).
    seed: of the random verification inputs (default ``settings.verify_seed``).

    Candidates run in ``search_order``: the best-ranked of each family first, then ``get``'s
    order; once ``settings.find_patience`` candidates after those were no faster than the best
    (beyond ``policy.tolerance``), the search has converged and the rest are skipped, except those that one of the
    measured problems most like this one timed within ``settings.find_contender_factor`` of its best (get's learned
    model prices a candidate by its mean over those problems: one that a few of them found best can be priced
    far down the order; ``learned.LearnedModel.contenders``); a contender that gains resumes the search (the count
    starts again). A candidate that ``get`` predicts over ``settings.find_prune_factor`` times slower than the best
    measured is skipped without running (``search_rules.SearchPrices``: not a family's first try that the learned model
    prices by a guess; where a family's first timed candidate ran faster than predicted, its other prices come down
    by as much).
    Neither rule skips a candidate needing less workspace than every
    one measured so far: the time/workspace trade-off keeps its lean end for ``plan``. Where the best measured is not
    deterministic and beats every deterministic one beyond the tolerance, a candidate not known to be nondeterministic
    runs while the same rules counted over the deterministic ones alone would run it (``_for_determinism``; not
    under a budget): a later policy asking for determinism is answered with their best. A
    workspace costly to learn (a cuDNN execution plan's, by building it) is learned for the candidates
    that run, for all of them under a ``workspace_limit``, and for a skipped one only while a
    candidate can still be leaner than the leanest measured; a skipped candidate whose workspace
    was not learned shows 0 bytes and says so in its message. With ``policy.micro_batching`` and
    a ``workspace_limit``, the batch splits that ``microbatch_search.micro_batch_offers`` proposes (from
    finds on sub-batches) are tried last, verified and timed by ``timer`` like any candidate.

    Each result's status: ok (timed; one clearly slower than the best so far stops being timed
    early and says so; one beyond the policy's ``max_rel_error`` but within the default tolerance is ok, kept
    for other policies and not used by this one), out_of_memory, failed ("ExceptionType: message"),
    wrong_result (beyond the looser of the two bounds, NaN or Inf: never selected), or a policy/budget status. Returns
    ``ranking.order(results, policy)``: usable results ranked (ties within ``policy.tolerance``
    to the smaller workspace), then the rest. Raises ``TypeError`` for a bad problem, policy or
    candidate, ``ValueError`` for a candidate given twice.

        >>> from convtune import ConvProblem, get_algorithm
        >>> p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(6, 6), kernel_size=1)
        >>> [r.status.value for r in find(p, candidates=[get_algorithm("torch:native")])]
        ['ok']
    """
    check_type(problem, ConvProblem, "find()'s problem")
    problem.require_device("find()")
    check_type(policy, Policy, "find()'s policy", optional=True)
    if seed is not None:
        check_type(seed, int, "find()'s seed")
        check_seed(seed, f"find(seed={seed})")
    db = as_db(db, "find()")
    policy = DEFAULT_POLICY if policy is None else policy
    settings.check()
    _refuse_what_cannot_fit(problem)
    results: list[PerfResult] = []
    given = candidates
    if candidates is None:
        candidates, faulty = registered_candidates(problem)
        results += [PerfResult(name, Status.FAILED, message=why) for name, why in faulty.items()]
    else:
        supported = []
        for algorithm in candidates:
            if not isinstance(algorithm, Algorithm):
                raise TypeError(f"find(candidates=...) takes Algorithm instances, got {type(algorithm).__name__}")
            try:
                support = algorithm.supports(problem)
            except CANDIDATE_FAULTS as exc:  # a failing candidate is data
                results.append(PerfResult(algorithm.name, Status.FAILED, message=describe(exc)))
                continue
            if not support:
                results.append(PerfResult(algorithm.name, Status.UNSUPPORTED, message=support.reason))
            elif algorithm.splits_batch and not policy.micro_batching:
                results.append(PerfResult(algorithm.name, Status.SKIPPED, message=(
                    "micro-batched: only a policy that allows splitting the batch uses it "
                    "(Policy(micro_batching=True, workspace_limit=...))")))
            else:
                supported.append(algorithm)
        candidates = supported
    names = [a.name for a in candidates]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"find(candidates=...) names an algorithm twice: {twice}; pass each once")
    table = costmodel.corrections(db, problem.device).resolved(problem.device)
    predictions = ranked_predictions(problem, candidates, policy, db, keep_filters=False, prices=table)
    ranked, head_size = search_order([a for a, _ in predictions])
    contenders = table.contenders(problem, [(a.name, a.place) for a in ranked], settings.find_contender_factor)
    predicted = {a.name: cast(float, guess.time_ms) for a, guess in predictions}  # every one has a time
    guessed = [a.name for a in ranked[:head_size] if table.guessed(a.name, problem, a.place)]

    def new_rules() -> SearchRules:  # (each with prices of its own: a family's first timing scales its own)
        return SearchRules(SearchPrices(predicted, guessed), head_size, patience=settings.find_patience,
                           tolerance=policy.tolerance, prune_factor=settings.find_prune_factor, contenders=contenders)

    rules = new_rules()
    # the same rules counted over the deterministic candidates alone, where the policy lets the best be another
    deterministic = None if policy.deterministic else new_rules()
    search = Search(problem, policy, timer, seed)
    log.info("find %s: %d candidate(s)", problem.key, len(ranked))
    try:
        results += _search(search, ranked, rules, deterministic)
        if not any(r.ok and within_error(r, policy) for r in results):
            results = _slow_but_right(results, policy)
        if problem.device == "cpu" and timer is benchmark:  # a fake or another timer in tests and tools: as it says
            results = _confirm(search, results, {a.name: a for a in ranked})
        if policy.micro_batching:
            results += _micro_batched(problem, policy, results, search, rules, db=db, timer=timer,
                                      candidates=given, seed=seed)
    finally:
        if search.isolated:
            isolation.release()  # the worker drops this problem's inputs and reference
    if db is not None:
        kept = _keep_earlier_measurements(db, problem, results)
        try:
            db.store(problem, kept)
        except (sqlite3.Error, OSError) as exc:  # a read-only or full disk: the answer stands, unremembered
            log.warning("find: could not store the results of %s in the tuning database (%s: %s); they are used "
                        "but not remembered", problem.key, type(exc).__name__, exc)
        else:
            try:
                costmodel.stored(db, problem, kept)
            except Exception as exc:  # noqa: BLE001 - the answer stands; get keeps pricing with this problem's
                # earlier measurements in this process (the database holds the new ones for the next)
                log.warning("find: get's prices could not take in the results of %s (%s: %s)", problem.key,
                            type(exc).__name__, exc)
    return order(results, policy, problem.dtype)


class _Compiles:
    """A pool of compile threads that keeps its futures, so that the ones not started can be cancelled the way a
    waiter hears of (``Future.cancel``: the thread that takes one up marks it done)."""

    def __init__(self, threads: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="convtune-compile")
        self._futures: list[Any] = []

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        future = self._pool.submit(fn, *args, **kwargs)
        self._futures.append(future)
        return future

    def cancel_waiting(self) -> None:
        for future in self._futures:
            future.cancel()  # False for one running or done: it is waited for

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class _Ahead:
    """The next candidates' one-time work (``Algorithm.prepare``: Triton's compiles) done on
    ``settings.find_compile_threads`` threads, under Triton's ``AsyncCompileMode``, while the search measures the
    current one; a candidate's own run waits for its compile. On CUDA, where a candidate has something to prepare,
    not in the background worker (beside the user's training); entered in a copy of the caller's context
    (``contextvars``), so that the mode is the search's own and a mode of the caller's stays as it was (the search
    then has no head start). Any fault here costs only the head start: each run compiles what it lacks."""

    def __init__(self, search: Search, ranked: list[Algorithm], rules: SearchRules) -> None:
        self.search, self.ranked, self.rules = search, ranked, rules
        self.threads = settings.find_compile_threads
        self.prepared: set[int] = set()  # the places in ranked of those prepared
        self._refusals: dict[int, bool] = {}  # place in ranked -> whether the policy refuses it (``_refused``)
        self._pool: _Compiles | None = None
        self._mode: Any = None

    def _wanted(self) -> bool:
        # Triton compiles for the GPU (its interpreter compiles nothing); in the background worker the compiles
        # would take the CPUs of the user's training
        return self.search.problem.device == "cuda" and not background.in_worker()

    def __enter__(self) -> _Ahead:
        if not (self.threads and self._wanted() and any(type(a).prepare is not Algorithm.prepare for a in self.ranked)):
            return self
        try:
            import triton

            pool = _Compiles(self.threads)
            mode = triton.AsyncCompileMode(pool, ignore_errors=True)
        except Exception as exc:  # noqa: BLE001 - a Triton without it: only the head start is lost
            log.debug("find %s: no compiles ahead (%s: %s)", self.search.problem.key, type(exc).__name__, exc)
            return self
        self._pool = pool
        try:
            mode.__enter__()  # RuntimeError where the caller has one active: then no head start
        except RuntimeError as exc:
            log.debug("find %s: no compiles ahead (%s)", self.search.problem.key, exc)
            self._close()
        else:
            self._mode = mode
        return self

    def __call__(self, index: int) -> None:
        """Before ``ranked[index]`` runs: prepare, each once, the candidates from it on that would run as things
        stand, up to ``threads`` of them beyond it (not more than the budget has candidates left). Those passed over
        are looked at again at the next call while still ahead: a price over the prune factor may come down
        (``SearchPrices``), and a contender's gain resumes a converged search."""
        if self._mode is None:
            return
        budget = self.search.budget
        wanted = self.threads + 1
        if budget.max_candidates:
            wanted = min(wanted, max(budget.max_candidates - budget.timed, 0))
        for place in range(index, len(self.ranked)):
            if wanted <= 0:
                break
            algorithm = self.ranked[place]
            if self._refused(place):  # the policy's first check refuses it: it never runs
                continue
            skip = self.search._skip(self.rules.why_skipped(algorithm.name, self.search.best_ms))
            if skip is not None:
                if not skip[1]:  # the budget is spent: none of the rest runs
                    break
                continue
            wanted -= 1
            if place in self.prepared:
                continue
            self.prepared.add(place)
            try:
                algorithm.prepare(self.search.problem)
            except Exception as exc:  # noqa: BLE001 - its run compiles what it lacks, and fails there if it must
                log.debug("%s: prepare failed on %s (%s: %s)", algorithm.name, self.search.problem.key,
                          type(exc).__name__, exc)

    def _refused(self, place: int) -> bool:
        """Whether the policy refuses ``ranked[place]`` on what it declares (``measure.declared_props``, a workspace
        costly to learn counting as none), as its try will: a Triton configuration in TF32 under allow_tf32=False, say.
        Looked at once per candidate."""
        known = self._refusals.get(place)
        if known is None:
            try:
                props, _, _ = declared_props(self.ranked[place], self.search.problem, learn=False)
            except Exception:  # noqa: BLE001 - its try says what is wrong with it
                known = False
            else:
                known = self.search.policy.violation(**props) is not None
            self._refusals[place] = known
        return known

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        """The compiles not started are cancelled, the running ones waited for (Triton's mode keeps what they
        made); the mode is left and the threads end."""
        if self._pool is not None:
            self._pool.cancel_waiting()
        if self._mode is not None:
            try:
                self._mode.__exit__(None, None, None)
            except Exception as exc:  # noqa: BLE001 - ignore_errors: a compile's own fault does not reach here
                log.debug("find %s: compiles ahead ended with %s: %s", self.search.problem.key,
                          type(exc).__name__, exc)
        if self._pool is not None:
            self._pool.shutdown()
        self._pool = self._mode = None


def _search(search: Search, ranked: list[Algorithm], rules: SearchRules,
            deterministic: SearchRules | None = None) -> list[PerfResult]:
    """Each candidate of ``ranked`` tried in turn, until the search converges (``rules``: ``find``'s), the next ones'
    compiles started ahead of them (``_Ahead``). ``deterministic``: the same rules over the deterministic candidates
    alone (``_for_determinism``), or None."""
    def in_order() -> list[PerfResult]:
        with _Ahead(search, ranked, rules) as ahead:
            return _search_in_order(search, ranked, rules, ahead, deterministic)

    return contextvars.copy_context().run(in_order)


def _search_in_order(search: Search, ranked: list[Algorithm], rules: SearchRules, ahead: _Ahead,
                     deterministic: SearchRules | None) -> list[PerfResult]:
    results = []
    for index, algorithm in enumerate(ranked, 1):
        ahead(index - 1)
        best_before, deterministic_before = search.best_ms, search.best_deterministic_ms
        leanest_before = search.leanest_bytes
        ruled_out = rules.why_skipped(algorithm.name, best_before)
        # (one run only for determinism's sake leaves find's own count alone: the search goes as it would without it)
        for_determinism = ruled_out is not None and _for_determinism(search, algorithm, deterministic) is None
        result = search.try_candidate(algorithm, None if for_determinism else ruled_out)
        if for_determinism and result.ok and result.workspace_bytes < leanest_before:
            for_determinism = False  # find's own rules run one leaner than every one measured all the same; counted
        if result.ok and not for_determinism:  # (the best before and after it: of the results this policy can use)
            rules.timed(index, algorithm.name, result.time_ms, best_before_ms=best_before, best_ms=search.best_ms)
        # (a deterministic result that sets no best where there is none, being beyond the policy's error, would start
        # the count again as a first best does: it is none, and a run for determinism's sake that gives it, like one
        # not deterministic, counts as no gain; the count bounds what these runs cost where many candidates do not
        # know their determinism, cuDNN's plans, or none of them is within the policy's error)
        if (deterministic is not None and result.ok and result.deterministic
                and (math.isfinite(deterministic_before) or within_error(result, search.policy))):
            deterministic.timed(index, algorithm.name, result.time_ms, best_before_ms=deterministic_before,
                                best_ms=search.best_deterministic_ms)
        elif for_determinism and deterministic is not None:
            deterministic.no_gain(index)
        if algorithm.place is not None:  # kept with the result: get's learned model reads it
            result = dataclasses.replace(result, place=algorithm.place)
        results.append(result)
        _log_result(index, len(ranked), result, search.best_ms)
    return results


def _for_determinism(search: Search, algorithm: Algorithm, deterministic: SearchRules | None) -> str | None:
    """Why a candidate that ``find``'s rules skip is skipped for determinism's sake too, or None where it runs all the
    same: it is not known to be nondeterministic (one that does not know, a cuDNN plan, has its two runs compared),
    the best measured is not deterministic and is faster beyond the tolerance than every deterministic one, and the
    same rules counted over the deterministic candidates alone (``deterministic``) would run it. Its time is a point
    a later policy asking for determinism needs, as a leaner candidate's is for a workspace budget: without it the
    database would answer that policy with the deterministic candidates the search happened to time on its way to a
    best they do not reach."""
    if deterministic is None:
        return "the policy asks for determinism"
    if search.budget.max_candidates or search.budget.seconds:
        # (a budget bounds the policy's own search: runs for another policy's sake would spend what its later
        # candidates, and the CPU's confirming rounds, are run from)
        return "the search has a budget"
    if not search.best_ms * (1 + deterministic.tolerance) < search.best_deterministic_ms:
        return "the best measured is deterministic, or within the tolerance of a deterministic one"
    try:
        declared = algorithm.is_deterministic(search.problem)
    except CANDIDATE_FAULTS:  # its own try says what is wrong with it
        return "it cannot say whether it is deterministic"
    if declared is False:
        return "not deterministic"
    return deterministic.why_skipped(algorithm.name, search.best_deterministic_ms)


def _micro_batched(problem: ConvProblem, policy: Policy, results: list[PerfResult], search: Search,
                   rules: SearchRules, **find_kw: Any) -> list[PerfResult]:
    """The splits ``microbatch_search.micro_batch_offers`` proposes, each verified and timed like any candidate (its
    price over the prune factor times the best measured: skipped, ``rules``)."""
    def find_sub(sub: ConvProblem, sub_policy: Policy) -> list[PerfResult]:
        return find(sub, sub_policy, **find_kw)

    out = []
    for offer in micro_batch_offers(problem, policy, results, find_sub, find_kw["candidates"]):
        result = search.try_candidate(offer.algorithm, rules.pruned(offer.predicted_ms, search.best_ms))
        out.append(dataclasses.replace(result, message="; ".join(filter(None, (offer.note, result.message)))))
    return out


def _keep_earlier_measurements(db: Any, problem: ConvProblem, results: list[PerfResult]) -> list[PerfResult]:
    """``results``, where a candidate this search did not time (policy, budget) keeps its earlier ok result, and one
    its policy refused keeps an earlier search's verdict (skipped, failed, wrong_result, ...); the earlier ok results
    alone when no candidate of this search succeeded.

    The database replaces a problem's results with each find's: without this, a find under a
    narrow policy (deterministic, a small workspace limit) would erase timings that a later,
    wider policy can use.
    """
    stored = db.results(problem)
    earlier = {r.algorithm: r for r in stored if r.ok}
    if earlier and not any(r.ok for r in results):
        # Every candidate failed this time (a broken setting, a device in trouble): the good
        # measurements stored before stay, except those this find found wrong, which are recorded so.
        wrong = [r for r in results if r.status is Status.WRONG_RESULT]
        kept = [r for name, r in earlier.items() if name not in {w.algorithm for w in wrong}]
        log.warning("find: no candidate of %s succeeded; %d good result(s) stored before are kept",
                    problem.key, len(kept))
        return kept + wrong
    not_timed = (Status.SKIPPED, *POLICY_EXCLUDED)
    # A candidate this find's policy refuses that an earlier search, under a policy allowing it, passed over or saw
    # fail keeps that verdict: as excluded_by_policy it would make the earlier policy measure again
    # (ranking.left_untimed), whose find would exclude what this one timed or saw fail, and two policies asked in
    # turn would measure on every call.
    judged = {r.algorithm: r for r in stored if not r.ok and r.status not in POLICY_EXCLUDED}
    return [_earlier(earlier[r.algorithm], r) if r.status in not_timed and r.algorithm in earlier
            else judged[r.algorithm] if r.status in POLICY_EXCLUDED and r.algorithm in judged
            else r for r in results]


def _earlier(kept: PerfResult, now: PerfResult) -> PerfResult:
    """The earlier ok result ``kept`` of a candidate this find did not time (``now``), but not deterministic where
    ``now`` is not: found so by this find (two runs differed, and a policy that asks for determinism skipped it) or
    declared so; a promise an earlier find made on two runs that agreed is withdrawn."""
    return kept if now.deterministic or not kept.deterministic else dataclasses.replace(kept, deterministic=False)


def summary(results: Sequence[PerfResult]) -> str:
    """A table of ``results``, one line per candidate: status, ms, % of best, workspace, error.

        >>> print(summary([PerfResult("a:b", "ok", time_ms=2.0, workspace_bytes=2048, rel_error=1e-7)]))
        algorithm  status  time ms  % of best  workspace  rel error  message
        a:b        ok      2.000    100%       2.0 KiB    1.0e-07
    """
    times = [r.time_ms for r in results if r.ok and r.time_ms]
    best = min(times) if times else None
    rows = [("algorithm", "status", "time ms", "% of best", "workspace", "rel error", "message")]
    for r in results:
        rows.append((
            r.algorithm, r.status.value,
            format_ms(r.time_ms),
            f"{100 * r.time_ms / best:.0f}%" if r.ok and r.time_ms and best else "-",
            format_bytes(r.workspace_bytes),
            "-" if r.rel_error is None else f"{r.rel_error:.1e}",
            r.message,
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
