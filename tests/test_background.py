"""The 'background' selection mode: PyTorch's own call (or get's choice) at once, find in a worker thread, the
measured choice after."""

from __future__ import annotations

import copy
import importlib
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import convtune as ct
from convtune import background
from convtune.cli import main
from convtune.network import Tuning
from convtune.settings import settings


def problem(n: int = 1, size: int = 6) -> ct.ConvProblem:
    return ct.ConvProblem("fwd", n=n, c=3, k=4, input_size=(size, size), kernel_size=3, padding=1)


@pytest.fixture
def db(tmp_path):
    with ct.TuningDB(tmp_path / "tuning.sqlite") as tdb:
        yield tdb
    assert background.wait(120)  # nothing left running into the next test


def test_select_answers_with_pytorchs_own_call_at_once_and_the_database_once_measured(db):
    p = problem()
    first = ct.select(p, mode="background", db=db)
    assert first.time_ms is None and "not measured" in first.message  # no measurement yet
    assert first.algorithm == "torch:native" and "PyTorch's own call" in first.message  # nothing asked of cuDNN
    assert background.wait(120) and background.pending() == 0
    stored = db.lookup(p)
    assert stored is not None and stored.time_ms is not None
    again = ct.select(p, mode="background", db=db)
    assert again == stored  # measured, nothing queued again
    assert background.pending() == 0


def test_a_policy_that_refuses_pytorchs_call_gets_the_cost_models_choice_at_once(db, monkeypatch):
    from convtune.algorithms.native import Native

    monkeypatch.setattr(Native, "is_deterministic", lambda self, problem: False)  # as cuDNN's gradients may be
    policy = ct.Policy(deterministic=True)
    first = ct.select(problem(), policy, mode="background", db=db)
    assert first.algorithm != "torch:native" and "the cost model predicts" in first.message
    assert first.deterministic and first.time_ms is None
    assert ct.select(problem(n=2), mode="background", db=db).algorithm == "torch:native"  # the default policy's


@pytest.fixture
def held(monkeypatch):
    """The worker holds each measurement until the test sets this event (so no check races it)."""
    gate, measure = threading.Event(), background._find
    monkeypatch.setattr(background, "_find", lambda *args: gate.wait(120) and measure(*args))
    yield gate
    gate.set()


def test_a_problem_is_queued_once_and_each_finished_measurement_advances_the_generation(db, held):
    p = problem(n=2)
    before = background.generation()
    assert background.measure(p, ct.Policy(), db) and background.measure(p, ct.Policy(), db)
    assert background.pending() == 1 and background.queued(p, ct.Policy(), db)  # one problem, queued once
    assert not background.queued(p, ct.Policy(deterministic=True), db)  # another policy is another question
    held.set()
    assert background.wait(120)
    assert background.generation() == before + 1 and not background.queued(p, ct.Policy(), db)


def test_the_worker_starts_once_no_problem_has_been_queued_for_the_settle_time(db, monkeypatch):
    started: list[float] = []  # time.monotonic() as each measurement starts
    measure = background._find
    monkeypatch.setattr(background, "_find", lambda *args: started.append(time.monotonic()) or measure(*args))
    with settings.override(background_settle_s=2.0):
        assert background.measure(problem(n=3), ct.Policy(), db)
        time.sleep(0.1)  # (far less than the settle time: nothing has started)
        queued_last = time.monotonic()
        assert background.measure(problem(n=4), ct.Policy(), db)  # a second problem: the wait starts again
        assert background.wait(120)
    assert len(started) == 2 and min(started) >= queued_last + 2.0, (started, queued_last)


def test_problems_met_at_every_step_are_measured_all_the_same(db, monkeypatch):
    # a problem queued every 0.05 s leaves no settle time of 0.2 s quiet: the oldest starts once it has waited
    # SETTLE_LIMIT settle times (the measurement itself is not what this is about: a stand-in that succeeds)
    monkeypatch.setattr(background, "SETTLE_LIMIT", 3)
    monkeypatch.setattr(background, "_find", lambda *args: True)
    before = background.generation()
    with settings.override(background_settle_s=0.2):
        for n in range(7, 107):  # at most 100 problems, 5 s
            background.measure(problem(n=n), ct.Policy(), db)
            if background.generation() > before:
                break  # measured while problems kept coming
            time.sleep(0.05)
        else:
            pytest.fail("nothing was measured while a problem came every 0.05 s")
        assert background.wait(120)


def test_a_settle_time_that_does_not_parse_leaves_the_worker_running_and_is_named(db, monkeypatch, caplog):
    monkeypatch.setenv("CONVTUNE_BACKGROUND_SETTLE_S", "soon")
    with caplog.at_level(logging.WARNING, logger="convtune.background"):
        assert background.measure(problem(n=5), ct.Policy(), db)
        assert background.wait(120)  # the worker neither died nor hung on it
    assert "the background worker starts at once" in caplog.text and "CONVTUNE_BACKGROUND_SETTLE_S" in caplog.text
    monkeypatch.delenv("CONVTUNE_BACKGROUND_SETTLE_S")
    assert background.measure(problem(n=6), ct.Policy(), db) and background.wait(120)
    assert db.lookup(problem(n=6)) is not None


def test_a_failed_measurement_keeps_the_models_choice_and_is_not_asked_again(db, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("the device went away")

    monkeypatch.setattr(sys.modules["convtune.find"], "find", broken)  # the module (convtune.find: the function)
    p = problem(n=3)
    tuning = Tuning(mode="background", db=db)
    with caplog.at_level(logging.WARNING, logger="convtune.background"):
        first = tuning.select(p)
        assert first.time_ms is None and tuning.waiting_since(p.key) is not None
        assert background.wait(120)
    assert "the device went away" in caplog.text
    assert not background.measure(p, ct.Policy(), db)  # not queued again in this process
    again = tuning.select(p)  # asked again (its measurement finished), and final now
    assert again.time_ms is None and tuning.waiting_since(p.key) is None and db.lookup(p) is None


def test_a_measurement_that_raises_a_base_exception_is_reported_and_the_worker_goes_on(db, monkeypatch, caplog):
    class Cancelled(BaseException):  # as asyncio.CancelledError, or a plug-in's own: not an Exception
        pass

    find = sys.modules["convtune.find"].find
    doomed, next_one = problem(n=7), problem(n=8)

    def cancelled_once(p, *args, **kwargs):
        if p == doomed:
            raise Cancelled("the plug-in was cancelled")
        return find(p, *args, **kwargs)

    monkeypatch.setattr(sys.modules["convtune.find"], "find", cancelled_once)
    with caplog.at_level(logging.WARNING, logger="convtune.background"):
        assert background.measure(doomed, ct.Policy(), db) and background.measure(next_one, ct.Policy(), db)
        assert background.wait(120) and background.pending() == 0  # nothing left waiting forever
    assert "the plug-in was cancelled" in caplog.text  # reported, not swallowed
    assert not background.measure(doomed, ct.Policy(), db)  # failed: not asked again, the choice made at once stays
    assert db.lookup(doomed) is None and db.lookup(next_one) is not None  # the worker went on with the next one


def test_tuning_selects_again_once_the_measurement_is_stored(db, held):
    tuning = Tuning(mode="background", db=db)
    p, other = problem(n=4), problem(n=5)
    first = tuning.select(p)
    assert first.time_ms is None and tuning.select(p) is first  # remembered while it waits
    since = tuning.waiting_since(p.key)
    assert since is not None and tuning.select(other).time_ms is None
    held.set()
    assert background.wait(120)
    measured = tuning.select(p)
    assert measured.time_ms is not None and measured == db.lookup(p) and tuning.waiting_since(p.key) is None
    assert tuning.select(p) is measured  # asked once from then on


def test_a_measurement_that_finishes_before_the_choice_is_remembered_is_still_taken(db, monkeypatch):
    tuning = Tuning(mode="background", db=db)
    p = problem(n=6)
    real = background.measure

    def at_once(*args):  # the worker finishes before measure() returns to the caller
        assert real(*args)
        assert background.wait(120)
        return True

    monkeypatch.setattr(background, "measure", at_once)
    assert tuning.select(p).time_ms is None
    assert tuning.select(p).time_ms is not None


def test_a_model_meets_a_new_shape_runs_at_once_and_takes_the_measured_choice_later(db, held):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1))
    twin = torch.nn.Sequential(*(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1)))
    twin.load_state_dict(model.state_dict())
    ct.optimize(model, torch.randn(2, 3, 8, 8), mode="background", db=db)
    rows = [r for r in ct.explain(model) if r["status"] != "torch"]
    assert rows and all(r["time_ms"] is not None for r in rows)  # the example's inputs: measured inline
    x = torch.randn(2, 3, 12, 10)  # a shape met later: the model's choice now, measured behind
    torch.testing.assert_close(model(x), twin(x), atol=1e-5, rtol=1e-4)
    provisional = [r for r in ct.explain(model) if "12x10" in r["problem"]]
    assert provisional and all(r["time_ms"] is None for r in provisional)
    assert background.pending() == len(provisional)  # one queued measurement per provisional direction
    held.set()
    assert background.wait(120)
    conv = model[0]
    assert conv._convtune_provisional  # its next call selects again
    torch.testing.assert_close(model(x), twin(x), atol=1e-5, rtol=1e-4)
    assert not conv._convtune_provisional
    measured = [r for r in ct.explain(model) if "12x10" in r["problem"]]
    assert measured and all(r["time_ms"] is not None for r in measured)


def test_the_worker_makes_the_executables_a_layer_switches_to_before_the_switch(db, held, monkeypatch):
    from convtune import extension
    from convtune.pytorch import runtime, tuning

    if not runtime.available():
        pytest.skip(f"the C++ extension is not available here: {extension.status()}")
    made: dict[tuple[str, str], str] = {}  # (problem, algorithm) -> the thread that made its executable
    prepare = runtime.prepare

    def recorded(problem, name, db=None, device=None):
        if runtime._made(problem, name, device)[1] is None:  # made now, not taken from what was made before
            made.setdefault((problem.key, name), threading.current_thread().name)
        return prepare(problem, name, db, device)

    monkeypatch.setattr(runtime, "prepare", recorded)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1))
    ct.optimize(model, torch.randn(2, 3, 8, 8), mode="background", db=db)
    x = torch.randn(2, 3, 12, 10)  # a new shape: PyTorch's call now, measured behind
    model(x)
    made.clear()
    held.set()
    assert background.wait(120)
    by_worker = dict(made)  # (empty where every choice's executable was made before: PyTorch's, for the answer at once)
    assert set(by_worker.values()) <= {"convtune-background"}, by_worker
    model(x)  # the layers switch: what they run was made already
    assert made == by_worker, set(made) - set(by_worker)  # nothing made on the layers' calls
    assert [r for r in ct.explain(model) if "12x10" in r["problem"] and r["time_ms"] is not None]
    assert tuning.make_measured_executables in background._after


@pytest.mark.parametrize("native_ms,host_rule,made", [
    (0.0200, True, {"gemm:1x1"}),  # gemm:1x1 the first: made
    (0.0100, True, {"torch:native", "gemm:1x1"}),  # torch:native first, gemm:1x1 the tie member the rule moves to
    (0.0100, False, {"torch:native"}),  # the rule off: the first alone
])
def test_after_a_measurement_the_worker_makes_the_first_and_the_tie_member_the_rule_takes(db, monkeypatch, native_ms,
                                                                                         host_rule, made):
    from convtune import extension
    from convtune.pytorch import host_costs, runtime, tuning
    from convtune.results import PerfResult, Status
    from convtune.settings import settings

    if not runtime.available():
        pytest.skip(f"the C++ extension is not available here: {extension.status()}")
    monkeypatch.setattr(host_costs, "host_overheads_us", lambda device, db=None: {
        "python": 50.0, "native": 5.0, "gemm_1x1": -8.0, "gemm_1x1 backward": -8.0})
    p = ct.ConvProblem("fwd", n=3, c=6, k=5, input_size=(7, 9), kernel_size=1)  # a problem no other test makes
    db.store(p, [PerfResult("torch:native", Status.OK, time_ms=native_ms, rel_error=0.0),
                 PerfResult("gemm:1x1", Status.OK, time_ms=0.0101, rel_error=0.0),
                 PerfResult("direct:taps", Status.OK, time_ms=0.0102, rel_error=0.0)])  # in the tie; the Python path
    def executables() -> set[str]:
        out = set()
        for name in ("torch:native", "gemm:1x1", "direct:taps"):
            try:
                if runtime._made(p, name)[1] is not None:
                    out.add(name)
            except runtime.NotNative:  # refused (direct:taps runs in Python only)
                pass
        return out

    before = executables()
    with settings.override(host_rule=host_rule):
        tuning.make_measured_executables(p, ct.Policy(), db)
    assert executables() - before == made - before


def test_the_command_line_does_not_offer_background_tuning(capsys):
    assert main(["tune", "resnet18", "--mode", "background"]) != 0
    assert "invalid choice: 'background'" in capsys.readouterr().err


def test_the_model_stays_correct_while_layers_forget_their_choices(db):
    x = torch.randn(1, 3, 9, 9)
    conv = ct.nn.Conv2d(3, 4, 3, padding=1, mode="background", db=db)
    for _ in range(20):  # the worker may drop the selection between any two calls
        torch.testing.assert_close(conv(x), F.conv2d(x, conv.weight, conv.bias, padding=1), atol=1e-5, rtol=1e-4)
    assert background.wait(120)


def test_a_layer_waiting_for_a_measurement_keeps_no_hot_path_and_copies_select_again(db, held):
    x = torch.randn(1, 3, 7, 7)
    conv = ct.nn.Conv2d(3, 4, 3, padding=1, mode="background", db=db)
    y = conv(x)
    assert conv._convtune_fast == {} and conv._convtune_provisional  # every call looks for the measurement
    assert conv._convtune_traced == {}  # compiled code too: a provisional choice is never traced for good
    twin = copy.deepcopy(conv)
    assert twin.selections == {}  # a copy selects again on its first call, in its own right
    held.set()
    assert background.wait(120)
    torch.testing.assert_close(conv(x), y)
    assert conv._convtune_provisional == {} and conv._convtune_fast  # measured: the hot path again
    assert conv._convtune_traced  # and compiled code traces the measured choice
    assert all(r["time_ms"] is not None for r in ct.explain(conv))
    torch.testing.assert_close(twin(x), y)
    assert all(r["time_ms"] is not None for r in ct.explain(twin))


def test_a_process_that_ends_with_measurements_queued_exits_cleanly(tmp_path):
    code = f"""
import convtune as ct
db = ct.TuningDB({str(tmp_path / "t.sqlite")!r})
for n in range(1, 7):
    ct.select(ct.ConvProblem("fwd", n=n, c=16, k=16, input_size=(40, 40), kernel_size=3, padding=1),
              mode="background", db=db)
print("queued", ct.background.pending())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "queued" in out.stdout, out.stderr[-2000:]


def test_the_worker_times_on_a_device_it_shares(db, monkeypatch):
    # A CUDA graph captured by the worker would make the caller's torch.cuda.synchronize() fail.
    from convtune import timing

    seen, real = [], timing.benchmark
    monkeypatch.setattr(timing, "benchmark", lambda fn, **kwargs: seen.append(kwargs) or real(fn, **kwargs))
    assert background.measure(problem(n=5), ct.Policy(), db) and background.wait(120)
    assert seen and all(kwargs.get("shared_device") is True for kwargs in seen)


def test_the_worker_ends_once_nothing_is_queued_and_the_next_problem_starts_another(db):
    # A thread that has run PyTorch's CPU operators slows the caller's while it lives (up to twice, on 2 cores), so
    # the worker does not wait for more work.
    threads = []
    for n in (7, 8):
        assert background.measure(problem(n=n), ct.Policy(), db)
        threads.append(background._worker)  # the thread measure started
        assert background.wait(120)
        threads[-1].join(30)
        assert not threads[-1].is_alive() and background._worker is None
    assert threads[0] is not threads[1] and db.lookup(problem(n=8)) is not None


def test_the_worker_knows_it_is_the_worker(db, monkeypatch):
    # find leaves the process's cached CUDA memory alone there (no empty_cache under the caller's step).
    seen, real = [], sys.modules["convtune.find"].find
    monkeypatch.setattr(sys.modules["convtune.find"], "find",
                        lambda *args, **kwargs: seen.append(background.in_worker()) or real(*args, **kwargs))
    assert not background.in_worker()
    assert background.measure(problem(n=6), ct.Policy(), db) and background.wait(120)
    assert seen == [True]


def test_compiled_code_runs_torch_while_a_measurement_is_pending_then_adopts_it(db, held):
    from convtune import extension

    native = extension.load()
    assert native is not None
    x = torch.randn(1, 3, 7, 7)
    conv = ct.nn.Conv2d(3, 4, 3, padding=1, mode="get", db=db)
    conv(x)  # a first choice (the cost model's) makes the layer
    conv._convtune_tuning = Tuning(None, "background", db)
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True, dynamic=True)
    other = torch.randn(2, 3, 7, 7)
    expected = F.conv2d(other, conv.weight, conv.bias, padding=1)
    torch.testing.assert_close(compiled(other), expected, atol=1e-5, rtol=1e-4)  # PyTorch's call meanwhile
    shapes = lambda: {tuple(e[0]) for e in native.layer_entries(conv._convtune_layer)}  # noqa: E731
    assert (2, 3, 7, 7) not in shapes() and conv._convtune_provisional
    held.set()
    assert background.wait(120)
    torch.testing.assert_close(compiled(other), expected, atol=1e-5, rtol=1e-4)
    assert (2, 3, 7, 7) in shapes() and not conv._convtune_provisional  # the measured choice, kept
    assert not conv._convtune_full_path


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_code_of_static_shape_goes_on_running_right_when_a_pending_measurement_lands(db, held, dynamic):
    # Traced while the measurement is pending, then traced again once it has landed (a new input shape): the
    # traced forward must not change the layer's tables (Dynamo guards them) nor call the C++ layer's table.
    x = torch.randn(1, 3, 7, 7)
    conv = ct.nn.Conv2d(3, 4, 3, padding=1, mode="get", db=db)
    conv(x)
    conv._convtune_tuning = Tuning(None, "background", db)
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    first, second = torch.randn(2, 3, 7, 7), torch.randn(3, 3, 7, 7)
    expected = lambda t: F.conv2d(t, conv.weight, conv.bias, padding=1)  # noqa: E731
    torch.testing.assert_close(compiled(first), expected(first), atol=1e-5, rtol=1e-4)  # PyTorch's call meanwhile
    assert conv._convtune_provisional  # the path under test: a choice waiting on a measurement
    held.set()
    assert background.wait(120)
    for t in (first, second, first):
        torch.testing.assert_close(compiled(t), expected(t), atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()  # traced again after it landed, its choice still provisional until a call adopts it
    again = torch.compile(conv, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    torch.testing.assert_close(again(first), expected(first), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(conv(first), expected(first), atol=1e-5, rtol=1e-4)  # eager adopts the measurement
    for t in (first, second):
        torch.testing.assert_close(compiled(t), expected(t), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_code_on_the_full_path_goes_on_running_right_when_a_pending_measurement_lands(db, held, dynamic,
                                                                                             padding_mode):
    # An eager choice waiting on a measurement puts the layer on the full path; compiled code traced after the
    # measurement lands must not trace adopting it (the tables Dynamo guards, the C++ layer's layer_forget; a layer
    # that pads first has no C++ layer, and would be tuned again in traced code).
    x = torch.randn(1, 3, 7, 7)
    conv = ct.nn.Conv2d(3, 4, 3, padding=1, padding_mode=padding_mode, mode="background", db=db)
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect") if padding_mode == "reflect" else F.pad(x, (1, 1, 1, 1))
    expected = F.conv2d(padded, conv.weight, conv.bias)
    torch.testing.assert_close(conv(x), expected, atol=1e-5, rtol=1e-4)
    assert conv._convtune_provisional and conv._convtune_full_path
    assert bool(conv._convtune_layer) == (padding_mode == "zeros")
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    torch.testing.assert_close(compiled(x), expected, atol=1e-5, rtol=1e-4)  # the provisional choice meanwhile
    held.set()
    assert background.wait(120)
    torch.testing.assert_close(compiled(x), expected, atol=1e-5, rtol=1e-4)  # raised before
    torch.testing.assert_close(conv(x), expected, atol=1e-5, rtol=1e-4)  # an eager call adopts the measurement
    assert not conv._convtune_provisional
    torch.testing.assert_close(compiled(x), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")  # (Python 3.12: fork with threads)
@pytest.mark.parametrize("module,name", [("convtune.costmodel", "_tables_lock"), ("convtune.db", "_opened_lock"),
                                         ("convtune.extension", "_lock"), ("convtune.pytorch.workspace", "_lock"),
                                         ("convtune.pytorch.runtime", "_prepared_lock"),
                                         ("convtune.pytorch.host_costs", "_host_costs_lock")])
def test_a_child_forked_while_another_thread_holds_a_lock_of_convtunes_takes_it(module, name):
    owner = importlib.import_module(module)
    held, release = threading.Event(), threading.Event()

    def hold():  # another thread holds the lock (reading a database, building the extension, ...) while we fork
        with getattr(owner, name):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if getattr(owner, name).acquire(timeout=5) else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        thread.join()
    assert os.waitstatus_to_exitcode(status) == 0, f"the child waited on {module}.{name}, held by a thread it lacks"


def test_a_candidate_whose_run_would_switch_pytorchs_tf32_is_not_measured_beside_the_callers_work(db, monkeypatch):
    # PyTorch's TF32 switches are the process's: in the worker a float32 GEMM that switches the matrix products'
    # setting would switch it for the caller's work too (here a CPU problem, with gemm:1x1 declaring a switch)
    from convtune import tf32
    from convtune.algorithms.gemm import Gemm1x1

    class Switching(tf32.Settings):
        def changes(self, device: str) -> list[str]:
            return ["the matrix products' TF32 on"]

    monkeypatch.setattr(Gemm1x1, "tf32_settings", lambda self, problem: Switching(matmul=True))
    p = ct.ConvProblem("fwd", n=1, c=4, k=4, input_size=(5, 5), kernel_size=1)
    candidates = [ct.get_algorithm("gemm:1x1"), ct.get_algorithm("torch:native")]
    here = {r.algorithm: r for r in ct.find(p, candidates=candidates)}
    assert here["gemm:1x1"].ok  # in the caller's own thread it switches for its own call
    monkeypatch.setattr(background, "in_worker", lambda: True)
    there = {r.algorithm: r for r in ct.find(p, candidates=candidates)}
    assert there["torch:native"].ok
    assert there["gemm:1x1"].status is ct.Status.SKIPPED
    message = there["gemm:1x1"].message
    assert "not measured in the background" in message and "matrix products" in message
