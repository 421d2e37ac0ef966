"""Depthwise convolution kernels on the tensor cores: a kernel row as a banded matrix, in Triton.

Along one row a depthwise convolution of one channel is a product with a banded (Toeplitz) matrix: a tile of
BLOCK_N output columns of an output row is the input row's window of BLOCK_J columns times B[j, i] = w[s] where
j = i·stride + s·dilation (zero elsewhere). Stacking BLOCK_M output rows (any samples and rows) makes it a
(BLOCK_M × BLOCK_J) · (BLOCK_J × BLOCK_N) product per kernel row, batched over a tile of channels: ``tl.dot`` on
the tensor cores, whose rate is many times the CUDA cores' even though most of B is zeros (of BLOCK_J products
per output, S are the convolution's). The other depthwise kernels (``kernels.depthwise``) multiply tap by tap on
the CUDA cores, one load per product; here one load of the input window serves every tap of a kernel row.

- ``forward``: programs over (tiles of output rows, tiles of output columns, tiles of channels); per kernel row a
  window of the input rows it reads times the row's band of weights, built from the weights by a gather.
- ``backward_data``: the same product the other way: input columns from a window of dy's columns, through the
  band of taps by which each dy column reaches each input column (any stride: a tap whose offset the stride
  does not divide is a zero of the band; an input row a kernel row does not reach reads zeros).
- ``backward_filter``: per kernel row, C[i, j] = Σ over a run of output rows of dy[row, q0 + i] · x[row', wi0 + j],
  a product of dy's tile (transposed) with the input window; the row's taps are C's diagonals j = i·stride +
  s·dilation, summed once per run (``tl.gather`` of the diagonal, then a sum). Each run's sums land in float32
  partials that ``shared.sum_partials`` adds in a fixed order: no atomics, deterministic.

float16 and bfloat16 operands are multiplied exactly and summed in float32; float32 ones use TF32 exactly when the
problem allows it (else full-precision products). Operands are 4-D (N, C, H, W) views with their own strides (a 1-D
problem has H = 1), so one kernel serves both layouts: a tile of channels reads channels_last's rows in vectors, a
single channel reads channels_first's. Offsets are 32-bit: the algorithms refuse operands of 2**31 elements or
more.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import hardware
from ..problem import ConvProblem
from .recording import launch
from .shared import as_4d, cdiv, for_layout, geometry, kernel, next_power_of_2, sizes, sum_partials, tf32

MAX_WINDOW = 128  # the widest input window (BLOCK_J) a configuration reads per row: its band is (BLOCK_J × BLOCK_N)


@dataclasses.dataclass(frozen=True)
class BandTile:
    """One configuration: output rows, output columns and channels per program, warps, and (weight gradient)
    output rows summed per partial sum."""

    rows: int
    columns: int
    channels: int
    warps: int = 4
    chunk: int = 0


def columns(problem: ConvProblem, tile: BandTile) -> int:
    """The columns of its result a program computes: ``tile.columns``, or all of them where the result is narrower
    than a tile (its other columns are never stored)."""
    _, wd, _, q = sizes(problem)
    return min(tile.columns, wd if problem.direction == "bwd_data" else q)


def window(problem: ConvProblem, tile: BandTile) -> int:
    """BLOCK_J: the columns of the operand a program reads per row for the ``columns`` of its result it computes
    (the band's entries past that window serve only columns that are never stored), a power of two (16 at least,
    for ``tl.dot``)."""
    _, s, _, stride_w, _, _, _, dil_w = geometry(problem)
    computed = columns(problem, tile)
    span = (computed - 1) * stride_w + (s - 1) * dil_w + 1  # forward and weight gradient: input columns
    if problem.direction == "bwd_data":  # dy columns reaching those input columns, from the floored first
        reach = (computed - 1) + (s - 1) * dil_w
        span = reach // stride_w + 1 + (reach % stride_w != 0)
    return max(16, next_power_of_2(span))


def operand_bytes(problem: ConvProblem, tile: BandTile) -> int:
    """The bytes of one turn's two ``tl.dot`` operands, which the compiled kernel stages in shared memory: the input
    (or dy) window and the band, or (weight gradient) dy's tile and the input window."""
    window_columns = window(problem, tile)
    if problem.direction == "bwd_filter":
        elements = tile.channels * tile.columns * tile.rows + tile.channels * tile.rows * window_columns
    else:
        elements = tile.channels * tile.rows * window_columns + tile.channels * window_columns * tile.columns
    return elements * problem.torch_dtype.itemsize


def stages(problem: ConvProblem, tile: BandTile, shared_bytes: int) -> int | None:
    """Triton's ``num_stages`` for a launch whose blocks have ``shared_bytes`` of shared memory: the default (0:
    Triton's own, which keeps two turns' operands in flight) where two turns' operands fit, 1 (none ahead) where
    one turn's does, None where not even one fits (the configuration cannot run there)."""
    need = operand_bytes(problem, tile)
    if 2 * need <= shared_bytes:
        return 0
    return 1 if need <= shared_bytes else None


def side_tiles(problem: ConvProblem, tile: BandTile) -> int:
    """The most programs a launch puts along its second or third grid axis: tiles of the result's columns, and of
    its channels."""
    _, wd, _, q = sizes(problem)
    width, channels = (wd, problem.c) if problem.direction == "bwd_data" else (q, problem.k)
    return max(cdiv(width, tile.columns), cdiv(channels, tile.channels))


@triton.jit
def _tap(offset, dil, S: tl.constexpr):
    """The tap whose offset along the row is ``offset`` (s·dilation), and where there is one: whole, 0 <= s < S (a
    negative offset, never a tap, is masked whatever its division gives)."""
    s = offset // dil
    return s, (offset >= 0) & (s * dil == offset) & (s < S)


@triton.jit
def _rows(first, count, P, BLOCK_M: tl.constexpr):
    """BLOCK_M rows from ``first`` of the (N·P) rows of a result: their sample, row, and which exist."""
    row = first + tl.arange(0, BLOCK_M)
    n = row // P
    return row < count, n, row - n * P


@kernel()
def _forward(x, w, y, rows, P, Q, H, W, K,
             sxn, sxc, sxh, sxw, swk, swr, sws, syn, syk, syp, syq,
             stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
             M: tl.constexpr, R: tl.constexpr, S: tl.constexpr, TF32: tl.constexpr, BLOCK_C: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    row_ok, n, p = _rows(tl.program_id(0) * BLOCK_M, rows, P, BLOCK_M)
    q0 = tl.program_id(1) * BLOCK_N
    k = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    k_ok = k < K
    i = tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_J)
    wi = q0 * stride_w - pad_w + j  # the input window
    col_ok = (wi >= 0) & (wi < W)
    # (BLOCK_J, BLOCK_N): input column j reaches output column i through tap s where j = i·stride + s·dilation
    s, on_band = _tap(j[:, None] - i[None, :] * stride_w, dil_w, S)
    band_ok = k_ok[:, None, None] & on_band[None, :, :]
    taps = w + k[:, None, None] * swk + (s * sws)[None, :, :]
    inputs = x + ((k // M) * sxc)[:, None, None] + (wi * sxw)[None, None, :]
    acc = tl.zeros((BLOCK_C, BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(R):
        h = p * stride_h - pad_h + r * dil_h
        ok = row_ok & (h >= 0) & (h < H)
        a = tl.load(inputs + (n * sxn + h * sxh)[None, :, None],
                    mask=k_ok[:, None, None] & ok[None, :, None] & col_ok[None, None, :], other=0.0)
        b = tl.load(taps + r * swr, mask=band_ok, other=0.0)
        acc = tl.dot(a, b, acc, input_precision="tf32" if TF32 else "ieee")
    q = q0 + i
    out = y + (k * syk)[:, None, None] + (n * syn + p * syp)[None, :, None] + (q * syq)[None, None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=k_ok[:, None, None] & row_ok[None, :, None] & (q < Q)[None, None, :])


@kernel()
def _backward_data(dy, w, dx, rows, H, W, P, Q, C,
                   sdn, sdk, sdp, sdq, swk, swr, sws, sxn, sxc, sxh, sxw,
                   stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                   M: tl.constexpr, R: tl.constexpr, S: tl.constexpr, TF32: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    row_ok, n, h = _rows(tl.program_id(0) * BLOCK_M, rows, H, BLOCK_M)
    w0 = tl.program_id(1) * BLOCK_N
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    i = tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_J)
    # The dy window: from the first dy column any of the tile's input columns receives from (floored; it may be
    # negative, and is masked), BLOCK_J of them. Input column w0 + i receives dy column q0 + j through the tap s with
    # s·dilation = w0 + i + pad - (q0 + j)·stride.
    first = w0 + pad_w - (S - 1) * dil_w
    q0 = tl.where(first >= 0, first // stride_w, -((stride_w - 1 - first) // stride_w))
    q = q0 + j
    col_ok = (q >= 0) & (q < Q)
    s, band = _tap((w0 + pad_w - q0 * stride_w) + i[None, :] - j[:, None] * stride_w, dil_w, S)  # (BLOCK_J, BLOCK_N)
    acc = tl.zeros((BLOCK_C, BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m in range(M):
        k = c * M + m
        grads = dy + (k * sdk)[:, None, None] + (q * sdq)[None, None, :]
        taps = w + k[:, None, None] * swk + (s * sws)[None, :, :]
        for r in range(R):
            t = h + pad_h - r * dil_h  # the dy row p with p·stride = t, where there is one
            p = t // stride_h
            ok = row_ok & (t >= 0) & (p * stride_h == t) & (p < P)
            a = tl.load(grads + (n * sdn + p * sdp)[None, :, None],
                        mask=c_ok[:, None, None] & ok[None, :, None] & col_ok[None, None, :], other=0.0)
            b = tl.load(taps + r * swr, mask=c_ok[:, None, None] & band[None, :, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision="tf32" if TF32 else "ieee")
    col = w0 + i
    out = dx + (c * sxc)[:, None, None] + (n * sxn + h * sxh)[None, :, None] + (col * sxw)[None, None, :]
    ok = c_ok[:, None, None] & row_ok[None, :, None] & (col < W)[None, None, :]
    tl.store(out, acc.to(dx.dtype.element_ty), mask=ok)


@kernel()
def _backward_filter_partials(x, dy, partials, rows, chunk, P, Q, H, W, K,
                              sxn, sxc, sxh, sxw, sdn, sdk, sdp, sdq,
                              stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                              M: tl.constexpr, R: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
                              TF32: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    # One program: a run of ``chunk`` output rows, a tile of output columns and one of channels; its partial sums
    # (K, R·S) land at partials[run × column tiles + column tile].
    run = tl.program_id(0)
    columns = tl.num_programs(1)
    q0 = tl.program_id(1) * BLOCK_N
    k = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    k_ok = k < K
    i = tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_J)
    q = q0 + i
    wi = q0 * stride_w - pad_w + j
    col_ok = (wi >= 0) & (wi < W)
    grads = dy + (k * sdk)[:, None, None] + (q * sdq)[None, :, None]
    inputs = x + ((k // M) * sxc)[:, None, None] + (wi * sxw)[None, None, :]
    grad_ok = k_ok[:, None, None] & (q < Q)[None, :, None]
    input_ok = k_ok[:, None, None] & col_ok[None, None, :]
    # Tap s of the row is C's diagonal j = i·stride + s·dilation: gathered per (channel, i) along j.
    t = tl.arange(0, S_PAD)
    diagonal = i[:, None] * stride_w + t[None, :] * dil_w  # (BLOCK_N, S_PAD)
    on_band = (t < S)[None, :] & (diagonal < BLOCK_J)
    index = tl.broadcast_to(tl.where(on_band, diagonal, 0)[None, :, :], (BLOCK_C, BLOCK_N, S_PAD))
    start = run * chunk
    stop = tl.minimum(start + chunk, rows)
    out = partials + (run * columns + tl.program_id(1)) * K * R * S + k[:, None] * (R * S) + t[None, :]
    for r in range(R):
        acc = tl.zeros((BLOCK_C, BLOCK_N, BLOCK_J), dtype=tl.float32)
        for first in range(start, stop, BLOCK_M):
            row_ok, n, p = _rows(first, stop, P, BLOCK_M)
            h = p * stride_h - pad_h + r * dil_h
            ok = row_ok & (h >= 0) & (h < H)
            g = tl.load(grads + (n * sdn + p * sdp)[None, None, :], mask=grad_ok & row_ok[None, None, :], other=0.0)
            a = tl.load(inputs + (n * sxn + h * sxh)[None, :, None], mask=input_ok & ok[None, :, None], other=0.0)
            acc = tl.dot(g, a, acc, input_precision="tf32" if TF32 else "ieee")
        on_taps = tl.where(on_band[None, :, :], tl.gather(acc, index, 2), 0.0)
        tl.store(out + r * S, tl.sum(on_taps, axis=1), mask=k_ok[:, None] & (t < S)[None, :])


# -- launches ---------------------------------------------------------------------------------
def _stages(problem: ConvProblem, tile: BandTile) -> dict[str, int]:
    """The launch's ``num_stages`` where Triton's default would not fit this GPU's shared memory (``stages``)."""
    chosen = stages(problem, tile, hardware.shared_memory_per_block())
    if chosen is None:
        raise ValueError(f"{tile} needs {operand_bytes(problem, tile)} bytes of shared memory for {problem.key}, "
                         f"more than this GPU's {hardware.shared_memory_per_block()}: the algorithm refuses it")
    return {"num_stages": chosen} if chosen else {}


def _launch(kernel, problem: ConvProblem, tile: BandTile, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
            computed: tuple[int, int], read: tuple[int, int], channels: int) -> None:
    """Launch ``_forward`` or ``_backward_data``: programs over tiles of (rows × columns × ``channels``) of ``out``,
    whose spatial size is ``computed``, reading ``a`` of spatial size ``read``."""
    a4, w4, out4 = (as_4d(t, problem) for t in (a, w, out))
    r, s, *steps = geometry(problem)
    rows = problem.n * computed[0]
    grid = (cdiv(rows, tile.rows), cdiv(computed[1], tile.columns), cdiv(channels, tile.channels))
    kernel = for_layout(kernel, problem)
    launch(kernel, grid, a4, w4, out4, rows, *computed, *read, channels, *a4.stride(), w4.stride(0), w4.stride(2),
           w4.stride(3), *out4.stride(), *steps, M=problem.k // problem.c, R=r, S=s, TF32=tf32(problem),
           BLOCK_C=tile.channels, BLOCK_M=tile.rows, BLOCK_N=tile.columns, BLOCK_J=window(problem, tile),
           num_warps=tile.warps, **_stages(problem, tile))


def forward(problem: ConvProblem, tile: BandTile, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """y = the depthwise convolution of x with w, into ``y``."""
    h, wd, p, q = sizes(problem)
    _launch(_forward, problem, tile, x, w, y, (p, q), (h, wd), problem.k)


def backward_data(problem: ConvProblem, tile: BandTile, dy: torch.Tensor, w: torch.Tensor, dx: torch.Tensor) -> None:
    """dx = the gradient of the input from dy and w, into ``dx``."""
    h, wd, p, q = sizes(problem)
    _launch(_backward_data, problem, tile, dy, w, dx, (h, wd), (p, q), problem.c)


def partial_sums(problem: ConvProblem, tile: BandTile) -> int:
    """How many partial sums of the weight gradient ``backward_filter`` makes: one per run of ``tile.chunk``
    output rows and tile of output columns."""
    _, _, p, q = sizes(problem)
    return cdiv(problem.n * p, tile.chunk) * cdiv(q, tile.columns)


def backward_filter(problem: ConvProblem, tile: BandTile, x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor,
                    partials: torch.Tensor) -> None:
    """dw = the gradient of the weight from x and dy, into ``dw``, through ``partials`` (float32, (``partial_sums``,
    K, taps))."""
    x4, dy4 = as_4d(x, problem), as_4d(dy, problem)
    h, wd, p, q = sizes(problem)
    r, s, *steps = geometry(problem)
    rows = problem.n * p
    grid = (cdiv(rows, tile.chunk), cdiv(q, tile.columns), cdiv(problem.k, tile.channels))
    partials_kernel = for_layout(_backward_filter_partials, problem)
    launch(partials_kernel, grid, x4, dy4, partials, rows, tile.chunk, p, q, h, wd, problem.k,
           *x4.stride(), *dy4.stride(), *steps, M=problem.k // problem.c, R=r, S=s,
           S_PAD=next_power_of_2(s), TF32=tf32(problem), BLOCK_C=tile.channels, BLOCK_M=tile.rows,
           BLOCK_N=tile.columns, BLOCK_J=window(problem, tile), num_warps=tile.warps, **_stages(problem, tile))
    # dw (K, 1, *kernel) holds element (k, 0, tap) at k·taps + tap in either layout (one input channel).
    sum_partials(partials.view(partials.shape[0], -1), dw)
