"""Isolation: a candidate that crashes, hangs or exits costs itself only, never the search or the process."""

from __future__ import annotations

import os

import pytest
import torch

import adversaries
import convtune as ct
from convtune import isolation
from convtune.algorithms.registry import get_algorithm
from convtune.problem import ConvProblem
from convtune.results import Status
from convtune.settings import settings

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


def test_one_worker_serves_every_find_until_a_candidate_ends_it(workers):
    with settings.override(isolate="all"):
        ct.find(P, candidates=[adversaries.Correct()])
        first = isolation._worker._process
        ct.find(P.replace(n=3), candidates=[adversaries.Correct(), get_algorithm("torch:native")])
        assert isolation._worker._process is first and first.is_alive() and first.pid != os.getpid()
        ct.find(P, candidates=[adversaries.Exits()])
        assert not first.is_alive()
        assert by_name(ct.find(P, candidates=[adversaries.Correct()]))["plugin:correct"].ok  # a new worker


def test_what_stays_in_the_process(workers):
    with settings.override(isolate="plugins"):
        assert isolation.wanted(adversaries.Correct()) and not isolation.wanted(get_algorithm("torch:native"))
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
