"""triton:depthwise_band_*: convtune's depthwise kernels on the tensor cores (``convtune.kernels.banded``: a kernel
row as a banded matrix), one algorithm per direction and tile configuration.

Where they run and what every Triton family refuses: ``triton_family``.

    >>> from convtune.problem import ConvProblem
    >>> from convtune.algorithms.registry import get_algorithm
    >>> p = ConvProblem("fwd", n=8, c=64, k=64, input_size=(28, 28), kernel_size=7, padding=3, groups=64,
    ...                 dtype="float16", layout="channels_last", device="cuda")
    >>> band = get_algorithm("triton:depthwise_band_fwd_r32n16c8w4")
    >>> bool(band.supports(p))
    True
    >>> print(band.supports(p.replace(kernel_size=(7, 129), padding=(3, 64))).reason)  # doctest: +NORMALIZE_WHITESPACE
    reads an input window of up to 128 columns per row (16 columns of the result and a kernel row of 129 taps need
    256); the other depthwise kernels, cuDNN or torch:native take it
"""

from __future__ import annotations

import math

from .. import hardware
from ..costmodel import Cost
from ..problem import ConvProblem
from .base import NumericNotes, Support, unsupported
from .triton_family import (
    TritonAlgorithm,
    depthwise_only,
    grid_axis_fits,
    register_family,
    tensor_core_notes,
)

# (output rows, output columns, channels, warps[, output rows per partial sum]) per program. A tile of channels
# reads channels_last's rows in vectors (8 channels of float16: 16 bytes), a single channel channels_first's. None
# is timed on a GPU yet; compiled for the H200 (sm_90), r32n16c8w4 issues about 0.056 warp instructions per useful
# multiply-add of a 7x7 forward in channels_last (r64n16c4w4 0.053), 1.7-1.8x what one fused multiply-add per
# product on the CUDA cores would (docs/algorithms.md). r64n16c8w8, the same work a warp on twice the rows, loads a
# kernel row's band once for twice the rows: its loop issues about a sixth fewer instructions on the forward and
# the data gradient (not on the weight gradient, which has no band to load). Each is a candidate: find's verified
# measurement picks.
TILES = ((32, 16, 8, 4), (64, 16, 4, 4), (64, 32, 1, 4), (64, 16, 8, 8))  # the forward's and the data gradient's
# The weight gradient's: runs of 256 output rows per partial sum, and of 64 for layers with few rows. Its tiles of 16
# channels on 16 rows issue about a third fewer instructions in all than those of 8, but in fewer programs, which
# leave schedulers idle on most layers (a run of 256 rows of a 7x7 layer of 96 channels at 56x56 gives 168 programs
# of 4 warps for the H200's 528 schedulers): compiled for sm_90, their issue bound there is 45 µs against 50, and
# the shortest on 9 of depthwise.md's 10 layers (sass_counts.md).
BACKWARD_FILTER_TILES = ((32, 16, 8, 4, 256), (64, 32, 1, 4, 256), (16, 16, 16, 4, 256), (32, 16, 8, 4, 64),
                         (16, 16, 16, 4, 64))


class TritonDepthwiseBand(TritonAlgorithm):
    """One direction of the banded depthwise kernels with one tile configuration."""

    family = "depthwise_band"
    kernels = "banded"
    tile_type = "BandTile"

    def __init__(self, direction: str, rows: int, columns: int, channels: int, warps: int, chunk: int = 0):
        self._configure(direction, (rows, columns, channels, warps, chunk),
                        f"r{rows}n{columns}c{channels}w{warps}" + (f"s{chunk}" if chunk else ""))

    def kind(self, problem: ConvProblem) -> Support:
        return depthwise_only(problem)

    def _family_supports(self, problem: ConvProblem) -> Support:
        module = self.module()
        needed = module.window(problem, self.tile)
        if needed > module.MAX_WINDOW:
            return unsupported(f"reads an input window of up to {module.MAX_WINDOW} columns per row "
                               f"({module.columns(problem, self.tile)} columns of the result and a kernel row of "
                               f"{problem.kernel_size[-1]} taps need {needed}); the other depthwise kernels, cuDNN "
                               f"or torch:native take it")
        if module.stages(problem, self.tile, hardware.shared_memory_per_block()) is None:
            return unsupported(f"stages {module.operand_bytes(problem, self.tile)} bytes of operands in shared memory, "
                               f"more than this GPU's {hardware.shared_memory_per_block()} (float32 operands of a wide "
                               f"window); a configuration with a smaller tile, or another algorithm, takes it")
        return grid_axis_fits(module.side_tiles(problem, self.tile),
                              f"tiles of {self.tile.channels} channels or {self.tile.columns} columns",
                              "a configuration with wider tiles, the other depthwise kernels, cuDNN or torch:native")

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return tensor_core_notes(problem)

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        # Tensor-core products of the whole band: a window's BLOCK_J products for each output (or, for the data
        # gradient, each input: stride times more positions) position and kernel row, where the convolution needs S.
        # A tenth of the tensor cores' peak on those products (the compiled loop issues about 400 instructions per 16
        # tensor-core instructions: at most a sixth of the peak), three times the compulsory traffic, as the CUDA-core
        # kernels are; then the configuration's measured factor (TritonAlgorithm.measured_factor).
        positions = 1.0
        if problem.direction == "bwd_data":
            positions = math.prod(problem.input_size) / math.prod(problem.output_size)
        products = problem.flops / problem.kernel_size[-1] * self.module().window(problem, self.tile) * positions
        return Cost(products, 0.1, 3 * problem.min_bytes + 2 * workspace_bytes, 1 + bool(workspace_bytes),
                    composed=False, measured_factor=self.measured_factor())



register_family(TritonDepthwiseBand, {"fwd": TILES, "bwd_data": TILES, "bwd_filter": BACKWARD_FILTER_TILES})
