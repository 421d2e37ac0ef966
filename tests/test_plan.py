"""convtune.plan: one choice per layer under one workspace budget, shared or divided, exactly.

Most tests hand the planner a fake database of hand-made PerfResults, so the optimum is known
(by brute force over every combination); one runs the real ``find`` into a real TuningDB, and
the last ones check that ``optimize(..., workspace_budget=...)`` runs the plan's choices.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import math
import random

import pytest
import torch

import convtune
from convtune import ConvProblem, PerfResult, Policy, TuningDB
from convtune.algorithms.base import SUPPORTED, unsupported
from convtune.algorithms.registry import get_algorithm, isolated
from convtune.errors import NoAlgorithmError
from convtune.plan import BUDGET_MODES as MODES
from convtune.plan import InfeasibleBudgetError, Plan, budget_curve, pareto_front, plan
from convtune.pytorch import tuning as tuning_module
from convtune.ranking import usable
from fakes import Fake


@pytest.fixture(autouse=True)
def _fast(quick_timing):
    yield


def problem(i: int, direction: str = "fwd") -> ConvProblem:
    return ConvProblem(direction, n=1, c=2, k=2 + i, input_size=(6, 6), kernel_size=3, padding=1)


def ok(name: str, time_ms: float, workspace_bytes: int, **kw) -> PerfResult:
    return PerfResult(name, "ok", time_ms=time_ms, workspace_bytes=workspace_bytes, **kw)


class Stored:
    """A tuning database of hand-made results: ``results(problem)`` is all the planner reads."""

    def __init__(self, table: dict[ConvProblem, list[PerfResult]]) -> None:
        self.table = table
        self.asked: list[str] = []

    def results(self, p: ConvProblem) -> list[PerfResult]:
        self.asked.append(p.key)
        return list(self.table.get(p, []))


def random_instance(rng: random.Random) -> tuple[list[ConvProblem], Stored]:
    """1-3 distinct problems, each with 1-4 candidates (some failed or slower-and-bigger), listed 1-5 times."""
    distinct = [problem(i) for i in range(rng.randint(1, 3))]
    table = {}
    for p in distinct:
        results = [ok(f"a:{j}", float(rng.randint(1, 9)), rng.choice([0, 1, 2, 3, 5, 8]))
                   for j in range(rng.randint(1, 4))]
        if rng.random() < 0.3:
            results.append(PerfResult("a:broken", "failed", message="boom"))
        table[p] = results
    problems = distinct + [rng.choice(distinct) for _ in range(rng.randint(0, 2))]
    rng.shuffle(problems)
    return problems, Stored(table)


def brute_force(problems, db: Stored, budget, mode: str) -> float:
    """The least total time over every combination of usable results that fits (inf if none)."""
    options = [[r for r in db.table[p] if usable(r, Policy())] for p in problems]
    best = math.inf
    for combo in itertools.product(*options):
        needs = [r.workspace_bytes for r in combo]
        total_ws = max(needs) if mode == "shared" else sum(needs)
        if budget is None or total_ws <= budget:
            best = min(best, sum(r.time_ms for r in combo))
    return best


# -- the Pareto front ----------------------------------------------------------------------------

def test_pareto_front_keeps_the_undominated_usable_results_by_workspace():
    results = [ok("a:big", 1.0, 100), ok("a:same_ws_slower", 2.0, 100), ok("a:mid", 2.0, 50),
               ok("a:dominated", 3.0, 60), ok("a:zero", 5.0, 0), ok("a:zero_twin", 5.0, 0),
               PerfResult("a:fast_failed", "failed", message="boom"),
               PerfResult("a:wrong", "wrong_result", time_ms=0.1, workspace_bytes=0),
               PerfResult("a:untimed", "ok", time_ms=None)]
    assert [r.algorithm for r in pareto_front(results)] == ["a:zero", "a:mid", "a:big"]
    assert pareto_front([]) == []


def test_pareto_front_applies_the_policy_but_not_its_workspace_limit():
    results = [ok("a:fast_nondet", 1.0, 10, deterministic=False), ok("a:tf32", 2.0, 5, uses_tf32=True),
               ok("a:slow", 4.0, 0)]
    policy = Policy(deterministic=True, allow_tf32=False, workspace_limit=0)
    assert [r.algorithm for r in pareto_front(results, policy)] == ["a:slow"]
    assert [r.algorithm for r in pareto_front(results, Policy(workspace_limit=0))] == ["a:slow", "a:tf32",
                                                                                       "a:fast_nondet"]


# -- optimality ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_plan_is_optimal_against_brute_force(mode):
    rng = random.Random(1234 + len(mode))
    for _ in range(300):
        problems, db = random_instance(rng)
        budget = rng.choice([None, 0, 1, 2, 3, 4, 5, 7, 8, 10, 13, 20])
        best = brute_force(problems, db, budget, mode)
        if math.isinf(best):
            with pytest.raises(InfeasibleBudgetError):
                plan(problems, budget, mode=mode, db=db)
            continue
        result = plan(problems, budget, mode=mode, db=db)
        assert result.total_time_ms == best
        assert result.total_time_ms == sum(c.time_ms for c in result.choices)
        needs = [c.workspace_bytes for c in result.choices]
        assert result.workspace_bytes == (max(needs) if mode == "shared" else sum(needs))
        assert budget is None or result.workspace_bytes <= budget
        assert all(c in db.table[p] for p, c in zip(result.problems, result.choices))
        assert list(result.problems) == problems and result.mode == mode and result.workspace_budget == budget


def test_divided_mode_may_split_a_problem_listed_twice():
    p = problem(0)
    db = Stored({p: [ok("a:fast", 1.0, 100), ok("a:lean", 4.0, 0)]})
    divided = plan([p, p], 100, mode="divided", db=db)
    assert sorted(c.algorithm for c in divided.choices) == ["a:fast", "a:lean"]
    assert divided.total_time_ms == 5.0 and divided.workspace_bytes == 100
    shared = plan([p, p], 100, mode="shared", db=db)
    assert [c.algorithm for c in shared.choices] == ["a:fast", "a:fast"] and shared.total_time_ms == 2.0


@pytest.mark.parametrize("mode", MODES)
def test_more_budget_is_never_slower_and_the_curve_matches_plan(mode):
    rng = random.Random(99)
    budgets = [0, 1, 2, 3, 5, 8, 13, 21, 34]
    for _ in range(60):
        problems, db = random_instance(rng)
        curve = budget_curve(problems, budgets, mode=mode, db=db)
        assert [b for b, _ in curve] == budgets
        times = [t for _, t in curve]
        assert all(later <= earlier for earlier, later in itertools.pairwise(times))
        for budget, total in curve:
            if math.isinf(total):
                with pytest.raises(InfeasibleBudgetError):
                    plan(problems, budget, mode=mode, db=db)
            else:
                assert plan(problems, budget, mode=mode, db=db).total_time_ms == pytest.approx(total, rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_a_zero_budget_takes_each_problems_fastest_zero_workspace_result(mode):
    a, b = problem(0), problem(1)
    db = Stored({a: [ok("a:fast", 1.0, 64), ok("a:zero_slow", 9.0, 0), ok("a:zero", 3.0, 0)],
                 b: [ok("b:zero", 2.0, 0), ok("b:fast", 0.5, 8)]})
    result = plan([a, b, a], 0, mode=mode, db=db)
    assert [c.algorithm for c in result.choices] == ["a:zero", "b:zero", "a:zero"]
    assert result.total_time_ms == 8.0 and result.workspace_bytes == 0


def test_no_budget_and_size_strings():
    a, b = problem(0), problem(1)
    db = Stored({a: [ok("a:fast", 1.0, 2048), ok("a:zero", 3.0, 0)],
                 b: [ok("b:fast", 1.0, 1024), ok("b:zero", 2.0, 0)]})
    free = plan([a, b], None, db=db)
    assert free.choices == free.unconstrained and [c.algorithm for c in free.choices] == ["a:fast", "b:fast"]
    assert plan([a, b], "1KiB", db=db).workspace_budget == 1024
    assert [c.algorithm for c in plan([a, b], "1KiB", db=db).choices] == ["a:zero", "b:fast"]
    assert [c.algorithm for c in plan([a, b], "2KiB", mode="divided", db=db).choices] == ["a:fast", "b:zero"]
    assert plan([], "1KiB", db=db).total_time_ms == 0


# -- infeasible budgets, reports, policies -------------------------------------------------------

@pytest.mark.parametrize("mode, smallest", [("shared", 300), ("divided", 700)])
def test_an_infeasible_budget_names_the_smallest_feasible_one(mode, smallest):
    a, b = problem(0), problem(1)
    db = Stored({a: [ok("a:x", 1.0, 300), ok("a:y", 0.5, 900)], b: [ok("b:x", 1.0, 200)]})
    with pytest.raises(InfeasibleBudgetError) as info:
        plan([a, b, b], smallest - 1, mode=mode, db=db)
    assert isinstance(info.value, ValueError)
    assert info.value.smallest_feasible_bytes == smallest
    message = str(info.value)
    assert f"smallest feasible budget is {smallest} bytes" in message and mode in message and "Raise" in message
    assert plan([a, b, b], smallest, mode=mode, db=db).workspace_bytes == smallest


def test_report_shows_the_time_lost_and_memory_saved_per_problem():
    a, b = problem(0), problem(1)
    db = Stored({a: [ok("a:fast", 1.0, 4096), ok("a:mid", 1.5, 1024), ok("a:zero", 4.0, 0)],
                 b: [ok("b:zero", 2.0, 0)]})
    result = plan([a, b], 1024, db=db)
    rows = result.report()
    assert rows[0] == {"problem": a.key, "algorithm": "a:mid", "time_ms": 1.5, "workspace_bytes": 1024,
                       "unconstrained_algorithm": "a:fast", "unconstrained_time_ms": 1.0,
                       "unconstrained_workspace_bytes": 4096, "time_lost_ms": 0.5, "memory_saved_bytes": 3072}
    assert rows[1]["algorithm"] == rows[1]["unconstrained_algorithm"] == "b:zero"
    assert rows[1]["time_lost_ms"] == 0 and rows[1]["memory_saved_bytes"] == 0
    assert result.unconstrained_time_ms == 3.0 and result.unconstrained_workspace_bytes == 4096
    assert [r.algorithm for r in result.pareto(0)] == ["a:zero", "a:mid", "a:fast"]
    assert [r.algorithm for r in result.pareto(1)] == ["b:zero"]


def test_the_policy_filters_what_the_plan_may_choose():
    a = problem(0)
    db = Stored({a: [ok("a:fast_nondet", 1.0, 0, deterministic=False), ok("a:tf32", 1.5, 0, uses_tf32=True),
                     ok("a:det", 2.0, 0), ok("a:det_big", 1.8, 4096)]})
    assert plan([a], 0, db=db).choices[0].algorithm == "a:fast_nondet"
    for mode in MODES:
        result = plan([a, a], None, mode=mode, db=db, policy=Policy(deterministic=True))
        assert all(c.deterministic for c in result.choices + result.unconstrained)
        assert all(r.deterministic for r in result.pareto(0))
    assert plan([a], 0, db=db, policy=Policy(deterministic=True, allow_tf32=False)).choices[0].algorithm == "a:det"
    # The policy's workspace_limit does not count: the budget does.
    limited = plan([a], None, db=db, policy=Policy(deterministic=True, allow_tf32=False, workspace_limit=0))
    assert limited.choices[0].algorithm == "a:det_big"


def test_bad_arguments_are_named():
    a = problem(0)
    db = Stored({a: [ok("a:x", 1.0, 0)]})
    # the database third, as the API names it (ct.plan(problems, workspace_budget, db=None)); the mode by name only
    assert plan([a], None, db).choices == plan([a], None, db=db).choices
    assert budget_curve([a], [0], db) == budget_curve([a], [0], db=db)
    with pytest.raises(TypeError):
        plan([a], None, db, None, "divided")  # type: ignore[misc]
    for call in (plan, budget_curve):  # the mode where it came before: refused, never a database file named so
        with pytest.raises(TypeError, match="give the mode by name, mode='divided'"):
            call([a], None if call is plan else [0], "divided")
    with pytest.raises(ValueError, match="mode='both'"):
        plan([a], None, mode="both", db=db)
    with pytest.raises(TypeError, match="wrap a single problem"):
        plan(a, None, db=db)
    with pytest.raises(TypeError, match="got a str"):
        plan([a, "conv1"], None, db=db)
    with pytest.raises(ValueError, match="workspace_budget"):
        plan([a], "lots", db=db)
    with pytest.raises(TypeError, match="Policy"):
        plan([a], None, db=db, policy={"deterministic": True})
    with pytest.raises(TypeError, match=r"^budget_curve\(\) takes a sequence of ConvProblems, got ConvProblem"):
        budget_curve(a, [0], db=db)
    with pytest.raises(TypeError, match=r"budget_curve\(\)'s db must be a TuningDB"):
        budget_curve([a], [0], db=3)


def test_a_problem_without_measurements_is_named_unless_find_may_measure_it():
    a, b = problem(0), problem(1)
    db = Stored({a: [ok("a:x", 1.0, 0)], b: [PerfResult("b:broken", "failed", message="boom")]})
    with pytest.raises(NoAlgorithmError, match=b.key.replace("|", r"\|")) as info:
        plan([a, b], None, db=db, find_missing=False)
    assert "find_missing=True" in str(info.value)


# -- with find and a real database ---------------------------------------------------------------

@pytest.fixture
def finds(monkeypatch):
    """The problems plan() runs find on, in order (convtune.plan is the function on the package: the module is
    reached through importlib)."""
    keys = []
    real_find = convtune.find

    def counting_find(*args, **kwargs):
        keys.append(args[0].key)
        return real_find(*args, **kwargs)

    monkeypatch.setattr(importlib.import_module("convtune.plan"), "find", counting_find)
    return keys


def test_plan_measures_again_what_a_finds_workspace_limit_left_untimed(tmp_path, finds):
    # A find under a workspace limit does not time the candidates over it: a plan whose budget allows them read a
    # front without them and never measured them (the budget's whole point: the faster, larger one).
    # (lean sleeps 50 ms a run for real: the real timer cannot take a busy host's pause for it being the faster)
    lean, fast = Fake("fake:lean", time_ms=50.0, sleep=True), Fake("fake:fast", time_ms=0.1, workspace_bytes=2**20)
    p = problem(0)
    with isolated(lean, fast, builtins=False), TuningDB(tmp_path / "tuning.sqlite") as db:
        convtune.find(p, Policy(workspace_limit="1KiB"), db=db)
        assert {r.algorithm: r.status.value for r in db.results(p)}["fake:fast"] == "over_workspace_limit"
        assert plan([p], "1KiB", db=db, find_missing=False).choices[0].algorithm == "fake:lean"  # nothing measured
        assert plan([p], "2MiB", db=db).choices[0].algorithm == "fake:fast" and finds == [p.key]  # measured again
        assert plan([p], "2MiB", db=db).choices[0].algorithm == "fake:fast" and finds == [p.key]  # then read
        assert plan([p], "1KiB", db=db).choices[0].algorithm == "fake:lean" and finds == [p.key]


def test_plan_measures_again_what_a_finds_determinism_left_untimed(tmp_path, finds):
    # the same for a find under determinism: a plan under the default policy may use the candidate it refused
    lean, fast = Fake("fake:lean", time_ms=50.0, sleep=True), Fake("fake:fast", time_ms=0.1, deterministic=False)
    p = problem(0)
    with isolated(lean, fast, builtins=False), TuningDB(tmp_path / "tuning.sqlite") as db:
        convtune.find(p, Policy(deterministic=True), db=db)
        assert {r.algorithm: r.status.value for r in db.results(p)}["fake:fast"] == "excluded_by_policy"
        strict = Policy(deterministic=True)
        assert plan([p], "1MiB", policy=strict, db=db).choices[0].algorithm == "fake:lean" and finds == []
        assert plan([p], "1MiB", db=db).choices[0].algorithm == "fake:fast" and finds == [p.key]  # measured again
        assert plan([p], "1MiB", db=db).choices[0].algorithm == "fake:fast" and finds == [p.key]  # then read
        assert plan([p], "1MiB", policy=strict, db=db).choices[0].algorithm == "fake:lean" and finds == [p.key]


def test_plan_measures_what_the_database_does_not_know_then_reads_it(tmp_path, finds):
    p = ConvProblem("fwd", n=1, c=3, k=4, input_size=(6, 6), kernel_size=3, padding=1)
    with TuningDB(tmp_path / "tuning.sqlite") as db:
        with pytest.raises(NoAlgorithmError):
            plan([p], 0, db=db, find_missing=False)
        first = plan([p, p], 0, db=db)
        assert finds == [p.key]  # measured once, though listed twice
        assert db.results(p), "find stores what it measured"
        again = plan([p, p], 0, mode="divided", db=db)
        assert finds == [p.key]  # read from the database this time
    for result in (first, again):
        assert all(c.ok and c.workspace_bytes == 0 and c.time_ms > 0 for c in result.choices)
        assert all(get_algorithm(c.algorithm, p).buffer_bytes(p) == 0 for c in result.choices)
        assert result.total_time_ms == pytest.approx(2 * result.choices[0].time_ms)
    free = plan([p], None, db=TuningDB(tmp_path / "tuning.sqlite"))
    assert free.choices[0].time_ms <= first.choices[0].time_ms
    assert isinstance(free, Plan)


# -- optimize(..., workspace_budget=...) ---------------------------------------------------------

class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.body = torch.nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.head = torch.nn.Conv1d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(torch.relu(self.stem(x)))).flatten(2))


def test_optimize_with_a_zero_budget_selects_zero_workspace_algorithms(tmp_path):
    torch.manual_seed(0)
    model = SmallCNN()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 6)
    with TuningDB(tmp_path / "tuning.sqlite") as db:
        convtune.optimize(model, x, training=True, db=db, workspace_budget=0)
    rows = convtune.explain(model)
    assert len(rows) == 3 * 3 - 1  # no bwd_data for the stem
    for row in rows:
        assert row["algorithm"] and row["workspace_bytes"] == 0, row
        p = ConvProblem.from_key(row["problem"])
        assert get_algorithm(row["algorithm"], p).buffer_bytes(p) == 0
    out, expected = model(x), twin(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    out.square().sum().backward()
    expected.square().sum().backward()
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-4, rtol=1e-4)


def test_optimize_runs_the_plans_choices_forward_and_backward(tmp_path):
    # Stored measurements decide: a per-layer select with a 2% tolerance would take "fake:mid"
    # (a tie, less workspace); the plan minimises the total time and takes "fake:mid_fast".
    fakes = [Fake("fake:big", workspace_bytes=8192), Fake("fake:mid", workspace_bytes=1024),
             Fake("fake:mid_fast", workspace_bytes=2048), Fake("fake:zero")]
    stored = [ok("fake:big", 1.0, 8192), ok("fake:mid", 2.0, 1024), ok("fake:mid_fast", 1.99, 2048),
              ok("fake:zero", 5.0, 0)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 3, 1))
    twin = copy.deepcopy(model)
    x = torch.randn(1, 2, 5, 5)
    with isolated(*fakes, builtins=False), TuningDB(tmp_path / "tuning.sqlite") as db:
        for conv, shape in ((model[0], x.shape), (model[2], (1, 4, 5, 5))):
            for direction in ("fwd", "bwd_data", "bwd_filter"):
                db.store(ConvProblem.from_module(conv, shape, direction), stored)
        judged = []  # the host-cost rule's judgments
        judge = tuning_module.where_the_host_pays
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tuning_module, "where_the_host_pays", lambda layer, tuning: judged.append(layer) or
                       judge(layer, tuning))
            convtune.optimize(model, x, training=True, mode="db_then_get", db=db, workspace_budget="2KiB")
        # each layer judged on its own selection, then once more on the plan's choices, all directions at once
        assert len(judged) == 4 and all(layer.fwd == layer.bwd_filter == "fake:mid_fast" for layer in judged[2:])
        rows = convtune.explain(model)
        assert len(rows) == 5 and {r["algorithm"] for r in rows} == {"fake:mid_fast"}
        assert {r["direction"] for r in rows} == {"fwd", "bwd_data", "bwd_filter"}
        out, expected = model(x), twin(x)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
        out.sum().backward()
        expected.sum().backward()
        for mine, theirs in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-4)
        convtune.optimize(model, x, training=True, mode="db_then_get", db=db, workspace_budget=0)
        assert {r["algorithm"] for r in convtune.explain(model)} == {"fake:zero"}
        convtune.optimize(model, x, training=True, mode="db_then_get", db=db)
        assert {r["algorithm"] for r in convtune.explain(model)} == {"fake:big"}


class _ForwardRefused(Fake):
    """Serves every problem but the forward of a 2-channel input."""

    def _supports(self, p):
        return unsupported("fwd of a 2-channel input refused") if p.direction == "fwd" and p.c == 2 else SUPPORTED


def test_a_layer_on_torchs_path_is_neither_measured_backward_nor_planned(tmp_path):
    # The first layer's forward is served by nothing: its backward directions are not measured, and it
    # takes no part in the budget's plan (it has no measurements in a mode that never measures, which
    # would fail the plan of every layer); the second layer still gets the plan's choice.
    refused = [_ForwardRefused("fake:big", workspace_bytes=8192), _ForwardRefused("fake:mid", workspace_bytes=1024),
               _ForwardRefused("fake:mid_fast", workspace_bytes=2048), _ForwardRefused("fake:zero")]
    stored = [ok("fake:big", 1.0, 8192), ok("fake:mid", 2.0, 1024), ok("fake:mid_fast", 1.99, 2048),
              ok("fake:zero", 5.0, 0)]
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 3, 1))
    x = torch.randn(1, 2, 5, 5)
    with isolated(*refused, builtins=False), TuningDB(tmp_path / "tuning.sqlite") as db:
        for direction in ("fwd", "bwd_data", "bwd_filter"):
            db.store(ConvProblem.from_module(model[2], (1, 4, 5, 5), direction), stored)
        convtune.optimize(model, x, training=True, mode="db_then_get", db=db, workspace_budget="2KiB")
        rows = convtune.explain(model)
        assert [r["algorithm"] for r in rows] == [None, "fake:mid_fast", "fake:mid_fast", "fake:mid_fast"]
        convtune.optimize(model[:1], x, training=True, mode="hybrid", db=db)  # measures what is missing
        assert sum(a.runs for a in refused) == 0
