"""Depthwise convolution kernels (groups == input channels), 1-D and 2-D, in Triton.

Output channel k reads input channel k // M (M: the channel multiplier, K = C·M). Every kernel
works on 4-D (N, C, H, W) views, a 1-D problem being one with H = 1, and takes each operand's
strides, so one kernel serves channels_first and channels_last; a configuration's tile shape
decides which layout it suits (a wide channel tile reads channels_last rows whole, a wide
position tile reads channels_first rows whole). Products are summed in float32 whatever the
operands' dtype, and every sum has one fixed order: the results are deterministic.

- ``forward``: a program computes a tile of (output positions × output channels), looping over
  the kernel's taps; neighbouring taps read overlapping input, which the caches serve. The positions
  are consecutive ones or (``Tile.patch``) a 2-D patch of one sample, whose taps read the input its
  earlier kernel rows read.
- ``backward_data``: the same over input positions; a tap contributes where the output position
  it maps to is whole (divisible by the stride) and inside the output.
- ``backward_filter``: a reduction over batch and space for each (channel, tap). A program sums
  a run of output rows for a tile of channels, a kernel row's taps at once: each tile of dy is loaded
  once per kernel row and multiplied by that row's shifted input tiles, one (positions × taps ×
  channels) float32 accumulator (the run stays in cache across the kernel rows); a second kernel adds
  the runs' partials in a fixed order and rounds once into the gradient. No atomics.
- ``backward_data`` of a strided problem has a second form ('phases'): an input position receives
  gradient only through the taps whose offset the stride divides, the same taps for every position of
  one stride phase (h mod stride, w mod stride); a program takes positions of one phase and loops over
  that phase's taps alone (of a 3x3 stride-2 kernel, 1, 2 or 4 of the 9).

The channel multiplier and the kernel's size are compile-time constants: with a multiplier of 1
the compiler sees that a tile's channels are contiguous and loads channels_last rows in vectors.

Offsets are 32-bit: the algorithms refuse operands of 2**31 elements or more.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ..problem import ConvProblem
from .recording import launch
from .shared import (
    as_4d,
    cdiv,
    for_layout,
    geometry,
    gradient_source,
    kernel,
    next_power_of_2,
    patch_positions,
    positions,
    sizes,
    sum_partials,
)


@dataclasses.dataclass(frozen=True)
class Tile:
    """One kernel configuration: positions and channels per program, warps, (backward_filter) output rows
    summed per program (its positions are then positions × a kernel row's taps, padded to a power of two, per
    turn, capped at the row's length), and (backward_data) the form: '' (every input position, every tap) or
    'phases' (a strided problem's input positions one stride phase at a time, each phase looping over its own
    taps only, ``_backward_data_by_phase``); (forward) ``patch``: 0, the positions consecutive in
    (N, rows, columns) order, or the width of a patch of positions // patch rows of one sample
    (``patch_positions``); (forward, backward_data) ``unroll``: a kernel row's taps unrolled (``unroll_factor``);
    (forward, backward_data) ``as_tile``: every operand loaded as the tile is, with no exchange through shared
    memory (the weights laid out tap by tap, channels contiguous, ``tap_weights``)."""

    positions: int
    channels: int
    warps: int = 4
    chunk: int = 0
    form: str = ""
    patch: int = 0
    unroll: bool = False
    as_tile: bool = False

    def row_positions(self, taps: int) -> int:
        """backward_filter: the positions per turn for kernel rows of ``taps`` taps (0: more taps than
        the tile holds)."""
        return self.positions // next_power_of_2(taps)


@triton.jit
def _add_tap(acc, rows, positions_ok, channels_ok, taps, AS_TILE: tl.constexpr):
    """acc + one tap's contribution: the operand at ``rows`` (positions × channels, zero where a position
    is not whole) times the tap's weight of each channel, in float32. AS_TILE: the weights (laid out tap by tap,
    channels contiguous) loaded as the tile itself is, each thread its own channels' (a vector, from the
    cache); else loaded once per channel and shared out to the tile's layout (through shared memory and two
    barriers a tap, in the compiled code)."""
    values = tl.load(rows, mask=positions_ok[:, None] & channels_ok[None, :], other=0.0)
    if AS_TILE:
        weights = tl.load(taps[None, :] + positions_ok[:, None].to(tl.int32) * 0, mask=channels_ok[None, :], other=0.0)
        return acc + values.to(tl.float32) * weights.to(tl.float32)
    weights = tl.load(taps, mask=channels_ok, other=0.0)
    return acc + values.to(tl.float32) * weights.to(tl.float32)[None, :]


@kernel()
def _forward(x, w, y, total, P, Q, H, W, K,
             sxn, sxc, sxh, sxw, swk, swr, sws, syn, syk, syp, syq,
             stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
             M: tl.constexpr, R: tl.constexpr, S: tl.constexpr, BLOCK_POS: tl.constexpr, BLOCK_CH: tl.constexpr,
             PATCH_W: tl.constexpr, UNROLL: tl.constexpr, AS_TILE: tl.constexpr):
    pos_ok, n, p, q = patch_positions(total, P, Q, BLOCK_POS, PATCH_W)
    k = tl.program_id(1) * BLOCK_CH + tl.arange(0, BLOCK_CH)
    k_ok = k < K
    h0 = p * stride_h - pad_h
    w0 = q * stride_w - pad_w
    x_rows = x + n[:, None] * sxn + (k // M)[None, :] * sxc
    acc = tl.zeros((BLOCK_POS, BLOCK_CH), dtype=tl.float32)
    for r in range(R):
        h = h0 + r * dil_h
        h_ok = pos_ok & (h >= 0) & (h < H)
        for s in tl.range(0, S, 1, loop_unroll_factor=UNROLL):
            wi = w0 + s * dil_w
            ok = h_ok & (wi >= 0) & (wi < W)
            acc = _add_tap(acc, x_rows + (h * sxh + wi * sxw)[:, None], ok, k_ok, w + k * swk + r * swr + s * sws,
                           AS_TILE)
    offsets = (n * syn + p * syp + q * syq)[:, None] + k[None, :] * syk
    tl.store(y + offsets, acc.to(y.dtype.element_ty), mask=pos_ok[:, None] & k_ok[None, :])


@kernel()
def _backward_data(dy, w, dx, total, H, W, P, Q, C,
                   sdn, sdk, sdp, sdq, swk, swr, sws, sxn, sxc, sxh, sxw,
                   stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                   M: tl.constexpr, R: tl.constexpr, S: tl.constexpr, BLOCK_POS: tl.constexpr,
                   BLOCK_CH: tl.constexpr, UNROLL: tl.constexpr, AS_TILE: tl.constexpr):
    pos_ok, n, h, wi = positions(total, H, W, BLOCK_POS)
    c = tl.program_id(1) * BLOCK_CH + tl.arange(0, BLOCK_CH)
    c_ok = c < C
    acc = tl.zeros((BLOCK_POS, BLOCK_CH), dtype=tl.float32)
    for m in range(M):
        k = c * M + m
        dy_rows = dy + n[:, None] * sdn + k[None, :] * sdk
        for r in range(R):
            p, p_ok = gradient_source(h, pad_h, r, dil_h, stride_h, P)
            for s in tl.range(0, S, 1, loop_unroll_factor=UNROLL):
                q, q_ok = gradient_source(wi, pad_w, s, dil_w, stride_w, Q)
                ok = pos_ok & p_ok & q_ok
                acc = _add_tap(acc, dy_rows + (p * sdp + q * sdq)[:, None], ok, c_ok, w + k * swk + r * swr + s * sws,
                               AS_TILE)
    offsets = (n * sxn + h * sxh + wi * sxw)[:, None] + c[None, :] * sxc
    tl.store(dx + offsets, acc.to(dx.dtype.element_ty), mask=pos_ok[:, None] & c_ok[None, :])


@triton.jit
def _output_row(row, P, stride_h, pad_h, tap, dil_h, H):
    """Output row ``row`` of the (N·P) rows: its sample n, its row p, and the input row h kernel row ``tap``
    reads for it, with whether h is inside the input."""
    n = row // P
    p = row - n * P
    h = p * stride_h - pad_h + tap * dil_h
    return n, p, h, (h >= 0) & (h < H)


@triton.jit
def _first_tap(phase, pad, dil, stride, TAPS: tl.constexpr):
    """The first tap (along one axis) through which input positions of ``phase`` (their index mod the stride)
    receive gradient: the smallest t with (phase + pad - t·dil) divisible by the stride (TAPS: none)."""
    first = phase * 0 + TAPS
    for t in range(TAPS - 1, -1, -1):
        first = tl.where((phase + pad - t * dil) % stride == 0, t, first)
    return first


@kernel()
def _backward_data_by_phase(dy, w, dx, H, W, P, Q, C, N, step_h, step_w,
                            sdn, sdk, sdp, sdq, swk, swr, sws, sxn, sxc, sxh, sxw,
                            stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                            M: tl.constexpr, R: tl.constexpr, S: tl.constexpr, BLOCK_POS: tl.constexpr,
                            BLOCK_CH: tl.constexpr, AS_TILE: tl.constexpr):
    # Grid: (tiles of one phase's positions, tiles of channels, phases). A phase's input positions are
    # h = ph + stride_h·i, w = pw + stride_w·j; the taps through which they receive gradient are r0, r0 +
    # step_h, ... (step: the stride over its gcd with the dilation), the same for all of them, so every tap
    # the loops visit is whole for every position (no division leaves a remainder).
    phase = tl.program_id(2)
    ph = phase // stride_w
    pw = phase - ph * stride_w
    rows = (H - ph + stride_h - 1) // stride_h
    cols = (W - pw + stride_w - 1) // stride_w
    # (a phase an input smaller than the stride leaves empty: no positions, and no division by its 0 rows)
    pos_ok, n, i, j = positions(N * rows * cols, tl.maximum(rows, 1), tl.maximum(cols, 1), BLOCK_POS)
    h = ph + stride_h * i
    wi = pw + stride_w * j
    c = tl.program_id(1) * BLOCK_CH + tl.arange(0, BLOCK_CH)
    c_ok = c < C
    r0 = _first_tap(ph, pad_h, dil_h, stride_h, R)
    s0 = _first_tap(pw, pad_w, dil_w, stride_w, S)
    acc = tl.zeros((BLOCK_POS, BLOCK_CH), dtype=tl.float32)
    for m in range(M):
        k = c * M + m
        dy_rows = dy + n[:, None] * sdn + k[None, :] * sdk
        for r in range(r0, R, step_h):
            p = (h + pad_h - r * dil_h) // stride_h
            p_ok = (p >= 0) & (p < P)
            for s in range(s0, S, step_w):
                q = (wi + pad_w - s * dil_w) // stride_w
                ok = pos_ok & p_ok & (q >= 0) & (q < Q)
                acc = _add_tap(acc, dy_rows + (p * sdp + q * sdq)[:, None], ok, c_ok, w + k * swk + r * swr + s * sws,
                               AS_TILE)
    offsets = (n * sxn + h * sxh + wi * sxw)[:, None] + c[None, :] * sxc
    tl.store(dx + offsets, acc.to(dx.dtype.element_ty), mask=pos_ok[:, None] & c_ok[None, :])


@kernel()
def _backward_filter_partials(x, dy, partials, rows, rows_per_part, P, Q, H, W, K,
                              sxn, sxc, sxh, sxw, sdn, sdk, sdp, sdq,
                              stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                              M: tl.constexpr, R: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
                              BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program: a tile of channels over a run of output rows (n, p), a kernel row's S taps at once: per
    # output row and tile of its positions, dy is loaded once and multiplied by the S shifted input tiles, one
    # (positions × taps × channels) tile, so dy is read R times (not R·S). Rows are decoded once per row, the
    # positions of a row are a vector (no division per element).
    part = tl.program_id(0)  # the first grid axis: it has room for 2**31 - 1 runs (the others 65535)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K
    s = tl.arange(0, S_PAD)
    s_ok = s < S
    first_row = part * rows_per_part
    last_row = tl.minimum(first_row + rows_per_part, rows)
    x_channels = (k // M) * sxc
    dy_channels = k * sdk
    for r in range(R):
        acc = tl.zeros((BLOCK_Q, S_PAD, BLOCK_K), dtype=tl.float32)
        for row in range(first_row, last_row):
            n, p, h, h_ok = _output_row(row, P, stride_h, pad_h, r, dil_h, H)
            for q0 in range(0, Q, BLOCK_Q):
                q = q0 + tl.arange(0, BLOCK_Q)
                q_ok = q < Q
                wi = q[:, None] * stride_w - pad_w + s[None, :] * dil_w  # (positions, taps)
                ok = q_ok[:, None] & s_ok[None, :] & h_ok & (wi >= 0) & (wi < W)
                xv = tl.load(x + n * sxn + h * sxh + (wi * sxw)[:, :, None] + x_channels[None, None, :],
                             mask=ok[:, :, None] & k_ok[None, None, :], other=0.0)
                dyv = tl.load(dy + n * sdn + p * sdp + (q * sdq)[:, None] + dy_channels[None, :],
                              mask=q_ok[:, None] & k_ok[None, :], other=0.0)
                acc += xv.to(tl.float32) * dyv.to(tl.float32)[:, None, :]
        taps = tl.sum(acc, axis=0)  # (taps, channels)
        tl.store(partials + part * K * R * S + k[None, :] * R * S + r * S + s[:, None], taps,
                 mask=s_ok[:, None] & k_ok[None, :])


@triton.jit
def _lay_out_taps(w, taps, K, TAPS, swk, swr, sws, S: tl.constexpr, BLOCK: tl.constexpr):
    # taps (TAPS, K), dense: element (tap, k) is the weight of channel k at tap r·S + s.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < K * TAPS
    tap, k = i // K, i % K
    tl.store(taps + i, tl.load(w + k * swk + (tap // S) * swr + (tap % S) * sws, mask=ok), mask=ok)


# -- launches ---------------------------------------------------------------------------------
def tap_weights(tile: Tile, problem: ConvProblem, w: torch.Tensor, taps: torch.Tensor | None) -> torch.Tensor:
    """The 4-D weight as the kernels read it: as it is, or (``tile.as_tile``) copied into ``taps`` (the buffer
    ``taps_shape`` gives) tap by tap, each tap's channels contiguous, and seen as (K, 1, R, S) (the kernels read
    its strides)."""
    w4 = as_4d(w, problem)
    if not tile.as_tile:
        return w4
    k, _, r, s = w4.shape
    assert taps is not None and tuple(taps.shape) == taps_shape(problem), "as_tile needs its 'taps' buffer"
    block = 256
    launch(_lay_out_taps, (cdiv(k * r * s, block),), w4, taps, k, r * s, w4.stride(0), w4.stride(2),
           w4.stride(3), S=s, BLOCK=block, num_warps=4)
    return taps.as_strided((k, 1, r, s), (1, r * s * k, s * k, k))


def taps_shape(problem: ConvProblem) -> tuple[int, int]:
    """The shape of the weights laid out tap by tap (``tap_weights``): (taps, K)."""
    return math.prod(problem.kernel_size), problem.k


def unroll_factor(tile: Tile, problem: ConvProblem) -> int:
    """How many times the compiler unrolls the loop over a kernel row's taps: all of them (their loads in flight
    at once) where the tile says so, else not (1)."""
    return geometry(problem)[1] if tile.unroll else 1


def _direct(kernel, problem: ConvProblem, tile: Tile, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
            taps: torch.Tensor | None, computed: tuple[int, int], read: tuple[int, int], channels: int,
            **constants: int) -> None:
    """Launch ``_forward`` or ``_backward_data``: programs over tiles of (positions of ``out``, whose
    spatial size is ``computed``, × its ``channels``), reading ``a`` of spatial size ``read``; ``constants``:
    the kernel's own compile-time arguments."""
    a4, out4 = as_4d(a, problem), as_4d(out, problem)
    w4 = tap_weights(tile, problem, w, taps)
    total = problem.n * computed[0] * computed[1]
    if tile.patch:  # patches of (positions // patch) rows × patch columns, each of one sample
        rows, cols = cdiv(computed[0], tile.positions // tile.patch), cdiv(computed[1], tile.patch)
        programs = problem.n * rows * cols
    else:
        programs = cdiv(total, tile.positions)
    grid = (programs, cdiv(channels, tile.channels))
    r, s, *steps = geometry(problem)
    launch(for_layout(kernel, problem), grid, a4, w4, out4, total, *computed, *read, channels,
           *a4.stride(), w4.stride(0), w4.stride(2), w4.stride(3), *out4.stride(), *steps,
           M=problem.k // problem.c, R=r, S=s, BLOCK_POS=tile.positions, BLOCK_CH=tile.channels,
           AS_TILE=tile.as_tile, num_warps=tile.warps, **constants)


def forward(problem: ConvProblem, tile: Tile, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
            taps: torch.Tensor | None = None) -> None:
    """y = the depthwise convolution of x with w, into ``y`` (``taps``: the buffer of ``tap_weights``)."""
    h, wd, p, q = sizes(problem)
    _direct(_forward, problem, tile, x, w, y, taps, (p, q), (h, wd), problem.k, PATCH_W=tile.patch,
            UNROLL=unroll_factor(tile, problem))


def backward_data(problem: ConvProblem, tile: Tile, dy: torch.Tensor, w: torch.Tensor, dx: torch.Tensor,
                  taps: torch.Tensor | None = None) -> None:
    """dx = the gradient of the input from dy and w, into ``dx`` (``taps``: the buffer of ``tap_weights``)."""
    h, wd, p, q = sizes(problem)
    if tile.form == "phases":
        dy4, dx4 = as_4d(dy, problem), as_4d(dx, problem)
        w4 = tap_weights(tile, problem, w, taps)
        r, s, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w = geometry(problem)
        most = cdiv(h, stride_h) * cdiv(wd, stride_w) * problem.n  # the largest phase's positions
        grid = (cdiv(most, tile.positions), cdiv(problem.c, tile.channels), stride_h * stride_w)
        launch(
            for_layout(_backward_data_by_phase, problem), grid,
            dy4, w4, dx4, h, wd, p, q, problem.c, problem.n, stride_h // math.gcd(stride_h, dil_h),
            stride_w // math.gcd(stride_w, dil_w), *dy4.stride(), w4.stride(0), w4.stride(2), w4.stride(3),
            *dx4.stride(), stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, M=problem.k // problem.c, R=r, S=s,
            BLOCK_POS=tile.positions, BLOCK_CH=tile.channels, AS_TILE=tile.as_tile, num_warps=tile.warps)
        return
    _direct(_backward_data, problem, tile, dy, w, dx, taps, (h, wd), (p, q), problem.c,
            UNROLL=unroll_factor(tile, problem))


def backward_filter(problem: ConvProblem, tile: Tile, x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor,
                    partials: torch.Tensor) -> None:
    """dw = the gradient of the weight from x and dy, into ``dw``, through ``partials`` (float32,
    (parts, K, taps): one partial sum per run of ``tile.chunk`` output rows, ceil(N·P / chunk) runs)."""
    x4, dy4 = as_4d(x, problem), as_4d(dy, problem)
    h, wd, p, q = sizes(problem)
    parts = partials.shape[0]
    r, s, *steps = geometry(problem)
    # positions × the row's taps per turn (the algorithm refuses a kernel row longer than the tile); the row is
    # the tile's widest extent: a tile wider than the row would idle its lanes.
    block_q = min(tile.row_positions(s), next_power_of_2(q))
    launch(
        for_layout(_backward_filter_partials, problem), (parts, cdiv(problem.k, tile.channels)),
        x4, dy4, partials, problem.n * p, tile.chunk, p, q, h, wd, problem.k, *x4.stride(), *dy4.stride(), *steps,
        M=problem.k // problem.c, R=r, S=s, S_PAD=next_power_of_2(s), BLOCK_Q=block_q, BLOCK_K=tile.channels,
        num_warps=tile.warps)
    # dw (K, 1, *kernel) holds element (k, 0, tap) at k·taps + tap in either layout (one input channel).
    sum_partials(partials.view(parts, -1), dw)
