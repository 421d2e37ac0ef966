"""Plug-in algorithms that misbehave in ways only a worker process survives (tests/test_isolation.py).

They live in a module of their own so that a spawned worker can import them by name.
"""

from __future__ import annotations

import ctypes
import os
import time

import torch

from convtune.algorithms.base import Algorithm
from convtune.algorithms.native import native_conv


class Correct(Algorithm):
    """Right, through PyTorch: the one to be selected among the adversaries."""

    name = "plugin:correct"

    def _run(self, problem, a, b, out, ws) -> None:
        out.copy_(native_conv(problem, a, b))


class HiddenAllocation(Correct):
    """Right, declaring no workspace, but allocating ``hidden_bytes`` beside it on every run."""

    name = "plugin:hidden_allocation"

    def __init__(self, hidden_bytes: int = 64 << 20) -> None:
        super().__init__()
        self.hidden_bytes = hidden_bytes

    def _run(self, problem, a, b, out, ws) -> None:
        hidden = torch.ones(self.hidden_bytes, dtype=torch.uint8, device=out.device)
        super()._run(problem, a, b, out, ws)
        out.add_(hidden[:1].to(out.dtype).sub_(1))  # uses it, so nothing can drop it


class Exits(Correct):
    """Ends the process it runs in, as a library's abort would."""

    name = "plugin:exits"

    def _run(self, problem, a, b, out, ws) -> None:
        os._exit(3)


class Segfaults(Correct):
    """Reads address 0: a segmentation fault."""

    name = "plugin:segfaults"

    def _run(self, problem, a, b, out, ws) -> None:
        ctypes.string_at(0)


class Hangs(Correct):
    """Never returns."""

    name = "plugin:hangs"

    def _run(self, problem, a, b, out, ws) -> None:
        time.sleep(3600)


class CallsExit(Correct):
    """Raises SystemExit, as a sys.exit() deep in a library would."""

    name = "plugin:calls_exit"

    def _run(self, problem, a, b, out, ws) -> None:
        raise SystemExit(2)


class WritesItsInputsLater(Correct):
    """Right on its checked runs, then scribbles on its input operands while it is timed."""

    name = "plugin:writes_inputs_later"

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def _run(self, problem, a, b, out, ws) -> None:
        self.runs += 1
        super()._run(problem, a, b, out, ws)
        if self.runs > 2:
            a.mul_(2)


class RightOnlyUnderSeed7(Correct):
    """Right only where convtune's verify_seed setting reads 7: tells whether a worker sees the parent's settings."""

    name = "plugin:right_under_seed_7"

    def _run(self, problem, a, b, out, ws) -> None:
        from convtune.settings import settings

        super()._run(problem, a, b, out, ws)
        if settings.verify_seed != 7:
            out.mul_(2)


class PoisonsTheContext(Correct):
    """Triggers a device-side assert (an index out of range in a CUDA kernel): every later CUDA call of its
    process fails too."""

    name = "plugin:poisons_the_context"

    def _run(self, problem, a, b, out, ws) -> None:
        import torch

        index = torch.tensor([1 << 20], device=out.device)
        out.view(-1)[index] = 1.0  # out of range: the kernel asserts
        torch.cuda.synchronize()
