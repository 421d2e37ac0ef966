"""triton:grouped_*: convtune's own grouped-convolution kernels (``convtune.kernels.grouped``), an implicit
GEMM per group on the tensor cores, for 2 to 64 input channels per group; one algorithm per direction
and tile configuration.

Where they run and what every Triton family refuses: ``triton_family``.

    >>> from convtune.problem import ConvProblem
    >>> from convtune.algorithms.registry import get_algorithm
    >>> p = ConvProblem("fwd", n=8, c=128, k=128, input_size=(28, 28), kernel_size=3, padding=1, groups=32,
    ...                 dtype="float16", layout="channels_last", device="cuda")
    >>> bool(get_algorithm("triton:grouped_fwd_p64c32w4").supports(p))
    True
    >>> print(get_algorithm("triton:grouped_fwd_p64c32w4").supports(p.replace(groups=1)).reason)
    needs a grouped problem with 2 to 64 input channels per group, got 128 (groups=1)
"""

from __future__ import annotations

from ..costmodel import Cost, gemm_dims, shape_factor
from ..problem import ConvProblem
from .base import SUPPORTED, NumericNotes, Support, unsupported
from .triton_family import TritonAlgorithm, grid_axis_fits, register_family, tensor_core_notes, whole_gradient_runs

MAX_GROUP_CHANNELS = 64
# (positions, channels, warps[, positions per partial sum]); the channel tile is capped at the group's width.
FORWARD_TILES = ((64, 32, 4), (128, 16, 4))
BACKWARD_DATA_TILES = FORWARD_TILES
BACKWARD_FILTER_TILES = ((64, 64, 4, 4096), (32, 64, 4, 1024))


class TritonGrouped(TritonAlgorithm):
    """One direction of the grouped kernels with one tile configuration."""

    family = "grouped"
    kernels = "grouped"
    tile_type = "GemmTile"

    def kind(self, problem: ConvProblem) -> Support:
        per_group = problem.c // problem.groups
        if problem.groups == 1 or not 2 <= per_group <= MAX_GROUP_CHANNELS:
            return unsupported(f"needs a grouped problem with 2 to {MAX_GROUP_CHANNELS} input channels per group, "
                               f"got {per_group} (groups={problem.groups})")
        return SUPPORTED

    def _family_supports(self, problem: ConvProblem) -> Support:
        return grid_axis_fits(max(self.module().grid_axes(problem, self.tile)),
                              "tiles of groups' channels, or the weight gradient's taps", "torch:native or cuDNN")

    def partials_shape(self, problem: ConvProblem) -> tuple[int, ...]:
        return whole_gradient_runs(problem, self.tile_args[3])

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return tensor_core_notes(problem)

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        # Tensor-core products of one group's width at a time, each tap's input gathered from cache; a group
        # narrower than 16 channels leaves lanes idle (shape_factor). Not yet measured on a GPU: priced below
        # cuDNN's engines, so get leaves them first.
        return Cost(problem.flops, 0.3 * shape_factor(*gemm_dims(problem)), 2 * problem.min_bytes + 2 * workspace_bytes,
                    1 + bool(workspace_bytes), composed=False)


register_family(TritonGrouped, {"fwd": FORWARD_TILES, "bwd_data": BACKWARD_DATA_TILES,
                                "bwd_filter": BACKWARD_FILTER_TILES})
