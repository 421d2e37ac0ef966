"""get's learned cost model: it learns from the nearest measured problems what the analytic model cannot see,
is used only on its device, and a damaged or foreign model file is ignored with a warning."""

from __future__ import annotations

import dataclasses
import logging
import math
import random

import pytest
import torch

import convtune as ct
from convtune import costmodel, learned
from convtune.algorithms import registry
from convtune.cli import main as cli_main
from convtune.hardware import fingerprint, roofline_ms
from convtune.problem import ConvProblem
from convtune.settings import settings
from fakes import Fake


def problems(count: int, seed: int = 0) -> list[ConvProblem]:
    """``count`` random problems, the directions in turn (the model answers for a direction once
    ``learned.MIN_MEASURED`` of it are measured)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        c = rng.choice((8, 16, 32, 64, 128))
        groups = c if rng.random() < 0.4 else 1
        r = rng.choice((1, 3, 5, 7))
        out.append(ConvProblem(("fwd", "bwd_data", "bwd_filter")[i % 3], n=rng.choice((1, 8, 32)), c=c,
                               k=c, input_size=(rng.choice((7, 14, 28, 56)),) * 2, kernel_size=r, padding=r // 2,
                               groups=groups, dtype=rng.choice(("float32", "float16"))))
    return out


def measured(problem: ConvProblem, name: str, analytic_ms: float) -> float:
    """A machine where one family wins on depthwise problems and the other on dense ones, by 4x: what
    the analytic model (which prices both alike) cannot know."""
    depthwise = problem.groups == problem.c
    fast = (name == "plugin:dw") == depthwise
    return analytic_ms * (0.5 if fast else 2.0) * (1.1 if problem.direction == "bwd_filter" else 1.0)


def samples(count: int, seed: int = 0) -> list[learned.Sample]:
    out = []
    for p in problems(count, seed):
        for name in ("plugin:dw", "plugin:dense"):
            analytic = costmodel.analytic_ms(name, p)
            out.append(learned.Sample(p, name, analytic, measured(p, name, analytic)))
    return out


def test_it_learns_what_the_analytic_model_cannot_see_on_problems_it_never_saw():
    report = learned.holdout_report(samples(300), "test-machine", fraction=0.25)
    # the analytic model prices both families alike: its pick is right about half the time
    assert report["analytic_top1"] < 0.8 and report["analytic_geomean"] > 1.5
    assert report["learned_top1"] >= 0.9 and report["learned_geomean"] < 1.2, report


def test_a_saved_model_loads_and_answers_the_same(tmp_path):
    model = learned.train(samples(200), "test-machine")
    p = problems(1, seed=5)[0]
    path = model.save(tmp_path / "m.pt")
    again = learned.load(path)
    assert again.fingerprint == "test-machine" and again.samples == model.samples == 400
    assert math.isclose(again.factor(p, "plugin:dw", 1.0), model.factor(p, "plugin:dw", 1.0), rel_tol=1e-9)
    # built again from the same measurements: the same model (no seed, no training run)
    assert learned.train(samples(200), "test-machine").factor(p, "plugin:dw", 1.0) == model.factor(p, "plugin:dw", 1.0)


def test_on_a_problem_it_was_built_from_a_price_is_the_measured_time():
    rows = samples(200)
    model = learned.train(rows, "test-machine")
    for s in rows[:10]:
        price = s.analytic_ms * model.factor(s.problem, s.name, s.analytic_ms)
        assert math.isclose(price, s.measured_ms, rel_tol=0.05), (s, price)


def test_a_candidate_its_neighbours_did_not_measure_is_not_picked_on_a_guess():
    # Measured everywhere: 'plugin:dw' and 'plugin:dense'. 'plugin:new' was never measured: its analytic price may
    # be the lowest, but it is priced at least as the neighbours' typical candidate, never below the best known.
    model = learned.train(samples(200), "test-machine")
    p = problems(1, seed=7)[0]
    known = min(costmodel.analytic_ms(n, p) * model.factor(p, n, costmodel.analytic_ms(n, p))
                for n in ("plugin:dw", "plugin:dense"))
    guessed = 0.5 * known
    assert guessed * model.factor(p, "plugin:new", guessed) >= known
    # a direction with no measured problem: no correction at all
    only_fwd = [s for s in samples(200) if s.problem.direction == "fwd"]
    other = problems(1, seed=7)[0].replace(direction="bwd_data")
    assert learned.train(only_fwd, "test-machine").factor(other, "plugin:dw", 1.0) == 1.0


def placed_samples(count: int, seed: int = 0) -> list[learned.Sample]:
    """Per problem: 'b:first' in place 0 of backend b's order, twice the problem's floor; 'b:x<seed>' in place 1 (a
    name seen on one problem only), 4 floors; 'plugin:rare', measured on every fourth problem, 8 floors."""
    out = []
    for i, p in enumerate(problems(count, seed)):
        floor = roofline_ms(p)
        out += [learned.Sample(p, "b:first", 1.0, 2 * floor, 0), learned.Sample(p, f"b:x{seed}_{i}", 1.0, 4 * floor, 1)]
        if i % 4 == 0:
            out.append(learned.Sample(p, "plugin:rare", 1.0, 8 * floor))
    return out


def test_a_price_is_the_neighbours_best_times_the_candidates_distance_from_it():
    model = learned.train(placed_samples(200), "test-machine")
    p = problems(1, seed=11)[0]
    near = model._neighbourhood(p)
    # its factor is to the analytic price times its place's factor, so that get's price is the model's
    analytic = 2.0 ** near.best  # a price within the factor's bounds
    for name, order in (("b:first", 0), ("b:new", 1), ("b:new", None), ("b:new", 9)):
        price = analytic * costmodel.order_factor(order) * model.factor(p, name, analytic, order)
        assert math.isclose(math.log2(price), model.log2_price(p, name, analytic, order), abs_tol=1e-9)
    # a name never measured, in place 1: priced as the plans in place 1 were, one step from the best
    assert model.log2_price(p, "b:new", analytic, 1) == pytest.approx(near.best + 1.0)
    assert model.log2_price(p, "b:first", analytic, 0) == pytest.approx(near.best)
    # known by name (the best everywhere) and by a later place: the better of the two
    assert model.log2_price(p, "b:first", analytic, 1) == pytest.approx(near.best)


def test_a_price_known_by_place_alone_is_held_to_what_its_engine_measured():
    # per problem: one engine's plan first in the order and best; another engine's two plans, 16 and 64 times slower,
    # the faster without a place; on every third problem a third engine, 2 times slower (too few for a price)
    rows = []
    for i, p in enumerate(problems(200)):
        floor = roofline_ms(p)
        rows += [learned.Sample(p, f"b:good_k{i}", 1.0, 2 * floor, 0), learned.Sample(p, "b:slow_k1", 1.0, 32 * floor),
                 learned.Sample(p, "b:slow_k2_i3", 1.0, 128 * floor, 1)]
        if i % 3 == 0:
            rows.append(learned.Sample(p, "b:rare", 1.0, 4 * floor, 2))
    model = learned.train(rows, "test-machine")
    p = problems(1, seed=11)[0]
    near, analytic = model._neighbourhood(p), 1.0
    bound = max(0.0, 4.0 - learned.ENGINE_MARGIN)  # the slow engine's best plan: 16 times the best (log2 4)
    # on this problem a plan of the slow engine no neighbour measured by name comes first: its place says best, its
    # engine's best plan 16 times the best; the price is the engine's, ENGINE_MARGIN below
    assert model.log2_price(p, "b:slow_k7", analytic, 0) == pytest.approx(near.best + bound)
    # a plan of the good engine never measured by name, in place 1: its place's price (64 times), the engine's lower
    assert model.log2_price(p, "b:good_k999", analytic, 1) == pytest.approx(near.best + 6.0)
    # an engine measured on too few neighbours bounds nothing: cuDNN's first place, as before
    assert model.log2_price(p, "b:rare_k5", analytic, 0) == pytest.approx(near.best)
    # known by name: its name's and place's prices, the engine's not asked
    assert model.log2_price(p, "b:slow_k2_i3", analytic, 0) == pytest.approx(near.best)
    # a candidate with no place is not bounded by its engine: a guess, as before
    assert model.guessed(p, "b:slow_k7", None)
    assert learned.engine_key("cudnn:eng1_k2=0_k3=0") == learned.engine_key("cudnn:eng1_i7") == \
        learned.engine_key("cudnn:eng1") == "cudnn:eng1*"
    assert learned.engine_key("my_be:eng1_k2=0") == "my_be:eng1*"  # a backend's own underscores are kept


def test_a_ranking_priced_together_gets_each_candidates_price_alone_and_a_fault_costs_only_its_own(monkeypatch,
                                                                                                      caplog):
    model = learned.train(placed_samples(200), "test-machine")
    p = problems(1, seed=11)[0]
    asked = [("b:first", 0.01, 0), ("b:new", 0.02, 1), ("plugin:rare", 0.03, None), ("plugin:new", 0.04, None)]
    together = learned.corrections(p, asked, model)
    assert together == [pytest.approx(learned.correction(p, *c, model=model), rel=1e-12) for c in asked]
    table = costmodel.Corrections(model)
    assert table.prices(p, asked) == [pytest.approx(table.price(name, p, ms, place), rel=1e-12)
                                      for name, ms, place in asked]
    # a candidate the model cannot price: the analytic price for it alone, with a warning naming it
    score = learned._score

    def failing(near, key):
        if key == "b:new":
            raise ArithmeticError("no price")
        return score(near, key)

    monkeypatch.setattr(learned, "_score", failing)
    with caplog.at_level(logging.WARNING, logger="convtune.learned"):
        faulty = learned.corrections(p, asked, model)
    assert faulty[1] == 1.0 and faulty[:1] + faulty[2:] == together[:1] + together[2:]
    assert "could not price b:new (ArithmeticError: no price)" in caplog.text


def test_a_name_too_few_neighbours_measured_is_priced_as_their_typical_candidate_or_its_analytic_price():
    model = learned.train(placed_samples(200), "test-machine")
    p = problems(1, seed=11)[0]
    near = model._neighbourhood(p)
    # 'plugin:rare' was measured on about a quarter of the problems (always 2 steps from the best): no price of its own
    typical = near.best + near.typical
    assert model.log2_price(p, "plugin:rare", 1e-6) == pytest.approx(typical)
    assert model.log2_price(p, "plugin:rare", 1e-6) != pytest.approx(near.best + 2.0)
    # an analytic price far above: that (times the neighbours' typical correction) is the price instead
    assert model.log2_price(p, "plugin:rare", 1e6) == pytest.approx(math.log2(1e6) + near.correction)


def test_get_prices_with_the_model_and_the_candidates_place(tmp_path):
    model = learned.train(placed_samples(200), fingerprint("cpu"))
    p = problems(1, seed=11)[0]
    with settings.override(learned_model=str(tmp_path / "get_{device}.pt")):
        model.save(tmp_path / "get_cpu.pt")
        table, analytic = costmodel.Corrections(), 2.0 ** model._neighbourhood(p).best
        first, later = (table.price("b:unseen", p, analytic, place) for place in (0, 1))
    assert later == pytest.approx(2 * first)  # place 1 measured twice place 0's time on every neighbour


def test_an_extended_model_replaces_removes_and_restores_rows():
    rows = samples(200)
    model = learned.train(rows, "test-machine")
    p = rows[0].problem
    (old,) = [r for r in model.rows if r.problem == p]
    slower = model.extended([dataclasses.replace(s, measured_ms=2 * s.measured_ms) for s in rows if s.problem == p])
    (row,) = [r for r in slower.rows if r.problem == p]
    assert len(slower.rows) == len(model.rows) and slower.samples == model.samples
    assert row.best == pytest.approx(old.best + 1) and row.regrets == pytest.approx(old.regrets)
    gone = model.extended([], replaced=[p])  # measured again, nothing timed
    assert p not in [r.problem for r in gone.rows] and gone.samples == model.samples - old.count
    back = gone.extended([], replaced=[p], fallback=model)
    assert [r for r in back.rows if r.problem == p] == [old]


def test_a_database_builds_on_the_installed_model_and_keeps_its_places(tmp_path):
    rows = placed_samples(200)
    p = rows[0].problem
    with settings.override(learned_model=str(tmp_path / "get_{device}.pt")), ct.TuningDB(tmp_path / "t.sqlite") as db:
        learned.train(rows, fingerprint("cpu")).save(tmp_path / "get_cpu.pt")
        # p stored again by an earlier version (no places), and a problem the model does not hold
        db.store(p, [ct.PerfResult(s.name, "ok", time_ms=s.measured_ms) for s in rows if s.problem == p])
        new = p.replace(n=p.n + 1)
        db.store(new, [ct.PerfResult("b:first", "ok", time_ms=1.0, place=0)])
        model = costmodel.corrections(db, "cpu").model
        assert len(model.rows) == len({s.problem for s in rows}) + 1
        (row,) = [r for r in model.rows if r.problem == p]
        assert "b@0" in row.regrets  # the installed model's row, with its places
        costmodel.stored(db, p, [])  # measured again, nothing timed: the installed model's row still
        assert [r for r in costmodel.corrections(db, "cpu").model.rows if r.problem == p] == [row]
        costmodel.stored(db, new, [])
        assert new not in [r.problem for r in costmodel.corrections(db, "cpu").model.rows]


def test_a_price_is_never_below_the_problems_floor():
    # A machine that measured everything at a tenth of its floor (a wrong peak, a broken timer): the prices stop
    # at the floor, whatever the neighbours say.
    rows = [dataclasses.replace(s, measured_ms=0.1 * roofline_ms(s.problem) * (2 if s.name == "plugin:dense" else 1))
            for s in samples(200)]
    model = learned.train(rows, "test-machine")
    p = problems(1, seed=7)[0]
    floor = math.log2(roofline_ms(p))
    assert model.log2_price(p, "plugin:dw", 1.0) == pytest.approx(floor)
    assert model.log2_price(p, "plugin:never", 1.0) == pytest.approx(floor)


def test_a_file_of_other_objects_is_refused_unloaded_without_advice_to_load_it_unchecked(tmp_path, recwarn):
    import os
    import pickle

    path = tmp_path / "model.pt"
    path.write_bytes(pickle.dumps({"call": os.getcwd}))  # what a model file never holds: a callable
    with pytest.raises(ValueError, match="holds objects a model file never holds .* convtune train-get") as caught:
        learned.load(path)
    assert "weights_only" not in str(caught.value) and not [w for w in recwarn if "pickle" in str(w.message)]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other_version", "nan_regrets", "not_a_dict",
                                    "zero_count", "float32_best", "short_best", "index_out_of_range",
                                    "bad_problem_key", "empty", "names_a_string", "float_counts"])
def test_a_damaged_or_foreign_file_is_refused_with_the_reason(tmp_path, damage):
    path = learned.train(samples(10), "test-machine").save(tmp_path / "m.pt")
    data = torch.load(path, weights_only=True)
    if damage == "garbage":
        path.write_bytes(b"\x00garbage" * 50)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "other_version":  # the message names what differs
        torch.save(dict(data, feature_version=learned.FEATURE_VERSION + 1), path)
        with pytest.raises(ValueError, match=f"feature_version {learned.FEATURE_VERSION + 1}.*reads feature_version "
                                             f"{learned.FEATURE_VERSION}"):
            learned.load(path)
    elif damage == "nan_regrets":
        torch.save(dict(data, regrets=data["regrets"].clone().fill_(float("nan"))), path)
    elif damage == "zero_count":
        torch.save(dict(data, counts=data["counts"].clone().fill_(0)), path)
    elif damage == "float32_best":
        torch.save(dict(data, best=data["best"].float()), path)
    elif damage == "short_best":
        torch.save(dict(data, best=data["best"][:-1]), path)
    elif damage == "index_out_of_range":
        entries = data["entries"].clone()
        entries[0, 1] = len(data["names"])
        torch.save(dict(data, entries=entries), path)
    elif damage == "bad_problem_key":
        torch.save(dict(data, problems=["not a problem", *data["problems"][1:]]), path)
    elif damage == "empty":
        nothing = torch.zeros(0, dtype=torch.float64)
        torch.save(dict(data, problems=[], names=[], best=nothing, typical=nothing, correction=nothing,
                        regrets=nothing, entries=torch.zeros((0, 2), dtype=torch.int64),
                        counts=torch.zeros(0, dtype=torch.int64)), path)
    elif damage == "names_a_string":
        torch.save(dict(data, names="".join(data["names"])), path)
    elif damage == "float_counts":
        torch.save(dict(data, counts=data["counts"].double()), path)
    else:
        torch.save([1, 2, 3], path)
    with pytest.raises(ValueError, match="m.pt"):
        learned.load(path)


def test_get_uses_a_model_of_this_machine_and_ignores_others_with_a_warning(tmp_path, caplog):
    p = ConvProblem("fwd", n=8, c=32, k=32, input_size=(14, 14), kernel_size=3, padding=1, groups=32)
    plugins = [Fake("plugin:dw"), Fake("plugin:dense")]
    with settings.override(learned_model=str(tmp_path / "get_{device}.pt")), registry.isolated(*plugins):
        def first_of_two():
            names = [c.name for c in ct.get(p) if c.name.startswith("plugin:")]
            return names[0]

        assert math.isclose(costmodel.predict_ms("plugin:dw", p), costmodel.analytic_ms("plugin:dw", p))
        # trained here on the machine above: the depthwise family wins depthwise problems
        model = learned.train(samples(200), fingerprint("cpu"))
        model.save(tmp_path / "get_cpu.pt")
        saved = torch.load(tmp_path / "get_cpu.pt", weights_only=True)
        assert learned.active("cpu") is not None
        assert first_of_two() == "plugin:dw"
        # priced alike by the analytic model, 4x apart here by what the neighbours measured
        assert costmodel.analytic_ms("plugin:dw", p) == costmodel.analytic_ms("plugin:dense", p)
        assert costmodel.predict_ms("plugin:dw", p) < 0.9 * costmodel.predict_ms("plugin:dense", p)
        # the same model, but trained on another machine: not used, said once
        torch.save(dict(saved, fingerprint="cuda|some other GPU"), tmp_path / "get_cpu.pt")
        learned.forget()
        with caplog.at_level(logging.WARNING, logger="convtune.learned"):
            assert learned.active("cpu") is None
        assert "another machine" in caplog.text
        assert math.isclose(costmodel.predict_ms("plugin:dw", p), costmodel.analytic_ms("plugin:dw", p))
        # damaged: not used either
        (tmp_path / "get_cpu.pt").write_bytes(b"not a model")
        learned.forget()  # get looks at the file again at most once a second; a test does not wait
        with caplog.at_level(logging.WARNING, logger="convtune.learned"):
            assert learned.active("cpu") is None
        assert "not a learned cost model" in caplog.text
        # trained here but with other software: used, and said once
        torch.save(dict(saved, software="torch0.0|cudnn0"), tmp_path / "get_cpu.pt")
        learned.forget()
        with caplog.at_level(logging.WARNING, logger="convtune.learned"):
            assert learned.active("cpu") is not None
        assert "other software" in caplog.text


def test_a_ranking_looks_up_the_installed_model_once_not_per_candidate(tmp_path, monkeypatch):
    p = ConvProblem("fwd", n=8, c=32, k=32, input_size=(14, 14), kernel_size=3, padding=1, groups=32)
    plugins = [Fake("plugin:dw"), Fake("plugin:dense"), Fake("plugin:third")]
    with settings.override(learned_model=str(tmp_path / "get_{device}.pt")), registry.isolated(*plugins):
        learned.train(samples(200), fingerprint("cpu")).save(tmp_path / "get_cpu.pt")
        looks = []
        installed = learned.installed
        monkeypatch.setattr(learned, "installed", lambda device: looks.append(device) or installed(device))
        names = [c.name for c in ct.get(p)]
        assert len(names) >= 4 and names.index("plugin:dw") < names.index("plugin:dense")  # priced with the model
        assert len(looks) <= 2  # get's answer's key, and the ranking's table: each candidate read the settings before


def test_train_get_trains_on_the_database_and_refuses_an_empty_one(tmp_path, capsys, quick_timing):
    db_path = tmp_path / "t.sqlite"
    out = tmp_path / "model.pt"
    assert cli_main(["train-get", "--db", str(db_path), "--device", "cpu", "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err  # it only reads the database
    ct.TuningDB(db_path).close()
    assert cli_main(["train-get", "--db", str(db_path), "--device", "cpu", "--out", str(out)]) == 2
    assert "no measurements" in capsys.readouterr().err
    assert cli_main(["train-get", "--db", str(db_path), "--device", "cpu", "--epochs", "400"]) == 2
    assert "no longer trained" in capsys.readouterr().err
    with ct.TuningDB(db_path) as db, settings.override(find_patience=0, find_prune_factor=0):
        for p in problems(6, seed=3):  # every candidate timed: several measurements per problem
            ct.find(p.replace(n=1, input_size=(6, 6)), db=db)
    assert cli_main(["train-get", "--db", str(db_path), "--device", "cpu", "--out", str(out), "--json"]) == 0
    assert learned.load(out).fingerprint == fingerprint("cpu")
    printed = capsys.readouterr().out
    assert '"learned_geomean"' in printed  # judged on held-out problems first
    assert '"too few measured"' in printed and '"answers for": "no direction yet"' in printed  # 6 problems


def test_a_correction_is_bounded_and_the_corrections_follow_the_model(tmp_path):
    p = problems(1, seed=9)[0]
    absurd = [dataclasses.replace(s, measured_ms=s.analytic_ms * 1e9) for s in samples(200)]  # a machine 1e9x off
    assert learned.train(absurd, fingerprint("cpu")).factor(p, "plugin:dw", 1.0) == 2.0 ** learned.MAX_LOG2_FACTOR
    model = learned.train(samples(200), fingerprint("cpu"))
    # the database's corrections are ratios to the prediction of the model in use: a new model, a new table
    with settings.override(learned_model=str(tmp_path / "get_{device}.pt")), ct.TuningDB(tmp_path / "t.sqlite") as db:
        before = costmodel.corrections(db, "cpu")
        assert costmodel.corrections(db, "cpu") is before
        model.save(tmp_path / "get_cpu.pt")
        assert costmodel.corrections(db, "cpu") is not before


def test_tied_prices_are_picked_by_name_not_by_the_rows_order():
    # A database lists a problem's results fastest first: a tie broken by that order would pick the measured best.
    class NoCorrection:
        def log2_factors(self, rows):
            return [0.0] * len(rows)

    p = problems(1)[0]
    rows = [learned.Sample(p, "z:fast", 1.0, 1.0), learned.Sample(p, "a:slow", 1.0, 4.0)]
    picks = learned.first_picks(NoCorrection(), rows)
    assert picks["analytic"].name == picks["learned"].name == "a:slow"


def test_places_in_a_backends_order_rank_tied_prices_as_get_does():
    class NoCorrection:
        def log2_factors(self, rows):
            return [0.0] * len(rows)

    p = problems(1)[0]
    rows = [learned.Sample(p, "b:listed_second", 1.0, 4.0, order=1), learned.Sample(p, "b:listed_first", 1.0, 1.0, 0)]
    picks = learned.first_picks(NoCorrection(), rows)
    assert picks["analytic"].name == picks["learned"].name == "b:listed_first"
    # each name's place among its own backend's names
    assert learned.positions(["b:x", "c:y", "b:z", "c:w"]) == {"b:x": 0, "c:y": 0, "b:z": 1, "c:w": 1}


def test_another_heuristics_first_choice_moves_to_the_head_of_its_backends_order():
    # Equal analytic prices, so the backend's order decides; the promoted plan goes first, those before it one down.
    p = problems(1)[0]
    rows = [learned.Sample(p, "cudnn:eng1", 1.0, 1.0, 0), learned.Sample(p, "cudnn:eng2", 1.0, 1.0, 3),
            learned.Sample(p, "cudnn:eng3", 1.0, 1.0, 1)]
    assert learned.analytic_first(rows).name == "cudnn:eng1"
    assert learned.analytic_first(rows, "cudnn:eng2").name == "cudnn:eng2"
    assert learned.analytic_first(rows, "cudnn:eng9").name == "cudnn:eng1"  # not among them: the order as it is
    # a cheaper candidate of no ordering backend still wins
    assert learned.analytic_first([*rows, learned.Sample(p, "gemm:x", 0.5, 1.0, None)], "cudnn:eng2").name == "gemm:x"
    # another ordering backend's places are its own: its first keeps its place, and wins a tie by name
    other = learned.Sample(p, "another:first", 1.0, 1.0, 0)
    assert learned.analytic_first([*rows, other], "cudnn:eng2").name == "another:first"


def test_it_learns_from_a_backends_order_what_the_names_do_not_say():
    # A backend whose heuristics put its fastest plan first: the plans' names (hashed) tell nothing, their
    # place does. Trained with the places, the model picks the first-listed plan on problems it never saw.
    def ranked_samples(count: int, seed: int) -> list[learned.Sample]:
        rng = random.Random(seed)
        out = []
        for p in problems(count, seed):
            names = [f"plugin:eng{engine}" for engine in rng.sample(range(200), 4)]  # nothing of the place
            for place, name in enumerate(names):
                analytic = costmodel.analytic_ms(name, p)
                out.append(learned.Sample(p, name, analytic, analytic * (0.5 if place == 0 else 2.0), place))
        return out

    report = learned.holdout_report(ranked_samples(300, 1), "test-machine", fraction=0.25)
    assert report["learned_top1"] >= 0.9, report
    # without the places (the order unknown to the model), ties fall by name: the first-listed is the best 1 in 4
    unplaced = [dataclasses.replace(s, order=None) for s in ranked_samples(300, 1)]
    report = learned.holdout_report(unplaced, "test-machine", fraction=0.25)
    assert report["learned_top1"] < 0.6, report


def test_samples_take_their_places_from_the_recorded_orders(tmp_path):
    p = problems(1, seed=4)[0]
    results = [ct.PerfResult(name, ct.Status.OK, time_ms=t) for name, t in
               (("plugin:b", 1.0), ("plugin:a", 2.0), ("gemm:1x1", 3.0))]
    with ct.TuningDB(tmp_path / "t.sqlite") as db:
        db.store(p, results)
        places = {s.name: s.order for s in learned.samples_from(db, "cpu", orders={p.key: ["plugin:a", "plugin:b"]})}
        assert places == {"plugin:a": 0, "plugin:b": 1, "gemm:1x1": None}
        # not recorded: asked of this machine's backends, none of which ranks its plans here
        assert {s.order for s in learned.samples_from(db, "cpu")} == {None}


def test_a_candidate_too_few_neighbours_measured_is_priced_by_a_guess():
    model = learned.train(placed_samples(200), "test-machine")
    p = problems(1, seed=11)[0]
    assert model.guessed(p, "plugin:rare") and model.guessed(p, "b:new")  # a quarter of the problems; none
    assert not model.guessed(p, "b:first") and not model.guessed(p, "b:new", 1)  # by its name; by its place
    # where the model does not answer (no measured problem of the direction), nothing is its guess
    only_fwd = learned.train([s for s in placed_samples(200) if s.problem.direction == "fwd"], "test-machine")
    assert not only_fwd.guessed(p.replace(direction="bwd_data"), "plugin:rare")
    assert costmodel.Corrections(model).guessed("plugin:rare", p)
    assert costmodel.Corrections(model).guessed("b:new", p) and not costmodel.Corrections(model).guessed("b:new", p, 1)
    assert not costmodel.Corrections(analytic=True).guessed("plugin:rare", p)


def test_a_candidate_a_neighbour_timed_near_its_best_is_a_contender_whatever_its_price():
    # forward problems of batch 2 to 180: 'plugin:a' is best on each and 'plugin:b' 1.5x it; 'plugin:c' is 4x it,
    # except at batch 90, where it is best: priced by the neighbours' mean it comes last, but a neighbour found it best
    rows = []
    for n in range(2, 182, 2):
        p = ConvProblem("fwd", n=n, c=64, k=64, input_size=(14, 14), kernel_size=3, padding=1)
        floor = roofline_ms(p)
        rows += [learned.Sample(p, name, 1.0, t * floor) for name, t in (
            ("plugin:a", 1.0), ("plugin:b", 1.5), ("plugin:c", 0.5 if n == 90 else 4.0))]
    model = learned.train(rows, "test-machine")
    asked = ConvProblem("fwd", n=91, c=64, k=64, input_size=(14, 14), kernel_size=3, padding=1)  # not measured
    named = [("plugin:a", None), ("plugin:b", None), ("plugin:c", None), ("plugin:new", None)]
    assert model.log2_price(asked, "plugin:c", 1.0) > model.log2_price(asked, "plugin:b", 1.0)
    assert model.contenders(asked, named, 1.1) == {"plugin:a", "plugin:c"}
    assert model.contenders(asked, named, 1.6) == {"plugin:a", "plugin:b", "plugin:c"}  # b: 1.5x its best
    assert model.contenders(asked, named, 1.0) == {"plugin:a", "plugin:c"}  # the neighbours' best themselves
    far = ConvProblem("fwd", n=8, c=64, k=64, input_size=(14, 14), kernel_size=3, padding=1)  # batch 90 not near
    assert model.contenders(far, named, 1.1) == {"plugin:a"}
    # no answer for a direction none of whose problems were measured; none through a table of the analytic price
    assert model.contenders(asked.replace(direction="bwd_data"), named, 1.1) == frozenset()
    assert costmodel.Corrections(model).contenders(asked, named, 1.1) == {"plugin:a", "plugin:c"}
    assert costmodel.Corrections(model).contenders(asked, named, 0) == frozenset()  # the rule off
    assert costmodel.Corrections(analytic=True).contenders(asked, named, 1.1) == frozenset()
    # a model that cannot answer leaves the search to its other rules; any answer comes back as a frozenset
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(learned.LearnedModel, "contenders", lambda *args: 1 / 0)
        assert costmodel.Corrections(model).contenders(asked, named, 1.1) == frozenset()
        patch.setattr(learned.LearnedModel, "contenders", lambda *args: ["plugin:a"])
        assert costmodel.Corrections(model).contenders(asked, named, 1.1) == frozenset({"plugin:a"})
    # a place counts as a key: cuDNN's first plan on the neighbours, whatever its name here
    placed = learned.train(placed_samples(200), "test-machine")
    q = problems(1, seed=11)[0]
    assert placed.contenders(q, [("b:new", 0), ("b:new2", 1), ("plugin:rare", None)], 1.1) == {"b:new"}


def test_a_simulated_find_tries_each_family_first_then_stops_as_find_does():
    p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(5, 5), kernel_size=3)
    measured = {"cudnn:a": 1.0, "gemm:x": 3.0, "cudnn:b": 1.2, "cudnn:c": 1.1, "cudnn:d": 1.3, "cudnn:e": 0.5,
                "fft:y": 40.0}
    predicted = {"cudnn:a": 1.0, "gemm:x": 2.0, "cudnn:b": 1.1, "cudnn:c": 1.2, "cudnn:d": 1.3, "cudnn:e": 1.4,
                 "fft:y": 50.0}
    order = [(learned.Sample(p, name, 1.0, measured[name]), predicted[name])
             for name in sorted(predicted, key=predicted.get)]
    # every backend's first: cudnn:a, gemm:x (fft:y predicted 50x the best so far: pruned), then cudnn:b, c, d
    # gain nothing beyond 2 %, and with a patience of 3 the search stops before cudnn:e, the fastest
    assert learned.simulated_find(order, patience=3, tolerance=0.02, prune_factor=10.0) == (1.0, 5, pytest.approx(7.6))
    assert learned.simulated_find(order, patience=0, tolerance=0.02, prune_factor=10.0) == (0.5, 6, pytest.approx(8.1))
    assert learned.simulated_find(order, patience=0, tolerance=0.02, prune_factor=0) == (0.5, 7, pytest.approx(48.1))
    # fft:y's price a guess: as its family's first try it runs all the same (40 ms), then b, c, d as before
    assert learned.simulated_find(order, patience=3, tolerance=0.02, prune_factor=10.0,
                                  guessed=["fft:y"]) == (1.0, 6, pytest.approx(47.6))
    # cudnn:e a contender: it runs after the patience ran out, and cudnn:d, no contender, does not
    assert learned.simulated_find(order, patience=2, tolerance=0.02, prune_factor=10.0,
                                  contenders=["cudnn:e"]) == (0.5, 5, pytest.approx(6.8))
    # a contender that gains starts the count again: cudnn:f, no contender, runs after it (and is the best)
    longer = [*order, (learned.Sample(p, "cudnn:f", 1.0, 0.4), 1.5)]
    assert learned.simulated_find(longer, patience=2, tolerance=0.02, prune_factor=10.0,
                                  contenders=["cudnn:e"]) == (0.4, 6, pytest.approx(7.2))
    # a family priced 10x too high: its first try, timed at a tenth of its price, brings the rest under the prune
    measured.update({"fft:y": 0.9, "fft:z": 0.2})
    predicted.update({"fft:y": 9.0, "fft:z": 20.0})
    order = [(learned.Sample(p, name, 1.0, measured[name]), predicted[name])
             for name in sorted(predicted, key=predicted.get)]
    assert learned.simulated_find(order, patience=0, tolerance=0.02, prune_factor=10.0)[:2] == (0.2, 8)


def test_the_simulated_find_runs_what_find_runs_and_ends_where_find_ends(monkeypatch):
    # find itself, on fake candidates of three backends in a given order (one of them with two families, as
    # convtune's Triton kernels: each family tried once early), against the simulation of it
    import importlib

    from convtune.results import PerfResult, Status
    from fakes import FakeTimer

    find_module = importlib.import_module("convtune.find")  # the module (the package's name is the function)
    p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(5, 5), kernel_size=3, padding=1)
    draw = random.Random(1)
    for _ in range(200):
        names = [f"{draw.choice(['aa:', 'bb:', 'cc:one_fwd_', 'cc:two_fwd_'])}v{i}" for i in range(draw.randint(3, 12))]
        measured = {name: round(draw.uniform(0.5, 3), 2) for name in names}
        predicted = {name: measured[name] * draw.choice([0.3, 0.8, 1, 1.2, 5, 30]) for name in names}
        patience, prune = draw.choice([0, 1, 2, 3]), draw.choice([0.0, 2.0, 10.0])
        guessed = {name for name in names if draw.random() < 0.3}  # priced by a guess of the learned model
        contenders = frozenset(name for name in names if draw.random() < 0.3)  # a neighbour timed near its best
        monkeypatch.setattr(costmodel.Corrections, "guessed",
                            lambda self, name, problem, place=None, guessed=guessed: name in guessed)
        monkeypatch.setattr(costmodel.Corrections, "contenders",
                            lambda self, problem, named, factor, contenders=contenders: contenders & {
                                n for n, _ in named} if factor else frozenset())
        fakes = {name: Fake(name, time_ms=measured[name]) for name in names}
        order = sorted(names, key=lambda name: (predicted[name], name))
        monkeypatch.setattr(find_module, "ranked_predictions",
                            lambda *args, fakes=fakes, predicted=predicted, order=order, **kwargs: [
                                (fakes[name], PerfResult(name, Status.OK, time_ms=predicted[name])) for name in order])
        with settings.override(find_patience=patience, find_prune_factor=prune, isolate="off"):
            ran = [r for r in ct.find(p, timer=FakeTimer(), candidates=list(fakes.values())) if r.ok]
        simulated = learned.simulated_find([(learned.Sample(p, name, 1.0, measured[name]), predicted[name])
                                            for name in order], patience, ct.Policy().tolerance, prune, guessed,
                                           contenders)
        assert simulated[:2] == (pytest.approx(min(r.time_ms for r in ran)), len(ran)), (order, patience, prune,
                                                                                         guessed, contenders)


def test_a_configured_model_path_where_no_file_is_is_warned_once_and_the_analytic_model_serves(tmp_path, caplog):
    missing = tmp_path / "nothing_{device}.pt"
    with settings.override(learned_model=str(missing)), caplog.at_level("WARNING", logger="convtune.learned"):
        learned.forget()
        assert learned.active("cpu") is None
        learned.forget()
        assert learned.active("cpu") is None
    learned.forget()
    warned = [r.message for r in caplog.records if "where no file is" in r.message]
    assert warned == [f"settings.learned_model (CONVTUNE_LEARNED_MODEL) names {tmp_path / 'nothing_cpu.pt'}, where no "
                      f"file is; the analytic cost model serves; build one with convtune train-get, or unset it for "
                      f"the cache folder's"]
