"""triton:depthwise_rows_bwd_filter_*: convtune's depthwise weight gradient by input rows on the tensor cores (float32
without TF32: the same products on the CUDA cores; ``convtune.kernels.rows``), one algorithm per tile configuration.

Where they run and what every Triton family refuses: ``triton_family``.

    >>> from convtune.problem import ConvProblem
    >>> from convtune.algorithms.registry import get_algorithm
    >>> p = ConvProblem("bwd_filter", n=8, c=64, k=64, input_size=(28, 28), kernel_size=7, padding=3, groups=64,
    ...                 dtype="float16", layout="channels_last", device="cuda")
    >>> rows = get_algorithm("triton:depthwise_rows_bwd_filter_r8q16c16w4")
    >>> bool(rows.supports(p)), bool(rows.supports(p.replace(stride=2, dilation=2)))
    (True, True)
    >>> print(rows.supports(p.replace(kernel_size=(33, 3), padding=(16, 1))).reason)  # doctest: +NORMALIZE_WHITESPACE
    keeps 16 channels × 64 × 16 taps (the 33x3 kernel's, padded) = 16384 float32 sums a program, more than 8192;
    triton:depthwise_bwd_filter_* (kernel rows of up to 256 taps), cuDNN or torch:native take it
"""

from __future__ import annotations

import math

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

# (input rows a program runs down, output columns a product, channels a program, warps). Compiled for sm_90 on a CPU
# (bench/results/sass_counts.md), r8q16c16w4 on the 96-channel 56x56 7x7 layer (batch 32, float16, channels_last)
# takes 126 registers and 32 KB of shared memory, no spills, and its issue-bound time is 0.85x the strips' (the
# loads and the operands' way into the tensor cores, not the products, are most of its instructions); what it may
# gain is the cache, a program's dy rows staying in it from one input row to the next. Not yet timed on a GPU; find's
# measurement picks. Three configurations until then (each is compiled and measured in a cold tuning of a depthwise
# weight gradient unless find stops before it): runs of 8 input rows, and of 32 (fewer partial sums), in tiles of 16
# channels; and runs of 8 in tiles of 8 channels, whose 8192 sums hold kernels padded to 32x32 (up to 31x31,
# RepLKNet's). Products over 32 columns are left out until these are timed.
TILES = ((8, 16, 16, 4), (32, 16, 16, 4), (8, 16, 8, 4))


class TritonDepthwiseRows(TritonAlgorithm):
    """The depthwise weight gradient by input rows with one tile configuration."""

    family = "depthwise_rows"
    kernels = "rows"
    tile_type = "RowsTile"

    def __init__(self, direction: str, rows: int, block_q: int, channels: int, warps: int):
        self._configure(direction, (rows, block_q, channels, warps), f"r{rows}q{block_q}c{channels}w{warps}")

    def kind(self, problem: ConvProblem) -> Support:
        return depthwise_only(problem)

    def _family_supports(self, problem: ConvProblem) -> Support:
        module = self.module()
        r_pad, s_pad = module.padded_taps(problem)
        sums = self.tile_args[2] * r_pad * s_pad
        if sums > module.MAX_ACCUMULATORS:
            kernel = "x".join(map(str, problem.kernel_size))
            return unsupported(f"keeps {self.tile_args[2]} channels × {r_pad} × {s_pad} taps (the {kernel} kernel's, "
                               f"padded) = {sums} float32 sums a program, more than {module.MAX_ACCUMULATORS}; "
                               f"triton:depthwise_bwd_filter_* (kernel rows of up to 256 taps), cuDNN or torch:native "
                               f"take it")
        return grid_axis_fits(math.ceil(problem.k / self.tile_args[2]), f"tiles of {self.tile_args[2]} channels",
                              "the other depthwise kernels (wider channel tiles), torch:native or cuDNN")

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return tensor_core_notes(problem)

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        # The padded products (a 7x7 kernel: 256 for its 49 taps; a 3x3 one: 256 for 9) at 0.08 of the tensor cores'
        # peak (the float32 one without TF32), 1.8 times the compulsory traffic as the strips: 0.08 made the price
        # follow the issue-bound times counted from the machine code (bench/results/sass_counts.md). Measured on the
        # H200 they ran 4-8x those counts: the configuration's measured factor (TritonAlgorithm.measured_factor).
        r_pad, s_pad = self.module().padded_taps(problem)
        padded = problem.flops * r_pad * s_pad / math.prod(problem.kernel_size)
        return Cost(padded, 0.08, 1.8 * problem.min_bytes + 2 * workspace_bytes, 1 + bool(workspace_bytes),
                    composed=False, measured_factor=self.measured_factor())



register_family(TritonDepthwiseRows, {"bwd_filter": TILES})
