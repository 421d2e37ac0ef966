"""find: run the candidates of a problem, check their results, time them, return a perf list.

The candidates are tried in ``get``'s order. Each one is, in turn: held against the policy
(a violation is a status, nothing runs), given its declared workspace, run once on the shared
random inputs with its output poisoned and compared with the float64 reference (a wrong
result is recorded, not timed), then timed. Whatever goes wrong becomes a status on its
result; the search goes on. Neither the ordering nor a skip learns a workspace that costs work
to learn (an unbuilt cuDNN execution plan's) unless the decision depends on it (``find``).

    >>> from convtune import ConvProblem, get_algorithm
    >>> p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(8, 8), kernel_size=3, padding=1)
    >>> results = find(p, candidates=[get_algorithm("torch:native")])
    >>> results[0].algorithm, results[0].status.value
    ('torch:native', 'ok')
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
import sqlite3
import statistics
import time
from collections.abc import Sequence
from typing import Any, TypedDict, cast

import torch

from . import background, costmodel, hardware, isolation
from .algorithms.base import Algorithm, allocate_workspace, into
from .algorithms.microbatch import micro_batch_offers
from .algorithms.registry import candidates as registered_candidates
from .db import as_db
from .errors import CANDIDATE_FAULTS, check_type
from .get import ranked_predictions
from .policy import DEFAULT_POLICY, Policy
from .problem import ConvProblem
from .ranking import NATIVE, best, order, usable, within_error
from .results import PerfResult, Status, families_first
from .settings import settings
from .timing import Timer, benchmark
from .units import format_bytes, format_ms
from .verify import allocated_while, check, errors, judge, peak_allocated_bytes, reference_case, tolerance

log = logging.getLogger(__name__)

# What a candidate may allocate while running beyond its declared workspace and a result-sized temporary
# (``_allocates_beyond``): library handles, small buffers of PyTorch's own ops.
ALLOCATION_SLACK_BYTES = 1 << 20


class _Props(TypedDict):
    """A candidate's properties, as ``Policy.violation`` takes them and ``PerfResult`` records them."""

    workspace_bytes: int
    deterministic: bool
    uses_tf32: bool
    reduced_precision: bool


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, or an allocator's RuntimeError that says it ran out of memory."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class _Budget:
    """The search's budget: candidates timed and seconds spent (0 or None: no limit)."""

    def __init__(self, policy: Policy) -> None:
        self.max_candidates = policy.max_candidates or settings.find_max_candidates or 0
        self.seconds = policy.budget_s or settings.find_budget_s or 0.0
        self.start = time.monotonic()
        self.timed = 0

    def exhausted(self) -> str | None:
        """Why no further candidate may run, or None."""
        if self.max_candidates and self.timed >= self.max_candidates:
            return f"budget: {self.max_candidates} candidate(s) already run"
        if self.seconds and time.monotonic() - self.start >= self.seconds:
            return f"budget: {self.seconds:g} s spent"
        return None

    def timer_budget_s(self) -> float:
        """Seconds one candidate's timing may take: the timer's default, capped by what is left."""
        if not self.seconds:
            return settings.timing_budget_s
        left = self.seconds - (time.monotonic() - self.start)
        return max(0.0, min(settings.timing_budget_s, left))


class _Search:
    """One find: the inputs and reference shared by all candidates, the best time so far."""

    def __init__(self, problem: ConvProblem, policy: Policy, timer: Timer, seed: int | None) -> None:
        self.problem, self.policy, self.timer, self.seed = problem, policy, timer, seed
        self.budget = _Budget(policy)
        self.best_ms = math.inf
        self.leanest_bytes = math.inf  # the smallest workspace of a measured ok candidate
        # Two input sets and their references, shared by all candidates, each with pristine copies.
        self._cases: list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]] = []
        self._pristine: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.isolated = False  # a candidate was measured in the worker process (isolation.py)

    def case(self, index: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Input set ``index`` (0: the one timed; 1: a second one, fresh, that only a check sees)."""
        # Built on first need: a search where nothing runs computes no reference.
        while len(self._cases) <= index:
            seed = (settings.verify_seed if self.seed is None else self.seed) + len(self._cases)
            case = reference_case(self.problem, seed)
            self._cases.append(case)
            self._pristine.append((case[0][0].clone(), case[0][1].clone()))
        return self._cases[index]

    def restore_inputs(self) -> bool:
        """Put the shared inputs back if a candidate wrote into them; True if it had."""
        wrote = False
        for ((a, b), _), (a0, b0) in zip(self._cases, self._pristine):
            if not (torch.equal(a, a0) and torch.equal(b, b0)):
                a.copy_(a0)
                b.copy_(b0)
                wrote = True
        return wrote

    def try_candidate(self, algorithm: Algorithm, predicted_ms: float = math.inf,
                      converged: bool = False) -> PerfResult:
        """The result of one candidate; nothing it raises escapes.

        predicted_ms: get's guess; far above the best measured, the candidate is not run.
        converged: the search has stopped finding faster candidates. Either way, a candidate that
        needs less workspace than every one measured so far still runs: it is a new point of the
        time/workspace trade-off that a workspace budget (``plan``) may need.

        A workspace that is costly to learn (``known_workspace_bytes`` is None: an unbuilt cuDNN
        plan) is learned only where it decides: against the policy's workspace limit, for a run,
        or to see whether a candidate to be skipped is leaner than every one measured (not when
        the leanest measured needs none). A candidate skipped without it shows 0 bytes, and its
        message says the workspace was not learned.
        """
        problem = self.problem
        skip = self._skip(predicted_ms, converged)
        try:
            notes = algorithm.notes(problem)
            declared = algorithm.is_deterministic(problem)
            workspace_bytes = algorithm.known_workspace_bytes(problem)
            if workspace_bytes is None and self._workspace_decides(skip):
                workspace_bytes = algorithm.workspace_bytes(problem)
        except CANDIDATE_FAULTS as exc:  # a failing candidate is data
            return PerfResult(algorithm.name, Status.FAILED, message=_describe(exc))
        learned = workspace_bytes is not None
        # None: the algorithm does not know (cuDNN execution plans); two runs compared bit for bit decide.
        props: _Props = dict(workspace_bytes=cast(int, workspace_bytes) if learned else 0,
                             deterministic=declared is None or bool(declared),
                             uses_tf32=notes.tf32, reduced_precision=notes.reduced_precision)
        violation = self.policy.violation(**props)
        if violation is not None:
            return PerfResult(algorithm.name, violation[0], message=violation[1], **props)
        if skip is not None:
            message, leaner_runs = skip
            if not (leaner_runs and learned and cast(int, workspace_bytes) < self.leanest_bytes):
                if not learned:
                    message += "; workspace not learned (shown as 0)"
                return PerfResult(algorithm.name, Status.SKIPPED, message=message, **props)
        self.budget.timed += 1
        if isolation.wanted(algorithm, self.timer):
            deadline_s = self.policy.deadline_s or settings.candidate_deadline_s or math.inf
            try:
                result = isolation.measure(problem, self.policy, self.timer, self.seed, algorithm, dict(props),
                                           declared is None, self.best_ms, self.budget.timer_budget_s(), deadline_s)
            except isolation.NotSendable as exc:
                log.info("%s is measured in the process: it cannot go to a worker (%s)", algorithm.name, exc)
            else:
                self.isolated = True
                if result.ok:
                    self._record(result)
                return result
        if not isolation.in_worker() and not isolation.vouched_for(algorithm):
            if self._must_fit() and problem.device != "cuda":
                # It could not go to the worker, and on the CPU what it allocates beyond its declaration is not
                # checked here: a workspace limit cannot hold it. (isolate='off' trusts plug-ins; on CUDA the
                # allocator's statistics are read after its checks, _allocation_here.)
                return PerfResult(algorithm.name, Status.SKIPPED, **props, message=(
                    f"a plug-in measured in this process, where what it allocates beyond its declared workspace is "
                    f"not checked on the CPU, so a workspace limit cannot hold it: {self._why_here(algorithm)}; or "
                    f"set CONVTUNE_ISOLATE=off to trust plug-ins"))
            if problem.device != "cuda":
                _warn_unchecked(algorithm)
        return self.measure_here(algorithm, props, declared is None, self.budget.timer_budget_s())

    def _must_fit(self) -> bool:
        """Whether a plug-in measured in this process must be shown to keep to its declared workspace: under a
        workspace limit, unless isolate='off' trusts plug-ins."""
        return self.policy.workspace_limit is not None and settings.isolate != "off"

    def _why_here(self, algorithm: Algorithm) -> str:
        """Why a plug-in that must keep to its declaration (``_must_fit``) is measured in this process."""
        return ("it cannot go to a worker process (a class defined in __main__, say: define it in an importable "
                "module)" if not isolation.sendable(algorithm) else
                "its timer cannot go to a worker process (give find a timer that pickles)")

    def _allocation_here(self, algorithm: Algorithm, run: Any) -> tuple[Status | None, str]:
        """In this process on CUDA, a plug-in's allocations by the caching allocator's statistics, left as they were
        (``verify.allocated_while``): (None, '') where it keeps to its declaration, or that cannot be told and it
        need not show it; (FAILED, why) where it allocates more; (SKIPPED, why) where it must show it and that
        cannot be told. Its first run is read exactly where it takes the process past its earlier peak; one that
        allocates more there runs again, and passes if the second run keeps to it (what a first call sets up
        once, an autotuner's buffers, say). In the background worker, beside the caller's own work, nothing is
        read (the device is never synchronized there, and the caller's allocations would count)."""
        allowed = _allowed_bytes(algorithm, self.problem)
        if background.in_worker():
            cause = "beside the caller's work, in the background"
        else:
            used, exact = allocated_while(run)
            if used <= allowed or allocated_while(run)[0] <= allowed:
                return None, ""
            if exact:
                return Status.FAILED, _overdrawn(algorithm, self.problem, used)
            cause = (f"it stayed under the process's earlier peak of memory, which convtune does not reset: up to "
                     f"{format_bytes(used)}, allowed {format_bytes(allowed)}")
        why = f"what it allocates beyond its declared workspace could not be told in this process ({cause})"
        if self._must_fit():
            return Status.SKIPPED, (f"a plug-in measured in this process under a workspace limit: {why}; "
                                    f"{self._why_here(algorithm)}; or set CONVTUNE_ISOLATE=off to trust plug-ins")
        log.info("%s: %s", algorithm.name, why)
        return None, ""

    def measure_here(self, algorithm: Algorithm, props: _Props, probe_determinism: bool,
                     timer_budget_s: float | None) -> PerfResult:
        """Check and time ``algorithm`` in this process; an exception it raises (SystemExit too) is its status."""
        problem = self.problem
        self.case(1)  # outside the candidate's try: a reference that cannot be computed is not its fault
        try:
            return self._measure(algorithm, props, probe_determinism, timer_budget_s)
        except CANDIDATE_FAULTS as exc:  # a failing candidate is data
            log.debug("%s failed on %s", algorithm.name, problem.key, exc_info=exc)
            status = Status.OUT_OF_MEMORY if is_out_of_memory(exc) else Status.FAILED
            if status is Status.OUT_OF_MEMORY and problem.device == "cuda" and not background.in_worker():
                torch.cuda.empty_cache()  # (not under the caller's running step: the background worker)
            with contextlib.suppress(Exception):  # it may have scribbled on the inputs before failing
                self.restore_inputs()
            return PerfResult(algorithm.name, status, message=_describe(exc), **props)

    def _skip(self, predicted_ms: float, converged: bool) -> tuple[str, bool] | None:
        """Why the next candidate need not run, and whether a leaner one runs all the same; None: it runs."""
        exhausted = self.budget.exhausted()
        if exhausted:
            return exhausted, False
        if converged:
            return (f"search converged: {settings.find_patience} candidates in a row were no faster "
                    f"than the best"), True
        prune = settings.find_prune_factor
        if (prune and math.isfinite(self.best_ms) and math.isfinite(predicted_ms)
                and predicted_ms > prune * self.best_ms):
            return f"predicted {predicted_ms:.4g} ms, over {prune:g}x the best measured ({self.best_ms:.4g} ms)", True
        return None

    def _workspace_decides(self, skip: tuple[str, bool] | None) -> bool:
        """Whether a candidate's workspace changes what happens to it, given why it would be skipped."""
        if self.policy.workspace_limit is not None or skip is None:
            return True  # held against the limit, or it runs
        _, leaner_runs = skip
        return leaner_runs and self.leanest_bytes > 0  # nothing is leaner than no workspace

    def _measure(self, algorithm: Algorithm, props: _Props, probe_determinism: bool,
                 timer_budget_s: float | None) -> PerfResult:
        problem = self.problem
        if probe_determinism:  # no promise until two runs compare equal (a result cut short by the deadline has none)
            props = cast(_Props, dict(props, deterministic=False))
        inputs, ref = self.case()
        workspace = allocate_workspace(algorithm.buffer_bytes(problem), problem.device)
        out = problem.empty(problem.operand_shapes[2])
        # The deadline is held after every stage that runs the candidate (the two checks, the determinism
        # probe; the timing's budget ends at it): in this process a call cannot be stopped, only a worker's can.
        deadline_s = self.policy.deadline_s or settings.candidate_deadline_s
        started = time.perf_counter()
        if problem.device == "cuda" and not isolation.vouched_for(algorithm) and not isolation.in_worker():
            # A plug-in in this process: what its first runs allocate, before they have raised the process's
            # peak of memory (_allocation_here); its output a spare, allocated before the runs.
            spare = problem.empty(problem.operand_shapes[2])
            status, why = self._allocation_here(
                algorithm, lambda: algorithm.run(problem, *inputs, workspace=workspace, out=spare))
            if self.restore_inputs():
                status, why = Status.FAILED, WROTE_INPUTS
            if status is not None:
                return PerfResult(algorithm.name, status, **props, message=why)
        # Checked against the looser of the policy's bound and the default one: a result the policy finds too
        # inexact is still right, and stored ok with its error for other policies (ranking.usable holds each
        # policy's bound), rather than recorded wrong in place of a measurement a later policy could use.
        bound = tolerance(problem, algorithm.notes(problem))
        if self.policy.max_rel_error is not None:
            bound = max(bound, self.policy.max_rel_error)
        first = time.perf_counter()
        err, ok, message = check(algorithm, problem, inputs, ref, out, workspace, max_rel_error=bound)
        runs_s = [time.perf_counter() - first]
        if self.restore_inputs():  # after each stage: a candidate that writes into its inputs later fails too
            return _failed(algorithm, props, err, WROTE_INPUTS)
        if not ok:
            return PerfResult(algorithm.name, Status.WRONG_RESULT, rel_error=err, message=message, **props)
        # A second input set it has not seen, its output poisoned with a finite value this time: a
        # candidate that memoises, or behaves only when it sees NaN in its output, fails here. (A candidate
        # already over the deadline is checked so too: a timeout may answer where nothing finishes in time.)
        inputs2, ref2 = self.case(1)
        second = time.perf_counter()
        err2, ok, message = check(algorithm, problem, inputs2, ref2, problem.empty(problem.operand_shapes[2]),
                                  workspace, max_rel_error=bound, poison=_finite_poison(problem))
        runs_s.append(time.perf_counter() - second)
        if self.restore_inputs():
            return _failed(algorithm, props, err, WROTE_INPUTS)
        if not ok:
            return PerfResult(algorithm.name, Status.WRONG_RESULT, rel_error=err2, **props,
                              message=f"on a second input set: {message}")
        if deadline_s and time.perf_counter() - started > deadline_s:
            return _over_deadline(algorithm, props, err, runs_s, deadline_s)
        if isolation.in_worker() and not isolation.vouched_for(algorithm):  # see _allocates_beyond
            spare = problem.empty(problem.operand_shapes[2])  # allocated before the measured run, not in it
            overdrawn = _allocates_beyond(algorithm, problem,
                                          lambda: algorithm.run(problem, *inputs2, workspace=workspace, out=spare))
            if self.restore_inputs():
                return _failed(algorithm, props, err, WROTE_INPUTS)
            if overdrawn:
                return _failed(algorithm, props, err, overdrawn)
        if probe_determinism:
            again = algorithm.run(problem, *inputs, workspace=workspace, out=problem.empty(problem.operand_shapes[2]))
            props["deterministic"] = bool(torch.equal(out, again))
            if self.policy.deterministic and not props["deterministic"]:
                return PerfResult(algorithm.name, Status.SKIPPED, rel_error=err, **props,
                                  message="not deterministic (two runs differ bit for bit), and the policy "
                                          "asks for determinism")
        if deadline_s:
            left_s = deadline_s - (time.perf_counter() - started)
            if left_s <= 0:
                return _over_deadline(algorithm, props, err, runs_s, deadline_s)
            # (None: the timer's own budget, settings.timing_budget_s for convtune's: kept where it ends first)
            base_s = settings.timing_budget_s if timer_budget_s is None else timer_budget_s
            timer_budget_s = timer_budget_s if base_s <= left_s else left_s
        # The timed calls start from an output that holds a convolution's answer, but another input
        # set's: no poison to see, and a candidate that computes only when it sees one (or not at all
        # on repeated calls) leaves that wrong answer behind, which the check after timing fails.
        out.copy_(ref2)
        stop_above = self.best_ms * settings.early_stop_factor if math.isfinite(self.best_ms) else None
        # Timed as a tuned layer runs it (Algorithm.launcher); the last call's result is what is checked.
        launch, result = algorithm.launcher(problem, *inputs, out, workspace), out

        def timed() -> torch.Tensor:
            nonlocal result
            result = launch()
            return result

        timing = self.timer(timed, device=problem.device, budget_s=timer_budget_s, stop_above_ms=stop_above)
        into(problem, result, out)
        wrote = self.restore_inputs()
        if wrote:
            return _failed(algorithm, props, err, WROTE_INPUTS)
        timed_err, timed_worst = errors(out, ref)  # what the timed calls left in the output: the same answer
        ok, message = judge(timed_err, timed_worst, bound)
        if not ok:
            return PerfResult(algorithm.name, Status.WRONG_RESULT, rel_error=timed_err, **props,
                              message=f"the timed calls' result differs from the reference: {message}")
        err = max(err, err2, timed_err)  # its error: the largest of its checked results
        if timing.stopped_early:
            message = (f"timing stopped early: over {settings.early_stop_factor:g}x the best so far "
                       f"({self.best_ms:.4g} ms)")
        else:
            message = ""  # the error has its own field; an ok result's message is for what is unusual
        measured = PerfResult(algorithm.name, Status.OK, time_ms=timing.median_ms, spread_ms=timing.spread_ms,
                              rel_error=err, message=message, **props)
        if not within_error(measured, self.policy):
            measured = dataclasses.replace(measured, message=(
                f"relative error {err:.3g} above Policy.max_rel_error={self.policy.max_rel_error:g}: kept for other "
                f"policies; {message}").rstrip("; "))
        self._record(measured)
        return measured

    def time_again(self, pick: PerfResult, native: PerfResult,
                   algorithms: dict[str, Algorithm]) -> dict[str, PerfResult] | None:
        """``pick`` and ``native`` timed again in ``CONFIRM_ROUNDS`` alternating rounds, each then known by the median
        of its rounds (``_confirm``); None where they are not: either measured in a worker, calls so slow that the
        rounds would take over ``CONFIRM_LIMIT_S``, or one that fails now (logged)."""
        pair = [pick, native]
        if 2 * CONFIRM_ROUNDS * sum(cast(float, r.time_ms) for r in pair) > 1e3 * CONFIRM_LIMIT_S:
            return None  # slow calls: a sample spans many of the CPU's time slices, and the rounds would cost much
        chosen = [algorithms.get(r.algorithm) for r in pair]
        if any(a is None or isolation.wanted(a, self.timer) for a in chosen):
            return None
        problem, (inputs, _) = self.problem, self.case()
        rounds: list[list[float]] = [[], []]
        try:
            launches = [a.launcher(problem, *inputs, problem.empty(problem.operand_shapes[2]),  # type: ignore[union-attr]
                                   allocate_workspace(a.buffer_bytes(problem), problem.device))  # type: ignore[union-attr]
                        for a in chosen]
            for _ in range(CONFIRM_ROUNDS):
                for times, launch in zip(rounds, launches):
                    times.append(self.timer(launch, device=problem.device, budget_s=CONFIRM_BUDGET_S, min_repeats=1,
                                            max_repeats=1).median_ms)
        except CANDIDATE_FAULTS as exc:  # measured before; its first timing stands
            log.info("find %s: %s and %s could not be timed again (%s)", problem.key, pick.algorithm, native.algorithm,
                     _describe(exc))
            self.restore_inputs()
            return None
        if self.restore_inputs():  # checked when they were measured; one that writes its inputs now is not confirmed
            return None
        log.info("find %s: %s and %s timed again in %d alternating rounds: %s and %s ms (first %.4g and %.4g)",
                 problem.key, pick.algorithm, native.algorithm, CONFIRM_ROUNDS, rounds[0], rounds[1], pick.time_ms,
                 native.time_ms)
        out = {}
        for r, times, other in zip(pair, rounds, reversed(pair)):
            note = f"timed again against {other.algorithm} in alternating rounds (first {r.time_ms:.4g} ms)"
            kept = "" if r.message.startswith("timing stopped early") else r.message
            out[r.algorithm] = dataclasses.replace(r, time_ms=statistics.median(times),
                                                   spread_ms=max(times) - min(times),
                                                   message="; ".join(filter(None, (kept, note))))
        return out

    def rebase(self, results: list[PerfResult]) -> None:
        """The bar for the rest of the search (its best time) set again from ``results``, some timed again since."""
        self.best_ms = min((cast(float, r.time_ms) for r in results if r.ok and within_error(r, self.policy)),
                           default=math.inf)

    def _record(self, result: PerfResult) -> None:
        """A timed result sets the bar for the rest of the search (its best time, its leanest workspace) where this
        policy can use it (``within_error``): one too inexact for it is kept for other policies, not measured
        against."""
        if within_error(result, self.policy):
            self.best_ms = min(self.best_ms, cast(float, result.time_ms))
            self.leanest_bytes = min(self.leanest_bytes, result.workspace_bytes)


WROTE_INPUTS = "wrote into its input operands (they must stay read-only)"
CONFIRM_ROUNDS = 3  # a CPU pick's alternating rounds against PyTorch's call (_confirm): a warm-up, a sample
CONFIRM_PICKS = 3  # picks timed so, at most, where each round changes the pick
CONFIRM_BUDGET_S = 0.02  # each round's timing budget (its warm-up call and one sample run whatever it is)
CONFIRM_LIMIT_S = 1.0  # no rounds where the two's calls in them would take longer (a warm-up and a sample each)
_UNCHECKED: set[str] = set()  # plug-ins already warned of being measured in the process


def _confirm(search: _Search, results: list[PerfResult], algorithms: dict[str, Algorithm]) -> list[PerfResult]:
    """On the CPU, where the load of other processes can slow one candidate's timing and not the next one's: the
    policy's pick, where it is not PyTorch's own call, timed again against it (``_Search.time_again``); again while
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


def _warn_unchecked(algorithm: Algorithm) -> None:
    """Say once per plug-in that, measured in this process, what it allocates is not checked (``_allocates_beyond``)."""
    if algorithm.name not in _UNCHECKED:
        _UNCHECKED.add(algorithm.name)
        log.warning("%s is a plug-in measured in this process (settings.isolate=%s, or it cannot be sent to a worker: "
                    "a class defined in __main__, say): what it allocates beyond its declared workspace is not "
                    "checked here. Define it in an importable module and leave CONVTUNE_ISOLATE at 'plugins' so "
                    "that a worker process measures it", algorithm.name, settings.isolate)


def _failed(algorithm: Algorithm, props: _Props, err: float, message: str) -> PerfResult:
    """``algorithm``'s result that failed a check of its own doing (not of the result's accuracy)."""
    return PerfResult(algorithm.name, Status.FAILED, rel_error=err, **props, message=message)


def _allocates_beyond(algorithm: Algorithm, problem: ConvProblem, run: Any) -> str:
    """Why ``run`` (a run of ``algorithm``, after two) allocates more than ``algorithm`` declares, or ''.

    Called (and ``verify.peak_allocated_bytes`` run) only for the candidates convtune does not vouch for (plug-ins)
    where they are measured in a worker process (``settings.isolate``; the default for plug-ins): there
    the measurement disturbs nothing of the user's (it resets CUDA's peak-memory counter; on the CPU it
    runs the profiler, about 13 ms, which would end a profiler of the user's) and no other thread
    allocates meanwhile. convtune's own algorithms are held to their declarations by its tests
    (``tests/gpu/test_gpu_algorithms.py``, ``bench/verification_margins.py``). Allowed: the declared
    workspace (``Algorithm.workspace_bytes``), plus one temporary the size of each operand and of the
    result (PyTorch's own convolutions on the CPU reorder their input and allocate their result: a
    plug-in computing through them is not hiding anything), plus ALLOCATION_SLACK_BYTES. A hidden
    buffer larger than all the operands fails.
    """
    used = peak_allocated_bytes(run, problem.device)
    return _overdrawn(algorithm, problem, used) if used > _allowed_bytes(algorithm, problem) else ""


def _allowed_bytes(algorithm: Algorithm, problem: ConvProblem) -> int:
    """What a run of ``algorithm`` may allocate (``_allocates_beyond``): its declared workspace, a temporary the size
    of each operand, and ALLOCATION_SLACK_BYTES."""
    return algorithm.workspace_bytes(problem) + problem.min_bytes + ALLOCATION_SLACK_BYTES


def _overdrawn(algorithm: Algorithm, problem: ConvProblem, used: int) -> str:
    """The failure of a candidate that allocated ``used`` bytes while running, more than it may."""
    return (f"allocated {format_bytes(used)} while running, beyond its declared workspace of "
            f"{format_bytes(algorithm.workspace_bytes(problem))} (allowed: that, a temporary the size of each "
            f"operand and {format_bytes(ALLOCATION_SLACK_BYTES)}); declare what it uses (Algorithm.buffers or "
            f"library_bytes)")


def _over_deadline(algorithm: Algorithm, props: _Props, err: float, runs_s: list[float],
                   deadline_s: float) -> PerfResult:
    """``algorithm``'s ``timeout``: right on both input sets, but past the deadline before it could be timed; its
    slower checked run's time is kept, for when nothing else finishes (``_slow_but_right``)."""
    took = " and ".join(f"{t:.2f} s" for t in runs_s)
    return PerfResult(algorithm.name, Status.TIMEOUT, time_ms=max(runs_s) * 1e3, rel_error=err, **props,
                      message=f"its checked runs took {took}, over the deadline of {deadline_s:g} s "
                              f"(Policy.deadline_s, CONVTUNE_CANDIDATE_DEADLINE_S); not timed")


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


def _finite_poison(problem: ConvProblem) -> float:
    """A finite value far outside any result, for the second check's output (the first is poisoned with NaN)."""
    return float(torch.finfo(problem.torch_dtype).max) / 4


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


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
    the best measured); the rest follow in ``get``'s order.

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
    skipped with the reason) and the budget (max_candidates, budget_s; else the settings
    find_max_candidates, find_budget_s; 0 = none): once spent, the rest are skipped "budget".
    db: a ``TuningDB``; every result is stored in it (a candidate not timed this time, for the
    policy or the budget, keeps the ok result the database had). timer: how candidates are timed (``benchmark``;
    tests pass a fake). candidates: the algorithms to try (default: every registered algorithm
    supporting the problem; given ones that do not support it come back ``unsupported``).
    seed: of the random verification inputs (default ``settings.verify_seed``).

    Candidates run in ``search_order``: the best-ranked of each family first, then ``get``'s
    order; once ``settings.find_patience`` candidates after those were no faster than the best
    (beyond ``policy.tolerance``), the search has converged and the rest are skipped. A candidate
    that ``get`` predicts over ``settings.find_prune_factor`` times slower than the best measured
    is skipped without running. Neither rule skips a candidate needing less workspace than every
    one measured so far: the time/workspace trade-off keeps its lean end for ``plan``. A
    workspace costly to learn (a cuDNN execution plan's, by building it) is learned for the candidates
    that run, for all of them under a ``workspace_limit``, and for a skipped one only while a
    candidate can still be leaner than the leanest measured; a skipped candidate whose workspace
    was not learned shows 0 bytes and says so in its message. With ``policy.micro_batching`` and
    a ``workspace_limit``, the batch splits that ``algorithms.microbatch.micro_batch_offers`` proposes (from
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
                results.append(PerfResult(algorithm.name, Status.FAILED, message=_describe(exc)))
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
    predictions = ranked_predictions(problem, candidates, policy, db, keep_filters=False)
    predicted_ms = {a.name: cast(float, guess.time_ms) for a, guess in predictions}  # every prediction has a time
    ranked, head_size = search_order([a for a, _ in predictions])
    search = _Search(problem, policy, timer, seed)
    log.info("find %s: %d candidate(s)", problem.key, len(ranked))
    try:
        results += _search(search, ranked, head_size, predicted_ms, policy, settings.find_patience)
        if not any(r.ok and within_error(r, policy) for r in results):
            results = _slow_but_right(results, policy)
        if problem.device == "cpu" and timer is benchmark:  # a fake or another timer in tests and tools: as it says
            results = _confirm(search, results, {a.name: a for a in ranked})
        if policy.micro_batching:
            results += _micro_batched(problem, policy, results, search, db=db, timer=timer, candidates=given,
                                      seed=seed)
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

    def __init__(self, search: _Search, ranked: list[Algorithm], predicted_ms: dict[str, float]) -> None:
        self.search, self.ranked, self.predicted_ms = search, ranked, predicted_ms
        self.threads = settings.find_compile_threads
        self.prepared = 0  # ranked[:prepared] were looked at
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

    def __call__(self, index: int, converged: bool) -> None:
        """Before ``ranked[index]`` runs: prepare it and the next candidates, ``threads`` ahead of it, each once (not
        those that the search would skip as things stand, nor more than the budget has candidates left)."""
        if self._mode is None:
            return
        budget = self.search.budget
        end = index + self.threads + 1
        if budget.max_candidates:
            end = min(end, index + max(budget.max_candidates - budget.timed, 0))
        for algorithm in self.ranked[self.prepared:end]:
            self.prepared += 1
            if self.search._skip(self.predicted_ms.get(algorithm.name, math.inf), converged) is not None:
                continue
            try:
                algorithm.prepare(self.search.problem)
            except Exception as exc:  # noqa: BLE001 - its run compiles what it lacks, and fails there if it must
                log.debug("%s: prepare failed on %s (%s: %s)", algorithm.name, self.search.problem.key,
                          type(exc).__name__, exc)

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


def _search(search: _Search, ranked: list[Algorithm], head_size: int, predicted_ms: dict[str, float],
            policy: Policy, patience: int) -> list[PerfResult]:
    """Each candidate of ``ranked`` tried in turn, until the search converges (``find``'s rules), the next ones'
    compiles started ahead of them (``_Ahead``)."""
    def in_order() -> list[PerfResult]:
        with _Ahead(search, ranked, predicted_ms) as ahead:
            return _search_in_order(search, ranked, head_size, predicted_ms, policy, patience, ahead)

    return contextvars.copy_context().run(in_order)


def _search_in_order(search: _Search, ranked: list[Algorithm], head_size: int, predicted_ms: dict[str, float],
                     policy: Policy, patience: int, ahead: _Ahead) -> list[PerfResult]:
    results = []
    without_gain = 0
    for index, algorithm in enumerate(ranked, 1):
        converged = bool(patience and without_gain >= patience)
        ahead(index - 1, converged)
        best_before = search.best_ms
        result = search.try_candidate(algorithm, predicted_ms.get(algorithm.name, math.inf), converged=converged)
        if algorithm.place is not None:  # kept with the result: get's learned model reads it
            result = dataclasses.replace(result, place=algorithm.place)
        results.append(result)
        if result.ok and index > head_size:  # the first try of each family does not count
            gained = search.best_ms < best_before * (1 - policy.tolerance)  # what this policy can use
            without_gain = 0 if gained or not math.isfinite(best_before) else without_gain + 1
        _log_result(index, len(ranked), result, search.best_ms)
    return results


def _micro_batched(problem: ConvProblem, policy: Policy, results: list[PerfResult], search: _Search,
                   **find_kw: Any) -> list[PerfResult]:
    """The splits ``algorithms.microbatch.micro_batch_offers`` proposes, each verified and timed like any candidate."""
    def find_sub(sub: ConvProblem, sub_policy: Policy) -> list[PerfResult]:
        return find(sub, sub_policy, **find_kw)

    out = []
    for offer in micro_batch_offers(problem, policy, results, find_sub, find_kw["candidates"]):
        result = search.try_candidate(offer.algorithm, offer.predicted_ms)
        out.append(dataclasses.replace(result, message="; ".join(filter(None, (offer.note, result.message)))))
    return out


def _keep_earlier_measurements(db: Any, problem: ConvProblem, results: list[PerfResult]) -> list[PerfResult]:
    """``results``, where a candidate this search did not time (policy, budget) keeps its earlier ok result;
    the earlier ok results alone when no candidate of this search succeeded.

    The database replaces a problem's results with each find's: without this, a find under a
    narrow policy (deterministic, a small workspace limit) would erase timings that a later,
    wider policy can use.
    """
    earlier = {r.algorithm: r for r in db.results(problem) if r.ok}
    if earlier and not any(r.ok for r in results):
        # Every candidate failed this time (a broken setting, a device in trouble): the good
        # measurements stored before stay, except those this find found wrong, which are recorded so.
        wrong = [r for r in results if r.status is Status.WRONG_RESULT]
        kept = [r for name, r in earlier.items() if name not in {w.algorithm for w in wrong}]
        log.warning("find: no candidate of %s succeeded; %d good result(s) stored before are kept",
                    problem.key, len(kept))
        return kept + wrong
    not_timed = (Status.SKIPPED, Status.OVER_WORKSPACE_LIMIT)
    return [earlier.get(r.algorithm, r) if r.status in not_timed else r for r in results]


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
