"""Input fuzzing: whatever a user passes, ConvProblem, Policy and the command line either work or raise a
clean TypeError/ValueError (one line and exit status 2 for the CLI), never anything else."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import convtune as ct
from convtune.cli import main

ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.integers(min_value=-3, max_value=2**40), max_size=4).map(tuple),
    st.dictionaries(st.integers(0, 9), st.integers(0, 9), max_size=3), st.sets(st.integers(0, 9), max_size=3),
    st.just(torch.tensor([3])), st.just(math.inf),
)
PROBLEM_FIELDS = ("direction", "n", "c", "k", "input_size", "kernel_size", "stride", "padding", "dilation", "groups",
                  "dtype", "layout", "device", "allow_tf32")
POLICY_FIELDS = ("workspace_limit", "deterministic", "allow_tf32", "allow_reduced_precision", "max_rel_error", "prefer",
                 "tolerance", "max_candidates", "budget_s", "micro_batching", "deadline_s")
VALID = dict(direction="fwd", n=1, c=2, k=2, input_size=(6, 6), kernel_size=3)
FUZZ = hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.dictionaries(st.sampled_from(PROBLEM_FIELDS), ANYTHING, min_size=1, max_size=3))
def test_a_conv_problem_is_made_or_refused_cleanly(changes):
    try:
        p = ct.ConvProblem(**(VALID | changes))
    except (TypeError, ValueError):
        return
    assert ct.ConvProblem.from_key(p.key) == p  # what is accepted is a whole, valid problem


@FUZZ
@given(st.dictionaries(st.sampled_from(POLICY_FIELDS), ANYTHING, min_size=1, max_size=3))
def test_a_policy_is_made_or_refused_cleanly(changes):
    try:
        ct.Policy(**changes)
    except (TypeError, ValueError):
        pass


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["--n", "--c", "--k", "--size", "--kernel", "--stride", "--pad", "--groups", "--dtype",
                                 "--layout", "--workspace-limit", "--tolerance", "--max-candidates", "-1", "0", "3",
                                 "1e999", "nan", "64MiB", "9" * 40, "x", "3x3", "float16", "NHWC"]), max_size=8))
def test_the_command_line_never_reports_an_internal_error(capsys, argv):
    code = main(["get", *argv])
    err = capsys.readouterr().err
    assert code in (0, 2) and "internal error" not in err, (argv, err)
