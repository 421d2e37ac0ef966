"""Isolation: a candidate that crashes, hangs or exits costs itself only, never the search or the process."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import adversaries
import convtune as ct
from convtune import isolation
from convtune.algorithms.registry import get_algorithm
from convtune.problem import ConvProblem
from convtune.results import Status
from convtune.settings import settings
from fakes import FakeTimer

P = ConvProblem("fwd", n=2, c=4, k=4, input_size=(6, 6), kernel_size=3, padding=1)


@pytest.fixture
def workers():
    """Isolation on (the suite measures in the process), timing short, and the worker ended after the test."""
    with settings.override(timing_budget_s=0.02, timing_min_repeats=1, timing_max_repeats=3):
        yield
    isolation._worker.close()


def by_name(results):
    return {r.algorithm: r for r in results}


def test_crashes_hangs_and_exits_cost_the_candidate_only(workers):
    adversarial = [adversaries.Exits(), adversaries.Segfaults(), adversaries.Hangs(), adversaries.CallsExit()]
    with settings.override(isolate="plugins"):
        results = by_name(ct.find(P, ct.Policy(deadline_s=0.5), candidates=[*adversarial, adversaries.Correct(),
                                                                              get_algorithm("torch:native")]))
    assert results["plugin:exits"].status is Status.FAILED and "exit code 3" in results["plugin:exits"].message
    assert results["plugin:segfaults"].status is Status.FAILED and "died" in results["plugin:segfaults"].message
    assert results["plugin:hangs"].status is Status.TIMEOUT and "killed" in results["plugin:hangs"].message
    assert results["plugin:calls_exit"].status is Status.FAILED and "SystemExit" in results["plugin:calls_exit"].message
    # the search went on: the right plug-in (in its worker) and torch:native (here) were timed
    assert results["plugin:correct"].ok and results["torch:native"].ok
    # and this process is untouched: it still computes
    x, w = P.random_inputs()
    assert torch.isfinite(torch.nn.functional.conv2d(x, w, padding=1)).all()


def test_a_plugin_that_allocates_beyond_its_declared_workspace_fails_in_its_worker(workers, caplog):
    hidden, small = adversaries.HiddenAllocation(), adversaries.HiddenAllocation(64 << 10)
    small.name = "plugin:small_hidden"  # within the slack
    with settings.override(isolate="plugins"):
        results = by_name(ct.find(P, candidates=[hidden, small, adversaries.Correct()]))
        r = results["plugin:hidden_allocation"]
        assert r.status is Status.FAILED and "allocated 64.0 MiB" in r.message and "workspace of 0 B" in r.message
        assert results["plugin:small_hidden"].ok and results["plugin:correct"].ok
        lean = ct.find(P, ct.Policy(workspace_limit=0), candidates=[adversaries.HiddenAllocation(),
                                                                     adversaries.Correct()])
        assert lean[0].algorithm == "plugin:correct"
    with settings.override(isolate="off"):  # measured here on the CPU, where the check would disturb the process:
        assert by_name(ct.find(P, candidates=[adversaries.HiddenAllocation()]))["plugin:hidden_allocation"].ok
    assert "plugin:hidden_allocation is a plug-in measured in this process" in caplog.text  # and it says so


@pytest.mark.parametrize("readings, limit, expected", [
    ([(1 << 10, True)], None, None), ([(64 << 20, True), (64 << 20, False)], None, Status.FAILED),
    ([(64 << 20, True), (1 << 10, False)], None, None), ([(64 << 20, False), (64 << 20, False)], None, None),
    ([(64 << 20, False), (64 << 20, False)], 0, Status.SKIPPED), ([(1 << 10, False)], 0, None)],
    ids=["within", "over-twice", "over-on-its-first-call-only", "untold", "untold-under-a-limit",
         "within-by-its-bound"])
def test_in_the_process_on_cuda_what_the_allocator_can_tell_decides(readings, limit, expected, monkeypatch):
    # (On CUDA a plug-in measured in this process is held to its declaration by the caching allocator's figures,
    # which may only bound what it allocated: tests/gpu/test_gpu_algorithms.py measures them for real.)
    import importlib

    measure = importlib.import_module("convtune.measure")
    left = list(readings)
    monkeypatch.setattr(measure, "allocated_while", lambda run: (run(), left.pop(0))[1])
    search = measure.Search(P, ct.Policy(workspace_limit=limit), FakeTimer(), None)
    ran = []
    with settings.override(isolate="plugins"):
        status, why = search._allocation_here(adversaries.Correct(), lambda: ran.append(1))
    assert left == [] and len(ran) == len(readings) and status is expected
    if expected is Status.FAILED:
        assert "allocated 64.0 MiB while running" in why
    if expected is Status.SKIPPED:
        assert "could not be told" in why and "CONVTUNE_ISOLATE=off" in why


def test_in_the_background_worker_nothing_is_read_beside_the_callers_work(monkeypatch):
    import importlib

    measure = importlib.import_module("convtune.measure")

    def never(run):
        raise AssertionError("read the allocator (and synchronized the device) in the background")

    monkeypatch.setattr(measure, "allocated_while", never)
    monkeypatch.setattr(measure.background, "in_worker", lambda: True)
    with settings.override(isolate="plugins"):
        free = measure.Search(P, ct.Policy(), FakeTimer(), None)._allocation_here(adversaries.Correct(), None)
        held = measure.Search(P, ct.Policy(workspace_limit=0), FakeTimer(), None)._allocation_here(
            adversaries.Correct(), None)
    assert free == (None, "") and held[0] is Status.SKIPPED and "in the background" in held[1]


def test_one_worker_serves_every_find_until_a_candidate_ends_it(workers):
    with settings.override(isolate="all"):
        ct.find(P, candidates=[adversaries.Correct()])
        first = isolation._worker._process
        ct.find(P.replace(n=3), candidates=[adversaries.Correct(), get_algorithm("torch:native")])
        assert isolation._worker._process is first and first.poll() is None and first.pid != os.getpid()
        ct.find(P, candidates=[adversaries.Exits()])
        assert first.poll() == 3
        assert by_name(ct.find(P, candidates=[adversaries.Correct()]))["plugin:correct"].ok  # a new worker


def test_what_stays_in_the_process(workers):
    with settings.override(isolate="plugins"):
        assert isolation.wanted(adversaries.Correct()) and not isolation.wanted(get_algorithm("torch:native"))
        from convtune.algorithms.microbatch import MicroBatch

        assert isolation.wanted(MicroBatch(adversaries.Correct(), [(1, 2)]))  # it runs the plug-in's code
        assert not isolation.wanted(MicroBatch("torch:native", [(1, 2)]))
    with settings.override(isolate="all"):
        assert isolation.wanted(get_algorithm("torch:native"))
        assert not isolation.wanted(Unpicklable())  # cannot be sent: measured here
    with settings.override(isolate="off"):
        assert not isolation.wanted(adversaries.Correct())


class Unpicklable(adversaries.Correct):
    name = "plugin:unpicklable"

    def __init__(self) -> None:
        super().__init__()
        self.handle = lambda: None  # a lambda does not pickle


def test_in_the_process_systemexit_and_late_writes_cost_the_candidate_only():
    # isolation off (the suite's default): SystemExit from a candidate is its failure, not the process's end;
    # a candidate that writes into its inputs only while timed fails, and the inputs are put back for the rest
    late = adversaries.WritesItsInputsLater()
    results = by_name(ct.find(P, candidates=[adversaries.CallsExit(), late, get_algorithm("torch:native")]))
    assert results["plugin:calls_exit"].status is Status.FAILED and "SystemExit" in results["plugin:calls_exit"].message
    assert results["plugin:writes_inputs_later"].status is Status.FAILED
    assert "input operands" in results["plugin:writes_inputs_later"].message
    assert results["torch:native"].ok


def test_an_interrupted_measurement_leaves_no_answer_for_the_next(workers, monkeypatch):
    # Interrupted while waiting for the worker (Ctrl-C in a notebook): the worker is ended, and the next
    # find gets its own candidate's result, never the interrupted one's.
    with settings.override(isolate="all"):
        calls = {"n": 0}
        real = isolation.Worker._reply

        def interrupted(self, task_id, limit_s):
            calls["n"] += 1
            if calls["n"] == 2:  # after the worker said its reference is ready
                raise KeyboardInterrupt
            return real(self, task_id, limit_s)

        monkeypatch.setattr(isolation.Worker, "_reply", interrupted)
        with pytest.raises(KeyboardInterrupt):
            ct.find(P, candidates=[adversaries.Correct()])
        monkeypatch.setattr(isolation.Worker, "_reply", real)
        results = ct.find(P.replace(n=3), candidates=[get_algorithm("torch:native")])
        assert [r.algorithm for r in results] == ["torch:native"] and results[0].ok


def test_finds_in_threads_each_get_their_own_answers(workers):
    answers: list[list[str]] = []

    def run(candidate):
        for _ in range(3):
            answers.append([r.algorithm for r in ct.find(P, candidates=[candidate])])

    with settings.override(isolate="all"):
        threads = [threading.Thread(target=run, args=(c,)) for c in (adversaries.Correct(),
                                                                      get_algorithm("torch:native"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(map(tuple, answers)) == [("plugin:correct",)] * 3 + [("torch:native",)] * 3


def test_the_worker_sees_the_settings_of_the_moment(workers, monkeypatch):
    with settings.override(isolate="all"):
        ct.find(P, candidates=[adversaries.Correct()])  # the worker is up before the setting changes
        monkeypatch.setenv("CONVTUNE_VERIFY_SEED", "7")
        with settings.override():
            assert by_name(ct.find(P, candidates=[adversaries.RightOnlyUnderSeed7()]))[
                "plugin:right_under_seed_7"].ok


def test_what_cannot_go_to_a_worker_is_measured_here(workers):
    class InMain(adversaries.Correct):
        name = "plugin:in_main"

    InMain.__module__ = "__main__"  # as a class defined in a script or a notebook
    with settings.override(isolate="all"):
        assert not isolation.wanted(InMain())
        assert not isolation.wanted(adversaries.Correct(), timer=lambda fn, **kw: None)  # a timer that cannot go
        results = by_name(ct.find(P, candidates=[InMain()]))
        # what it allocates cannot be checked here, so a workspace limit cannot hold it: it is not selected
        limited = by_name(ct.find(P, ct.Policy(workspace_limit="1GiB"), candidates=[InMain()]))
        timer_stays = ct.find(P, ct.Policy(workspace_limit="1GiB"), candidates=[adversaries.Correct()],
                              timer=lambda fn, **kw: None)[0]  # the plug-in could go, its timer cannot
    assert timer_stays.status is Status.SKIPPED and "timer" in timer_stays.message
    assert results["plugin:in_main"].ok
    assert limited["plugin:in_main"].status is Status.SKIPPED and "not checked" in limited["plugin:in_main"].message
    with settings.override(isolate="off"):  # plug-ins trusted: measured here under a limit as well
        assert by_name(ct.find(P, ct.Policy(workspace_limit="1GiB"), candidates=[InMain()]))["plugin:in_main"].ok


def test_a_fork_while_another_thread_measures_does_not_deadlock_the_child():
    import time

    isolation._worker._lock.acquire()  # as a thread inside measure() holds it
    try:
        pid = os.fork()
        if pid == 0:  # the child: its worker (and lock) are its own
            try:
                isolation.release()
                os._exit(0)
            except BaseException:
                os._exit(1)
    finally:
        isolation._worker._lock.release()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on its parent's lock")
    assert os.waitstatus_to_exitcode(status) == 0


def test_no_worker_can_start_so_the_candidate_is_measured_here(workers, monkeypatch):
    monkeypatch.setattr(isolation.sys, "executable", "/nonexistent/python")
    with settings.override(isolate="all"):
        results = by_name(ct.find(P, candidates=[adversaries.Correct()]))
    assert results["plugin:correct"].ok


def test_a_worker_that_died_while_idle_is_not_the_next_candidates_fault(workers):
    import signal
    import time

    with settings.override(isolate="all"):
        ct.find(P, candidates=[adversaries.Correct()])
        process = isolation._worker._process
        os.kill(process.pid, signal.SIGKILL)  # killed between candidates (out of memory, say)
        process.wait(timeout=10)
        time.sleep(0.1)
        assert by_name(ct.find(P, candidates=[adversaries.Correct()]))["plugin:correct"].ok
