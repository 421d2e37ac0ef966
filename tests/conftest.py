import os

import hypothesis
import pytest
import torch

from convtune.settings import settings

# CI (.ci/run sets CI=1) draws the same examples every run, so a run's verdict does not depend on
# luck; elsewhere each run explores new ones.
hypothesis.settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    hypothesis.settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own tuning database folder: nothing touches the user's cache."""
    monkeypatch.setenv("CONVTUNE_CACHE_DIR", str(tmp_path / "cache"))
    with settings.override(cache_dir=str(tmp_path / "cache")):
        yield


@pytest.fixture
def quick_timing():
    """Timing cut to the bone, no progress bars: tests check what is chosen, not how fast."""
    with settings.override(timing_budget_s=0.005, timing_min_repeats=1, timing_max_repeats=2, progress=False):
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords or os.sep + "gpu" + os.sep in str(item.fspath):
            item.add_marker(skip)
