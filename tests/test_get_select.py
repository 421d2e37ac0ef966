"""get (the cost model: runs nothing, ranks sensibly, learns from the database) and select's modes."""

import dataclasses
import importlib
import json
import logging
import math
import re

import pytest
import torch

import convtune as ct
from convtune import ConvProblem, NoAlgorithmError, PerfResult, Policy, Status, costmodel, get, learned, select
from convtune.algorithms import cudnn_cost, registry
from convtune.algorithms.base import Backend
from convtune.algorithms.registry import algorithms, get_algorithm, isolated
from convtune.get import ranked_predictions
from convtune.hardware import roofline_ms
from convtune.settings import settings
from fakes import CostlyWorkspace, Fake, FakeDB, Raising, WrongResult

P1 = ConvProblem("fwd", n=2, c=16, k=16, input_size=(8, 8), kernel_size=1)  # a 1x1 convolution
P3 = ConvProblem("fwd", n=2, c=4, k=6, input_size=(7, 7), kernel_size=3, padding=1)


@pytest.fixture(autouse=True)
def quick_timing():
    with settings.override(timing_budget_s=0.005, timing_max_repeats=3):
        yield


def measured(problem, name, time_ms, workspace_bytes=0):
    return problem, PerfResult(name, Status.OK, time_ms=time_ms, workspace_bytes=workspace_bytes, rel_error=0.0)


def like(problem, times, count=learned.MIN_MEASURED, workspace=None):
    """(problem, result) pairs: ``times`` (name: ms) measured on ``problem`` and on ``count`` problems like it (its
    batch times 2, 3, ...), scaled by their floors, so that every measured problem says the same (get's learned
    model answers for a direction once a full neighbourhood of it is measured)."""
    out = []
    for i in range(count + 1):
        p = problem.replace(n=problem.n * (i + 1))
        scale = roofline_ms(p) / roofline_ms(problem)
        out += [measured(p, name, t * scale, (workspace or {}).get(name, 0)) for name, t in times.items()]
    return out


def db_with(*measurements):
    db = FakeDB()
    for problem, result in measurements:
        db.stored.setdefault(problem.key, (problem, []))[1].append(result)
    return db


# -- get ----------------------------------------------------------------------------------------

def test_get_runs_nothing_and_ranks_1x1_gemm_first():
    gemm, direct = Fake("gemm:1x1", priced_like="gemm:1x1"), Fake("direct:taps", priced_like="direct:taps")
    with isolated(direct, gemm, builtins=False):
        for _ in range(3):
            choices = get(P1)
    assert [c.name for c in choices] == ["gemm:1x1", "direct:taps"]
    assert all(c.predicted_ms > 0 for c in choices)
    assert gemm.runs == direct.runs == 0


def test_get_on_the_builtin_registry():
    choices = get(P3)
    names = [c.name for c in choices]
    assert "torch:native" in names and len(set(names)) == len(names)
    assert names == [a.name for a in sorted(algorithms(P3), key=lambda a: names.index(a.name))]
    assert all(c.predicted_ms > 0 for c in choices)
    # ranked by time, except that a time within the tolerance of a faster one may lead with less workspace (one
    # not known, a cuDNN plan's that was not built, counts as none)
    for first, second in zip(choices, choices[1:]):
        assert (first.predicted_ms <= second.predicted_ms * 1.02
                or (first.workspace_bytes or 0) < (second.workspace_bytes or 0))


def test_database_measurements_change_the_ranking():
    gemm, direct = Fake("gemm:1x1", priced_like="gemm:1x1"), Fake("direct:taps", priced_like="direct:taps")
    other = ConvProblem("fwd", n=4, c=32, k=32, input_size=(8, 8), kernel_size=1)
    with isolated(gemm, direct, builtins=False):
        assert get(P1)[0].name == "gemm:1x1"
        # measured on other problems of the same direction and dtype: direct is 100x faster than modelled
        times = {"direct:taps": costmodel.analytic_ms("direct:taps", other) / 100,
                 "gemm:1x1": costmodel.analytic_ms("gemm:1x1", other)}
        assert get(P1, db=db_with(*like(other, times)))[0].name == "direct:taps"
        # exactly MIN_MEASURED problems of the direction measured: enough; one fewer: too little to go by, the
        # analytic model's pick
        assert get(P1, db=db_with(*like(other, times, count=learned.MIN_MEASURED - 1)))[0].name == "direct:taps"
        assert get(P1, db=db_with(*like(other, times, count=learned.MIN_MEASURED - 2)))[0].name == "gemm:1x1"
        assert gemm.runs == direct.runs == 0


def test_a_candidate_never_measured_takes_the_neighbours_typical_correction():
    with isolated(Fake("direct:taps", priced_like="direct:taps"), builtins=False):
        plain = get(P3)[0].predicted_ms
        db = db_with(*like(P3, {"direct:other_variant": 10 * costmodel.analytic_ms("direct:other_variant", P3)}))
        assert get(P3, db=db)[0].predicted_ms == pytest.approx(10 * plain, rel=0.01)


def test_corrections_are_read_once_per_db_and_follow_what_find_stores():
    db = db_with(*like(P3.replace(n=5), {"fake:a": 1.0}), measured(P3, "fake:a", 1.0))
    with isolated(Fake("fake:a"), builtins=False):
        get(P3, db=db)
        get(P3, db=db)
        assert db.measurement_calls == 1
        before = costmodel.corrections(db, P3.device)
        select(P3, mode="find", db=db)
        after = costmodel.corrections(db, P3.device)
        assert db.measurement_calls == 1  # updated from the stored results, not read again
        (new,) = [r for r in db.results(P3) if r.ok]
        # the model holds P3's new measurement in place of its old one, beside the others
        assert after is not before and len(after.model.rows) == len(before.model.rows) == learned.MIN_MEASURED + 2
        (row,) = [r for r in after.model.rows if r.problem == P3]
        assert row.best == pytest.approx(math.log2(new.time_ms / roofline_ms(P3)))
        base = costmodel.analytic_ms("fake:a", P3)
        assert before.price("fake:a", P3, base) == pytest.approx(1.0, rel=0.05)  # mostly its own measurement
        # measured 8x slower: the price follows (its own row weighs most)
        slower = [dataclasses.replace(new, time_ms=8.0)]
        db.store(P3, slower)
        costmodel.stored(db, P3, slower)
        assert costmodel.corrections(db, P3.device).price("fake:a", P3, base) == pytest.approx(8.0, rel=0.1)


def test_a_table_of_measurements_prices_each_candidate_as_the_nearest_measured_problems_ran_it():
    # Measured on P1 only: direct:taps 4x slower than direct:other. On P3 (its nearest measured problem is P1)
    # the two keep that ratio, and their time is P1's best carried to P3's floor.
    table = costmodel.Corrections.of(like(P1, {"direct:taps": 4.0, "direct:other": 1.0}))
    taps, other = (table.price(name, P3, 1.0, place=None) for name in ("direct:taps", "direct:other"))
    assert taps == pytest.approx(4 * other)
    floors = [roofline_ms(p) for p in (P1, P3)]
    assert other == pytest.approx(1.0 * floors[1] / floors[0])
    # a name never measured: priced as the neighbours' typical candidate (the median of 1 and 4), at least
    assert table.price("direct:new", P3, 1e-3) == pytest.approx(2 * other)
    # no measurements: the analytic price and the place
    for empty in (costmodel.NO_CORRECTIONS, costmodel.Corrections.of([])):
        assert empty.price("direct:new", P3, 1.0, place=3) == pytest.approx(costmodel.order_factor(3))
    # another direction: nothing measured there, the analytic price
    assert table.price("direct:taps", P3.replace(direction="bwd_data"), 1.0) == pytest.approx(1.0)


def test_ties_go_to_the_smaller_workspace():
    big, small = Fake("fake:a_big", workspace_bytes=2**20), Fake("fake:b_small")
    # measurements pin the corrected predictions to exactly 1.00 and 1.01 ms
    db = db_with(*like(P3, {"fake:a_big": 1.00, "fake:b_small": 1.01}, workspace={"fake:a_big": 2**20}))
    with isolated(big, small, builtins=False):
        assert [c.name for c in get(P3, Policy(tolerance=0.0), db)] == ["fake:a_big", "fake:b_small"]
        choices = get(P3, Policy(tolerance=0.02), db)
    assert [c.name for c in choices] == ["fake:b_small", "fake:a_big"]
    assert choices[0].predicted_ms == pytest.approx(1.01)


@pytest.mark.parametrize("policy, excluded", [
    (Policy(workspace_limit="1KiB"), "fake:huge"),
    (Policy(deterministic=True), "fake:atomics"),
    (Policy(allow_tf32=False), "fake:tf32"),
    (Policy(allow_reduced_precision=False), "fake:half_acc"),
])
def test_get_leaves_out_policy_violations(policy, excluded):
    fakes = [Fake("fake:plain"), Fake("fake:huge", workspace_bytes=2**30), Fake("fake:atomics", deterministic=False),
             Fake("fake:tf32", tf32=True), Fake("fake:half_acc", reduced_precision=True)]
    with isolated(*fakes, builtins=False):
        everything = {c.name for c in get(P3)}
        names = {c.name for c in get(P3, policy)}
    assert everything - names == {excluded}


def plans(kind=CostlyWorkspace):
    # The vendor cost model ignores the workspace: the two predictions tie, and the tie rule decides.
    return [kind("cudnn:a_big", workspace_bytes=2**20), kind("cudnn:b_small")]


def names(ranked):
    return [a.name for a, _ in ranked]


def test_finds_ranking_builds_nothing_and_keeps_its_order_once_workspaces_are_known():
    costly = plans()
    with isolated(builtins=False):
        cold = ranked_predictions(P3, costly, Policy(), keep_filters=False)
        assert [c.builds for c in costly] == [0, 0]
        assert names(cold) == ["cudnn:a_big", "cudnn:b_small"]  # unknown counts as 0: the tie goes by name
        assert "workspace not known yet" in cold[0][1].message
        for plan in costly:
            plan.workspace_bytes(P3)
        warm = ranked_predictions(P3, costly, Policy(), keep_filters=False)
        known = ranked_predictions(P3, plans(Fake), Policy(), keep_filters=False)
    assert names(warm) == names(known) == ["cudnn:b_small", "cudnn:a_big"]
    assert [g.time_ms for _, g in warm] == [g.time_ms for _, g in known]


@pytest.mark.parametrize("place", [RuntimeError("no order"), "first", 1.5])
def test_a_plugin_whose_place_cannot_be_read_is_left_out_of_the_ranking_not_the_others(place, caplog):
    class Placed(Fake):
        @property
        def place(self):
            if isinstance(place, Exception):
                raise place
            return place

    with isolated(builtins=False):
        ranked = ranked_predictions(P3, [Placed("plugin:placed"), Fake("plugin:fine")], Policy())
        assert names(ranked) == ["plugin:fine"] and "plugin:placed could not describe" in caplog.text


@pytest.mark.parametrize("policy, keep_filters", [
    (Policy(), True),  # get's own answers and select's 'get' mode
    (Policy(workspace_limit="1MiB"), False),
    (Policy(prefer="least_memory"), False),
])
def test_rankings_that_depend_on_the_workspace_build(policy, keep_filters):
    costly = plans()
    with isolated(builtins=False):
        ranked = ranked_predictions(P3, costly, policy, keep_filters=keep_filters)
    assert [c.builds for c in costly] == [1, 1]
    assert names(ranked) == ["cudnn:b_small", "cudnn:a_big"]
    assert ranked[1][1].workspace_bytes == 2**20


def test_get_builds_only_the_plans_its_first_place_depends_on():
    # A plan's build (0.1 ms to a second on cuDNN) is what made get's first answer on a new problem slow: only
    # the plans predicted within the tolerance of the fastest, which the tie rule compares, are built.
    def three():
        return plans() + [CostlyWorkspace("cudnn:c_slow", workspace_bytes=2**30, priced_like="fft:rfft")]

    lazy, eager = three(), three()
    with isolated(*lazy, builtins=False):
        choices = get(P3)
    with isolated(builtins=False):
        everything = ranked_predictions(P3, eager, Policy(), learn_workspaces=True)
    assert [c.builds for c in lazy] == [1, 1, 0] and [c.builds for c in eager] == [1, 1, 1]
    assert choices[0].name == everything[0][0].name == "cudnn:b_small"  # the first as with every plan built
    assert choices[0].predicted_ms == everything[0][1].time_ms
    named = {c.name: c.workspace_bytes for c in choices}
    assert named == {"cudnn:b_small": 0, "cudnn:a_big": 2**20, "cudnn:c_slow": None}  # not known: not reported as 0


class Placed:
    """Like a cuDNN execution plan's: a place in its backend's order, a price that ignores the workspace."""

    def __init__(self, name, place, **kw):
        super().__init__(name, **kw)
        self.place = place

    def cost(self, problem, workspace_bytes):
        return costmodel.generic_cost(problem, 0)


class Plan(Placed, CostlyWorkspace):
    """Like a cuDNN execution plan: besides, a workspace learned by a build."""


class RefusedPlan(Plan):
    def buffers(self, problem):
        self.builds += 1
        raise RuntimeError("cuDNN could not build plan")


class KnownPlace(Placed, Fake):
    """Placed, its workspace known without a build."""


def test_a_first_place_with_no_tie_is_not_built_by_get_and_select_builds_its_pick():
    # get's first answer on a new problem need not wait for a plan's build (on depthwise layers cuDNN's first plan
    # compiles at run time: up to 0.8 s): with no candidate tied to it, its workspace cannot change the first place.
    def lone():
        return [Plan("cudnn:a_fast", 0, workspace_bytes=4096), Plan("cudnn:c_slow", 9, workspace_bytes=2**20)]

    lazy, picked = lone(), lone()
    with isolated(*lazy, builtins=False):
        choices = get(P3)
    assert [c.name for c in choices] == ["cudnn:a_fast", "cudnn:c_slow"] and [c.builds for c in lazy] == [0, 0]
    assert [c.workspace_bytes for c in choices] == [None, None]
    with isolated(*picked, builtins=False):
        chosen = select(P3, mode="get")
    assert chosen.algorithm == "cudnn:a_fast" and chosen.workspace_bytes == 4096  # the pick, built to run
    assert [c.builds for c in picked] == [1, 0]


def test_select_passes_over_a_first_place_that_cannot_be_built_where_get_did_not_build_it():
    refused, slow = RefusedPlan("cudnn:a_refused", 0), Plan("cudnn:c_slow", 9, workspace_bytes=2**20)
    with isolated(refused, slow, builtins=False):
        assert [c.name for c in get(P3)] == ["cudnn:a_refused", "cudnn:c_slow"] and refused.builds == 0
        chosen = select(P3, mode="get")
    assert chosen.algorithm == "cudnn:c_slow" and chosen.workspace_bytes == 2**20 and refused.builds == 1


def test_a_lone_first_whose_price_counts_its_workspace_is_learned_by_get_and_select():
    # generic_cost (a plug-in's default) counts twice the workspace as traffic: learning it may end a first place
    def two():
        return [CostlyWorkspace("plug:a_heavy", workspace_bytes=2**30), Fake("plug:b_lean", priced_like="direct:taps")]

    lazy, picked, eager = two(), two(), two()
    with isolated(*lazy, builtins=False):
        first = get(P3)[0]
    with isolated(*picked, builtins=False):
        chosen = select(P3, mode="get")
    with isolated(builtins=False):
        everything = ranked_predictions(P3, eager, Policy(), learn_workspaces=True)
    assert first.name == chosen.algorithm == everything[0][0].name == "plug:b_lean"
    assert lazy[0].builds == 1 and first.workspace_bytes == 0


def test_select_ranks_again_after_passing_over_an_unbuildable_first_so_the_tie_rule_settles_the_rest():
    def mix():
        return [RefusedPlan("cudnn:a_refused", 0), Plan("cudnn:b_big", 2, workspace_bytes=2**28),
                KnownPlace("gemm:z_lean", 2, workspace_bytes=4096)]

    picked, eager = mix(), mix()
    with isolated(*picked, builtins=False):
        chosen = select(P3, mode="get")
    with isolated(builtins=False):
        everything = ranked_predictions(P3, eager, Policy(), learn_workspaces=True)
    assert chosen.algorithm == everything[0][0].name == "gemm:z_lean" and chosen.workspace_bytes == 4096
    with isolated(RefusedPlan("cudnn:a_refused", 0), builtins=False):
        with pytest.raises(NoAlgorithmError, match="cudnn:a_refused: cannot be built"):
            select(P3, mode="get")


class Forgetful(CostlyWorkspace):
    """A plug-in whose workspace is learned by costly work that it does not remember; ``asked`` counts every time
    that work is asked for (``builds`` counts only the first per problem)."""

    asked = 0

    def known_workspace_bytes(self, problem):
        return None

    def buffers(self, problem):
        self.asked += 1
        return super().buffers(problem)


class BuiltMeanwhile(Forgetful):
    """A plan another thread builds between get's guess of it and the settling of its first place (it remembers)."""

    def known_workspace_bytes(self, problem):
        known = CostlyWorkspace.known_workspace_bytes(self, problem)
        self.built.add(problem)
        return known


@pytest.mark.parametrize("kind", [Forgetful, BuiltMeanwhile])
def test_get_learns_each_workspace_of_its_first_place_once_whatever_the_plan_says_meanwhile(kind):
    # A guess that counted an unknown workspace as 0 is what is learned (once), not what the plan says later: one
    # that never remembers is not learned forever, one built meanwhile does not keep its price of no workspace.
    costly = plans(kind)
    with isolated(*costly, builtins=False):
        choices = get(P3)
    assert [c.name for c in choices] == ["cudnn:b_small", "cudnn:a_big"]
    assert choices[1].workspace_bytes == 2**20 and [c.asked for c in costly] == [1, 1]


def test_get_leaves_out_a_plan_of_its_first_place_that_cannot_be_built(caplog):
    refused, fine = Unbuildable("cudnn:a_refused"), CostlyWorkspace("cudnn:b_fine", workspace_bytes=4096)
    slow = CostlyWorkspace("cudnn:c_slow", priced_like="fft:rfft")
    with isolated(refused, fine, slow, builtins=False), caplog.at_level(logging.WARNING, "convtune.get"):
        choices = get(P3)
    assert [c.name for c in choices] == ["cudnn:b_fine", "cudnn:c_slow"]
    assert [c.workspace_bytes for c in choices] == [4096, None] and slow.builds == 0
    assert "cudnn:a_refused could not describe" in caplog.text and "cuDNN could not build plan" in caplog.text


DEPTHWISE = ConvProblem("fwd", n=32, c=96, k=96, input_size=(56, 56), kernel_size=7, padding=3, groups=96,
                        dtype="float16", layout="channels_last", device="cuda")


def test_the_triton_configurations_are_priced_by_their_fitted_factors():
    # Every configuration of a family costs the same roofline; the fitted factors (bench/fit_triton_prices.py)
    # tell them apart: two configurations' prices stand as their factors do. A configuration never fitted takes
    # its family's median in its direction; a family never fitted (grouped) 1.
    from convtune import hardware
    from convtune.algorithms.triton_family import TritonAlgorithm, measured_factors

    factors = measured_factors()
    names = [a.name for a in registry.registered() if isinstance(a, TritonAlgorithm)]
    assert any(n in factors for n in names) and all(f > 0 for f in factors.values())
    a, b = (get_algorithm(f"triton:depthwise_strip_fwd_{tile}") for tile in ("t8b16c32w4", "t2b64c16w4"))
    assert a.measured_factor() == factors[a.name] != factors[b.name]
    launch_ms = 1e3 * costmodel.LAUNCH_S["cuda"] * a.cost(DEPTHWISE, 0).launches  # predict_ms: no workspace
    assert a.cost(DEPTHWISE, 0).launches == b.cost(DEPTHWISE, 0).launches
    with hardware.measured_on("cuda|NVIDIA H200|sm90|driver|cuda"):
        ratio = ((costmodel.predict_ms(a.name, DEPTHWISE) - launch_ms)
                 / (costmodel.predict_ms(b.name, DEPTHWISE) - launch_ms))
    assert ratio == pytest.approx(factors[a.name] / factors[b.name])
    grouped = next(get_algorithm(n) for n in names if n.startswith("triton:grouped_"))
    assert grouped.name not in factors and grouped.measured_factor() == 1.0


@pytest.fixture
def prices_file(tmp_path, monkeypatch):
    """The path of a prices file the Triton configurations read in place of the shipped one (read anew)."""
    from convtune.algorithms import triton_family

    path = tmp_path / "triton_prices.json"
    monkeypatch.setattr(triton_family, "PRICES_FILE", path)
    triton_family.measured_factors.cache_clear()
    yield path
    triton_family.measured_factors.cache_clear()


@pytest.mark.parametrize("content, expected", [(None, {}), ("{not json", {}), ('{"factors": [1, 2]}', {}),
                                               ('{"factors": {"x": 2}}', {"x": 2.0})],
                         ids=["missing", "damaged", "not_a_table", "none_of_ours"])
def test_a_missing_or_damaged_prices_file_leaves_the_roofline_prices_with_a_warning(prices_file, caplog, content,
                                                                                       expected):
    from convtune.algorithms import triton_family

    if content is not None:
        prices_file.write_text(content)
    with caplog.at_level(logging.WARNING, "convtune.algorithms.triton_family"):
        assert triton_family.measured_factors() == expected
        assert get_algorithm("triton:depthwise_strip_fwd_t8b16c32w4").measured_factor() == 1.0
    unreadable = not expected
    assert not unreadable or (str(prices_file) in caplog.text and "roofline prices serve" in caplog.text)


def test_a_bad_factor_in_the_prices_file_is_left_out_alone_with_a_warning(prices_file, caplog):
    from convtune.algorithms import triton_family

    good, bad = "triton:depthwise_strip_fwd_t8b16c32w4", "triton:depthwise_strip_fwd_t2b64c16w4"
    prices_file.write_text(json.dumps({"factors": {good: 1.5, bad: None, "triton:depthwise_strip_fwd_t4b32c32w4": True,
                                                   "triton:depthwise_strip_fwd_t4b16c64w4": -1, "x": float("nan")}}))
    with caplog.at_level(logging.WARNING, "convtune.algorithms.triton_family"):
        assert triton_family.measured_factors() == {good: 1.5}
        assert get_algorithm(bad).measured_factor() == 1.5  # its family's median in its direction
    assert caplog.text.count("is not a positive number") == 4 and bad in caplog.text


def test_get_prefer_least_memory():
    fakes = [Fake("gemm:1x1", priced_like="gemm:1x1", workspace_bytes=4096),
             Fake("direct:taps", priced_like="direct:taps")]
    with isolated(*fakes, builtins=False):
        assert get(P1)[0].name == "gemm:1x1"
        assert get(P1, Policy(prefer="least_memory"))[0].name == "direct:taps"


@pytest.mark.parametrize("ranks", [True, False])
def test_get_keeps_a_ranking_backends_own_order_among_equal_plans(ranks):
    class FakeBackend(Backend):
        prefix = "fakeb"

        def __init__(self):
            self.plans = [Fake("fakeb:z_listed_first"), Fake("fakeb:a_listed_second")]
            for place, plan in enumerate(self.plans):
                plan.place = place if ranks else None

        def algorithms(self, problem):
            return self.plans

    with isolated(FakeBackend(), builtins=False):
        choices = get(P3, Policy(tolerance=0.0))
        assert registry.backend_places(P3) == ({"fakeb:z_listed_first": 0, "fakeb:a_listed_second": 1} if ranks else {})
    if ranks:  # its heuristics' order: each later plan priced a little higher
        assert [c.name for c in choices] == ["fakeb:z_listed_first", "fakeb:a_listed_second"]
        assert choices[1].predicted_ms == pytest.approx(choices[0].predicted_ms * costmodel.order_factor(1))
    else:  # no order of its own: equal prices, which the ranking's tie rule settles by name
        assert choices[0].predicted_ms == choices[1].predicted_ms
        assert [c.name for c in choices] == ["fakeb:a_listed_second", "fakeb:z_listed_first"]


def test_a_measured_plan_is_priced_by_its_measurement_its_place_counted_once(tmp_path):
    # The database's model prices a measured plan at its measurement, whatever its place in the heuristic order
    # (order_factor, which get multiplies in, is divided out of the model's factor); an unmeasured problem's
    # plans by how the plans of their places ran on the measured one.
    plan = Fake("fakeb:first")
    plan.place = 0
    later = Fake("fakeb:second")
    later.place = 1

    class FakeBackend(Backend):
        prefix = "fakeb"

        def algorithms(self, problem):
            return [plan, later]

    with isolated(FakeBackend(), builtins=False), ct.TuningDB(tmp_path / "t.sqlite") as db:
        for p, r in like(P3, {"fakeb:first": 2.0, "fakeb:second": 3.0}):
            db.store(p, [*db.results(p), dataclasses.replace(r, place=0 if r.algorithm == "fakeb:first" else 1)])
        on_p3 = {c.name: c.predicted_ms for c in get(P3, Policy(tolerance=0.0), db=db)}
        other = P3.replace(n=3, input_size=(9, 9))  # never measured
        on_other = {c.name: c.predicted_ms for c in get(other, Policy(tolerance=0.0), db=db)}
    assert on_p3 == pytest.approx({"fakeb:first": 2.0, "fakeb:second": 3.0})
    assert on_other["fakeb:second"] == pytest.approx(1.5 * on_other["fakeb:first"])


def test_get_leaves_out_an_algorithm_that_cannot_describe_itself(caplog):
    class Broken(Fake):
        def buffers(self, problem):
            raise RuntimeError("no idea")

    with isolated(Broken("fake:broken"), Fake("fake:fine"), builtins=False), caplog.at_level(logging.WARNING):
        assert [c.name for c in get(P3)] == ["fake:fine"]
    assert "fake:broken" in caplog.text


def test_get_ranks_a_cuda_problem_without_a_gpu():
    p = P3.replace(device="cuda", dtype="float16", layout="NHWC")
    with isolated(Fake("cudnn:eng0"), Fake("fake:cpu_only", devices=("cpu",)), builtins=False):
        assert [c.name for c in get(p)] == ["cudnn:eng0"]


def test_cost_model_families(nominal_peaks):
    p = ConvProblem("fwd", n=8, c=64, k=64, input_size=(28, 28), kernel_size=3, padding=1)
    names = ["torch:native", "gemm:im2col", "direct:taps", "fft:rfft", "winograd:f4x3", "cudnn:eng1",
             "cublas:gemm", "triton:igemm", "newbackend:thing"]
    times = {n: costmodel.predict_ms(n, p, workspace_bytes=2**20) for n in names}
    assert all(t > 0 for t in times.values())
    # workspace traffic and per-tap loops cost time
    assert costmodel.predict_ms("gemm:im2col", p, 2**30) > costmodel.predict_ms("gemm:im2col", p, 0)
    assert costmodel.predict_ms("direct:taps", p.replace(kernel_size=5, padding=2)) > costmodel.predict_ms(
        "direct:taps", p)
    # Winograd F(4x4) multiplies less than F(2x2) on a large enough problem
    big = p.replace(n=32, input_size=(56, 56))
    assert costmodel.predict_ms("winograd:f4x3", big) < costmodel.predict_ms("winograd:f2x3", big)


# -- select -------------------------------------------------------------------------------------

def test_select_get_measures_nothing():
    fast, slow = Fake("gemm:1x1", priced_like="gemm:1x1"), Fake("direct:taps", priced_like="direct:taps")
    with isolated(fast, slow, builtins=False):
        result = select(P1, mode="get")
    assert result.algorithm == "gemm:1x1" and result.status is Status.OK
    assert result.time_ms is None and "predicts" in result.message
    assert fast.runs == slow.runs == 0


def test_select_find_measures_and_stores():
    fakes = [Fake("fake:a"), WrongResult()]
    db = FakeDB()
    with isolated(*fakes, builtins=False):
        result = select(P3, mode="find", db=db)
        assert result.algorithm == "fake:a" and result.time_ms > 0
        assert db.store_calls == 1 and len(db.results(P3)) == 2
        select(P3, mode="find")  # no database: nothing stored anywhere
    assert db.store_calls == 1


def test_select_hybrid_answers_the_second_call_from_the_db():
    counting = Fake("fake:counting")
    db = FakeDB()
    with isolated(counting, builtins=False):
        first = select(P3, db=db)
        runs = counting.runs
        second = select(P3, db=db)
    assert runs > 0 and counting.runs == runs
    assert first == second and db.store_calls == 1


def test_select_hybrid_uses_the_default_database():
    counting = Fake("fake:counting")
    with isolated(counting, builtins=False):
        first = select(P3)
        runs = counting.runs
        second = select(P3)
    assert counting.runs == runs > 0
    assert second.algorithm == first.algorithm == "fake:counting"


def test_select_db_then_get_never_measures():
    a = Fake("fake:a")
    db = FakeDB()
    with isolated(a, builtins=False):
        guess = select(P3, mode="db_then_get", db=db)
        assert guess.time_ms is None and a.runs == 0
        select(P3, mode="find", db=db)
        runs = a.runs
        hit = select(P3, mode="db_then_get", db=db)
    assert hit.time_ms is not None and a.runs == runs


def test_select_db_hit_that_violates_the_policy_is_not_used():
    big, small = Fake("fake:big", workspace_bytes=2**20), Fake("fake:small", time_ms=5.0)
    db = db_with(measured(P3, "fake:big", 0.001, 2**20))
    with isolated(big, small, builtins=False):
        result = select(P3, Policy(workspace_limit="1KiB"), mode="db_then_get", db=db)
    assert result.algorithm == "fake:small" and result.time_ms is None


def test_select_measures_again_what_an_earlier_finds_workspace_limit_left_untimed():
    # a find under a workspace limit times only what fits: a wider policy's best may be a candidate it never timed
    # (lean sleeps 50 ms a run for real: the real timer cannot take a busy host's pause for it being the faster)
    lean, fast = Fake("fake:lean", time_ms=50.0, sleep=True), Fake("fake:fast", time_ms=0.1, workspace_bytes=2**20)
    db = FakeDB()
    with isolated(lean, fast, builtins=False):
        limited = select(P3, Policy(workspace_limit="1KiB"), db=db)
        assert limited.algorithm == "fake:lean" and fast.runs == 0
        assert select(P3, Policy(workspace_limit="512KiB"), db=db).algorithm == "fake:lean"  # fake:fast still over
        assert select(P3, mode="db_then_get", db=db).time_ms is None  # the database knows no answer to it
        wider = select(P3, db=db)  # measured now, not answered from the limited find
        assert wider.algorithm == "fake:fast" and wider.time_ms is not None and fast.runs > 0
        runs = fast.runs
        assert select(P3, db=db) == wider
        assert select(P3, Policy(workspace_limit="1KiB"), db=db).algorithm == "fake:lean"
    assert fast.runs == runs  # both answered from the database now


@pytest.mark.parametrize("narrow, excluded", [
    (Policy(deterministic=True), {"deterministic": False}), (Policy(allow_tf32=False), {"tf32": True}),
    (Policy(allow_reduced_precision=False), {"reduced_precision": True})],
    ids=["determinism", "tf32", "reduced_precision"])
def test_select_measures_again_what_an_earlier_finds_policy_excluded(narrow, excluded):
    # a find under determinism (no TF32, no reduced precision) does not time what the policy refuses: the default
    # policy's best may be that one, so that find cannot answer it (lean sleeps for real, as above)
    lean, quick = Fake("fake:lean", time_ms=50.0, sleep=True), Fake("fake:quick", time_ms=0.1, **excluded)
    db = FakeDB()
    with isolated(lean, quick, builtins=False):
        assert select(P3, narrow, db=db).algorithm == "fake:lean" and quick.runs == 0
        assert {r.algorithm: r.status for r in db.results(P3)}["fake:quick"] is Status.EXCLUDED_BY_POLICY
        assert select(P3, narrow, db=db).algorithm == "fake:lean" and quick.runs == 0  # the narrow policy: answered
        assert select(P3, mode="db_then_get", db=db).time_ms is None  # the database knows no answer to the default
        wider = select(P3, db=db)
        assert wider.algorithm == "fake:quick" and wider.time_ms is not None and quick.runs > 0
        runs = quick.runs
        assert select(P3, db=db) == wider
        assert select(P3, narrow, db=db).algorithm == "fake:lean"
    assert quick.runs == runs  # both answered from the database now


@pytest.fixture
def finds(monkeypatch):
    """The policies select runs find under, in order (convtune.select is the function on the package: the module is
    reached through importlib)."""
    policies = []
    select_module = importlib.import_module("convtune.select")
    real_find = select_module.find
    monkeypatch.setattr(select_module, "find", lambda *a, **k: policies.append(a[1]) or real_find(*a, **k))
    return policies


def test_two_policies_asked_in_turn_measure_once_each(finds):
    # A find under determinism passes over (budget) a TF32 candidate and refuses a nondeterministic one; a find
    # without TF32 then times the latter and refuses the former. Had the second stored that refusal, each policy
    # would see a candidate the other left untimed and measure again on every call.
    atomics, plain, tf32 = Fake("fake:a_atomics", deterministic=False), Fake("fake:b_plain"), Fake("fake:c_tf32",
                                                                                                   tf32=True)
    strict, no_tf32 = Policy(deterministic=True, max_candidates=1), Policy(allow_tf32=False, max_candidates=1)
    db = FakeDB()
    with isolated(atomics, plain, tf32, builtins=False):
        select(P3, strict, db=db)
        status = {r.algorithm: r.status for r in db.results(P3)}
        assert status == {"fake:a_atomics": Status.EXCLUDED_BY_POLICY, "fake:b_plain": Status.OK,
                          "fake:c_tf32": Status.SKIPPED}, status  # (the premise: the budget passed fake:c_tf32 over)
        select(P3, no_tf32, db=db)  # fake:a_atomics is left untimed for this policy: measured
        assert {r.algorithm: r.status for r in db.results(P3)}["fake:c_tf32"] is Status.SKIPPED
        for _ in range(2):
            assert select(P3, strict, db=db).algorithm == "fake:b_plain"
            select(P3, no_tf32, db=db)
    assert finds == [strict, no_tf32]


@pytest.mark.parametrize("failing", [Raising, WrongResult], ids=["failed", "wrong_result"])
def test_two_policies_asked_in_turn_keep_a_refused_candidates_failure(finds, failing):
    # As above, with the candidates each policy refuses failing where the other runs them: a refusal that replaced
    # the other's failure with excluded_by_policy would send each policy measuring again on every call.
    atomics, plain = failing("fake:a_atomics", deterministic=False), Fake("fake:b_plain")
    tf32 = failing("fake:c_tf32", tf32=True)
    strict, no_tf32 = Policy(deterministic=True), Policy(allow_tf32=False)
    db = FakeDB()
    with isolated(atomics, plain, tf32, builtins=False):
        for _ in range(3):
            assert select(P3, strict, db=db).algorithm == "fake:b_plain"
            assert select(P3, no_tf32, db=db).algorithm == "fake:b_plain"
    assert finds == [strict, no_tf32]


def test_select_bad_mode():
    with pytest.raises(ValueError, match="db_then_get"):
        select(P3, mode="fastest")


def test_select_no_algorithm_after_measuring():
    with isolated(Raising(), WrongResult(), Fake("fake:atomics", deterministic=False), builtins=False):
        with pytest.raises(NoAlgorithmError) as info:
            select(P3, Policy(deterministic=True), mode="find")
    text = str(info.value)
    assert P3.key in text
    assert "fake:raising: failed: ValueError: boom" in text
    assert "fake:wrong: wrong_result" in text and "fake:atomics: excluded_by_policy: not deterministic" in text


def test_select_no_algorithm_from_the_model():
    with isolated(Fake("fake:huge", workspace_bytes=2**30), Fake("fake:gpu", devices=("cuda",)), builtins=False):
        with pytest.raises(NoAlgorithmError) as info:
            select(P3, Policy(workspace_limit=0), mode="get")
    text = str(info.value)
    assert P3.key in text and "fake:huge: needs" in text and "fake:gpu: runs on cuda" in text


@pytest.mark.parametrize("field, value, error", [
    ("tolerance", False, TypeError), ("tolerance", float("nan"), ValueError), ("max_candidates", 1.5, TypeError),
    ("max_candidates", True, TypeError), ("budget_s", True, TypeError), ("budget_s", float("inf"), ValueError),
    ("max_rel_error", float("nan"), ValueError), ("workspace_limit", "9" * 400, ValueError),
    ("workspace_limit", [1], TypeError), ("workspace_limit", float("inf"), ValueError),
    ("workspace_limit", "-0.5", ValueError), ("workspace_limit", "-0.0001KiB", ValueError),  # not rounded to 0
    ("workspace_limit", -0.5, ValueError),
    ("prefer", ["fastest"], ValueError),
])
def test_a_policy_refuses_values_that_are_not_what_its_fields_mean(field, value, error):
    with pytest.raises(error, match=field if field != "workspace_limit" else "workspace_limit"):
        Policy(**{field: value})


def test_without_a_usable_default_database_select_still_answers(tmp_path, monkeypatch, caplog):
    from convtune import db as db_module
    from convtune.settings import settings

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setattr(db_module, "_unopenable", set())
    monkeypatch.setattr(db_module, "_fallback", None)
    problem = ConvProblem("fwd", n=1, c=2, k=2, input_size=(6, 6), kernel_size=3)
    with settings.override(cache_dir=str(blocked / "cache")):  # its parent is a file: the folder cannot exist
        result = select(problem, mode="hybrid")
        assert select(problem, mode="db_then_get") == result  # remembered for the process's lifetime
        fallback = db_module.opened()
    assert result.ok and caplog.text.count("cannot be opened") == 1
    assert fallback.results(problem) and not fallback.path.is_relative_to(tmp_path)


@pytest.mark.parametrize("policy, builds", [
    (Policy(), [1, 0]),  # the workspaces would only break the tie: only the pick is built (it runs next)
    (Policy(workspace_limit="1MiB"), [1, 1]),  # they decide what is allowed: learned
    (Policy(prefer="least_memory"), [1, 1]),
])
def test_backgrounds_provisional_pick_builds_only_what_the_policy_needs(policy, builds, monkeypatch):
    from convtune import background

    queued = []
    monkeypatch.setattr(background, "measure", lambda *args: queued.append(args) or True)
    costly = plans()
    with isolated(*costly, builtins=False):
        chosen = select(P3, policy, mode="background", db=FakeDB())
    assert [c.builds for c in costly] == builds and len(queued) == 1
    assert chosen.time_ms is None and chosen.algorithm in {"cudnn:a_big", "cudnn:b_small"}
    assert chosen.workspace_bytes == {"cudnn:a_big": 2**20, "cudnn:b_small": 0}[chosen.algorithm]


class Unbuildable(CostlyWorkspace):
    """A plan cuDNN refuses to build: learning its workspace raises, every time, as ProblemGraph.build does."""

    def buffers(self, problem):
        self.builds += 1
        raise RuntimeError("cuDNN could not build plan")


def test_backgrounds_provisional_pick_passes_over_a_plan_that_cannot_be_built(monkeypatch):
    from convtune import background

    monkeypatch.setattr(background, "measure", lambda *args: True)
    refused, fine = Unbuildable("cudnn:a_refused"), CostlyWorkspace("cudnn:b_fine", workspace_bytes=4096)
    with isolated(refused, fine, builtins=False):
        assert select(P3, mode="background", db=FakeDB()).algorithm == "cudnn:b_fine"
        assert refused.builds == 1 and fine.builds == 1
        assert select(P3, mode="background", db=FakeDB()).algorithm == "cudnn:b_fine"  # asked again: the same
    with isolated(Unbuildable("cudnn:a_refused"), builtins=False):
        with pytest.raises(NoAlgorithmError, match="cannot be built"):
            select(P3, mode="background", db=FakeDB())


def test_a_backend_not_loaded_here_prices_its_names_as_where_it_loads():
    # Another machine's measurements (cuDNN's plans, judged or learned from on a machine without cuDNN) are
    # priced as that machine priced them; an unknown backend's by the generic cost.
    assert registry.declared_cost("cudnn:eng0")(P1, 0) == cudnn_cost.execution_plan_cost(P1, 0)
    assert registry.declared_cost("nosuch:eng0")(P1, 0) == costmodel.generic_cost(P1, 0)


@pytest.mark.parametrize("call, message", [
    (lambda: get(P1, policy={}), "get()'s policy must be a convtune.Policy or None, got a dict"),
    (lambda: get("fwd"), "get()'s problem must be a convtune.ConvProblem, got a str"),
    (lambda: select(P1, policy=3), "select()'s policy must be a convtune.Policy or None, got an int"),
    (lambda: select(None), "select()'s problem must be a convtune.ConvProblem, got None"),
    (lambda: ct.nn.Conv2d(2, 2, 1, policy="fast"), "policy must be a convtune.Policy or None, got a str"),
])
def test_an_argument_of_the_wrong_type_is_named_with_what_it_got(call, message):
    with pytest.raises(TypeError) as raised:
        call()
    assert str(raised.value) == message


def test_find_stores_each_plans_place_in_its_backends_order_and_the_learned_model_reads_it(tmp_path, monkeypatch):
    first, second = Fake("fakeb:one", time_ms=2.0), Fake("fakeb:two", time_ms=1.0)
    first.place, second.place = 0, 1

    class FakeBackend(Backend):
        prefix = "fakeb"

        def algorithms(self, problem):
            return [first, second]

    with isolated(FakeBackend(), Fake("plugin:other", time_ms=3.0), builtins=False), \
            ct.TuningDB(tmp_path / "t.sqlite") as db:
        ct.find(P3, db=db)
        stored = {r.algorithm: r.place for r in db.results(P3)}
        assert stored == {"fakeb:one": 0, "fakeb:two": 1, "plugin:other": None}
        assert "place" not in PerfResult("plugin:x", "ok", time_ms=1.0).to_dict()  # left out where there is none
        # the stored places are read back, not asked of the backends again
        monkeypatch.setattr(registry, "backend_places", lambda problem: pytest.fail("asked again"))
        assert {s.name: s.order for s in learned.samples_from(db, P3.device)} == stored


def test_a_database_that_fails_to_read_leaves_get_the_installed_and_analytic_prices(caplog):
    # the cost model reads a database's measurements once to correct its prices; a database that fails there (a
    # damaged file, a locked one) must not stop get from answering: one warning, and no corrections from it
    import sqlite3

    class Broken:
        def measurements(self, device):
            raise sqlite3.DatabaseError("database disk image is malformed")

    broken = Broken()
    with caplog.at_level("WARNING", logger="convtune.costmodel"):
        corrections = costmodel.corrections(broken, "cpu")
    assert "no corrections from the tuning database (DatabaseError: database disk image is malformed)" in caplog.text
    assert corrections.model is learned.installed("cpu")[0]  # the installed model alone (none for a CPU here)
    p = ConvProblem("fwd", n=2, c=8, k=8, input_size=(8, 8), kernel_size=3, padding=1)
    assert ct.get(p, db=broken)[0].name == ct.get(p)[0].name  # answered, as without a database


def test_find_select_plan_and_get_take_a_database_path_and_refuse_what_is_not_a_database(tmp_path):
    p = ConvProblem("fwd", n=2, c=4, k=4, input_size=(8, 8), kernel_size=3)
    path = tmp_path / "t.sqlite"
    measured = ct.find(p, db=str(path), candidates=[get_algorithm("torch:native")])[0]
    assert measured.ok and ct.TuningDB(path).lookup(p).algorithm == "torch:native"  # stored there
    assert ct.select(p, db=path).algorithm == "torch:native"  # a Path too, answered from the file
    assert ct.plan([p], "1MiB", db=str(path)).choices[0].algorithm == "torch:native"
    assert ct.get(p, db=str(path))
    for call, who in ((lambda: ct.find(p, db=3), "find()"), (lambda: ct.select(p, db=3.5), "select()"),
                      (lambda: ct.get(p, db=object()), "get()"), (lambda: ct.plan([p], None, db=[]), "plan()")):
        with pytest.raises(TypeError, match=re.escape(f"{who}'s db must be a TuningDB, a database file's path")):
            call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_cuda_problem_without_cuda_is_refused_by_what_runs_it_and_ranked_by_get():
    p = ConvProblem("fwd", n=2, c=3, k=3, input_size=(8, 8), kernel_size=3, device="cuda")
    for call, who in ((lambda: ct.find(p), "find()"), (lambda: ct.select(p, mode="find"), "find()"),
                      (lambda: p.random_inputs(0), "ConvProblem.random_inputs()")):
        with pytest.raises(ValueError, match=re.escape(f"{who}: {p.key} is a CUDA problem, but PyTorch sees no CUDA")):
            call()
    assert ct.get(p)


def test_a_database_path_with_a_tilde_is_the_home_folders(tmp_path, monkeypatch):
    from convtune import db as db_module
    from convtune.db import as_db

    monkeypatch.setattr(db_module, "_opened", {})  # this test's databases only, dropped after it
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "..")
    db = as_db("~/t.sqlite", "find()")
    assert (tmp_path / "t.sqlite").is_file() and not (tmp_path.parent / "~").exists()
    assert as_db(str(tmp_path / "t.sqlite"), "get()") is db  # opened once per file


def test_a_relative_database_path_stays_the_file_it_named_after_a_change_of_folder(tmp_path, monkeypatch):
    from convtune import db as db_module
    from convtune.db import as_db

    monkeypatch.setattr(db_module, "_opened", {})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    db = as_db("t.sqlite", "find()")
    monkeypatch.chdir(tmp_path / "b")
    assert as_db(str(tmp_path / "a" / "t.sqlite"), "get()") is db
    db.store(P1, [PerfResult("torch:native", Status.OK, time_ms=1.0)])
    assert not (tmp_path / "b" / "t.sqlite").exists() and db.results(P1)


def test_a_database_path_that_does_not_resolve_is_refused_by_find_and_tuned_on_by_a_layer(tmp_path, monkeypatch,
                                                                                          caplog):
    # A symlink loop: Path.resolve raises (RuntimeError or OSError, by Python's version) before any file is opened.
    from convtune import db as db_module
    from convtune.network import Tuning

    monkeypatch.setattr(db_module, "_opened", {})
    monkeypatch.setattr(db_module, "_unopenable", set())
    monkeypatch.setattr(db_module, "_fallback", None)  # this test's temporary database, not a later test's
    loop = tmp_path / "loop.sqlite"
    loop.symlink_to(loop)
    with pytest.raises((RuntimeError, OSError)):
        ct.find(P1, db=str(loop))
    with caplog.at_level(logging.WARNING, "convtune.db"):
        fallback = Tuning(db=str(loop)).db
        assert Tuning(db=str(loop)).db is fallback  # not tried again, warned once
    assert fallback is not None and not fallback.path.is_relative_to(tmp_path)
    assert caplog.text.count("cannot be opened") == 1 and "loop.sqlite" in caplog.text
