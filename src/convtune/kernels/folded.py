"""Convolution kernels for layers with few input channels (a network's first layer: 3 colour channels), 1-D and
2-D, in Triton: an implicit GEMM whose reduction runs over the kernel's taps and channels folded together.

An implicit GEMM that reduces over the input channels tap by tap (``kernels.grouped``) fills the tensor cores'
16 lanes with 3 channels and zeros where a layer has 3: a 7x7 stem wastes 13 of every 16 products. Folded, the
reduction index j runs over (tap row r, tap column s, channel c), c fastest, 3·49 = 147 of them for that stem,
in tiles of 16 or 32 (160 with 13 of padding): each program gathers a tile of that im2col matrix straight from
the input (zeros where a tap reads padding; in channels_last the channels and columns of one tap row lie side by
side in memory) and multiplies it with the weights' matching rows (``tl.dot``), summing in float32. Nothing is
written out but the result.

- ``forward``: programs over (output positions) × (tiles of output channels); the reduction's steps unrolled at
  compile time, where each step's (r, s, c) are constants (compiled for sm_90, the 7x7 stem's forward issues about a
  quarter of the instructions of a loop over them: ``bench/sass_counts.py``).
- ``backward_filter``: dW = dy^T · im2col(x) over the positions, for a tile of output channels and one tile of
  the folded (r, s, c), summed in runs of positions into float32 partials laid out like the gradient, which
  ``kernels.shared``'s second kernel adds in a fixed order (deterministic, no atomics). The programs of one run of
  positions are adjacent on the grid, so the run's output gradient is read once from memory and then from cache.

The data gradient reduces over the output channels, which such a layer has many of; it is not computed here (a
first layer's input needs no gradient, and where one does, cuDNN and PyTorch take it).

Operands are 4-D (N, C, H, W) views with their own strides (a 1-D problem has H = 1), so one kernel serves both
layouts. float32 operands use TF32 exactly when the problem allows it. Offsets are 32-bit: the algorithms refuse
operands of 2**31 elements or more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..problem import ConvProblem
from .recording import launch
from .shared import (
    GemmTile,
    as_4d,
    cdiv,
    for_layout,
    geometry,
    kernel,
    positions,
    run_positions,
    sizes,
    sum_partials,
    tf32,
)


def fold_block(folded: int) -> int:
    """The reduction tile for ``folded`` = taps × channels: 16 or 32 (``tl.dot`` takes 16 at least), whichever pads
    ``folded`` less, 32 on a tie (fewer steps)."""
    return 16 if cdiv(folded, 16) * 16 < cdiv(folded, 32) * 32 else 32


@triton.jit
def _unfold(j, CH: tl.constexpr, S: tl.constexpr):
    """The (tap row, tap column, channel) of folded reduction indices ``j`` (channel fastest)."""
    return j // (CH * S), (j // CH) % S, j % CH


@triton.jit
def _offsets(r, s, c, dil_h, dil_w, sxc, sxh, sxw):
    """Where the input element of folded indices (r, s, c) lies from its position's tap (0, 0), channel 0."""
    return c * sxc + (r * dil_h) * sxh + (s * dil_w) * sxw


@triton.jit
def _inside(pos_ok, top, left, j_ok, r, s, dil_h, dil_w, H, W):
    """Which (position, folded index) pairs read the input, not its padding (positions whose tap (0, 0) lies at
    ``top``, ``left``)."""
    h = top[:, None] + (r * dil_h)[None, :]
    wi = left[:, None] + (s * dil_w)[None, :]
    return pos_ok[:, None] & j_ok[None, :] & (h >= 0) & (h < H) & (wi >= 0) & (wi < W)


@kernel()
def _forward(x, w, y, total, P, Q, H, W, K,
             sxn, sxc, sxh, sxw, swk, swc, swr, sws, syn, syk, syp, syq,
             stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
             CH: tl.constexpr, R: tl.constexpr, S: tl.constexpr, TF32: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pos_ok, n, p, q = positions(total, P, Q, BLOCK_M)
    k = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = k < K
    top = p * stride_h - pad_h
    left = q * stride_w - pad_w
    corners = x + n * sxn + top * sxh + left * sxw  # each position's tap (0, 0), channel 0 (where it may lie outside)
    folded: tl.constexpr = CH * R * S
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in tl.static_range(0, folded, BLOCK_K):  # unrolled: each step's (r, s, c) are compile-time constants
        j = j0 + tl.arange(0, BLOCK_K)
        j_ok = j < folded
        r, s, c = _unfold(j, CH, S)
        a = tl.load(corners[:, None] + _offsets(r, s, c, dil_h, dil_w, sxc, sxh, sxw)[None, :],
                    mask=_inside(pos_ok, top, left, j_ok, r, s, dil_h, dil_w, H, W), other=0.0)
        b = tl.load(w + k[None, :] * swk + (c * swc + r * swr + s * sws)[:, None],
                    mask=j_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="tf32" if TF32 else "ieee")
    offsets = (n * syn + p * syp + q * syq)[:, None] + k[None, :] * syk
    tl.store(y + offsets, acc.to(y.dtype.element_ty), mask=pos_ok[:, None] & k_ok[None, :])


@kernel()
def _backward_filter_partials(x, dy, partials, total, chunk, P, Q, H, W, K, size,
                              sxn, sxc, sxh, sxw, sdn, sdk, sdp, sdq, swk, swc, swr, sws,
                              stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                              CH: tl.constexpr, R: tl.constexpr, S: tl.constexpr, TF32: tl.constexpr,
                              FOLD_TILES: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, STEPPED: tl.constexpr):
    # One program: a run of ``chunk`` positions, a tile of output channels and a tile of the folded (r, s, c); the
    # first grid axis (room for 2**31 - 1 programs) runs over runs × fold tiles, the fold tile fastest. STEPPED (an
    # output row at least BLOCK_P wide): each turn's (n, p, q) follow from the last turn's by adding BLOCK_P columns
    # and carrying a row and an image at most once, instead of dividing by the run-time P and Q each turn.
    part = tl.program_id(0) // FOLD_TILES
    j = (tl.program_id(0) % FOLD_TILES) * BLOCK_K + tl.arange(0, BLOCK_K)
    folded: tl.constexpr = CH * R * S
    j_ok = j < folded
    r, s, c = _unfold(j, CH, S)
    offsets_j = _offsets(r, s, c, dil_h, dil_w, sxc, sxh, sxw)
    k = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = k < K
    start = part * chunk
    stop = start + tl.minimum(chunk, total - start)  # (start + chunk may pass 2**31 where total nearly does)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    pos_ok, n, p, q = run_positions(start, stop, P, Q, BLOCK_P)
    for first in range(start, stop, BLOCK_P):
        if STEPPED:
            pos_ok = first + tl.arange(0, BLOCK_P) < stop
        else:
            pos_ok, n, p, q = run_positions(first, stop, P, Q, BLOCK_P)
        grad = tl.load(dy + (n * sdn + p * sdp + q * sdq)[None, :] + k[:, None] * sdk,
                       mask=k_ok[:, None] & pos_ok[None, :], other=0.0)
        top = p * stride_h - pad_h
        left = q * stride_w - pad_w
        inp = tl.load((x + n * sxn + top * sxh + left * sxw)[:, None] + offsets_j[None, :],
                      mask=_inside(pos_ok, top, left, j_ok, r, s, dil_h, dil_w, H, W), other=0.0)
        acc = tl.dot(grad, inp, acc, input_precision="tf32" if TF32 else "ieee")
        if STEPPED:  # the next turn's positions (q < Q and BLOCK_P <= Q: one carry at most, and one of p into n)
            q += BLOCK_P
            row = q >= Q
            q = tl.where(row, q - Q, q)
            p = tl.where(row, p + 1, p)
            image = p >= P
            p = tl.where(image, p - P, p)
            n = tl.where(image, n + 1, n)
    offsets = k[:, None] * swk + (c * swc + r * swr + s * sws)[None, :]
    tl.store(partials + part * size + offsets, acc, mask=k_ok[:, None] & j_ok[None, :])


# -- launches ---------------------------------------------------------------------------------
def _folded(problem: ConvProblem) -> int:
    """Taps × input channels: the reduction's length."""
    r, s = geometry(problem)[:2]
    return problem.c * r * s


def channel_tiles(problem: ConvProblem, tile: GemmTile) -> int:
    """Programs along the launch grid's second axis (CUDA holds 65535 there): tiles of output channels."""
    return cdiv(problem.k, tile.channels)


def forward(problem: ConvProblem, tile: GemmTile, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """y = the convolution of x with w, into ``y``."""
    x4, w4, y4 = (as_4d(t, problem) for t in (x, w, y))
    r, s, *steps = geometry(problem)
    h, wd, p, q = sizes(problem)
    total = problem.n * p * q
    launch(for_layout(_forward, problem), (cdiv(total, tile.positions), channel_tiles(problem, tile)),
           x4, w4, y4, total, p, q, h, wd, problem.k, *x4.stride(), *w4.stride(), *y4.stride(), *steps,
           CH=problem.c, R=r, S=s, TF32=tf32(problem), BLOCK_M=tile.positions, BLOCK_N=tile.channels,
           BLOCK_K=fold_block(_folded(problem)), num_warps=tile.warps)


def backward_filter(problem: ConvProblem, tile: GemmTile, x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor,
                    partials: torch.Tensor) -> None:
    """dw = the gradient of the weight from x and dy, into ``dw`` (dense in its layout), through ``partials``
    (float32, (parts, dw.numel()): one partial sum per run of ``tile.chunk`` output positions)."""
    x4, dy4, dw4 = (as_4d(t, problem) for t in (x, dy, dw))
    r, s, *steps = geometry(problem)
    h, wd, p, q = sizes(problem)
    parts, size = partials.shape
    block = fold_block(_folded(problem))
    fold_tiles = cdiv(_folded(problem), block)
    stepped = q >= tile.positions  # the kernel's one carry a turn holds only where a turn's positions fit in a row
    launch(for_layout(_backward_filter_partials, problem), (parts * fold_tiles, channel_tiles(problem, tile)),
           x4, dy4, partials, problem.n * p * q, tile.chunk, p, q, h, wd, problem.k, size, *x4.stride(),
           *dy4.stride(), *dw4.stride(), *steps, CH=problem.c, R=r, S=s, TF32=tf32(problem), FOLD_TILES=fold_tiles,
           BLOCK_P=tile.positions, BLOCK_N=tile.channels, BLOCK_K=block, STEPPED=stepped,
           num_warps=tile.warps)
    sum_partials(partials, dw)
