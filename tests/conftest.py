import os
import sys

import hypothesis
import pytest
import torch

from convtune import costmodel
from convtune.settings import settings

# CI (.ci/run sets CI=1) draws the same examples every run, so a run's verdict does not depend on
# luck; elsewhere each run explores new ones.
hypothesis.settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    hypothesis.settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own tuning database folder: nothing touches the user's cache. The tests' fake
    algorithms are measured in the process (they count their runs, read a shared clock); the tests of
    isolation (tests/test_isolation.py) turn worker processes on themselves."""
    monkeypatch.setenv("CONVTUNE_CACHE_DIR", str(tmp_path / "cache"))
    with settings.override(cache_dir=str(tmp_path / "cache"), isolate="off"):
        yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles with Dynamo's caches empty: compiled code of one test (other input shapes of the same
    forward, recompiles counted against Dynamo's limit) never decides how the next one is traced. Dynamo is
    never imported here for a test that does not import it."""
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    yield


@pytest.fixture
def quick_timing():
    """Timing cut to the bone, no progress bars: tests check what is chosen, not how fast."""
    with settings.override(timing_budget_s=0.005, timing_min_repeats=1, timing_max_repeats=2, progress=False):
        yield


class _NanResults:
    """``torch`` as convtune's ops module sees it, except that new tensors (the runs' results) start as NaN."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty_strided(*args, **kwargs):
        return torch.empty_strided(*args, **kwargs).fill_(float("nan"))


@pytest.fixture
def poisoned(monkeypatch):
    """The ops' result tensors start as NaN (the Python path's and the C++ executables'), so an
    algorithm that skips an element is caught."""
    from convtune import extension
    from convtune.pytorch import ops

    monkeypatch.setattr(ops, "torch", _NanResults())
    native = extension.load()
    if native is not None:
        native.set_poison(True)
    yield
    if native is not None:
        native.set_poison(False)


@pytest.fixture
def nominal_peaks(monkeypatch):
    """The cost model on fixed ceilings (100 GFLOP/s, 10 GB/s), not this machine's measured ones: a test whose
    outcome rests on predictions then means the same on every machine."""
    monkeypatch.setattr(costmodel, "_peaks", lambda device, dtype, tf32: (1e11, 1e10))
    costmodel.clear_cache()
    yield
    costmodel.clear_cache()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords or os.sep + "gpu" + os.sep in str(item.fspath):
            item.add_marker(skip)


_INTERPRETER_TEST = "test_the_kernel_tests_pass_in_the_interpreter"
_started = []  # the modules whose processes started here


def pytest_collection_finish(session):
    """The Triton interpreter's processes (tests/test_triton_interpreter.py) start as soon as their test is collected:
    they run beside the rest of the suite instead of after it (not where nothing runs: --collect-only)."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        if item.name == _INTERPRETER_TEST:
            item.module.start()
            _started.append(item.module)


def pytest_sessionfinish(session):
    for module in _started:
        module.stop()


def pytest_runtest_logreport(report):
    """Where CONVTUNE_TEST_TIMES names a file (bench/gpu_checks.sh names one beside each GPU test log), each test's
    setup, call and teardown append their seconds, outcome and test id to it as they end: a run cut by its time limit
    still says where its time went, where pytest's ``--durations`` prints only at the end."""
    path = os.environ.get("CONVTUNE_TEST_TIMES")
    if path:
        with open(path, "a", encoding="utf-8") as times:
            times.write(f"{report.duration:9.2f} s  {report.when:8}  {report.outcome:7}  {report.nodeid}\n")
