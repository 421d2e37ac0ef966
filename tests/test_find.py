"""find: every status from fakes, policy filters, ranking, early stop, budgets, storage; check()."""

import dataclasses
import importlib
import logging
import math
import re
import time

import pytest
import torch

from convtune import ConvProblem, PerfResult, Policy, Status, costmodel, find
from convtune.algorithms.registry import algorithms, get_algorithm, isolated
from convtune.find import summary
from convtune.measure import is_out_of_memory
from convtune.ranking import best, rank
from convtune.settings import settings
from convtune.verify import check, errors, judge, reference_case, tolerance
from fakes import (
    CostlyWorkspace,
    Fake,
    FakeDB,
    FakeTimer,
    FirstCallOnly,
    HandsOver,
    InputWriter,
    Memoising,
    NaNResult,
    NoWrite,
    OneWrongElement,
    OutOfMemory,
    PoisonSniffer,
    Raising,
    UniformSniffer,
    UnknownDeterminism,
    WrongResult,
)

P = ConvProblem("fwd", n=2, c=4, k=6, input_size=(7, 7), kernel_size=3, padding=1)


def by_name(results):
    return {r.algorithm: r for r in results}


def test_fastest_first_and_fields():
    fast, slow = Fake("fake:fast", time_ms=1.0, workspace_bytes=4096), Fake("fake:slow", time_ms=3.0)
    results = find(P, timer=FakeTimer(), candidates=[slow, fast])
    assert [r.algorithm for r in results] == ["fake:fast", "fake:slow"]
    best = results[0]
    assert best.status is Status.OK and best.time_ms == pytest.approx(1.0) and best.spread_ms == 0
    assert best.workspace_bytes == 4096 and best.rel_error < tolerance(P, fast.notes(P))


@pytest.mark.parametrize("fake, status, text", [
    (Raising("fake:raising", ValueError("boom")), Status.FAILED, "ValueError: boom"),
    (OutOfMemory(), Status.OUT_OF_MEMORY, "OutOfMemoryError"),
    (Raising("fake:cudaoom", RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")), Status.OUT_OF_MEMORY,
     "RuntimeError"),
    (WrongResult(), Status.WRONG_RESULT, "exceeds the tolerance"),
    (NaNResult(), Status.WRONG_RESULT, "NaN"),
    (NoWrite(), Status.WRONG_RESULT, "NaN"),
    (InputWriter(), Status.FAILED, "input operands"),
    (Fake("fake:refuses", unsupported_reason="only on Tuesdays"), Status.UNSUPPORTED, "only on Tuesdays"),
])
def test_every_failure_is_a_status_and_the_search_goes_on(fake, status, text):
    good = Fake("fake:good", time_ms=5.0)
    results = by_name(find(P, timer=FakeTimer(), candidates=[fake, good]))
    assert results[fake.name].status is status
    assert text in results[fake.name].message
    assert results["fake:good"].status is Status.OK
    assert find(P, timer=FakeTimer(), candidates=[fake, good])[0].algorithm == "fake:good"


def test_an_algorithm_is_timed_as_a_tuned_layer_runs_it_without_run_s_copy_into_the_output():
    # torch:native hands PyTorch's result over (a tuned layer takes it as it is): run's copy is no part of its time.
    results = by_name(find(P, timer=FakeTimer(), candidates=[HandsOver(time_ms=1.0, copy_ms=5.0),
                                                              Fake("fake:other", time_ms=2.0)]))
    assert results["fake:handsover"].status is Status.OK
    assert results["fake:handsover"].time_ms == pytest.approx(1.0)


@pytest.mark.parametrize("fake, where", [
    # Two checked runs (two input sets), then the timed calls (FakeTimer: a warm-up and five samples, runs 3-8):
    # the last one's result is what is checked.
    (HandsOver(time_ms=1.0, wrong_after=8), "timed calls"),
    # A memo of the first answer, handed over from execute (what the checked runs and the timed calls call).
    (HandsOver(time_ms=1.0, memoise=True), "second input set"),
])
def test_a_handed_over_result_that_is_wrong_after_the_first_calls_is_wrong(fake, where):
    results = by_name(find(P, timer=FakeTimer(), candidates=[fake, Fake("fake:other", time_ms=2.0)]))
    assert results["fake:handsover"].status is Status.WRONG_RESULT and where in results["fake:handsover"].message
    assert results["fake:other"].status is Status.OK


def test_a_handed_over_result_that_does_not_fit_the_output_fails_naming_it():
    class Mismatched(HandsOver):
        def execute(self, problem, a, b, out, ws):
            return super().execute(problem, a, b, out, ws).double()  # would be cast silently by a copy

    results = by_name(find(P, timer=FakeTimer(), candidates=[Mismatched(), Fake("fake:other", time_ms=2.0)]))
    assert results["fake:handsover"].status is Status.FAILED and "dtype" in results["fake:handsover"].message


def test_wrong_and_nan_never_selected_even_when_fastest():
    results = find(P, timer=FakeTimer(), candidates=[WrongResult(time_ms=0.1), NaNResult(time_ms=0.1),
                                                     Fake("fake:slow", time_ms=9.0)])
    assert results[0].algorithm == "fake:slow"
    assert math.isinf(by_name(results)["fake:nan"].rel_error)
    # wrong results are not timed
    assert by_name(results)["fake:wrong"].time_ms is None


def test_nan_never_passes_even_with_a_huge_max_rel_error():
    results = by_name(find(P, Policy(max_rel_error=1e30), timer=FakeTimer(),
                           candidates=[NaNResult(), WrongResult(scale=2.0)]))
    assert results["fake:nan"].status is Status.WRONG_RESULT
    assert results["fake:wrong"].status is Status.OK  # 100% off is within a 1e30 bound


@pytest.mark.parametrize("isolate", ["off", "plugins"])  # measured in this process, and in a worker
def test_policy_max_rel_error_tightens_the_choice_and_keeps_what_other_policies_can_use(tmp_path, isolate):
    # float32's default bound is 1e-4: 1e-5 off is right by it, too inexact for a policy asking 1e-6; 1% off is wrong
    # (named so that the inexact one runs first, and would stop the exact one's timing if it set the bar)
    from convtune import TuningDB

    strict = Policy(max_rel_error=1e-6)
    near = WrongResult("fake:a_near", scale=1.0 + 1e-5, time_ms=1.0)
    exact, wronger = Fake("fake:b_exact", time_ms=3.0), WrongResult("fake:wronger", scale=1.01, time_ms=0.5)
    with TuningDB(tmp_path / "t.sqlite") as db, settings.override(isolate=isolate):
        results = find(P, strict, db=db, timer=FakeTimer(), candidates=[near, exact, wronger])
        named = by_name(results)
        assert named["fake:a_near"].status is Status.OK and 1e-6 < named["fake:a_near"].rel_error < 1e-4
        assert "above Policy.max_rel_error=1e-06: kept for other policies" in named["fake:a_near"].message
        assert named["fake:wronger"].status is Status.WRONG_RESULT
        assert results[0].algorithm == "fake:b_exact"  # the policy's choice: what it can use
        # the search's bar is what the policy can use: the exact one was timed to the end, not stopped early
        assert named["fake:b_exact"].time_ms == pytest.approx(3.0) and not named["fake:b_exact"].message
        # stored: each policy answered from the same measurements
        assert db.lookup(P, Policy()).algorithm == "fake:a_near"
        assert db.lookup(P, strict).algorithm == "fake:b_exact"
        assert db.lookup(P, Policy(max_rel_error=1e-3)).algorithm == "fake:a_near"
        # a stricter find later loses nothing the default policy had
        find(P, Policy(max_rel_error=1e-30), db=db, timer=FakeTimer(), candidates=[near, exact])
        assert db.lookup(P, Policy()).algorithm == "fake:a_near" and db.lookup(P, strict) is not None


def test_a_strict_policy_past_every_deadline_still_gets_the_slow_answer_it_can_use():
    # the fast candidate is too inexact for the policy, the exact one over the deadline: the slow, exact answer
    strict = Policy(max_rel_error=1e-6, deadline_s=0.05)
    near = WrongResult("fake:a_near", scale=1.0 + 1e-5, time_ms=1.0)
    slow = Fake("fake:b_slow", time_ms=200.0, sleep=True)
    results = find(P, strict, timer=FakeTimer(), candidates=[near, slow])
    assert results[0].algorithm == "fake:b_slow" and results[0].ok and "over the deadline" in results[0].message
    assert rank(results, strict)[0].algorithm == "fake:b_slow"


@pytest.mark.parametrize("policy, fake, status", [
    (Policy(workspace_limit=1024), Fake("fake:huge", workspace_bytes=2**40), Status.OVER_WORKSPACE_LIMIT),
    (Policy(deterministic=True), Fake("fake:atomics", deterministic=False), Status.EXCLUDED_BY_POLICY),
    (Policy(allow_tf32=False), Fake("fake:tf32", tf32=True), Status.EXCLUDED_BY_POLICY),
    (Policy(allow_reduced_precision=False), Fake("fake:half_acc", reduced_precision=True), Status.EXCLUDED_BY_POLICY),
])
def test_policy_violations_are_not_run(policy, fake, status):
    good = Fake("fake:good")
    results = by_name(find(P, policy, timer=FakeTimer(), candidates=[fake, good]))
    assert results[fake.name].status is status and results[fake.name].message
    assert fake.runs == 0 and good.runs > 0
    assert results["fake:good"].status is Status.OK


def test_unknown_determinism_is_decided_by_two_runs():
    steady, noisy = UnknownDeterminism("fake:steady"), UnknownDeterminism("fake:noisy", noisy=True)
    results = by_name(find(P, timer=FakeTimer(), candidates=[steady, noisy]))
    assert results["fake:steady"].deterministic is True and results["fake:noisy"].deterministic is False
    assert results["fake:noisy"].status is Status.OK
    results = by_name(find(P, Policy(deterministic=True), timer=FakeTimer(), candidates=[steady, noisy]))
    assert results["fake:steady"].status is Status.OK
    assert results["fake:noisy"].status is Status.EXCLUDED_BY_POLICY and "bit for bit" in results["fake:noisy"].message


def test_a_candidate_found_not_deterministic_later_is_not_kept_deterministic(tmp_path):
    from convtune import TuningDB

    plan, other = UnknownDeterminism("fake:plan", time_ms=1.0), Fake("fake:other", time_ms=5.0)
    with TuningDB(tmp_path / "t.sqlite") as db:
        assert by_name(find(P, timer=FakeTimer(), candidates=[plan, other], db=db))["fake:plan"].deterministic
        plan.noisy = True  # an atomics plan whose two runs agreed the first time
        found = by_name(find(P, Policy(deterministic=True), timer=FakeTimer(), candidates=[plan, other], db=db))
        assert found["fake:plan"].status is Status.EXCLUDED_BY_POLICY
        kept = by_name(db.results(P))["fake:plan"]
        assert kept.ok and kept.time_ms == 1.0 and not kept.deterministic  # its timing stays, its promise does not
        assert db.lookup(P, Policy(deterministic=True)).algorithm == "fake:other"


def test_a_candidate_of_unknown_determinism_that_fails_promises_none():
    class RaisesWhenTimed(UnknownDeterminism):
        def compute(self, problem, a, b, out):
            super().compute(problem, a, b, out)
            if self.runs >= 3:  # its checks pass, its timed calls raise
                raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")

    result = find(P, timer=FakeTimer(), candidates=[RaisesWhenTimed("fake:plan")])[0]
    assert result.status is Status.OUT_OF_MEMORY and result.deterministic is False


def test_without_a_determinism_policy_the_timed_calls_are_the_second_run_compared():
    # no third run: the first check's result and the timed calls' (same inputs) are compared bit for bit
    steady, noisy = UnknownDeterminism("fake:steady"), UnknownDeterminism("fake:noisy", noisy=True)
    timer = FakeTimer()
    results = by_name(find(P, timer=timer, candidates=[steady, noisy]))
    assert results["fake:steady"].deterministic is True and results["fake:noisy"].deterministic is False
    timed_calls = 1 + timer.max_repeats  # FakeTimer: a warm-up call, then its samples
    assert steady.runs == noisy.runs == 2 + timed_calls  # the two checks, then the timed calls


def test_a_fast_candidate_has_the_inputs_compared_once_and_one_that_wrote_them_still_fails(monkeypatch):
    from convtune.measure import Search

    compared = []
    restore = Search.restore_inputs
    monkeypatch.setattr(Search, "restore_inputs", lambda self: compared.append(1) or restore(self))
    monkeypatch.setattr("convtune.measure.SLOW_RUN_S", math.inf)  # a cold first check's wall time decides nothing
    assert find(P, timer=FakeTimer(), candidates=[Fake("fake:good")])[0].ok
    assert len(compared) == 1  # once the candidate is done, not after each stage
    compared.clear()
    result = find(P, timer=FakeTimer(), candidates=[InputWriter("fake:writer")])[0]
    assert result.status is Status.FAILED and "input operands" in result.message
    # ...and the next candidate of a find sees the inputs as they were
    results = by_name(find(P, timer=FakeTimer(), candidates=[InputWriter("fake:writer"), Fake("fake:good")]))
    assert results["fake:writer"].status is Status.FAILED and results["fake:good"].ok


@pytest.mark.parametrize("prefer", ["fastest", "least_memory"])
def test_the_best_result_is_the_first_of_the_ranking_without_ranking_the_rest(prefer):
    g = torch.Generator().manual_seed(3)
    for trial in range(300):
        results = []
        for i in range(int(torch.randint(0, 12, (1,), generator=g))):
            status = Status.OK if torch.rand(1, generator=g) < 0.8 else Status.FAILED
            time_ms = round(float(torch.rand(1, generator=g)) * 2, 2)  # coarse: ties and near ties
            ws = int(torch.randint(0, 3, (1,), generator=g)) << 20
            name = "torch:native" if i == 0 and trial % 2 else f"fake:a{i}"
            results.append(PerfResult(name, status, time_ms=time_ms, workspace_bytes=ws,
                                      deterministic=bool(torch.rand(1, generator=g) < 0.5)))
        for policy in (Policy(prefer=prefer), Policy(prefer=prefer, tolerance=0.3, workspace_limit="1MiB"),
                       Policy(prefer=prefer, deterministic=True, tolerance=0.0)):
            ranked = rank(results, policy)
            assert best(results, policy) == (ranked[0] if ranked else None), (results, policy)


def test_huge_workspace_without_a_limit_is_out_of_memory():
    results = by_name(find(P, timer=FakeTimer(), candidates=[Fake("fake:huge", workspace_bytes=2**50)]))
    assert results["fake:huge"].status is Status.OUT_OF_MEMORY


def test_tie_goes_to_the_smaller_workspace():
    fast_big = Fake("fake:a_big", time_ms=1.00, workspace_bytes=2**20)
    nearly_small = Fake("fake:b_small", time_ms=1.01)
    results = find(P, Policy(tolerance=0.02), timer=FakeTimer(), candidates=[fast_big, nearly_small])
    assert [r.algorithm for r in results] == ["fake:b_small", "fake:a_big"]
    results = find(P, Policy(tolerance=0.0), timer=FakeTimer(), candidates=[fast_big, nearly_small])
    assert results[0].algorithm == "fake:a_big"


def test_among_equal_workspaces_a_tie_goes_to_torch_native():
    def ok(name, ms, ws=0):
        return PerfResult(name, Status.OK, time_ms=ms, workspace_bytes=ws)

    results = [ok("gemm:1x1", 1.00), ok("torch:native", 1.005), ok("cudnn:eng0", 0.99, ws=2**20)]
    # cudnn:eng0 ties too but needs a workspace; of the lean ones native wins the tie
    assert [r.algorithm for r in rank(results, Policy(tolerance=0.02))] == ["torch:native", "gemm:1x1", "cudnn:eng0"]
    # outside the tolerance the faster one wins
    assert rank(results, Policy(tolerance=0.001))[0].algorithm == "cudnn:eng0"
    assert rank([ok("gemm:1x1", 1.0), ok("torch:native", 1.1)], Policy(tolerance=0.02))[0].algorithm == "gemm:1x1"
    # a wider tolerance (host-bound eager code, README) sends a layer within it to PyTorch's own path
    assert rank([ok("gemm:1x1", 1.0), ok("torch:native", 1.08)], Policy(tolerance=0.1))[0].algorithm == "torch:native"


def test_prefer_least_memory():
    results = find(P, Policy(prefer="least_memory"), timer=FakeTimer(),
                   candidates=[Fake("fake:fast", time_ms=1.0, workspace_bytes=2**20), Fake("fake:lean", time_ms=5.0)])
    assert results[0].algorithm == "fake:lean"


def test_early_stop_of_a_clearly_slower_candidate():
    timer = FakeTimer(min_repeats=2, max_repeats=8)
    fast, slow = Fake("fake:a_fast", time_ms=1.0), Fake("fake:b_slow", time_ms=10.0)
    with settings.override(early_stop_factor=1.5):
        results = by_name(find(P, timer=timer, candidates=[fast, slow]))
    assert timer.calls[0]["stop_above_ms"] is None
    assert timer.calls[1]["stop_above_ms"] == pytest.approx(1.5)
    assert results["fake:b_slow"].status is Status.OK and "stopped early" in results["fake:b_slow"].message
    assert slow.runs < fast.runs


def test_candidate_budget_skips_the_rest():
    fakes = [Fake(f"fake:n{i}", time_ms=1.0 + i) for i in range(4)]
    violator = Fake("fake:tf32", tf32=True, time_ms=0.5)
    results = by_name(find(P, Policy(max_candidates=2, allow_tf32=False), timer=FakeTimer(),
                           candidates=[*fakes, violator]))
    statuses = sorted(r.status.value for r in results.values())
    assert statuses == ["excluded_by_policy", "ok", "ok", "skipped", "skipped"]
    assert "budget" in results["fake:n3"].message and "TF32" in results["fake:tf32"].message
    assert sum(f.runs > 0 for f in fakes) == 2


def test_candidate_budget_from_settings():
    with settings.override(find_max_candidates=1):
        results = find(P, timer=FakeTimer(), candidates=[Fake("fake:a"), Fake("fake:b")])
    assert sorted(r.status.value for r in results) == ["ok", "skipped"]


def test_seconds_budget_skips_the_rest():
    fakes = [Fake(f"fake:s{i}", time_ms=30.0, sleep=True) for i in range(4)]
    timer = FakeTimer(min_repeats=1, max_repeats=1)
    results = find(P, Policy(budget_s=0.05), timer=timer, candidates=fakes)
    assert results[0].status is Status.OK
    skipped = [r for r in results if r.status is Status.SKIPPED]
    assert skipped and all("budget" in r.message for r in skipped)
    # the timer is told what is left of the budget, never more than its own default
    assert 0 <= timer.calls[0]["budget_s"] <= min(0.05, settings.timing_budget_s)


def test_find_stores_everything_in_the_db():
    db = FakeDB()
    fakes = [Fake("fake:good"), Raising(), WrongResult(), Fake("fake:atomics", deterministic=False)]
    results = find(P, Policy(deterministic=True), db, timer=FakeTimer(), candidates=fakes)
    assert db.store_calls == 1
    assert sorted(r.algorithm for r in db.results(P)) == sorted(r.algorithm for r in results) == sorted(
        f.name for f in fakes)


def test_a_narrow_find_keeps_earlier_timings_in_the_db():
    db = FakeDB()
    fakes = [Fake("fake:good", time_ms=2.0), Fake("fake:atomics", deterministic=False, time_ms=1.0)]
    find(P, db=db, timer=FakeTimer(), candidates=fakes)
    narrow = by_name(find(P, Policy(deterministic=True), db, timer=FakeTimer(), candidates=fakes))
    assert narrow["fake:atomics"].status is Status.EXCLUDED_BY_POLICY  # what this find returns
    stored = by_name(db.results(P))
    assert stored["fake:atomics"].status is Status.OK and stored["fake:atomics"].time_ms == pytest.approx(1.0)
    assert db.lookup(P).algorithm == "fake:atomics"
    assert db.lookup(P, Policy(deterministic=True)).algorithm == "fake:good"


def test_duplicate_candidates_are_refused():
    with pytest.raises(ValueError, match="twice"):
        find(P, timer=FakeTimer(), candidates=[Fake("fake:a"), Fake("fake:a")])


def test_real_db_stores_and_serves(tmp_path):
    from convtune.db import TuningDB

    db = TuningDB(tmp_path / "t.sqlite")
    results = find(P, db=db, timer=FakeTimer(), candidates=[Fake("fake:good"), NaNResult(), Raising()])
    assert len(db.results(P)) == len(results)
    assert db.lookup(P).algorithm == "fake:good"


def test_default_candidates_come_from_the_registry():
    a, b = Fake("fake:reg_a", time_ms=2.0), Fake("fake:reg_b", time_ms=1.0, devices=("cuda",))
    with isolated(a, b, builtins=False):
        results = find(P, timer=FakeTimer())
    assert [r.algorithm for r in results] == ["fake:reg_a"]  # b runs on CUDA only


def test_candidates_must_be_algorithms():
    with pytest.raises(TypeError, match="Algorithm"):
        find(P, candidates=["torch:native"])
    with pytest.raises(TypeError, match="ConvProblem"):
        find("fwd")


def test_logs_one_line_per_candidate(caplog):
    with caplog.at_level(logging.INFO, logger="convtune.find"):
        find(P, timer=FakeTimer(), candidates=[Fake("fake:a", workspace_bytes=2048), Raising()])
    lines = [r.getMessage() for r in caplog.records if r.name == "convtune.find"]
    assert any("fake:a" in m and "% of best" in m and "KiB" in m for m in lines)
    assert any("fake:raising" in m and "failed" in m for m in lines)


def test_summary_table():
    results = find(P, timer=FakeTimer(), candidates=[Fake("fake:a"), Fake("fake:b", time_ms=2.0), Raising()])
    table = summary(results)
    lines = table.splitlines()
    assert len(lines) == 4 and "% of best" in lines[0]
    assert "100%" in lines[1] and "200%" in lines[2] and "ValueError: boom" in lines[3]


def test_is_out_of_memory():
    assert is_out_of_memory(torch.OutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert not is_out_of_memory(ValueError("out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_check_poisons_and_compares():
    (a, b), ref = reference_case(P, seed=3)
    out = P.empty(P.y_shape)
    err, ok, message = check(Fake(), P, (a, b), ref, out, None)
    assert ok and err < 1e-6 and "within" in message
    err, ok, message = check(NoWrite(), P, (a, b), ref, out, None)  # out held a correct result before
    assert not ok and math.isinf(err)
    err, ok, _ = check(WrongResult(scale=1.001), P, (a, b), ref, out, None, max_rel_error=1e-2)
    assert ok


def test_reference_case_is_random_and_seeded():
    (a1, b1), ref1 = reference_case(P, seed=1)
    (a2, _), _ = reference_case(P, seed=1)
    (a3, _), _ = reference_case(P, seed=2)
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)
    assert a1.abs().sum() > 0 and b1.abs().sum() > 0 and ref1.dtype == torch.float64


@pytest.mark.parametrize("problem", [
    P,
    ConvProblem("bwd_data", n=2, c=4, k=6, input_size=(9, 9), kernel_size=3, stride=2, padding=1),
    ConvProblem("bwd_filter", n=1, c=4, k=4, input_size=(8, 8), kernel_size=1, layout="NHWC"),
    ConvProblem("fwd", n=1, c=4, k=4, input_size=(10,), kernel_size=3, groups=2),
])
def test_find_with_the_registered_cpu_portfolio(problem):
    with settings.override(timing_budget_s=0.01, timing_max_repeats=3):
        results = find(problem)
    names = [r.algorithm for r in results]
    assert sorted(names) == sorted(a.name for a in algorithms(problem))
    assert "torch:native" in names and results[0].ok
    for r in results:
        if r.ok:
            bound = tolerance(problem, get_algorithm(r.algorithm).notes(problem))
            assert r.rel_error <= bound and r.time_ms > 0


def test_search_converges_after_patience_candidates_without_a_new_best():
    fakes = [Fake(f"fake:p{i}", time_ms=1.0 + 0.1 * i) for i in range(8)]  # all one backend: get's order
    with settings.override(find_patience=3):
        results = by_name(find(P, timer=FakeTimer(), candidates=fakes))
    ran = [name for name, r in results.items() if r.status is Status.OK]
    skipped = [r for r in results.values() if r.status is Status.SKIPPED]
    assert len(ran) == 4 and len(skipped) == 4  # the best, then 3 without gain
    assert all(r.message == "search converged: 3 candidates in a row were no faster than the best" for r in skipped)
    assert min(results.values(), key=lambda r: r.time_ms or math.inf).algorithm == "fake:p0"
    with settings.override(find_patience=0):
        assert all(r.status is Status.OK for r in find(P, timer=FakeTimer(), candidates=fakes))


def test_where_the_best_is_not_deterministic_the_deterministic_ones_are_searched_on_to_their_own_best():
    # the nondeterministic a0 is fastest: the search converges after a1-a3 gain nothing on it, and without the count
    # over the deterministic candidates alone a4, the best of those, was never timed; a policy asking for determinism
    # then had a1 from the database
    fakes = [Fake("fake:a0", time_ms=0.5, deterministic=False), *(Fake(f"fake:a{i}", time_ms=2.0) for i in (1, 2, 3)),
             Fake("fake:a4", time_ms=1.0), *(Fake(f"fake:a{i}", time_ms=2.0) for i in (5, 6, 7, 8))]
    db = FakeDB()
    with settings.override(find_patience=3):
        results = by_name(find(P, db=db, timer=FakeTimer(), candidates=fakes))
        assert sorted(n for n, r in results.items() if r.ok) == [f"fake:a{i}" for i in range(8)]  # a5-a7: a4's patience
        assert results["fake:a8"].status is Status.SKIPPED and "converged" in results["fake:a8"].message
        assert db.lookup(P).algorithm == "fake:a0" and db.lookup(P, Policy(deterministic=True)).algorithm == "fake:a4"
        # the best deterministic: nothing beyond find's own rules runs
        fakes[0] = Fake("fake:a0", time_ms=0.5)
        results = by_name(find(P, timer=FakeTimer(), candidates=fakes))
        assert sorted(n for n, r in results.items() if r.ok) == [f"fake:a{i}" for i in range(4)]
        # a policy asking for determinism searches the deterministic ones alone already
        fakes[0] = Fake("fake:a0", time_ms=0.5, deterministic=False)
        results = by_name(find(P, Policy(deterministic=True), timer=FakeTimer(), candidates=fakes))
        assert sorted(n for n, r in results.items() if r.ok) == [f"fake:a{i}" for i in range(1, 8)]


def test_the_deterministic_search_tries_what_does_not_know_its_determinism_and_counts_what_turns_out_not():
    # like cuDNN's plans: a4 is found deterministic by its two runs and is the deterministic best; a5-a9 differ run to
    # run, and each counts as no gain, so the third of them ends these runs
    fakes = [Fake("fake:a0", time_ms=0.5, deterministic=False), *(Fake(f"fake:a{i}", time_ms=2.0) for i in (1, 2, 3)),
             UnknownDeterminism("fake:a4", time_ms=1.0),
             *(UnknownDeterminism(f"fake:a{i}", noisy=True, time_ms=2.0) for i in range(5, 10))]
    with settings.override(find_patience=3):
        results = by_name(find(P, timer=FakeTimer(), candidates=fakes))
    assert results["fake:a4"].ok and results["fake:a4"].deterministic
    assert [results[f"fake:a{i}"].ok for i in range(5, 10)] == [True, True, True, False, False]
    assert not results["fake:a5"].deterministic and "converged" in results["fake:a8"].message


def test_a_leaner_candidate_run_for_determinism_counts_in_finds_own_search():
    # a4 needs less workspace than every one measured: find's own rules run it after convergence and count its gain,
    # which starts their count again (a5-a7 run); that it also runs for the deterministic candidates' sake changes
    # neither
    fakes = [CostlyWorkspace("fake:a0", time_ms=0.5, deterministic=False, workspace_bytes=4096),
             *(CostlyWorkspace(f"fake:a{i}", time_ms=2.0, workspace_bytes=4096) for i in (1, 2, 3)),
             CostlyWorkspace("fake:a4", time_ms=0.4),
             *(CostlyWorkspace(f"fake:a{i}", time_ms=2.0, workspace_bytes=4096) for i in (5, 6, 7, 8))]
    with settings.override(find_patience=3):
        results = by_name(find(P, timer=FakeTimer(), candidates=fakes))
    assert sorted(n for n, r in results.items() if r.ok) == [f"fake:a{i}" for i in range(8)]
    assert "converged" in results["fake:a8"].message


def test_runs_for_determinism_take_nothing_of_the_budget_finds_own_search_has():
    # under max_candidates=5 find's own search runs a0-a3 and the leaner a7; a4-a6, which the deterministic
    # candidates' count would run, must not spend the budget a7 is run from
    fakes = [CostlyWorkspace("fake:a0", time_ms=0.5, deterministic=False, workspace_bytes=4096),
             *(CostlyWorkspace(f"fake:a{i}", time_ms=2.0, workspace_bytes=4096) for i in (1, 2, 3)),
             *(CostlyWorkspace(f"fake:a{i}", time_ms=1.0, workspace_bytes=4096) for i in (4, 5, 6)),
             CostlyWorkspace("fake:a7", time_ms=2.0)]
    with settings.override(find_patience=3):
        results = by_name(find(P, Policy(max_candidates=5), timer=FakeTimer(), candidates=fakes))
    assert sorted(n for n, r in results.items() if r.ok) == ["fake:a0", "fake:a1", "fake:a2", "fake:a3", "fake:a7"]


class Inexact(Fake):
    """Right within the default bound (1e-4 here), not within a policy's max_rel_error of 1e-6."""

    def compute(self, problem, a, b, out) -> None:
        super().compute(problem, a, b, out)
        out.mul_(1 + 1e-5)


def test_runs_for_determinism_stop_where_no_deterministic_result_is_within_the_policys_error():
    # no deterministic candidate is within the policy's error: none sets a deterministic best, and each run for
    # determinism counts as no gain, so the third of them ends these runs
    fakes = [Fake("fake:a0", time_ms=0.5, deterministic=False),
             *(Inexact(f"fake:a{i}", time_ms=2.0) for i in range(1, 10))]
    with settings.override(find_patience=3):
        results = by_name(find(P, Policy(max_rel_error=1e-6), timer=FakeTimer(), candidates=fakes))
    assert [results[f"fake:a{i}"].ok for i in range(1, 10)] == [True] * 6 + [False] * 3
    assert "converged" in results["fake:a7"].message


def test_every_backend_gets_an_early_try_before_patience_runs_out():
    same_family = [Fake(f"fake:q{i}", time_ms=2.0) for i in range(6)]
    other = Fake("other:fast", time_ms=1.0)
    with settings.override(find_patience=2):
        results = by_name(find(P, timer=FakeTimer(), candidates=[*same_family, other]))
    assert results["other:fast"].status is Status.OK
    assert find(P, timer=FakeTimer(), candidates=[*same_family, other])[0].algorithm == "other:fast"


def test_a_candidate_predicted_far_slower_than_the_best_measured_is_not_run(nominal_peaks):
    # The cost model predicts by family: a 1x1 GEMM on a big 1x1 problem is far cheaper than the
    # direct method's per-tap loops, which the prune then skips without running them.
    big = ConvProblem("fwd", n=8, c=64, k=64, input_size=(28, 28), kernel_size=1)
    fast = Fake("gemm:1x1_fake", priced_like="gemm:1x1", time_ms=0.1)
    slow = Fake("direct:taps_fake", priced_like="direct:taps", time_ms=50.0)
    with settings.override(find_prune_factor=1.0001, find_patience=0):
        results = by_name(find(big, timer=FakeTimer(), candidates=[fast, slow]))
    assert results["direct:taps_fake"].status is Status.SKIPPED
    assert re.fullmatch(r"predicted [0-9.e+-]+ ms, over 1.0001x the best measured \(0.1 ms\)",
                        results["direct:taps_fake"].message)
    assert slow.runs == 0
    with settings.override(find_prune_factor=0, find_patience=0):
        assert by_name(find(big, timer=FakeTimer(), candidates=[fast, slow]))["direct:taps_fake"].ok


def test_a_leaner_candidate_still_runs_after_convergence_and_past_the_prune(nominal_peaks):
    big = ConvProblem("fwd", n=8, c=64, k=64, input_size=(28, 28), kernel_size=1)
    hungry = [Fake(f"gemm:1x1_h{i}", priced_like="gemm:1x1", time_ms=1.0 + 0.1 * i, workspace_bytes=1 << 20)
              for i in range(4)]
    # no workspace; predicted and measured slow
    lean = Fake("direct:taps_lean", priced_like="direct:taps", time_ms=30.0)
    with settings.override(find_patience=1, find_prune_factor=1.0001):
        results = by_name(find(big, timer=FakeTimer(), candidates=[*hungry, lean]))
    assert results["direct:taps_lean"].ok and lean.runs > 0
    assert any("converged" in r.message for r in results.values() if r.status is Status.SKIPPED)


def converging(workspaces):
    """Eight candidates of one backend, p0 fastest: with patience 3, p0-p3 run and p4-p7 are skipped."""
    return [CostlyWorkspace(f"fake:p{i}", time_ms=1.0 + 0.1 * i, workspace_bytes=ws) for i, ws in enumerate(workspaces)]


def test_a_skipped_candidate_is_not_built_when_nothing_can_be_leaner():
    fakes = converging([0, 0, 0, 0, 4096, 4096, 0, 4096])
    db = FakeDB()
    with settings.override(find_patience=3):
        results = by_name(find(P, db=db, timer=FakeTimer(), candidates=fakes))
    assert [f.builds for f in fakes] == [1, 1, 1, 1, 0, 0, 0, 0]
    for f in fakes[4:]:
        r = results[f.name]
        assert r.status is Status.SKIPPED and "converged" in r.message and "workspace not learned" in r.message
        assert r.workspace_bytes == 0
    # The database keeps what an earlier find measured, not the unlearned 0.
    with settings.override(find_patience=0):  # every candidate measured
        find(P, db=db, timer=FakeTimer(), candidates=converging([0, 0, 0, 0, 4096, 4096, 0, 4096]))
    with settings.override(find_patience=3):
        find(P, db=db, timer=FakeTimer(), candidates=converging([0, 0, 0, 0, 4096, 4096, 0, 4096]))
    stored = by_name(db.results(P))
    assert stored["fake:p5"].ok and stored["fake:p5"].workspace_bytes == 4096


def test_a_skipped_candidate_is_built_while_it_could_be_leaner_than_every_one_measured():
    fakes = converging([4096, 4096, 4096, 4096, 4096, 4096, 1024, 4096])
    with settings.override(find_patience=3):
        results = by_name(find(P, timer=FakeTimer(), candidates=fakes))
    assert [f.builds for f in fakes] == [1] * 8
    assert results["fake:p6"].ok and fakes[6].runs > 0  # the leaner one runs after convergence
    for name in ("fake:p4", "fake:p5", "fake:p7"):
        r = results[name]
        assert r.status is Status.SKIPPED and r.workspace_bytes == 4096 and "not learned" not in r.message


def test_a_pruned_candidate_is_not_built_when_nothing_can_be_leaner():
    big = ConvProblem("fwd", n=8, c=64, k=64, input_size=(28, 28), kernel_size=1)
    fast = CostlyWorkspace("gemm:1x1_fake", priced_like="gemm:1x1", time_ms=0.1)
    slow = CostlyWorkspace("direct:taps_fake", priced_like="direct:taps", time_ms=50.0, workspace_bytes=4096)
    with settings.override(find_prune_factor=1.0001, find_patience=0):
        results = by_name(find(big, timer=FakeTimer(), candidates=[fast, slow]))
    r = results["direct:taps_fake"]
    assert r.status is Status.SKIPPED and "predicted" in r.message and "workspace not learned" in r.message
    assert (fast.builds, slow.builds, slow.runs) == (1, 0, 0)


def test_a_budget_skip_builds_only_under_a_workspace_limit():
    def fakes():
        return [CostlyWorkspace(f"fake:n{i}", time_ms=1.0 + i, workspace_bytes=ws)
                for i, ws in enumerate([0, 1024, 4096])]

    free = fakes()
    results = by_name(find(P, Policy(max_candidates=1), timer=FakeTimer(), candidates=free))
    assert [f.builds for f in free] == [1, 0, 0]
    assert all("budget" in results[n].message and "workspace not learned" in results[n].message
               for n in ("fake:n1", "fake:n2"))
    limited = fakes()
    results = by_name(find(P, Policy(max_candidates=1, workspace_limit="2KiB"), timer=FakeTimer(), candidates=limited))
    assert [f.builds for f in limited] == [1, 1, 1]
    assert results["fake:n1"].status is Status.SKIPPED and results["fake:n1"].workspace_bytes == 1024
    assert results["fake:n2"].status is Status.OVER_WORKSPACE_LIMIT and results["fake:n2"].workspace_bytes == 4096


def test_under_a_workspace_limit_every_skipped_candidate_is_built():
    fakes = converging([0, 0, 0, 0, 1024, 1024, 0, 4096])
    with settings.override(find_patience=3):
        results = by_name(find(P, Policy(workspace_limit="2KiB"), timer=FakeTimer(), candidates=fakes))
    assert [f.builds for f in fakes] == [1] * 8
    assert results["fake:p5"].status is Status.SKIPPED and results["fake:p5"].workspace_bytes == 1024
    assert results["fake:p7"].status is Status.OVER_WORKSPACE_LIMIT


def _raising_from(method: str, exc: BaseException) -> Fake:
    """A plug-in whose ``method`` raises ``exc`` (``supports`` through the hook plug-ins override)."""
    def broken(self, *args, **kwargs):
        raise exc
    cls = type("Broken", (Fake,), {"_supports" if method == "supports" else method: broken})
    return cls("fake:broken")


@pytest.mark.parametrize("exc", [RuntimeError("broken plug-in"), SystemExit(3)], ids=["RuntimeError", "SystemExit"])
@pytest.mark.parametrize("method", ["supports", "buffers", "notes", "cost", "is_deterministic"])
def test_a_plug_in_that_raises_from_any_method_costs_itself_only(method, exc, caplog):
    from convtune import get, optimize, select, unsupported_reasons

    broken, good = _raising_from(method, exc), Fake("fake:good", time_ms=0.5)
    with isolated(broken, good, builtins=False):
        if method == "supports":
            assert [a.name for a in algorithms(P)] == ["fake:good"]
            assert f"supports() raised {type(exc).__name__}" in unsupported_reasons(P)["fake:broken"]
            assert f"fake:broken.supports() raised {type(exc).__name__}" in caplog.text
        else:
            assert unsupported_reasons(P) == {}
        assert get(P)[0].name == "fake:good"
        results = by_name(find(P, timer=FakeTimer()))
        assert results["fake:good"].ok
        if method != "cost":  # a cost model only orders the search: that candidate is measured all the same
            assert results["fake:broken"].status is Status.FAILED, results["fake:broken"]
        if method == "supports":  # not run: its status says what it raised
            assert f"supports() raised {type(exc).__name__}" in results["fake:broken"].message
        assert select(P, mode="get").algorithm == "fake:good"
        # timed for real here, where the two compute alike: a broken cost model may tie
        assert select(P, mode="find").algorithm in ({"fake:good", "fake:broken"} if method == "cost" else {"fake:good"})
        model = torch.nn.Sequential(torch.nn.Conv2d(P.c, P.k, 3, padding=1))
        x = torch.randn(P.n, P.c, *P.input_size)
        expected = model(x)
        tuned = optimize(model, x, mode="find")
        torch.testing.assert_close(tuned(x), expected)


@pytest.mark.parametrize("exc", [RuntimeError("broken backend"), SystemExit(3)], ids=["RuntimeError", "SystemExit"])
def test_a_backend_whose_algorithms_raise_is_a_failed_row_of_find_not_its_end(exc, caplog):
    from convtune.algorithms.base import Backend

    class BrokenBackend(Backend):
        prefix = "fakeb"

        def algorithms(self, problem):
            raise exc

    with isolated(BrokenBackend(), Fake("fake:good", time_ms=0.5), builtins=False):
        assert [a.name for a in algorithms(P)] == ["fake:good"]
        results = by_name(find(P, timer=FakeTimer()))
    assert results["fake:good"].ok
    assert results["fakeb:*"].status is Status.FAILED
    assert f"algorithms() raised {type(exc).__name__}" in results["fakeb:*"].message
    assert "backend fakeb offers nothing" in caplog.text


def test_a_database_that_cannot_be_written_loses_the_memory_not_the_answer(tmp_path, caplog):
    import sqlite3

    from convtune import TuningDB

    db = TuningDB(tmp_path / "t.sqlite")

    def refuse(problem, results):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    db.store = refuse
    results = find(P, timer=FakeTimer(), candidates=[Fake("fake:good")], db=db)
    assert results[0].algorithm == "fake:good" and results[0].ok
    assert "could not store the results" in caplog.text


@pytest.mark.parametrize("cheat, text", [
    (lambda: FirstCallOnly(after=1), "second input set"),  # garbage from its second run on
    (lambda: FirstCallOnly(after=3), "timed calls"),  # correct in both checks (and the determinism probe), then not
    (lambda: PoisonSniffer(), "second input set"),
    (lambda: Memoising(), "second input set"),
    (lambda: UniformSniffer(), "timed calls"),  # right in both checks (NaN, then one finite value), idle when timed
])
def test_a_candidate_that_is_right_only_when_checked_is_never_selected(cheat, text):
    bad, good = cheat(), Fake("fake:good", time_ms=5.0)
    bad.time_ms = 0.1  # the fastest, if it were right
    results = by_name(find(P, timer=FakeTimer(), candidates=[bad, good]))
    assert results[bad.name].status is Status.WRONG_RESULT and text in results[bad.name].message
    assert find(P, timer=FakeTimer(), candidates=[cheat(), good])[0].algorithm == "fake:good"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_one_wrong_element_fails_in_every_dtype(dtype):
    # 524,288 outputs: one zeroed element of typical size moves the relative L2 error by 1.4e-3
    problem = ConvProblem("fwd", n=8, c=8, k=64, input_size=(32, 32), kernel_size=3, padding=1, dtype=dtype)
    inputs, ref = reference_case(problem)
    out = problem.empty(problem.operand_shapes[2])
    err, ok, message = check(OneWrongElement(), problem, inputs, ref, out, None)
    if dtype != "float32":  # the norm alone misses it; the element bound does not
        assert err < tolerance(problem, OneWrongElement().notes(problem))
        assert not ok and "elements are wrong" in message
    assert not ok
    results = by_name(find(problem, timer=FakeTimer(),
                           candidates=[OneWrongElement(time_ms=0.1), Fake("fake:good", time_ms=100.0)]))
    assert results["fake:one_wrong"].status is Status.WRONG_RESULT
    _, ok, _ = check(get_algorithm("torch:native"), problem, inputs, ref, out, None)
    assert ok  # and the element bound passes PyTorch's own convolution
    if dtype != "float32":
        with settings.override(element_factor=0):  # the bound off: the norm alone, which misses it
            assert check(OneWrongElement(), problem, inputs, ref, out, None)[1]


@pytest.mark.parametrize("dtype, most", [("float32", 0.002), ("float16", 0.012), ("bfloat16", 0.10)])
def test_an_element_zeroed_anywhere_is_seen_but_where_the_reference_is_near_zero(dtype, most):
    # The element bound (verify's docstring) lets a zeroed element through only where |ref_i| is within
    # element_factor x tolerance / (1 - that) of the RMS: for a normal reference about 0.04%, 0.8% and 7% of the
    # positions in float32, float16 and bfloat16.
    problem = ConvProblem("fwd", n=2, c=16, k=32, input_size=(12, 12), kernel_size=3, padding=1, dtype=dtype)
    inputs, ref = reference_case(problem)
    out = problem.empty(problem.operand_shapes[2])
    get_algorithm("torch:native").run(problem, *inputs, workspace=None, out=out)
    bound = tolerance(problem, get_algorithm("torch:native").notes(problem))
    assert judge(*errors(out, ref), bound)[0]
    positions = torch.randperm(out.numel(), generator=torch.Generator().manual_seed(0))[:1000]
    passed = 0
    for i in positions.tolist():
        wrong = out.clone()
        wrong.view(-1)[i] = 0
        passed += judge(*errors(wrong, ref), bound)[0]
    assert passed <= most * len(positions), passed


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_errors_read_as_in_float64_within_a_few_parts_in_100000(dtype):
    # errors() compares a float32, float16 or bfloat16 result in float32 (half the traffic of float64): the same
    # figures as computed in float64, to a few parts in 100,000 of themselves, for errors of 1e-8 to 1
    import math

    gen = torch.Generator().manual_seed(1)
    ref = torch.randn(4, 16, 24, 24, dtype=torch.float64, generator=gen)
    ref.view(-1)[:7] = 0  # exact zeros in the reference: the element bound's scale is rms(ref) there
    for size in (1e-8, 1e-4, 1e-2, 1.0):
        out = (ref + size * torch.randn(ref.shape, dtype=torch.float64, generator=gen)).to(getattr(torch, dtype))
        diff = out.double() - ref
        rel = float(diff.norm() / ref.norm())
        worst = float((diff.abs() / (ref.abs() + ref.norm() / math.sqrt(ref.numel()))).max())
        got_rel, got_worst = errors(out, ref)
        assert got_rel == pytest.approx(rel, rel=5e-5, abs=1e-7) and got_worst == pytest.approx(worst, rel=5e-5,
                                                                                                abs=1e-7), size
    out = ref.to(getattr(torch, dtype))
    out.view(-1)[3] = float("nan")
    assert errors(out, ref) == (math.inf, math.inf)


def test_a_find_where_everything_failed_keeps_the_good_results_stored_before(tmp_path):
    from convtune import TuningDB

    with TuningDB(tmp_path / "t.sqlite") as db:
        find(P, timer=FakeTimer(), candidates=[Fake("fake:good")], db=db)
        assert db.lookup(P).algorithm == "fake:good"
        find(P, timer=FakeTimer(), candidates=[Raising("fake:good", RuntimeError("device in trouble"))], db=db)
        assert db.lookup(P).algorithm == "fake:good" and db.lookup(P).ok


def test_a_candidate_slower_than_its_deadline_is_a_timeout_and_the_search_goes_on():
    sleeper, good = Fake("fake:sleeper", time_ms=300.0, sleep=True), Fake("fake:good", time_ms=5.0)
    results = by_name(find(P, Policy(deadline_s=0.1), timer=FakeTimer(), candidates=[sleeper, good]))
    assert results["fake:sleeper"].status is Status.TIMEOUT and "deadline" in results["fake:sleeper"].message
    assert sleeper.runs == 2  # checked on both input sets, then left: not timed
    assert results["fake:good"].status is Status.OK


class SlowAfterItsFirstRun(Fake):
    def compute(self, problem, a, b, out) -> None:
        super().compute(problem, a, b, out)
        if self.runs > 1:
            time.sleep(0.3)


def test_the_deadline_is_held_after_every_run_not_only_the_first():
    late = SlowAfterItsFirstRun("fake:late")
    results = by_name(find(P, Policy(deadline_s=0.1), timer=FakeTimer(), candidates=[late, Fake("fake:good")]))
    assert results["fake:late"].status is Status.TIMEOUT and "deadline" in results["fake:late"].message
    assert late.runs == 2 and results["fake:good"].ok  # not timed: the search went on


def test_the_timing_ends_at_the_deadline():
    timer = FakeTimer()
    with settings.override(timing_budget_s=30.0):
        assert find(P, Policy(deadline_s=2.0), timer=timer, candidates=[Fake("fake:ok")])[0].ok
        assert find(P, timer=timer, candidates=[Fake("fake:ok")])[0].ok  # the default deadline: 60 s
    assert 0 < timer.calls[0]["budget_s"] <= 2.0 and timer.calls[1]["budget_s"] == 30.0


def test_a_slow_candidate_that_memoises_is_wrong_not_the_slow_answer():
    # Where nothing finishes within the deadline the fastest timeout answers; it must be right on a second input
    # set too, as every answer is.
    results = by_name(find(P, Policy(deadline_s=0.05), timer=FakeTimer(),
                           candidates=[Memoising("fake:memo", time_ms=150.0, sleep=True)]))
    assert results["fake:memo"].status is Status.WRONG_RESULT and "second input set" in results["fake:memo"].message


def test_a_candidate_slower_than_its_deadline_that_writes_into_its_inputs_fails_and_runs_no_more():
    writer = InputWriter("fake:slowwriter", time_ms=300.0, sleep=True)
    results = by_name(find(P, Policy(deadline_s=0.1), timer=FakeTimer(), candidates=[writer, Fake("fake:good")]))
    assert results["fake:slowwriter"].status is Status.FAILED and "input" in results["fake:slowwriter"].message
    assert writer.runs == 1


def test_where_no_candidate_finishes_within_the_deadline_the_fastest_right_one_answers():
    slow, slower = Fake("fake:slow", time_ms=150.0, sleep=True), Fake("fake:slower", time_ms=300.0, sleep=True)
    results = by_name(find(P, Policy(deadline_s=0.05), timer=FakeTimer(), candidates=[slower, slow]))
    assert results["fake:slow"].ok and "timed once" in results["fake:slow"].message
    assert results["fake:slower"].status is Status.TIMEOUT


def test_a_find_where_everything_failed_does_not_keep_what_it_found_wrong(tmp_path):
    from convtune import TuningDB

    with TuningDB(tmp_path / "t.sqlite") as db:
        find(P, timer=FakeTimer(), candidates=[Fake("fake:x")], db=db)
        find(P, timer=FakeTimer(), candidates=[WrongResult("fake:x")], db=db)
        assert db.lookup(P) is None and db.results(P)[0].status is Status.WRONG_RESULT


def test_a_problem_whose_operands_exceed_the_devices_memory_is_refused_before_anything_runs():
    from convtune import hardware

    huge = ConvProblem("fwd", n=100_000, c=1024, k=1024, input_size=(1024, 1024), kernel_size=3)
    fake = Fake("fake:a")
    assert huge.min_bytes > hardware.memory_bytes("cpu") > 0
    with pytest.raises(ValueError, match=r"operands take .* more than the .* memory of cpu"):
        find(huge, candidates=[fake])
    assert fake.runs == 0
    small = huge.replace(n=1, c=4, k=4, input_size=(8, 8))
    assert find(small, candidates=[fake])[0].ok  # and a problem that fits runs as before


def test_a_reference_that_does_not_fit_in_memory_is_refused_naming_the_problem(monkeypatch):
    # operands that fit, but not with their float64 reference beside them (what an allocator says when it cannot)
    measure_module = importlib.import_module("convtune.measure")

    def out_of_memory(problem, seed):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 4829479200 bytes")

    monkeypatch.setattr(measure_module, "reference_case", out_of_memory)
    fake = Fake("fake:a")
    with pytest.raises(ValueError, match=rf"{re.escape(P.key)}: its inputs and float64 reference.* do not fit in "
                                         rf"the memory free on cpu.* measure a smaller batch or spatial size"):
        find(P, timer=FakeTimer(), candidates=[fake])
    assert fake.runs == 0

    def silent(problem, seed):  # an allocator's error with nothing to say
        raise torch.OutOfMemoryError()

    monkeypatch.setattr(measure_module, "reference_case", silent)
    with pytest.raises(ValueError, match="do not fit in the memory free on cpu"):
        find(P, timer=FakeTimer(), candidates=[fake])

    def broken(problem, seed):
        raise RuntimeError("a fault of another kind")

    monkeypatch.setattr(measure_module, "reference_case", broken)
    with pytest.raises(RuntimeError, match="another kind"):  # not taken for a lack of memory
        find(P, timer=FakeTimer(), candidates=[fake])


class Preparing(Fake):
    """A fake with one-time work to do ahead (``Algorithm.prepare``), logged with its runs in ``log``."""

    def __init__(self, name: str, log: list, fails: bool = False, **kw):
        super().__init__(name, **kw)
        self.log, self.fails = log, fails

    def prepare(self, problem):
        self.log.append(("prepare", self.name))
        if self.fails:
            raise RuntimeError("a compiler fault")

    def _run(self, problem, a, b, out, ws):
        self.log.append(("run", self.name))
        return super()._run(problem, a, b, out, ws)


def test_find_prepares_the_next_candidates_ahead_of_their_runs_and_not_those_it_will_skip(monkeypatch):
    pytest.importorskip("triton")
    find_module = importlib.import_module("convtune.find")
    monkeypatch.setattr(find_module._Ahead, "_wanted", lambda self: True)  # on CUDA only; the CPU stands in
    log: list = []
    fakes = [Preparing(f"fake:p{i}", log, time_ms=1.0 + 0.1 * i) for i in range(8)]
    with settings.override(find_patience=3, find_compile_threads=2):
        results = by_name(find(P, timer=FakeTimer(), candidates=fakes))
    ran = [name for name, r in results.items() if r.status is Status.OK]
    prepared = [name for kind, name in log if kind == "prepare"]
    assert len(ran) == 4 and len(prepared) == len(set(prepared))  # each at most once
    for name in ran:  # each before its first run
        assert log.index(("prepare", name)) < log.index(("run", name))
    # two ahead of the one running: p0-p2 before p0 runs; none the converged search skips
    assert [kind for kind, _ in log[:4]] == ["prepare", "prepare", "prepare", "run"]
    assert set(prepared) == {f"fake:p{i}" for i in range(6)}
    with settings.override(find_patience=3, find_compile_threads=0):
        log.clear()
        find(P, timer=FakeTimer(), candidates=fakes)
    assert all(kind == "run" for kind, _ in log)
    import concurrent.futures

    import triton

    with concurrent.futures.ThreadPoolExecutor(1) as pool, triton.AsyncCompileMode(pool):
        pass  # find left no mode of its own behind


def test_a_converged_search_runs_its_contenders_prepared_ahead_and_a_contenders_gain_resumes_it(monkeypatch):
    # p0..p11, each slower than the one before but p7 and p9: with patience 2 the search converges after p2; p7 and
    # p9 are contenders (a problem like this one timed them near its best) and run all the same, prepared ahead;
    # p9 beats the best, so the search resumes: p10 and p11 run (no contenders), p11 being the fastest
    pytest.importorskip("triton")
    find_module = importlib.import_module("convtune.find")
    monkeypatch.setattr(find_module._Ahead, "_wanted", lambda self: True)  # on CUDA only; the CPU stands in
    log: list = []
    times = [1.0 + 0.1 * i for i in range(12)]
    times[9], times[11] = 0.5, 0.3
    fakes = [Preparing(f"fake:p{i}", log, time_ms=t) for i, t in enumerate(times)]
    for i, fake in enumerate(fakes):
        fake.place = i  # its place in its backend's order, which the learned model reads
    asked = []

    def contenders(self, problem, named, factor):
        asked.append((list(named), factor))
        return frozenset({"fake:p7", "fake:p9"}) if factor else frozenset()  # as Corrections.contenders

    monkeypatch.setattr(costmodel.Corrections, "contenders", contenders)
    monkeypatch.setattr(find_module, "ranked_predictions", lambda *args, **kwargs: [
        (fake, PerfResult(fake.name, Status.OK, time_ms=1.0)) for fake in fakes])
    with settings.override(find_patience=2, find_compile_threads=2, find_contender_factor=1.25, isolate="off"):
        results = by_name(find(P, timer=FakeTimer(), candidates=fakes))
    ran = [name for name, r in results.items() if r.status is Status.OK]
    assert sorted(ran) == sorted(f"fake:p{i}" for i in (0, 1, 2, 7, 9, 10, 11))
    assert all("converged" in results[f"fake:p{i}"].message for i in (3, 4, 5, 6, 8))
    for name in ran:  # each prepared before it runs
        assert log.index(("prepare", name)) < log.index(("run", name)), name
    assert asked == [([(f.name, f.place) for f in fakes], 1.25)]  # the candidates with their places, and the factor
    with settings.override(find_patience=2, find_contender_factor=0, isolate="off"):  # the rule off: asked for none
        asked.clear()
        results = by_name(find(P, timer=FakeTimer(), candidates=fakes))
    assert asked == [([(f.name, f.place) for f in fakes], 0)]
    assert sorted(n for n, r in results.items() if r.ok) == [f"fake:p{i}" for i in (0, 1, 2)]


def test_find_prepares_no_candidate_its_policy_refuses_and_none_beyond_its_budget(monkeypatch):
    # every other fake needs 4 MiB of workspace, over the policy's limit: refused before it could run, it is not
    # compiled ahead, nor counted among the two ahead; and no more are prepared than the budget lets run
    pytest.importorskip("triton")
    find_module = importlib.import_module("convtune.find")
    monkeypatch.setattr(find_module._Ahead, "_wanted", lambda self: True)  # on CUDA only; the CPU stands in
    log: list = []
    fakes = [Preparing(f"fake:w{i}", log, time_ms=1.0 + 0.1 * i, workspace_bytes=(4 << 20) * (i % 2))
             for i in range(8)]
    with settings.override(find_patience=0, find_compile_threads=2):
        results = by_name(find(P, Policy(workspace_limit="1MiB"), timer=FakeTimer(), candidates=fakes))
    prepared = [name for kind, name in log if kind == "prepare"]
    assert sorted(prepared) == [f"fake:w{i}" for i in (0, 2, 4, 6)]
    assert all(results[f"fake:w{i}"].status is Status.OVER_WORKSPACE_LIMIT for i in (1, 3, 5, 7))
    assert [kind for kind, _ in log[:4]] == ["prepare", "prepare", "prepare", "run"]  # w0, w2, w4 before w0 runs
    log.clear()
    with settings.override(find_patience=0, find_compile_threads=4):
        results = by_name(find(P, Policy(max_candidates=2), timer=FakeTimer(), candidates=fakes))
    ran = sorted(name for name, r in results.items() if r.ok)
    assert len(ran) == 2 and sorted(name for kind, name in log if kind == "prepare") == ran


def test_a_candidate_left_for_its_price_is_prepared_once_its_familys_first_timing_brings_its_price_down(monkeypatch):
    # tt:k_fwd_a, its family's first try, is priced by a guess (40 ms, never pruned for it) and runs in 0.9 ms: its
    # family's prices come down 40-fold, so tt:k_fwd_b (45 ms, left when first looked at: over 10x the best 1 ms)
    # runs, and is prepared before it does
    pytest.importorskip("triton")
    find_module = importlib.import_module("convtune.find")
    monkeypatch.setattr(find_module._Ahead, "_wanted", lambda self: True)  # on CUDA only; the CPU stands in
    log: list = []
    measured = {"gg:a": 1.0, "tt:k_fwd_a": 0.9, "gg:b": 1.1, "tt:k_fwd_b": 0.5}
    predicted = {"gg:a": 1.0, "tt:k_fwd_a": 40.0, "gg:b": 1.2, "tt:k_fwd_b": 45.0}
    fakes = {name: Preparing(name, log, time_ms=ms) for name, ms in measured.items()}
    fakes["gg:a"].place = 3  # its place in its backend's order: the learned model reads it
    asked = []

    def guessed(self, name, problem, place=None):
        asked.append((name, place))
        return name == "tt:k_fwd_a"

    monkeypatch.setattr(costmodel.Corrections, "guessed", guessed)
    monkeypatch.setattr(find_module, "ranked_predictions", lambda *args, **kwargs: [
        (fakes[name], PerfResult(name, Status.OK, time_ms=predicted[name])) for name in fakes])
    with settings.override(find_patience=0, find_prune_factor=10.0, find_compile_threads=2, isolate="off"):
        results = by_name(find(P, timer=FakeTimer(), candidates=list(fakes.values())))
    assert all(r.ok for r in results.values())
    assert log.index(("prepare", "tt:k_fwd_b")) < log.index(("run", "tt:k_fwd_b"))
    assert sorted(asked) == [("gg:a", 3), ("tt:k_fwd_a", None)]  # the families' first tries, with their places


def test_a_failing_prepare_or_a_callers_compile_mode_changes_no_result(monkeypatch):
    pytest.importorskip("triton")
    import concurrent.futures

    import triton

    find_module = importlib.import_module("convtune.find")
    log: list = []
    plain = [Fake(f"fake:r{i}", time_ms=1.0 + i) for i in range(3)]
    expected = [(r.algorithm, r.status) for r in find(P, timer=FakeTimer(), candidates=plain)]
    failing = [Preparing(f"fake:r{i}", log, fails=True, time_ms=1.0 + i) for i in range(3)]
    monkeypatch.setattr(find_module._Ahead, "_wanted", lambda self: True)
    with settings.override(find_compile_threads=2):
        assert [(r.algorithm, r.status) for r in find(P, timer=FakeTimer(), candidates=failing)] == expected
        assert ("prepare", "fake:r2") in log
        log.clear()
        with concurrent.futures.ThreadPoolExecutor(1) as pool, triton.AsyncCompileMode(pool):
            assert [(r.algorithm, r.status) for r in find(P, timer=FakeTimer(), candidates=failing)] == expected
            with pytest.raises(RuntimeError):  # the caller's mode is still the active one
                triton.AsyncCompileMode(pool).__enter__()
        assert log and all(kind == "run" for kind, _ in log)  # the caller's mode is theirs: no head start
        monkeypatch.undo()
        log.clear()
        find(P, timer=FakeTimer(), candidates=failing)  # a CPU problem: Triton compiles nothing for it
    assert all(kind == "run" for kind, _ in log)


def test_find_ends_with_compiles_still_queued_and_waits_only_for_the_running_one(monkeypatch):
    # A converged search leaves compiles of candidates it will not run queued on the compile threads: find cancels
    # them and returns; a compile already running is waited for (its kernel is kept).
    pytest.importorskip("triton")
    import threading

    import triton

    find_module = importlib.import_module("convtune.find")
    monkeypatch.setattr(find_module._Ahead, "_wanted", lambda self: True)
    modes, compiled = [], []

    class Recorded(triton.AsyncCompileMode):
        def __enter__(self):
            modes.append(self)
            return super().__enter__()

    monkeypatch.setattr(triton, "AsyncCompileMode", Recorded)

    class Compiling(Fake):
        def prepare(self, problem):  # what a Triton warm-up does under the mode: one compile submitted
            def compile_it(name=self.name):
                time.sleep(0.3)
                compiled.append(name)
                return name

            modes[-1].submit(self.name, compile_it, lambda kernel: None)

    fakes = [Compiling(f"fake:c{i}", time_ms=1.0 + 0.1 * i) for i in range(12)]
    done: list = []
    with settings.override(find_patience=2, find_compile_threads=1):
        worker = threading.Thread(target=lambda: done.append(find(P, timer=FakeTimer(), candidates=fakes)), daemon=True)
        worker.start()
        worker.join(timeout=60)
    assert not worker.is_alive(), "find waited on compiles it had cancelled"
    assert len([r for r in done[0] if r.status is Status.OK]) == 3  # converged after 2 without gain
    assert compiled[:1] == ["fake:c0"] and len(compiled) < 3 + 1  # the one running at the end, none queued


def test_on_the_cpu_the_pick_is_timed_again_against_pytorchs_call_in_alternating_rounds():
    # As if PyTorch's call had been timed while another process loaded the CPU (5 ms) and the others not: the pick
    # timed again in turns with it, each known by the median of its rounds (the fake timer gives each fake's own time;
    # a fake stands in for PyTorch's call), and again while the pick changes to one not timed so
    from convtune.find import _confirm
    from convtune.measure import CONFIRM_ROUNDS, Search

    fakes = {f.name: f for f in (Fake("fake:a", time_ms=3.0), Fake("fake:b", time_ms=1.2),
                                 Fake("torch:native", time_ms=2.0))}
    first = [PerfResult("fake:a", Status.OK, time_ms=1.0, rel_error=0.0),
             PerfResult("fake:b", Status.OK, time_ms=1.5, rel_error=0.0),
             PerfResult("torch:native", Status.OK, time_ms=5.0, rel_error=0.0),
             PerfResult("fake:wrong", Status.WRONG_RESULT, rel_error=1.0)]
    timer = FakeTimer()
    search = Search(P, Policy(), timer, None)
    again = _confirm(search, first, fakes)
    assert len(timer.calls) == 2 * 2 * CONFIRM_ROUNDS and again[3] is first[3]  # a, then b, each against native
    named = by_name(again)
    assert [named[n].time_ms for n in ("fake:a", "fake:b", "torch:native")] == pytest.approx([3.0, 1.2, 2.0])
    assert "timed again against torch:native in alternating rounds (first 1 ms)" in named["fake:a"].message
    assert "timed again against fake:b" in named["torch:native"].message
    assert rank(again, Policy())[0].algorithm == "fake:b" and search.best_ms == pytest.approx(1.2)
    # left as measured: the policy's pick is PyTorch's call (a tie within the tolerance goes to it), PyTorch's call is
    # not usable, the rounds would take over a second, a time budget or a deadline, or a pick that fails now
    slow = [dataclasses.replace(r, time_ms=r.time_ms * 300) if r.ok else r for r in first]
    tie = [dataclasses.replace(first[0], time_ms=4.95), first[2]]  # within 2%: the tie goes to PyTorch's call
    failing = Fake("fake:a", time_ms=3.0)
    failing.launcher = lambda *args: (_ for _ in ()).throw(RuntimeError("flaky"))
    cases = [(tie, Policy(), fakes), (first[:2] + first[3:], Policy(), fakes), (slow, Policy(), fakes),
             (first, Policy(budget_s=60), fakes), (first, Policy(deadline_s=60), fakes),
             (first, Policy(), {**fakes, "fake:a": failing})]
    for results, policy, named_algorithms in cases:
        assert _confirm(Search(P, policy, FakeTimer(), None), results, named_algorithms) == results
    # find confirms with its own timer on the CPU only: a fake or another timer is left as it measured
    assert "timed again" not in by_name(find(P, timer=FakeTimer(), candidates=[Fake("fake:fast", time_ms=0.0),
                                                                               get_algorithm("torch:native")]))["fake:fast"].message


def test_a_result_cut_short_before_its_determinism_was_probed_promises_none():
    # an algorithm that does not know whether it is deterministic, past the deadline before its two runs were compared:
    # the slow answer a deterministic policy gets must not be it
    noisy = UnknownDeterminism("fake:noisy", noisy=True, time_ms=100, sleep=True)
    results = find(P, Policy(deterministic=True, deadline_s=0.05), timer=FakeTimer(), candidates=[noisy])
    assert results[0].deterministic is False and not rank(results, Policy(deterministic=True))
