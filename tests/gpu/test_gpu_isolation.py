"""Isolation on the GPU: a plug-in measured in its worker on CUDA, and one that poisons the CUDA context
costs itself only (the worker ends; this process's context is untouched)."""

from __future__ import annotations

import pytest
import torch

import adversaries
import convtune as ct
from convtune import isolation
from convtune.algorithms.registry import get_algorithm
from convtune.problem import ConvProblem
from convtune.results import Status
from convtune.settings import settings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

P = ConvProblem("fwd", n=8, c=32, k=32, input_size=(14, 14), kernel_size=3, padding=1, dtype="float16",
                layout="channels_last", device="cuda")


def test_a_poisoned_context_ends_the_worker_not_the_search():
    try:
        with settings.override(isolate="plugins", timing_budget_s=0.05):
            results = {r.algorithm: r for r in ct.find(P, candidates=[
                adversaries.PoisonsTheContext(), adversaries.Correct(), get_algorithm("torch:native")])}
    finally:
        isolation._worker.close()
    poisoned = results["plugin:poisons_the_context"]
    assert poisoned.status is Status.FAILED, poisoned
    assert results["plugin:correct"].ok and results["torch:native"].ok  # measured after it, in a new worker
    x, w = P.random_inputs()
    assert torch.isfinite(torch.nn.functional.conv2d(x, w, padding=1)).all()  # this process computes on
