"""The depthwise weight gradient by input rows, on the tensor cores, in Triton.

The weight gradient of a depthwise convolution sums, for each channel, products of x and dy over batch and space:
dw[c, r, s] = Σ x[n, c, p·stride_h - pad_h + r·dil_h, q·stride_w - pad_w + s·dil_w] · dy[n, c, p, q]. Taken one
input row h of x at a time, the kernel rows r that meet it pair it with the dy rows p where p·stride_h = h + pad_h -
r·dil_h, and the row's share is a matrix product per channel: A (S × Q) = the row's columns in a window shifted tap by
tap (A[s, q] = x[h, q·stride_w - pad_w + s·dil_w]: the same few columns, loaded again from the cache) times B (Q × R)
= those dy rows side by side, so that dw[c] (S × R) += A·B. A program runs down a run of input rows (``tile.rows``)
of one image for a tile of channels, the channels the batch of a 3-D ``tl.dot``; the rows' columns in blocks of
``tile.block_q``. At stride and dilation 1, neighbouring input rows share R - 1 of their dy rows, so a program's dy
may stay in its SM's cache while it runs down its rows (not measured yet), and x is loaded once a row and tap (where
the CUDA-core kernels, ``kernels.strips``, load dy again for every kernel row).

The products are the tensor cores' (M, N and K of at least 16: the kernel's rows and taps padded to powers of two of
at least 16, whose lanes multiply zeros; a program keeps channels × padded taps float32 sums, at most
``MAX_ACCUMULATORS``): float16 and bfloat16 operands summed in float32; float32 ones rounded to TF32 where the
problem allows it, else multiplied in float32 (``ieee``: on the CUDA cores). Each run's sums land in float32
partials, one row (channel, tap) a run, that ``shared.sum_partials`` adds in a fixed order: no atomics,
deterministic. Operands are 4-D (N, C, H, W) views with their own strides (a 1-D problem has H = 1), so one
kernel serves both layouts; channels_last's channels are contiguous, the tile's first axis. Offsets are 32-bit: the
algorithm refuses operands of 2**31 elements or more.
"""

from __future__ import annotations

import dataclasses

import torch
import triton.language as tl

from ..problem import ConvProblem
from .recording import launch
from .shared import as_4d, cdiv, for_layout, geometry, kernel, next_power_of_2, sizes, sum_partials, tf32

MIN_DOT = 16  # tl.dot's least M, N and K
MAX_ACCUMULATORS = 8192  # float32 sums a program keeps: channels × padded taps (64 a thread with 4 warps)


@dataclasses.dataclass(frozen=True)
class RowsTile:
    """One configuration: input rows a program runs down (one partial sum a run), output columns a product, channels
    a program, warps."""

    rows: int
    block_q: int
    channels: int
    warps: int = 4

    def __post_init__(self) -> None:
        if self.rows < 1 or self.block_q < MIN_DOT or self.block_q & (self.block_q - 1):
            raise ValueError(f"RowsTile(rows={self.rows}, block_q={self.block_q}): a run of at least one row, and "
                             f"products over a power of two of at least {MIN_DOT} columns")


def padded_taps(problem: ConvProblem) -> tuple[int, int]:
    """(R, S) padded to the products' sizes: powers of two of at least ``MIN_DOT``."""
    r, s, *_ = geometry(problem)
    return max(MIN_DOT, next_power_of_2(r)), max(MIN_DOT, next_power_of_2(s))


@kernel()
def _row_products(x, dy, partials, H, W, P, Q, K, rows_per_part, parts_per_image,
                  sxn, sxc, sxh, sxw, sdn, sdk, sdp, sdq, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                  M: tl.constexpr, R: tl.constexpr, S: tl.constexpr, R_PAD: tl.constexpr, S_PAD: tl.constexpr,
                  TF32: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_CH: tl.constexpr):
    # One program: a tile of channels down a run of input rows of one image; sums (channels, taps s, kernel rows r).
    part = tl.program_id(0)  # the first grid axis: it has room for 2**31 - 1 runs (the others 65535)
    n = part // parts_per_image
    h_first = (part - n * parts_per_image) * rows_per_part
    h_last = tl.minimum(h_first + rows_per_part, H)
    k = tl.program_id(1) * BLOCK_CH + tl.arange(0, BLOCK_CH)
    k_ok = k < K
    s = tl.arange(0, S_PAD)
    r = tl.arange(0, R_PAD)
    q = tl.arange(0, BLOCK_Q)
    acc = tl.zeros((BLOCK_CH, S_PAD, R_PAD), dtype=tl.float32)
    inputs = x + n * sxn + (k // M) * sxc
    grads = dy + n * sdn + k * sdk
    for h in range(h_first, h_last):
        # the dy rows this input row meets: p·stride_h = h + pad_h - r·dil_h, one a kernel row
        reach = h + pad_h - r * dil_h
        p = reach // stride_h
        r_ok = (r < R) & (reach >= 0) & (reach - p * stride_h == 0) & (p < P)
        for q0 in range(0, Q, BLOCK_Q):
            qq = q0 + q
            wi = qq[None, :] * stride_w - pad_w + s[:, None] * dil_w  # (S_PAD, BLOCK_Q): the shifted windows
            a_ok = (s[:, None] < S) & (qq[None, :] < Q) & (wi >= 0) & (wi < W)
            a = tl.load(inputs[:, None, None] + h * sxh + (wi * sxw)[None, :, :],
                        mask=k_ok[:, None, None] & a_ok[None, :, :], other=0.0)
            b = tl.load(grads[:, None, None] + (qq * sdq)[None, :, None] + (p * sdp)[None, None, :],
                        mask=k_ok[:, None, None] & (qq < Q)[None, :, None] & r_ok[None, None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision="tf32" if TF32 else "ieee")
    # partials (parts, K, R·S): element (part, k, r·S + s)
    out = partials + part * K * R * S + k[:, None, None] * (R * S) + r[None, None, :] * S + s[None, :, None]
    tl.store(out, acc, mask=k_ok[:, None, None] & (s < S)[None, :, None] & (r < R)[None, None, :])


def partial_sums(problem: ConvProblem, tile: RowsTile) -> int:
    """How many partial sums ``backward_filter`` makes: one per run of ``tile.rows`` input rows of an image."""
    h, *_ = sizes(problem)
    return problem.n * cdiv(h, tile.rows)


def backward_filter(problem: ConvProblem, tile: RowsTile, x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor,
                    partials: torch.Tensor) -> None:
    """dw = the gradient of the weight from x and dy, into ``dw``, through ``partials`` (float32,
    (``partial_sums``, K, taps))."""
    x4, dy4 = as_4d(x, problem), as_4d(dy, problem)
    h, wd, p, q = sizes(problem)
    r, s, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w = geometry(problem)
    r_pad, s_pad = padded_taps(problem)
    parts = partials.shape[0]
    products = for_layout(_row_products, problem)
    launch(products, (parts, cdiv(problem.k, tile.channels)), x4, dy4, partials, h, wd, p, q, problem.k,
           tile.rows, cdiv(h, tile.rows), *x4.stride(), *dy4.stride(), stride_h, stride_w, pad_h, pad_w,
           dil_h, dil_w, M=problem.k // problem.c, R=r, S=s, R_PAD=r_pad, S_PAD=s_pad, TF32=tf32(problem),
           BLOCK_Q=tile.block_q, BLOCK_CH=tile.channels, num_warps=tile.warps)
    # dw (K, 1, *kernel) holds element (k, 0, tap) at k·taps + tap in either layout (one input channel).
    sum_partials(partials.view(parts, -1), dw)
