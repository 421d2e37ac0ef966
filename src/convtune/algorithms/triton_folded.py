"""triton:folded_*: convtune's own kernels for layers with few input channels (``convtune.kernels.folded``), an
implicit GEMM on the tensor cores whose reduction runs over the taps and channels folded together: a network's
first layer (3 colour channels), where cuDNN's bfloat16 plans run a 7x7 stem at about a third of its float16
speed. One algorithm per direction (the forward and the weight gradient) and tile configuration.

Where they run and what every Triton family refuses: ``triton_family``.

    >>> from convtune.problem import ConvProblem
    >>> from convtune.algorithms.registry import get_algorithm
    >>> p = ConvProblem("fwd", n=8, c=3, k=64, input_size=(224, 224), kernel_size=7, stride=2, padding=3,
    ...                 dtype="bfloat16", layout="channels_last", device="cuda")
    >>> bool(get_algorithm("triton:folded_fwd_p128c64w4").supports(p))
    True
    >>> print(get_algorithm("triton:folded_fwd_p128c64w4").supports(p.replace(c=16)).reason)
    needs a dense problem with 1 to 8 input channels, got 16 (groups=1)
"""

from __future__ import annotations

import math

from ..costmodel import Cost, gemm_dims, shape_factor
from ..problem import ConvProblem
from .base import SUPPORTED, NumericNotes, Support, unsupported
from .triton_family import TritonAlgorithm, grid_axis_fits, register_family, tensor_core_notes, whole_gradient_runs

MAX_CHANNELS = 8  # past 8, a tap's channels fill half the tensor cores' 16 lanes or more: folding gains little
MAX_FOLDED = 1024  # taps × channels: the forward unrolls its reduction at compile time (a ViT's 16x16 patches: 768)
# (positions, output channels, warps[, positions per partial sum])
FORWARD_TILES = ((128, 64, 4), (64, 32, 4))
BACKWARD_FILTER_TILES = ((64, 64, 4, 4096), (64, 64, 4, 16384))


class TritonFolded(TritonAlgorithm):
    """One direction of the folded kernels with one tile configuration."""

    family = "folded"
    kernels = "folded"
    tile_type = "GemmTile"

    def kind(self, problem: ConvProblem) -> Support:
        if problem.groups != 1 or problem.c > MAX_CHANNELS:
            return unsupported(f"needs a dense problem with 1 to {MAX_CHANNELS} input channels, got "
                               f"{problem.c // problem.groups} (groups={problem.groups})")
        folded = problem.c * math.prod(problem.kernel_size)
        if folded > MAX_FOLDED:
            return unsupported(f"folds {folded} taps × channels into its reduction, unrolled at compile time up to "
                               f"{MAX_FOLDED}; cuDNN and torch:native take it")
        return SUPPORTED

    def _family_supports(self, problem: ConvProblem) -> Support:
        return grid_axis_fits(self.module().channel_tiles(problem, self.tile), "tiles of output channels",
                              "torch:native or cuDNN")

    def partials_shape(self, problem: ConvProblem) -> tuple[int, ...]:
        return whole_gradient_runs(problem, self.tile_args[3])

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return tensor_core_notes(problem)

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        # Tensor-core products over the folded reduction (shape_factor: a short one leaves lanes idle), the input
        # gathered from cache per tap: priced as kernels.grouped's are, each configuration's measured factor
        # (bench/fit_triton_prices.py, against cuDNN's fastest plan on the same first layers) scaling it.
        return Cost(problem.flops, 0.3 * shape_factor(*gemm_dims(problem)), 2 * problem.min_bytes + 2 * workspace_bytes,
                    1 + bool(workspace_bytes), composed=False, measured_factor=self.measured_factor())


register_family(TritonFolded, {"fwd": FORWARD_TILES, "bwd_filter": BACKWARD_FILTER_TILES})
