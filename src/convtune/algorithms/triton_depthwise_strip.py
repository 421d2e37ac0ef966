"""triton:depthwise_strip_*: convtune's depthwise kernels by strips of a row (``convtune.kernels.strips``: each input
column loaded once per kernel row for every output of a strip it reaches), one algorithm per direction and tile
configuration.

Where they run and what every Triton family refuses: ``triton_family``.

    >>> from convtune.problem import ConvProblem
    >>> from convtune.algorithms.registry import get_algorithm
    >>> p = ConvProblem("bwd_data", n=8, c=64, k=64, input_size=(28, 28), kernel_size=7, padding=3, groups=64,
    ...                 dtype="float16", layout="channels_last", device="cuda")
    >>> strip = get_algorithm("triton:depthwise_strip_bwd_data_t4b32c32w4")
    >>> bool(strip.supports(p))
    True
    >>> bool(strip.supports(p.replace(stride=2)))
    True
    >>> print(strip.supports(p.replace(stride=(1, 8))).reason)  # doctest: +NORMALIZE_WHITESPACE
    computes the data gradient of column stride 8 (the stride's last entry) only with strips of a multiple of 8
    outputs, this configuration's strips have 4; triton:depthwise_strip_bwd_data_t8*, triton:depthwise_bwd_data_*ph
    (by stride phase), cuDNN or torch:native take it
"""

from __future__ import annotations

import math

import torch

from ..costmodel import Cost
from ..problem import ConvProblem
from .base import SUPPORTED, Buffer, NumericNotes, Support, unsupported
from .triton_family import (
    INDEX_LIMIT,
    TritonAlgorithm,
    depthwise_only,
    grid_axis_fits,
    register_family,
)

# (outputs a strip, strips a program, channels a program, warps[, output rows per partial sum]). 128 threads take
# strips × channels / 128 channels each: 8 (16 bytes of float16, channels_last's vector), but 4 in t8b16c32w4.
# Compiled for the H200 (sm_90), t4b32c32w4 issues about 0.063 warp instructions per multiply-add of a 7x7 forward
# in channels_last (96 channels, 56x56, batch 32), a third of the tap-by-tap depthwise_fwd_p64c32w4t's 0.18
# (bench/results/sass_counts.md). Timed on an H100 (bench/results/depthwise_h100.md), t8b16c32w4 was the fastest
# forward and data gradient of every 5x5 and 7x7 layer there at ba19f07, at 0.63-0.85x t4b32c32w4's time, although
# both issue the same instructions: longer strips load fewer columns an output. t8b32c32w4 (8 channels a thread, as
# t4b32c32w4; 236 registers, no spills at 7x7) took 0.89-0.98x t8b16c32w4's time on the stride-1 5x5 and 7x7
# layers' forward and data gradient at 4d335f1 (1.06x on the 3x3 layer, 1.16x at stride 2), when t8b16c32w4 ran up
# to 21% slower than before (docs/algorithms.md): not compared with the restored kernel yet. Each is a candidate:
# find's verified measurement picks. The x2 tiles (strips of two output rows, kernels.strips) load each input row once
# for both rows: 8 of 14 kernel rows' loads at 7x7. Counted for sm_90 on a CPU at the 7x7 forward above, t8x2b16c32w4
# issues t8b32c32w4's instructions (and has its registers) with 0.57x its loads; t8x2b8c32w4 (147 registers, 2
# channels a thread) 1.08x t8b16c32w4's instructions an output. On the H200 (bench/results/depthwise.md)
# t8x2b16c32w4 took 46.3 µs there against t8b16c32w4's 47.2, and was the fastest at 9x9 and 13x13.
TILES = ((4, 32, 32, 4), (4, 64, 16, 4), (4, 16, 64, 4), (8, 16, 32, 4), (2, 64, 16, 4), (8, 32, 32, 4),
         (8, 16, 32, 4, 0, 2), (8, 8, 32, 4, 0, 2))
# The weight gradient's: runs of 4 to 32 output rows per partial sum (more rows, fewer partial sums, fewer programs).
# A program reads its run's dy rows again for every kernel row: on the H100 the 7x7 layer above took 134 µs with runs
# of 8 rows and 151 with 32 (4d335f1), about 2.4x its issue-bound time (56 µs) where the forward took 1.65x (47 µs
# at ba19f07). A run of 8 rows of 32 channels there reads 28 KB of dy and 50 KB of x, more than the 5 programs an SM
# holds keep in its 256 KB cache; runs of 4 rows (149 µs) and of 2 (229 µs), which would fit, were slower on all six
# layers timed there (1.1-3.3x and 1.7-6x the best run): the extra partial sums cost more than the cache saves.
# Runs of 2 are no longer a candidate.
BACKWARD_FILTER_TILES = ((4, 32, 32, 4, 8), (4, 32, 32, 4, 32), (8, 16, 32, 4, 8), (8, 16, 32, 4, 32),
                         (4, 16, 64, 4, 16), (8, 16, 32, 4, 4))
MAX_STRIP = 8  # outputs a strip: the kernels keep that many accumulators (kernels.strips.MAX_STRIP, the same)
MAX_COLUMNS = 128  # the input columns a strip reads per kernel row, each a load unrolled at compile time


class TritonDepthwiseStrip(TritonAlgorithm):
    """One direction of the depthwise kernels by strips with one tile configuration."""

    family = "depthwise_strip"
    kernels = "strips"
    tile_type = "StripTile"

    def __init__(self, direction: str, strip: int, strips: int, channels: int, warps: int, chunk: int = 0,
                 rows: int = 1):
        if not 1 <= strip <= MAX_STRIP:
            raise ValueError(f"strip={strip}: the kernels keep 1 to {MAX_STRIP} outputs a strip")
        if rows not in (1, 2) or (rows == 2 and direction == "bwd_filter"):
            raise ValueError(f"rows={rows}: a strip of the forward or the data gradient spans 1 or 2 output rows, "
                             f"the weight gradient's 1")
        self._configure(direction, (strip, strips, channels, warps, chunk, rows),
                        f"t{strip}" + (f"x{rows}" if rows > 1 else "") + f"b{strips}c{channels}w{warps}"
                        + (f"s{chunk}" if chunk else ""))

    def kind(self, problem: ConvProblem) -> Support:
        return depthwise_only(problem)

    def _family_supports(self, problem: ConvProblem) -> Support:
        module = self.module()
        taps = problem.kernel_size[-1]
        stride, dilation = problem.stride[-1], problem.dilation[-1]
        strip = self.tile_args[0]
        if problem.direction == "bwd_data" and strip % stride:
            fitting = sorted({f"triton:depthwise_strip_bwd_data_t{t[0]}*" for t in TILES if t[0] % stride == 0})
            others = ", ".join([*fitting, "triton:depthwise_bwd_data_*ph (by stride phase)"])
            return unsupported(f"computes the data gradient of column stride {stride} (the stride's last entry) "
                               f"only with strips of a multiple of {stride} outputs, this configuration's strips "
                               f"have {strip}; {others}, cuDNN or torch:native take it")
        if self.tile_args[5] == 2 and (why := module.two_rows_reason(problem)):
            return unsupported(f"computes strips of two output rows only where both rows read the same input rows; "
                               f"{why}; the configurations of one row a strip (triton:depthwise_strip_"
                               f"{problem.direction}_t*b*), cuDNN or torch:native take it")
        if problem.direction == "bwd_filter" and taps > module.MAX_FILTER_TAPS:
            return unsupported(f"keeps a weight-gradient sum for each of up to {module.MAX_FILTER_TAPS} taps of a "
                               f"kernel row, got {taps}; triton:depthwise_bwd_filter_*, cuDNN or torch:native take it")
        columns = (strip - 1) * (stride if problem.direction != "bwd_data" else 1) + (taps - 1) * dilation + 1
        if columns > MAX_COLUMNS:
            return unsupported(f"unrolls a load for each of the {columns} input columns a strip of {strip} outputs "
                               f"reads per kernel row (kernel row {taps} taps, dilation {dilation}, stride {stride}), "
                               f"more than {MAX_COLUMNS}; a configuration with shorter strips, the other depthwise "
                               f"kernels, cuDNN or torch:native take it")
        channels = problem.c if problem.direction == "bwd_data" else problem.k
        fits = grid_axis_fits(math.ceil(channels / self.tile_args[2]), f"tiles of {self.tile_args[2]} channels",
                              "a configuration with wider channel tiles, torch:native or cuDNN")
        if not fits:
            return fits
        if problem.direction != "bwd_filter":
            weights = math.prod(module.weights_shape(problem, self.tile))
            if weights >= INDEX_LIMIT:
                return unsupported(f"lays the weights out in a float32 buffer of {weights} elements, which needs "
                                   f"64-bit offsets; these kernels use 32-bit ones (below {INDEX_LIMIT}); torch:native "
                                   f"and cuDNN take it")
        return SUPPORTED

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        if problem.direction != "bwd_filter":  # the weights in float32, tap by tap (strips.lay_out_weights)
            return [Buffer("weights", self.module().weights_shape(problem, self.tile), torch.float32)]
        return super().buffers(problem)

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return NumericNotes(float32_inside=problem.dtype != "float32")

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        # Multiply-adds on the CUDA cores in float32. Measured on an H100 (bench/results/depthwise_h100.md: six
        # layers of 3x3 to 7x7, batch 32, float16, channels_last, every direction) the fastest strip configuration
        # took 0.43-0.74x the tap-by-tap kernels' fastest (geometric mean 0.62 forward, 0.61 data gradient, 0.54
        # weight gradient), so their price (a tenth of the float32 peak, three times the compulsory traffic) at
        # 0.6x: 0.16 of the peak and 1.8 times the traffic. Where get's learned model (or a database) has not
        # measured them near a problem, it prices them no better than the neighbours' typical candidate (learned.py).
        # A strided 2-D data gradient launches once per phase of dx's rows.
        # Then the configuration's measured factor (TritonAlgorithm.measured_factor: bench/fit_triton_prices.py), which
        # keeps the strips' fastest configuration at this price and sets the other configurations and families by
        # their measured times against it.
        rows = problem.direction == "bwd_data" and len(problem.stride) == 2
        phases = min(problem.stride[0], problem.input_size[0]) if rows else 1
        return Cost(problem.flops, 0.16, 1.8 * problem.min_bytes + 2 * workspace_bytes,
                    phases + bool(workspace_bytes), float32_inside=True, composed=False,
                    measured_factor=self.measured_factor())


register_family(TritonDepthwiseStrip, {"fwd": TILES, "bwd_data": TILES, "bwd_filter": BACKWARD_FILTER_TILES})
