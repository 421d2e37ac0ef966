"""triton:depthwise_*: convtune's own depthwise kernels (``convtune.kernels.depthwise``), one
algorithm per direction and tile configuration.

Where they run and what every Triton family refuses: ``triton_family``.

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

import functools
import math
from typing import Any

from ..costmodel import Cost
from ..problem import ConvProblem
from .base import Buffer, NumericNotes, Support, unsupported
from .triton_family import TritonAlgorithm, depthwise_only, grid_axis_fits, register_family

# Tile configurations per direction: (positions, channels, warps[, chunk[, form[, patch]]]). Wide channel tiles
# read channels_last rows whole; wide position tiles suit channels_first, where positions are contiguous. One
# forward configuration takes a 4x4 patch of one sample's positions (patch: the patch's width; names ending in
# 'q' and the width): on the H200 5-7 % faster than any other on 7x7 to 13x13 kernels of large images, where
# the best of 8x8, 4x8 and 4x4 patches ran each shape (forward and data gradient) at 0.64-1.07x the speed of
# the best over consecutive positions (bench/results/depthwise.md as measured at 77a0049, in git history).
# Three more of the forward's and the data gradient's, each the fastest on some shapes on the H200
# (bench/results/depthwise.md at eb37812, where all 16 combinations of the 4 tiles were measured; each alone
# 1.04-1.27x the best of the 4 plain ones): a kernel row's taps unrolled (names ending in 'u': their loads in
# flight at once), the weights laid out tap by tap ('t': every operand loaded as the tile is, with no exchange
# through shared memory), and both.
BASE_TILES = ((32, 64, 4), (64, 32, 4), (16, 128, 4), (256, 4, 4))
DATA_TILES = (*BASE_TILES, (64, 32, 4, 0, "", 0, False, True), (16, 128, 4, 0, "", 0, True, False),
              (64, 32, 4, 0, "", 0, True, True))
FORWARD_TILES = (*DATA_TILES, (16, 128, 4, 0, "", 4))
# The data gradient of a strided problem also in the form 'phases' (one stride phase's positions at a time, each
# looping over its own taps; names ending in 'ph'), the first also with the weights tap by tap.
BACKWARD_DATA_TILES = (*DATA_TILES, *((*tile, 0, "phases") for tile in ((64, 32, 4), (32, 64, 4), (256, 4, 4))),
                       (64, 32, 4, 0, "phases", 0, False, True))
# The filter gradient's first number is positions × a kernel row's taps (padded to a power of two) per turn, a
# fixed accumulator; its fourth: output rows summed per program (more rows, fewer partial sums). (dy loaded as
# the tile is, once per tap, ran 0.84x as fast at 7x7 and larger kernels: not a candidate.)
BACKWARD_FILTER_TILES = ((64, 64, 4, 8), (128, 32, 4, 8), (256, 4, 4, 8))
FORM_SUFFIX = {"": "", "phases": "ph"}


class TritonDepthwise(TritonAlgorithm):
    """One direction of the depthwise kernels with one tile configuration."""

    family = "depthwise"
    kernels = "depthwise"
    tile_type = "Tile"

    def __init__(self, direction: str, positions: int, channels: int, warps: int, chunk: int = 0, form: str = "",
                 patch: int = 0, unroll: bool = False, as_tile: bool = False):
        super().__init__(direction, positions, channels, warps, chunk)
        self.form, self.patch, self.unroll, self.as_tile = form, patch, unroll, as_tile
        self.name += FORM_SUFFIX[form] + (f"q{patch}" if patch else "") + "u" * unroll + "t" * as_tile

    @functools.cached_property
    def tile(self) -> Any:
        return self.module().Tile(*self.tile_args, form=self.form, patch=self.patch, unroll=self.unroll,
                                  as_tile=self.as_tile)

    def kind(self, problem: ConvProblem) -> Support:
        return depthwise_only(problem)

    def _family_supports(self, problem: ConvProblem) -> Support:
        taps = problem.kernel_size[-1]
        if self.directions == ("bwd_filter",) and 1 << (taps - 1).bit_length() > self.tile_args[0]:
            return unsupported(f"takes kernel rows of up to {self.tile_args[0]} taps (a power of two at least as "
                               f"many as the row's), got {taps}; a wider configuration, cuDNN or torch:native takes it")
        if self.patch and problem.ndim == 1:
            return unsupported("patches of positions are for 2-D problems; the other configurations take 1-D ones")
        if self.form == "phases" and all(s == 1 for s in problem.stride):
            return unsupported("the form by stride phase is for strided problems; at stride 1 every input "
                               "position takes every tap, as the other configurations compute it")
        # the launches' second grid axis runs over tiles of channels, the phases form's third over stride phases
        tiles = math.ceil((problem.c if problem.direction == "bwd_data" else problem.k) / self.tile_args[1])
        phases = math.prod(problem.stride) if self.form == "phases" else 1
        return grid_axis_fits(max(tiles, phases), f"{tiles} tiles of {self.tile_args[1]} channels, {phases} stride "
                              f"phases", "a configuration with wider channel tiles, torch:native or cuDNN")

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        if self.as_tile and problem.direction != "bwd_filter":  # the weights laid out tap by tap (tap_weights)
            return [Buffer("taps", self.module().taps_shape(problem), problem.torch_dtype)]
        return super().buffers(problem)

    def partials_shape(self, problem: ConvProblem) -> tuple[int, ...]:
        # One float32 partial sum per (run of output rows, channel, tap); a 1-D problem's rows are its samples.
        rows = problem.n * (problem.output_size[0] if problem.ndim == 2 else 1)
        return (-(-rows // self.tile_args[3]), problem.k, math.prod(problem.kernel_size))

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return NumericNotes(float32_inside=problem.dtype != "float32")

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        # Multiply-adds on the CUDA cores in float32, each tap's operand loaded again from cache: measured on
        # the H200 (bench/results/depthwise.md) at 2-9x the floor forward and for the data gradient, 5-23x for
        # the weight gradient (whose reduction makes partial sums), so a tenth of the float32 peak and three
        # times the compulsory traffic; with the H200's peaks (hardware.py) these predict 0.75-2.0x the measured
        # time of every weight gradient there. get then leaves cuDNN first where neither was measured.
        return Cost(problem.flops, 0.1, 3 * problem.min_bytes + 2 * workspace_bytes,
                    1 + bool(workspace_bytes), float32_inside=True, composed=False,
                    measured_factor=self.measured_factor())


register_family(TritonDepthwise, {"fwd": FORWARD_TILES, "bwd_data": BACKWARD_DATA_TILES,
                                  "bwd_filter": BACKWARD_FILTER_TILES})
