"""Measuring one candidate of a find: the shared inputs and their float64 references, the policy's check, the runs
against the reference, the timing, and what becomes of a candidate that fails any of them.

``Search`` holds one find's state (its inputs, the best time so far, the budget); ``Search.try_candidate`` gives one
candidate's ``PerfResult``, whatever the candidate does: held against the policy (a violation is a status, nothing
runs), given its declared workspace, run once on the shared random inputs with its output poisoned and compared
with the float64 reference, run again on a second input set, then timed by the timer ``find`` was given (a wrong
result is recorded, not timed), the timed calls' result checked too. Where it does not declare whether it is
deterministic, that result is compared bit for bit with its first run's on the same inputs (a policy that asks for
determinism runs it a third time before timing instead: a candidate that fails it is not timed). The shared inputs
are compared with their pristine copies once a candidate is done, after a failed check (which they may explain) and
after a slow checked run: a candidate that wrote into them fails, and the next one sees them as they were.
``find`` chooses the order and when to stop (``search_rules``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import statistics
import time
from typing import Any, TypedDict, cast

import torch

from . import background, isolation
from .algorithms.base import Algorithm, allocate_workspace, into
from .errors import CANDIDATE_FAULTS, first_line
from .policy import Policy
from .problem import ConvProblem
from .ranking import within_error
from .results import PerfResult, Status
from .settings import settings
from .timing import Timer
from .units import format_bytes
from .verify import allocated_while, check, errors, judge, peak_allocated_bytes, reference_case, tolerance

log = logging.getLogger(__name__)

# What a candidate may allocate while running beyond its declared workspace and a result-sized temporary
# (``_allocates_beyond``): library handles, small buffers of PyTorch's own ops.
ALLOCATION_SLACK_BYTES = 1 << 20
WROTE_INPUTS = "wrote into its input operands (they must stay read-only)"
SLOW_RUN_S = 0.01  # a checked run this long has the shared inputs compared at once (else when the candidate is done)
# find's CPU pick timed again against PyTorch's call (``Search.time_again``, ``find._confirm``):
CONFIRM_ROUNDS = 3  # alternating rounds: a warm-up, a sample
CONFIRM_BUDGET_S = 0.02  # each round's timing budget (its warm-up call and one sample run whatever it is)
CONFIRM_LIMIT_S = 1.0  # no rounds where the two's calls in them would take longer (a warm-up and a sample each)
_UNCHECKED: set[str] = set()  # plug-ins already warned of being measured in the process


class Props(TypedDict):
    """A candidate's properties, as ``Policy.violation`` takes them and ``PerfResult`` records them."""

    workspace_bytes: int
    deterministic: bool
    uses_tf32: bool
    reduced_precision: bool


def declared_props(algorithm: Algorithm, problem: ConvProblem, learn: bool) -> tuple[Props, bool | None, bool]:
    """What ``algorithm`` declares on ``problem`` before it runs, as a policy judges it: its props (a workspace not
    known without building it counts as 0 unless ``learn``: then it is built to learn it; a determinism it does not
    know counts as deterministic until two of its runs compare), what it declared of its determinism (None: not
    known) and whether the workspace is known. Raises what the algorithm raises."""
    notes = algorithm.notes(problem)
    declared = algorithm.is_deterministic(problem)
    workspace_bytes = algorithm.known_workspace_bytes(problem)
    if workspace_bytes is None and learn:
        workspace_bytes = algorithm.workspace_bytes(problem)
    props: Props = dict(workspace_bytes=0 if workspace_bytes is None else workspace_bytes,
                        deterministic=declared is None or bool(declared),
                        uses_tf32=notes.tf32, reduced_precision=notes.reduced_precision)
    return props, declared, workspace_bytes is not None


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, or an allocator's RuntimeError that says it ran out of memory."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class Budget:
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


class Search:
    """One find: the inputs and reference shared by all candidates, the best time so far."""

    def __init__(self, problem: ConvProblem, policy: Policy, timer: Timer, seed: int | None) -> None:
        self.problem, self.policy, self.timer, self.seed = problem, policy, timer, seed
        self.budget = Budget(policy)
        self.best_ms = math.inf
        self.best_deterministic_ms = math.inf  # the best time of a deterministic one (find's _for_determinism)
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
            try:
                case = reference_case(self.problem, seed)
                pristine = (case[0][0].clone(), case[0][1].clone())
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                if self.problem.device == "cuda" and not background.in_worker():
                    torch.cuda.empty_cache()  # (not under the caller's running step: the background worker)
                said = first_line(exc, 200)
                raise ValueError(f"{self.problem.key}: its inputs and float64 reference, which every candidate is "
                                 f"checked against, do not fit in the memory free on {self.problem.device} "
                                 f"({type(exc).__name__}: {said}); measure a smaller batch or spatial size, or free "
                                 f"memory") from None
            self._cases.append(case)
            self._pristine.append(pristine)
        return self._cases[index]

    def restore_inputs(self) -> bool:
        """Put the shared inputs back if a candidate wrote into them; True if it had."""
        pairs = [(t, t0) for ((a, b), _), (a0, b0) in zip(self._cases, self._pristine) for t, t0 in ((a, a0), (b, b0))]
        if not pairs:
            return False
        # One synchronization for all of them (a find asks once per candidate, and after a failed or slow check). != as
        # torch.equal compares: NaN written into an input differs, -0.0 for 0.0 does not.
        changed = torch.stack([t.ne(t0).any() for t, t0 in pairs]).tolist()
        for (t, t0), wrote in zip(pairs, changed):
            if wrote:
                t.copy_(t0)
        return any(changed)

    def try_candidate(self, algorithm: Algorithm, ruled_out: str | None = None) -> PerfResult:
        """The result of one candidate; nothing it raises escapes.

        ruled_out: why the search's rules would not run it (``search_rules.SearchRules``: its price far above the best
        measured, or the search converged); None: they would. A candidate so ruled out that needs less workspace
        than every one measured so far still runs: it is a new point of the time/workspace trade-off that a
        workspace budget (``plan``) may need.

        A workspace that is costly to learn (``known_workspace_bytes`` is None: an unbuilt cuDNN
        plan) is learned only where it decides: against the policy's workspace limit, for a run,
        or to see whether a candidate to be skipped is leaner than every one measured (not when
        the leanest measured needs none). A candidate skipped without it shows 0 bytes, and its
        message says the workspace was not learned.
        """
        problem = self.problem
        skip = self._skip(ruled_out)
        try:
            props, declared, learned = declared_props(algorithm, problem, learn=self._workspace_decides(skip))
        except CANDIDATE_FAULTS as exc:  # a failing candidate is data
            return PerfResult(algorithm.name, Status.FAILED, message=describe(exc))
        violation = self.policy.violation(**props)
        if violation is not None:
            return PerfResult(algorithm.name, violation[0], message=violation[1], **props)
        if skip is not None:
            message, leaner_runs = skip
            if not (leaner_runs and learned and props["workspace_bytes"] < self.leanest_bytes):
                if not learned:
                    message += "; workspace not learned (shown as 0)"
                return PerfResult(algorithm.name, Status.SKIPPED, message=message, **props)
        switches = (algorithm.tf32_settings(problem).changes(problem.device)
                    if background.in_worker() and not isolation.wanted(algorithm, self.timer) else [])
        if switches:
            # PyTorch's TF32 switches are the process's: the caller's work, which goes on meanwhile, would run under
            # them too. A new CUDA context in a worker process would cost the caller's GPU memory for the rest of
            # its run: not measured in the background.
            return PerfResult(algorithm.name, Status.SKIPPED, **props, message=(
                f"not measured in the background: its run switches PyTorch's process-wide {' and '.join(switches)}, "
                f"which would reach the caller's work running meanwhile (find, select and optimize measure it)"))
        self.budget.timed += 1
        if declared is None:  # no promise until two of its results compare equal (one that fails makes none)
            props = cast(Props, dict(props, deterministic=False))
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

    def measure_here(self, algorithm: Algorithm, props: Props, probe_determinism: bool,
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
            return PerfResult(algorithm.name, status, message=describe(exc), **props)

    def _skip(self, ruled_out: str | None) -> tuple[str, bool] | None:
        """Why the next candidate need not run (the budget, else ``ruled_out``: ``try_candidate``), and whether a
        leaner one runs all the same; None: it runs."""
        exhausted = self.budget.exhausted()
        if exhausted:
            return exhausted, False
        return None if ruled_out is None else (ruled_out, True)

    def _workspace_decides(self, skip: tuple[str, bool] | None) -> bool:
        """Whether a candidate's workspace changes what happens to it, given why it would be skipped."""
        if self.policy.workspace_limit is not None or skip is None:
            return True  # held against the limit, or it runs
        _, leaner_runs = skip
        return leaner_runs and self.leanest_bytes > 0  # nothing is leaner than no workspace

    def _done(self, algorithm: Algorithm, props: Props, err: float, result: PerfResult) -> PerfResult:
        """``result`` for a candidate that stops before it is timed, unless it wrote into the shared inputs (put back):
        then it failed."""
        return _failed(algorithm, props, err, WROTE_INPUTS) if self.restore_inputs() else result

    def _measure(self, algorithm: Algorithm, props: Props, probe_determinism: bool,
                 timer_budget_s: float | None) -> PerfResult:
        problem = self.problem
        # its own copy, where the determinism found is written (try_candidate's props promise none where it is to be
        # found: a result cut short by the deadline, or failing, has none)
        props = cast(Props, dict(props))
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
        # The inputs are compared after a failed check (a candidate that wrote into them fails for that), after a slow
        # run (the comparison costs little beside it, and one that wrote them runs no more), and once the candidate is
        # done (_done): a candidate that writes into them at any stage fails.
        if (not ok or runs_s[-1] > SLOW_RUN_S) and self.restore_inputs():
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
        if (not ok or runs_s[-1] > SLOW_RUN_S) and self.restore_inputs():
            return _failed(algorithm, props, err, WROTE_INPUTS)
        if not ok:
            return PerfResult(algorithm.name, Status.WRONG_RESULT, rel_error=err2, **props,
                              message=f"on a second input set: {message}")
        if deadline_s and time.perf_counter() - started > deadline_s:
            return self._done(algorithm, props, err, _over_deadline(algorithm, props, err, runs_s, deadline_s))
        if isolation.in_worker() and not isolation.vouched_for(algorithm):  # see _allocates_beyond
            spare = problem.empty(problem.operand_shapes[2])  # allocated before the measured run, not in it
            overdrawn = _allocates_beyond(algorithm, problem,
                                          lambda: algorithm.run(problem, *inputs2, workspace=workspace, out=spare))
            if self.restore_inputs():
                return _failed(algorithm, props, err, WROTE_INPUTS)
            if overdrawn:
                return _failed(algorithm, props, err, overdrawn)
        if probe_determinism and self.policy.deterministic:  # known before timing: a candidate that fails is not timed
            again = algorithm.run(problem, *inputs, workspace=workspace, out=problem.empty(problem.operand_shapes[2]))
            props["deterministic"] = bool(torch.equal(out, again))
            probe_determinism = False
            if not props["deterministic"]:
                return self._done(algorithm, props, err, PerfResult(
                    algorithm.name, Status.EXCLUDED_BY_POLICY, rel_error=err, **props,
                    message="not deterministic (two runs differ bit for bit), and the policy asks for determinism"))
        if deadline_s:
            left_s = deadline_s - (time.perf_counter() - started)
            if left_s <= 0:
                return self._done(algorithm, props, err, _over_deadline(algorithm, props, err, runs_s, deadline_s))
            # (None: the timer's own budget, settings.timing_budget_s for convtune's: kept where it ends first)
            base_s = settings.timing_budget_s if timer_budget_s is None else timer_budget_s
            timer_budget_s = timer_budget_s if base_s <= left_s else left_s
        # The timed calls start from an output that holds a convolution's answer, but another input
        # set's: no poison to see, and a candidate that computes only when it sees one (or not at all
        # on repeated calls) leaves that wrong answer behind, which the check after timing fails. Where
        # determinism is to be told, into an output of their own: the first check's result is compared with theirs.
        first_result, out = out, (problem.empty(problem.operand_shapes[2]) if probe_determinism else out)
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
        if probe_determinism:  # the same inputs, run once before the timing and many times in it
            props["deterministic"] = bool(torch.equal(first_result, out))
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
        of its rounds (``find._confirm``); None where they are not: either measured in a worker, calls so slow that the
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
                     describe(exc))
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
        self.best_deterministic_ms = min((cast(float, r.time_ms) for r in results
                                          if r.ok and r.deterministic and within_error(r, self.policy)),
                                         default=math.inf)

    def _record(self, result: PerfResult) -> None:
        """A timed result sets the bar for the rest of the search (its best time, its leanest workspace) where this
        policy can use it (``within_error``): one too inexact for it is kept for other policies, not measured
        against."""
        if within_error(result, self.policy):
            self.best_ms = min(self.best_ms, cast(float, result.time_ms))
            self.leanest_bytes = min(self.leanest_bytes, result.workspace_bytes)
            if result.deterministic:
                self.best_deterministic_ms = min(self.best_deterministic_ms, cast(float, result.time_ms))




def _warn_unchecked(algorithm: Algorithm) -> None:
    """Say once per plug-in that, measured in this process, what it allocates is not checked (``_allocates_beyond``)."""
    if algorithm.name not in _UNCHECKED:
        _UNCHECKED.add(algorithm.name)
        log.warning("%s is a plug-in measured in this process (settings.isolate=%s, or it cannot be sent to a worker: "
                    "a class defined in __main__, say): what it allocates beyond its declared workspace is not "
                    "checked here. Define it in an importable module and leave CONVTUNE_ISOLATE at 'plugins' so "
                    "that a worker process measures it", algorithm.name, settings.isolate)


def _failed(algorithm: Algorithm, props: Props, err: float, message: str) -> PerfResult:
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


def _over_deadline(algorithm: Algorithm, props: Props, err: float, runs_s: list[float],
                   deadline_s: float) -> PerfResult:
    """``algorithm``'s ``timeout``: right on both input sets, but past the deadline before it could be timed; its
    slower checked run's time is kept, for when nothing else finishes (``find._slow_but_right``)."""
    took = " and ".join(f"{t:.2f} s" for t in runs_s)
    return PerfResult(algorithm.name, Status.TIMEOUT, time_ms=max(runs_s) * 1e3, rel_error=err, **props,
                      message=f"its checked runs took {took}, over the deadline of {deadline_s:g} s "
                              f"(Policy.deadline_s, CONVTUNE_CANDIDATE_DEADLINE_S); not timed")


def _finite_poison(problem: ConvProblem) -> float:
    """A finite value far outside any result, for the second check's output (the first is poisoned with NaN)."""
    return float(torch.finfo(problem.torch_dtype).max) / 4


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
