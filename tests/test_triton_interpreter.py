"""The Triton families' tests in Triton's CPU interpreter, where this machine has no GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import test_cubin
import test_triton_depthwise
import test_triton_depthwise_band
import test_triton_depthwise_rows
import test_triton_depthwise_strip
import test_triton_folded
import test_triton_grouped
from convtune import extension
from triton_cases import HAS_TRITON, RUNS_KERNELS

FAMILIES = (test_triton_depthwise, test_triton_grouped, test_triton_depthwise_band, test_triton_depthwise_strip,
            test_triton_depthwise_rows, test_triton_folded)


# The first two families' files in two halves (the channels_last cases, and the rest), all processes at once: the
# interpreter runs one thread, and the depthwise file alone took 5 min of a 2-core CPU's 7. The banded family's
# file (about 20 s: two configurations a case), the strip family's (about 90 s: one a case), the weight gradient by
# rows' (about 10 s), the folded family's (about 10 s) and the recording's tests (test_cubin.py) are one process each.
HALVES = ("channels_last", "not channels_last")
RUNS = [(module, half) for module in FAMILIES[:2] for half in HALVES] + [(module, None) for module in FAMILIES[2:]] \
    + [(test_cubin, None)]


_RUNS: list[tuple[object, subprocess.Popen]] = []


def start() -> list[tuple[object, subprocess.Popen]]:
    """The interpreter's processes, started once. tests/conftest.py starts them as soon as this test is collected, so
    that they run beside the rest of the suite (which keeps its core: they run at a lower priority) instead of after
    it; the test waits for them. The C++ extension is built (or found) here first, at the suite's priority, so that no
    child holds its build lock; each child leads a process group of its own, which ``stop`` ends whole."""
    if not _RUNS and not (RUNS_KERNELS or not HAS_TRITON):
        extension.load()
        env = dict(os.environ, TRITON_INTERPRET="1")
        for module, half in RUNS:
            run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                                    *(["-k", half] if half else ["-rs"]), module.__file__], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   cwd=Path(__file__).resolve().parent.parent, start_new_session=True)
            os.setpriority(os.PRIO_PROCESS, run.pid, 10)  # the rest of the suite keeps a core whenever it wants one
            _RUNS.append((module, run))
    return _RUNS


def stop() -> None:
    """Ends the processes still running, with whatever they started (a session that stopped before the test waited
    for them)."""
    for _, run in _RUNS:
        if run.poll() is None:
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass
            run.communicate()


@pytest.mark.slow  # about 6.5 min of a 2-core CPU, mostly beside the rest of the suite
@pytest.mark.skipif(RUNS_KERNELS or not HAS_TRITON, reason="the kernels run in this process")
def test_the_kernel_tests_pass_in_the_interpreter():
    passed = dict.fromkeys(FAMILIES, 0)
    for module, run in start():
        stdout, stderr = run.communicate()
        assert run.returncode == 0, stdout[-4000:] + stderr[-2000:]
        summary = stdout.strip().splitlines()[-1]
        if module is test_cubin:  # the tests that run kernels ran (other skips, such as no extension, may be)
            assert test_cubin.KERNELS_SKIP not in stdout, stdout[-2000:]
        else:
            passed[module] += int(summary.split(" passed")[0].split()[-1])
    for module, count in passed.items():
        assert count >= module.KERNEL_TESTS, (module.__name__, count)  # the kernel tests ran, none skipped
