"""The Triton families' tests in Triton's CPU interpreter, where this machine has no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import test_triton_depthwise
import test_triton_grouped
from triton_cases import HAS_TRITON, RUNS_KERNELS

FILES = (test_triton_depthwise, test_triton_grouped)


@pytest.mark.slow  # about 7 min on a 2-core CPU: both families in the interpreter, one process each at once
@pytest.mark.skipif(RUNS_KERNELS or not HAS_TRITON, reason="the kernels run in this process")
def test_the_kernel_tests_pass_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    runs = [(module, subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                                       module.__file__], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=Path(__file__).resolve().parent.parent))
            for module in FILES]
    for module, run in runs:
        stdout, stderr = run.communicate()
        assert run.returncode == 0, stdout[-4000:] + stderr[-2000:]
        summary = stdout.strip().splitlines()[-1]
        passed = int(summary.split(" passed")[0].split()[-1])
        assert passed >= module.KERNEL_TESTS, summary  # the kernel tests ran, none skipped
