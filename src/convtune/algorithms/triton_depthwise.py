"""triton:depthwise_*: convtune's own depthwise kernels (``convtune.kernels.depthwise``), one
algorithm per direction and tile configuration.

Each configuration is a candidate like any other: ``find`` checks it against the float64
reference and times it, so the search is the autotuner. They run on CUDA, and on the CPU when
Triton's interpreter is on (``TRITON_INTERPRET=1``, how the tests check them without a GPU).
Triton compiles a configuration for each new problem shape on its first run (a second or so,
once per process; Triton caches the binaries on disk).

    >>> from convtune.problem import ConvProblem
    >>> from convtune.algorithms.registry import get_algorithm
    >>> p = ConvProblem("fwd", n=8, c=64, k=64, input_size=(28, 28), kernel_size=7, padding=3, groups=64,
    ...                 dtype="float16", layout="channels_last", device="cuda")
    >>> get_algorithm("triton:depthwise_fwd_p32c64w4").buffers(p)
    []
    >>> print(get_algorithm("triton:depthwise_fwd_p32c64w4").supports(p.replace(groups=32)).reason)
    needs a depthwise problem (groups == c == 64), got groups=32
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch

from ..costmodel import Cost
from ..problem import ConvProblem
from ..settings import settings
from .base import SUPPORTED, Algorithm, Buffer, NumericNotes, Support, unsupported
from .registry import register

INDEX_LIMIT = 2**31  # the kernels' offsets are 32-bit

# Tile configurations per direction: (positions, channels, warps[, chunk]). Wide channel tiles read
# channels_last rows whole; wide position tiles suit channels_first, where positions are contiguous.
FORWARD_TILES = ((32, 64, 4), (64, 32, 4), (16, 128, 4), (256, 4, 4))
BACKWARD_DATA_TILES = FORWARD_TILES
# The filter gradient's fourth number: output rows summed per program (more rows, fewer partial sums).
BACKWARD_FILTER_TILES = ((16, 64, 4, 16), (32, 32, 4, 8), (8, 128, 4, 32), (64, 4, 4, 8))


def _interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (its documented ``TRITON_INTERPRET`` switch)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _kernels():
    from ..kernels import depthwise

    return depthwise


class TritonDepthwise(Algorithm):
    """One direction of the depthwise kernels with one tile configuration."""

    devices = ("cuda", "cpu")
    kernel_direction = ""

    def __init__(self, positions: int, channels: int, warps: int, chunk: int = 0):
        self.tile_args = (positions, channels, warps, chunk)
        label = f"p{positions}c{channels}w{warps}" + (f"s{chunk}" if chunk else "")
        self.name = f"triton:depthwise_{self.kernel_direction}_{label}"
        self.directions = (self.kernel_direction,)
        super().__init__()

    @property
    def tile(self):
        return _kernels().Tile(*self.tile_args)

    def _supports(self, problem: ConvProblem) -> Support:
        if not settings.triton:
            return unsupported("convtune's Triton kernels are off (settings.triton, CONVTUNE_TRITON=0)")
        if problem.device == "cpu" and not _interpreting():
            return unsupported("Triton kernels run on the CPU only in Triton's interpreter (TRITON_INTERPRET=1)")
        if importlib.util.find_spec("triton") is None:
            return unsupported("needs Triton: pip install triton")
        if problem.ndim not in (1, 2):
            return unsupported(f"handles 1-D and 2-D convolutions, got {problem.ndim}-D")
        if problem.groups != problem.c:
            return unsupported(f"needs a depthwise problem (groups == c == {problem.c}), got groups={problem.groups}")
        biggest = max(math.prod(shape) for shape in problem.operand_shapes)
        if biggest >= INDEX_LIMIT:
            return unsupported(f"an operand of {biggest} elements needs 64-bit offsets; these kernels use 32-bit "
                               f"ones (below {INDEX_LIMIT}); torch:native and cuDNN take it")
        return SUPPORTED

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return NumericNotes(float32_inside=problem.dtype != "float32")

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        # Multiply-adds on the CUDA cores in float32, each tap's operand loaded again from cache: measured on
        # the H200 at 3-9x the floor (bench/results/depthwise.md), so a tenth of the float32 peak and three
        # times the compulsory traffic; get then leaves cuDNN first where neither was measured.
        return Cost(problem.flops, 0.1, 3 * problem.min_bytes + 2 * workspace_bytes, 1 + bool(workspace_bytes),
                    float32_inside=True, composed=False)


class DepthwiseForward(TritonDepthwise):
    kernel_direction = "fwd"

    def _run(self, problem, a, b, out, ws) -> None:
        _kernels().forward(problem, self.tile, a, b, out)


class DepthwiseBackwardData(TritonDepthwise):
    kernel_direction = "bwd_data"

    def _run(self, problem, a, b, out, ws) -> None:
        _kernels().backward_data(problem, self.tile, a, b, out)


class DepthwiseBackwardFilter(TritonDepthwise):
    kernel_direction = "bwd_filter"

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        # One float32 partial sum per (run of output rows, channel, tap); a 1-D problem's rows are its samples.
        rows = problem.n * (problem.output_size[0] if problem.ndim == 2 else 1)
        parts = -(-rows // self.tile_args[3])
        return [Buffer("partials", (parts, problem.k, math.prod(problem.kernel_size)), torch.float32)]

    def _run(self, problem, a, b, out, ws) -> None:
        _kernels().backward_filter(problem, self.tile, a, b, out, ws["partials"])


for _tile in FORWARD_TILES:
    register(DepthwiseForward(*_tile))
for _tile in BACKWARD_DATA_TILES:
    register(DepthwiseBackwardData(*_tile))
for _filter_tile in BACKWARD_FILTER_TILES:
    register(DepthwiseBackwardFilter(*_filter_tile))
