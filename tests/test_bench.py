"""The benchmark scripts run on the CPU, and their result files can be written again from their JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def tuning_cost():
    sys.path.insert(0, str(BENCH))
    try:
        import tuning_cost
        yield tuning_cost
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.slow
def test_tuning_cost_profiles_a_whole_network_cold_and_warm_on_the_cpu(tmp_path, tuning_cost):
    env = dict(os.environ, CONVTUNE_CACHE_DIR=str(tmp_path / "cache"), CONVTUNE_PROGRESS="0")
    subprocess.run([sys.executable, str(BENCH / "tuning_cost.py"), "--device", "cpu", "--network", "resnet18",
                    "--batch", "1", "--dtype", "float32", "--layout", "nchw", "--layers", "1", "--whole",
                    "--out", str(tmp_path), "--name", "t"], check=True, env=env, capture_output=True, timeout=300)
    payload = json.loads((tmp_path / "t.json").read_text())
    whole = payload["whole"]
    assert whole["problems"] > 0 and whole["phases_s"]["find, in all"] > 0
    assert whole["warm"]["wall_s"] > 0 and whole["warm"]["top_cumulative_s"]
    assert len(payload["tuning"]) == 3  # the first layer in three directions
    text = (tmp_path / "t.md").read_text()
    assert "convtune's costliest functions" in text
    assert text.rstrip("\n") == tuning_cost.markdown(payload).rstrip("\n")
