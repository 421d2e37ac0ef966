"""Depthwise convolution by strips of a row, on the CUDA cores, in Triton.

The other CUDA-core kernels (``kernels.depthwise``) load a tile once per tap: for every multiply-add a load from the
cache and a conversion to float32 besides the product. Here a thread computes a strip of T (1-8) neighbouring
outputs of one row for its channels: each input column that a kernel row reads for the strip is loaded and converted
once and multiplied into every output of the strip it reaches (an input column c reaches output t through tap s
where c = t·stride + s·dilation), so a kernel row of S taps costs (T - 1)·stride + (S - 1)·dilation + 1 loads for
T·S products; the weights of the kernel row (laid out in float32, tap by tap, channels contiguous, by
``lay_out_weights``) are loaded once per kernel row. The strip's T accumulators, and the column loop, are unrolled
at compile time (T, S, the row's stride and dilation are compile-time constants); the loops over kernel rows and
over the data gradient's channel multiple run at run time.

- ``forward``: programs over (strips of output rows, tiles of output channels); output channel k reads input
  channel k // M (M: the channel multiplier).
- Strips of two rows (``StripTile.rows`` = 2; the forward and the data gradient): a strip is T outputs of two
  neighbouring rows p and p + 1, whose kernel rows r and r - shift read the same input row where the row stride is a
  whole number of row dilations (shift = stride / dilation; the data gradient: row stride and dilation 1). Each
  input row is loaded and converted once for both rows: R + shift rows' loads for 2·R kernel rows' products where
  shift < R (about half the loads an output at stride 1), for twice the accumulators; where shift >= R the rows
  share nothing (2·R loads) and the tile only adds work.
- ``backward_data``: the forward's loop over dy with the kernel turned around (tap R-1-r, S-1-s), padding
  dilation·(size - 1) - padding, summed over the M output channels c·M + m that each input channel c feeds. A strided
  problem's dy is read as if spread ``stride`` apart with zeros between, without the zeros: dx's rows one stride phase
  (row mod stride) a launch, each looping over only the kernel rows that meet dy's rows from it, and its columns in
  strips whose length the column stride divides, so that which of a strip's columns are dy's is known at compile time
  (a stride-2 7x7 layer: about a quarter of the stride-1 loop's loads and products a dx element).
- ``backward_filter`` (kernel rows of up to 8 taps): a program per run of output rows (``tile.chunk``), tile of
  channels and kernel row sums x·dy over the run, strip by strip: the strip's T dy values and each input column
  once, one float32 accumulator per tap (the kernel rows side by side, not one after another in a program: R times
  the programs, for the latency of small layers' few runs); each run's sums land in float32 partials that
  ``shared.sum_partials`` adds in a fixed order: no atomics, deterministic.

Products are summed in float32 whatever the operands' dtype, in a fixed order. Operands are 4-D (N, C, H, W) views
with their own strides (a 1-D problem has H = 1), so one kernel serves both layouts: a tile of channels reads
channels_last's rows in vectors (not the data gradient's dy where the channel multiplier is above 1: its channels
c·M + m lie M apart). Offsets are 32-bit: the algorithms refuse operands of 2**31 elements or more.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ..problem import ConvProblem
from .recording import launch
from .shared import as_4d, cdiv, for_layout, geometry, kernel, sizes, sum_partials

MAX_FILTER_TAPS = 8  # taps of a kernel row the weight gradient keeps accumulators for
MAX_STRIP = 8  # outputs a strip: the kernels keep that many accumulators (the algorithms refuse longer strips too)


@dataclasses.dataclass(frozen=True)
class StripTile:
    """One configuration: outputs per strip (T), strips and channels per program, warps, and (weight gradient)
    output rows summed per partial sum."""

    strip: int
    strips: int
    channels: int
    warps: int = 4
    chunk: int = 0
    rows: int = 1  # output rows a strip (forward and data gradient): 2 loads each input row once for two rows

    def __post_init__(self) -> None:
        if not 1 <= self.strip <= MAX_STRIP:
            raise ValueError(f"StripTile(strip={self.strip}): the kernels keep 1 to {MAX_STRIP} outputs a strip")
        if self.rows not in (1, 2):
            raise ValueError(f"StripTile(rows={self.rows}): a strip spans 1 or 2 output rows")


def row_shift(problem: ConvProblem) -> int:
    """How many input rows apart the first kernel rows of a two-row strip's rows p and p + 1 read: the row stride in
    row dilations (kernel row r of p + 1 reads what kernel row r + shift of p reads), rounded down; 1 for the data
    gradient of row stride 1, a forward of stride 1 over dy (``two_rows_reason`` says where it is whole)."""
    _, _, stride_h, _, _, _, dil_h, _ = geometry(problem)
    return 1 // dil_h if problem.direction == "bwd_data" else stride_h // dil_h


def two_rows_reason(problem: ConvProblem) -> str | None:
    """Why strips of two output rows do not take ``problem`` (None: they do). The rows p and p + 1 share their
    input rows when the row stride is a whole number of the row dilation (``row_shift``) below the kernel's rows; a
    strided data gradient reads dy's rows spread apart, one phase a launch. A problem of one output row (1-D) or
    whose rows share no input row would only add work."""
    r, _, stride_h, _, _, _, dil_h, _ = geometry(problem)
    h, _, p, _ = sizes(problem)
    rows = h if problem.direction == "bwd_data" else p  # the rows the kernel makes
    if rows < 2:
        return f"{rows} output row: no second row to share input rows with (a 1-D problem has one)"
    if problem.direction == "bwd_data":
        if stride_h > 1:
            return f"row stride {stride_h}: the data gradient of a row stride above 1 runs a launch per row phase"
        stride_h = 1  # the data gradient is a forward of stride 1 over dy
    if stride_h % dil_h:
        return f"row stride {stride_h} is not a whole number of row dilations ({dil_h})"
    if row_shift(problem) >= r:
        return (f"row stride {stride_h} reaches past the kernel's {r} rows (dilation {dil_h}): the two rows share no "
                f"input row")
    return None


@triton.jit
def _pick(t: tl.constexpr, v0, v1, v2, v3, v4, v5, v6, v7):
    """v<t> (t a compile-time constant below 8)."""
    if t == 0:
        v = v0
    elif t == 1:
        v = v1
    elif t == 2:
        v = v2
    elif t == 3:
        v = v3
    elif t == 4:
        v = v4
    elif t == 5:
        v = v5
    elif t == 6:
        v = v6
    else:
        v = v7
    return v


@triton.jit
def _add_tap(acc, values, weights, tap_stride, COL: tl.constexpr, t: tl.constexpr, T: tl.constexpr,
             S: tl.constexpr, STRIDE_W: tl.constexpr, DIL_W: tl.constexpr):
    """acc (output t of the strip) + the column's values times the weights of the tap joining them, if any
    (``weights``: the kernel row's first tap, as the tile is; taps ``tap_stride`` apart)."""
    offset: tl.constexpr = COL - t * STRIDE_W  # the tap's offset along the row: s·dilation
    if t < T and offset >= 0 and offset % DIL_W == 0 and offset // DIL_W < S:
        acc = acc + values * tl.load(weights + (offset // DIL_W) * tap_stride)
    return acc


@triton.jit
def _add_taps(a0, a1, a2, a3, a4, a5, a6, a7, values, weights, tap_stride, COL: tl.constexpr, T: tl.constexpr,
              S: tl.constexpr, STRIDE_W: tl.constexpr, DIL_W: tl.constexpr):
    """The strip's outputs (a<t>) + column COL's values times the weights of the taps joining them (``_add_tap``)."""
    a0 = _add_tap(a0, values, weights, tap_stride, COL, 0, T, S, STRIDE_W, DIL_W)
    a1 = _add_tap(a1, values, weights, tap_stride, COL, 1, T, S, STRIDE_W, DIL_W)
    a2 = _add_tap(a2, values, weights, tap_stride, COL, 2, T, S, STRIDE_W, DIL_W)
    a3 = _add_tap(a3, values, weights, tap_stride, COL, 3, T, S, STRIDE_W, DIL_W)
    a4 = _add_tap(a4, values, weights, tap_stride, COL, 4, T, S, STRIDE_W, DIL_W)
    a5 = _add_tap(a5, values, weights, tap_stride, COL, 5, T, S, STRIDE_W, DIL_W)
    a6 = _add_tap(a6, values, weights, tap_stride, COL, 6, T, S, STRIDE_W, DIL_W)
    a7 = _add_tap(a7, values, weights, tap_stride, COL, 7, T, S, STRIDE_W, DIL_W)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _store(dst, acc, t: tl.constexpr, T: tl.constexpr, n, p, q0, ok, c, c_ok, Q, sdn, sdc, sdh, sdw):
    """Output t of the strips (where T has one), rounded into ``dst``'s dtype."""
    if t < T:
        q = q0 + t
        tl.store(dst + (n * sdn + p * sdh + q * sdw)[:, None] + c[None, :] * sdc, acc.to(dst.dtype.element_ty),
                 mask=(ok & (q < Q))[:, None] & c_ok[None, :])


@triton.jit
def _columns(rows, q0, h_ok, c_ok, W, ssw, pad_w, wa, wb, C_PAD, a0, a1, a2, a3, a4, a5, a6, a7,
             b0, b1, b2, b3, b4, b5, b6, b7, COLS: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
             STRIDE_W: tl.constexpr, DIL_W: tl.constexpr, UP_W: tl.constexpr, PHASE_W: tl.constexpr,
             DO_A: tl.constexpr, DO_B: tl.constexpr):
    """One input row's columns (``rows``: its start, for the strips' channels) into the strips' outputs: into the
    a accumulators through the kernel row of weights ``wa`` (DO_A), into the b accumulators (the output row below,
    two-row strips) through ``wb`` (DO_B); each column loaded and converted once for both."""
    for col in tl.static_range(COLS):
        if (col + UP_W - PHASE_W) % UP_W == 0:  # a column of src (q0 is a multiple of UP_W); else zeros
            wi = (q0 * STRIDE_W - pad_w + col) // UP_W  # whole
            values = tl.load(rows + (wi * ssw)[:, None], mask=(h_ok & (wi >= 0) & (wi < W))[:, None]
                             & c_ok[None, :], other=0.0).to(tl.float32)
            if DO_A:
                a0, a1, a2, a3, a4, a5, a6, a7 = _add_taps(a0, a1, a2, a3, a4, a5, a6, a7, values, wa, C_PAD, col,
                                                           T, S, STRIDE_W, DIL_W)
            if DO_B:
                b0, b1, b2, b3, b4, b5, b6, b7 = _add_taps(b0, b1, b2, b3, b4, b5, b6, b7, values, wb, C_PAD, col,
                                                           T, S, STRIDE_W, DIL_W)
    return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7


# The phase arguments are compiled as run-time integers whatever their value (Triton would make a constant of a 1 and
# mark a multiple of 16): one binary for every phase of a layer.
@kernel("p_first", "r_first", "r_step")
def _strips(src, wts, dst, total, strips, P, Q, H, W, C, C_PAD,
            ssn, ssc, ssh, ssw, sdn, sdc, sdh, sdw, stride_h, pad_h, pad_w, dil_h, p_first, r_first, r_step,
            DIV: tl.constexpr, M_IN: tl.constexpr, R: tl.constexpr, S: tl.constexpr, STRIDE_W: tl.constexpr,
            DIL_W: tl.constexpr, UP_H: tl.constexpr, UP_W: tl.constexpr, PHASE_W: tl.constexpr, T: tl.constexpr,
            U: tl.constexpr, SHIFT: tl.constexpr, BLOCK_STRIPS: tl.constexpr, BLOCK_CH: tl.constexpr):
    # dst[n, c, p, q] = Σ over m < M_IN, r, s of src'[n, (c // DIV)·M_IN + m, p·stride_h - pad_h + r·dil_h,
    # q·STRIDE_W - pad_w + s·DIL_W] · wts[(m·R + r)·S + s, c], where src' is src spread UP_H rows and UP_W columns
    # apart with zeros between (src'[.., u, v] = src[.., u / UP_H, v / UP_W] where both divide, else 0: a strided
    # problem's data gradient); a program: BLOCK_STRIPS strips of T outputs ((N·P) rows × ``strips`` a row) ×
    # BLOCK_CH channels, each thread a strip's channels. Its rows are p_first + UP_H·j (j < P): one launch a
    # phase of the rows, where only the kernel rows r_first, r_first + r_step, ... < R meet src's rows; T is a
    # multiple of UP_W, so that whether a column of src' is one of src's (PHASE_W: pad_w mod UP_W) is known at
    # compile time. U = 2 (UP_H = 1 only): a strip is T outputs of two rows, p and p + 1, whose kernel rows r and
    # r - SHIFT read the same input row (SHIFT = stride_h / dil_h, a whole number): each input row is loaded once for
    # both, R + SHIFT rows for 2·R kernel rows' products (2·R where SHIFT >= R: nothing shared).
    i = tl.program_id(0) * BLOCK_STRIPS + tl.arange(0, BLOCK_STRIPS)
    ok = i < total
    row = i // strips
    q0 = (i - row * strips) * T
    blocks = (P + U - 1) // U  # of a strip's rows in an image's
    n = row // blocks
    if UP_H == 1:  # every row, every kernel row: a loop of compile-time bounds (the run-time ones cost ~20% on an
        p = (row - n * blocks) * U  # H100, the compiler leaving loads among the products), whatever p_first, r_first,
        r_lo, r_inc = 0, 1  # r_step
    else:
        p = p_first + (row - n * blocks) * UP_H
        r_lo, r_inc = r_first, r_step
    c = tl.program_id(1) * BLOCK_CH + tl.arange(0, BLOCK_CH)
    c_ok = c < C
    zero = tl.zeros((BLOCK_STRIPS, BLOCK_CH), dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero
    b0, b1, b2, b3, b4, b5, b6, b7 = zero, zero, zero, zero, zero, zero, zero, zero
    COLS: tl.constexpr = (T - 1) * STRIDE_W + (S - 1) * DIL_W + 1  # the columns a strip's outputs read
    # two-row strips: the input rows j that only row p's kernel rows read (j < SHIFT), both rows' (SHIFT <= j < R),
    # only row p + 1's (j >= R, j - SHIFT < R)
    ONLY_A: tl.constexpr = SHIFT if SHIFT < R else R
    ONLY_B: tl.constexpr = R if R > SHIFT else SHIFT
    for m in range(M_IN):  # a loop at run time: the body is unrolled per kernel row, not per multiple
        base = src + (n * ssn)[:, None] + (((c // DIV) * M_IN + m) * ssc)[None, :]
        # the kernel row's weights as the tile is (each thread its own channels' from the cache; padded to whole
        # channel tiles, so unmasked); the compiler loads each tap's once however many outputs it serves
        weights = wts + (m * R * S) * C_PAD + c[None, :] + (i * 0)[:, None]
        if U == 1:
            for r in range(r_lo, R, r_inc):
                h = (p * stride_h - pad_h + r * dil_h) // UP_H  # whole: the launch's phase of the rows meets row r
                wr = weights + (r * S) * C_PAD
                a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7 = _columns(
                    base + (h * ssh)[:, None], q0, ok & (h >= 0) & (h < H), c_ok, W, ssw, pad_w, wr, wr, C_PAD,
                    a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7,
                    COLS, T, S, STRIDE_W, DIL_W, UP_W, PHASE_W, True, False)
        else:
            for j in range(0, ONLY_A):
                h = p * stride_h - pad_h + j * dil_h
                wr = weights + (j * S) * C_PAD
                a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7 = _columns(
                    base + (h * ssh)[:, None], q0, ok & (h >= 0) & (h < H), c_ok, W, ssw, pad_w, wr, wr, C_PAD,
                    a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7,
                    COLS, T, S, STRIDE_W, DIL_W, UP_W, PHASE_W, True, False)
            for j in range(SHIFT, R):
                h = p * stride_h - pad_h + j * dil_h
                a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7 = _columns(
                    base + (h * ssh)[:, None], q0, ok & (h >= 0) & (h < H), c_ok, W, ssw, pad_w,
                    weights + (j * S) * C_PAD, weights + ((j - SHIFT) * S) * C_PAD, C_PAD,
                    a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7,
                    COLS, T, S, STRIDE_W, DIL_W, UP_W, PHASE_W, True, True)
            for j in range(ONLY_B, R + SHIFT):
                h = p * stride_h - pad_h + j * dil_h
                wr = weights + ((j - SHIFT) * S) * C_PAD
                a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7 = _columns(
                    base + (h * ssh)[:, None], q0, ok & (h >= 0) & (h < H), c_ok, W, ssw, pad_w, wr, wr, C_PAD,
                    a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7,
                    COLS, T, S, STRIDE_W, DIL_W, UP_W, PHASE_W, False, True)
    _store(dst, a0, 0, T, n, p, q0, ok, c, c_ok, Q, sdn, sdc, sdh, sdw)
    _store(dst, a1, 1, T, n, p, q0, ok, c, c_ok, Q, sdn, sdc, sdh, sdw)
    _store(dst, a2, 2, T, n, p, q0, ok, c, c_ok, Q, sdn, sdc, sdh, sdw)
    _store(dst, a3, 3, T, n, p, q0, ok, c, c_ok, Q, sdn, sdc, sdh, sdw)
    _store(dst, a4, 4, T, n, p, q0, ok, c, c_ok, Q, sdn, sdc, sdh, sdw)
    _store(dst, a5, 5, T, n, p, q0, ok, c, c_ok, Q, sdn, sdc, sdh, sdw)
    _store(dst, a6, 6, T, n, p, q0, ok, c, c_ok, Q, sdn, sdc, sdh, sdw)
    _store(dst, a7, 7, T, n, p, q0, ok, c, c_ok, Q, sdn, sdc, sdh, sdw)
    if U == 2:
        ok_b = ok & (p + 1 < P)
        _store(dst, b0, 0, T, n, p + 1, q0, ok_b, c, c_ok, Q, sdn, sdc, sdh, sdw)
        _store(dst, b1, 1, T, n, p + 1, q0, ok_b, c, c_ok, Q, sdn, sdc, sdh, sdw)
        _store(dst, b2, 2, T, n, p + 1, q0, ok_b, c, c_ok, Q, sdn, sdc, sdh, sdw)
        _store(dst, b3, 3, T, n, p + 1, q0, ok_b, c, c_ok, Q, sdn, sdc, sdh, sdw)
        _store(dst, b4, 4, T, n, p + 1, q0, ok_b, c, c_ok, Q, sdn, sdc, sdh, sdw)
        _store(dst, b5, 5, T, n, p + 1, q0, ok_b, c, c_ok, Q, sdn, sdc, sdh, sdw)
        _store(dst, b6, 6, T, n, p + 1, q0, ok_b, c, c_ok, Q, sdn, sdc, sdh, sdw)
        _store(dst, b7, 7, T, n, p + 1, q0, ok_b, c, c_ok, Q, sdn, sdc, sdh, sdw)


@triton.jit
def _add_product(acc, s: tl.constexpr, values, grads, q0, ok, k_ok, Q, sdq, COL: tl.constexpr, t: tl.constexpr,
                 S: tl.constexpr, STRIDE_W: tl.constexpr, DIL_W: tl.constexpr):
    """acc (the sum of tap s) + the column's values times the strip's output t's gradient (``grads``: the strips'
    rows of dy) where column COL reaches output t through tap s (the compiler loads each output's gradient once
    however many taps it serves)."""
    offset: tl.constexpr = COL - t * STRIDE_W  # as in _add_tap
    if s < S and offset >= 0 and offset % DIL_W == 0 and offset // DIL_W == s:
        q = q0 + t
        d = tl.load(grads + (q * sdq)[:, None], mask=(ok & (q < Q))[:, None] & k_ok[None, :], other=0.0)
        acc = acc + values * d.to(tl.float32)
    return acc


@kernel()
def _filter_partials(x, dy, partials, rows, rows_per_part, strips, P, Q, H, W, K,
                     sxn, sxc, sxh, sxw, sdn, sdk, sdp, sdq, stride_h, pad_h, pad_w, dil_h,
                     M: tl.constexpr, R: tl.constexpr, S: tl.constexpr, STRIDE_W: tl.constexpr,
                     DIL_W: tl.constexpr, T: tl.constexpr, BLOCK_STRIPS: tl.constexpr, BLOCK_CH: tl.constexpr):
    # One program: a tile of channels over a run of output rows, strip by strip, for one kernel row: S float32
    # accumulators (strips × channels), summed over the strips once per run into the partials.
    part = tl.program_id(0)  # the first grid axis: it has room for 2**31 - 1 runs (the others 65535)
    k = tl.program_id(1) * BLOCK_CH + tl.arange(0, BLOCK_CH)
    r = tl.program_id(2)
    k_ok = k < K
    first = part * rows_per_part * strips
    last = tl.minimum(part * rows_per_part + rows_per_part, rows) * strips
    zero = tl.zeros((BLOCK_STRIPS, BLOCK_CH), dtype=tl.float32)
    COLS: tl.constexpr = (T - 1) * STRIDE_W + (S - 1) * DIL_W + 1
    s0, s1, s2, s3, s4, s5, s6, s7 = zero, zero, zero, zero, zero, zero, zero, zero
    for start in range(first, last, BLOCK_STRIPS):
        i = start + tl.arange(0, BLOCK_STRIPS)
        ok = i < last
        row = i // strips
        q0 = (i - row * strips) * T
        n = row // P
        p = row - n * P
        h = p * stride_h - pad_h + r * dil_h
        h_ok = ok & (h >= 0) & (h < H)
        grads = dy + (n * sdn + p * sdp)[:, None] + (k * sdk)[None, :]
        inputs = x + (n * sxn + h * sxh)[:, None] + ((k // M) * sxc)[None, :]
        for col in tl.static_range(COLS):
            wi = q0 * STRIDE_W - pad_w + col
            values = tl.load(inputs + (wi * sxw)[:, None], mask=(h_ok & (wi >= 0) & (wi < W))[:, None]
                             & k_ok[None, :], other=0.0).to(tl.float32)
            for t in tl.static_range(T):
                s0 = _add_product(s0, 0, values, grads, q0, ok, k_ok, Q, sdq, col, t, S, STRIDE_W, DIL_W)
                s1 = _add_product(s1, 1, values, grads, q0, ok, k_ok, Q, sdq, col, t, S, STRIDE_W, DIL_W)
                s2 = _add_product(s2, 2, values, grads, q0, ok, k_ok, Q, sdq, col, t, S, STRIDE_W, DIL_W)
                s3 = _add_product(s3, 3, values, grads, q0, ok, k_ok, Q, sdq, col, t, S, STRIDE_W, DIL_W)
                s4 = _add_product(s4, 4, values, grads, q0, ok, k_ok, Q, sdq, col, t, S, STRIDE_W, DIL_W)
                s5 = _add_product(s5, 5, values, grads, q0, ok, k_ok, Q, sdq, col, t, S, STRIDE_W, DIL_W)
                s6 = _add_product(s6, 6, values, grads, q0, ok, k_ok, Q, sdq, col, t, S, STRIDE_W, DIL_W)
                s7 = _add_product(s7, 7, values, grads, q0, ok, k_ok, Q, sdq, col, t, S, STRIDE_W, DIL_W)
    out = partials + part * K * R * S + k * (R * S) + r * S
    for s in tl.static_range(S):
        tl.store(out + s, tl.sum(_pick(s, s0, s1, s2, s3, s4, s5, s6, s7), axis=0), mask=k_ok)


@triton.jit
def _lay_out_weights(w, out, C, C_PAD, swk, swr, sws, M_IN: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
                     FLIP: tl.constexpr, BLOCK: tl.constexpr):
    # out (M_IN·R·S, C_PAD) float32: element ((m·R + r)·S + s, c) is the weight of channel c·M_IN + m at tap (r, s),
    # or (FLIP) at tap (R-1-r, S-1-s); zero in the padding channels.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M_IN * R * S * C_PAD
    row = i // C_PAD
    c = i - row * C_PAD
    s = row % S
    r = (row // S) % R
    m = row // (R * S)
    if FLIP:
        r, s = R - 1 - r, S - 1 - s
    value = tl.load(w + (c * M_IN + m) * swk + r * swr + s * sws, mask=ok & (c < C), other=0.0)
    tl.store(out + i, value.to(tl.float32), mask=ok)


# -- launches ---------------------------------------------------------------------------------
def weights_shape(problem: ConvProblem, tile: StripTile) -> tuple[int, int]:
    """The shape of the float32 weights ``forward`` and ``backward_data`` read (``lay_out_weights``): (M_IN·R·S,
    their channels padded to whole tiles)."""
    r, s, *_ = geometry(problem)
    sources, channels = (problem.k // problem.c, problem.c) if problem.direction == "bwd_data" else (1, problem.k)
    return sources * r * s, cdiv(channels, tile.channels) * tile.channels


def lay_out_weights(problem: ConvProblem, w: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (``weights_shape``) = the weights in float32, tap by tap, channels contiguous: the forward's as they
    are, the data gradient's turned around and grouped by input channel."""
    w4 = as_4d(w, problem)
    r, s, *_ = geometry(problem)
    data = problem.direction == "bwd_data"
    sources = problem.k // problem.c if data else 1
    block = 256
    launch(_lay_out_weights, (cdiv(out.numel(), block),), w4, out, problem.k // sources, out.shape[1],
           w4.stride(0), w4.stride(2), w4.stride(3), M_IN=sources, R=r, S=s, FLIP=data, BLOCK=block, num_warps=4)


def _run(problem: ConvProblem, tile: StripTile, src: torch.Tensor, w: torch.Tensor, dst: torch.Tensor,
         weights: torch.Tensor, read: tuple[int, int], made: tuple[int, int], channels: int, pads: tuple[int, int],
         stride_h: int, stride_w: int, divisor: int, sources: int, spread: tuple[int, int] = (1, 1)) -> None:
    """``_strips`` from ``src`` into ``dst``, ``src`` spread ``spread`` apart (rows, columns) with zeros between:
    one launch per phase of ``dst``'s rows (row mod spread[0]) that has rows."""
    src4, dst4 = as_4d(src, problem), as_4d(dst, problem)
    lay_out_weights(problem, w, weights)
    r, s, _, _, _, _, dil_h, dil_w = geometry(problem)
    up_h, up_w = spread
    assert tile.strip % up_w == 0, "a strip's outputs must span whole phases of the spread columns"
    strips = cdiv(made[1], tile.strip)
    if tile.rows == 2:
        reason = two_rows_reason(problem)
        assert reason is None and up_h == 1, reason  # the algorithms refuse it (two_rows_reason)
    run = for_layout(_strips, problem)
    for first in range(min(up_h, made[0])):
        rows = cdiv(made[0] - first, up_h)
        # the kernel rows that meet src's rows from this phase: (first·stride_h - pad_h + r·dil_h) divisible by up_h
        # (every up_h / gcd(dil_h, up_h)-th from the first)
        meet = [k for k in range(r) if (first * stride_h - pads[0] + k * dil_h) % up_h == 0]
        step = up_h // math.gcd(dil_h, up_h)
        total = problem.n * cdiv(rows, tile.rows) * strips
        grid = (cdiv(total, tile.strips), cdiv(channels, tile.channels))
        launch(run, grid, src4, weights, dst4, total, strips, rows, made[1], *read, channels, weights.shape[1],
               *src4.stride(), *dst4.stride(), stride_h, pads[0], pads[1], dil_h, first, meet[0] if meet else r, step,
               DIV=divisor, M_IN=sources, R=r, S=s, STRIDE_W=stride_w, DIL_W=dil_w, UP_H=up_h, UP_W=up_w,
               PHASE_W=pads[1] % up_w, T=tile.strip, U=tile.rows, SHIFT=row_shift(problem) if tile.rows == 2 else 1,
               BLOCK_STRIPS=tile.strips, BLOCK_CH=tile.channels,
               num_warps=tile.warps)


def forward(problem: ConvProblem, tile: StripTile, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
            weights: torch.Tensor) -> None:
    """y = the depthwise convolution of x with w, into ``y`` (``weights``: the buffer of ``weights_shape``)."""
    h, wd, p, q = sizes(problem)
    _, _, stride_h, stride_w, pad_h, pad_w, _, _ = geometry(problem)
    _run(problem, tile, x, w, y, weights, (h, wd), (p, q), problem.k, (pad_h, pad_w), stride_h, stride_w,
         problem.k // problem.c, 1)


def backward_data(problem: ConvProblem, tile: StripTile, dy: torch.Tensor, w: torch.Tensor, dx: torch.Tensor,
                  weights: torch.Tensor) -> None:
    """dx = the gradient of the input from dy and w, into ``dx``: the forward of dy spread ``stride`` apart (the
    strip's length a multiple of the column stride, ``stride[-1]``)."""
    h, wd, p, q = sizes(problem)
    r, s, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w = geometry(problem)
    _run(problem, tile, dy, w, dx, weights, (p, q), (h, wd), problem.c,
         (dil_h * (r - 1) - pad_h, dil_w * (s - 1) - pad_w), 1, 1, 1, problem.k // problem.c, (stride_h, stride_w))


def partial_sums(problem: ConvProblem, tile: StripTile) -> int:
    """How many partial sums of the weight gradient ``backward_filter`` makes: one per run of ``tile.chunk``
    output rows."""
    _, _, p, _ = sizes(problem)
    return cdiv(problem.n * p, tile.chunk)


def backward_filter(problem: ConvProblem, tile: StripTile, x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor,
                    partials: torch.Tensor) -> None:
    """dw = the gradient of the weight from x and dy (kernel rows of up to 8 taps), into ``dw``, through
    ``partials`` (float32, (``partial_sums``, K, taps))."""
    x4, dy4 = as_4d(x, problem), as_4d(dy, problem)
    h, wd, p, q = sizes(problem)
    r, s, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w = geometry(problem)
    parts = partials.shape[0]
    partials_kernel = for_layout(_filter_partials, problem)
    launch(partials_kernel, (parts, cdiv(problem.k, tile.channels), r), x4, dy4, partials, problem.n * p,
           tile.chunk, cdiv(q, tile.strip), p, q, h, wd, problem.k, *x4.stride(), *dy4.stride(), stride_h,
           pad_h, pad_w, dil_h, M=problem.k // problem.c, R=r, S=s, STRIDE_W=stride_w, DIL_W=dil_w, T=tile.strip,
           BLOCK_STRIPS=tile.strips, BLOCK_CH=tile.channels, num_warps=tile.warps)
    # dw (K, 1, *kernel) holds element (k, 0, tap) at k·taps + tap in either layout (one input channel).
    sum_partials(partials.view(parts, -1), dw)
