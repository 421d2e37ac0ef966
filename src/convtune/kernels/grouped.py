"""Grouped convolution kernels (2 to 64 input channels per group), 1-D and 2-D, in Triton: an implicit
GEMM per group on the tensor cores.

A group's convolution is a matrix product once each kernel tap's input is gathered: for the forward,
positions × (taps, channels of the group) times (taps, channels) × output channels of the group. The
kernels never write that matrix out: a program gathers a tile of it per tap straight from the input
(zeros where a tap reads padding) and multiplies it with the tap's weights (``tl.dot``), summing in
float32. The tensor cores take 16 lanes at least: groups narrower than a tile are packed into it whole (4
groups of 4 channels in a tile of 16), their weights a block-diagonal matrix (zero where an input channel
is of another group than the output channel), so that a tile's lanes hold channels of several groups rather
than padding; a group wider than a tile takes several.

- ``forward``: programs over (output positions) × (tiles of output channels: whole groups, or part of one).
- ``backward_data``: the same over input positions and tiles of input channels; a tap contributes where the
  output position it maps to is whole (divisible by the stride) and inside the output.
- ``backward_filter``: per tap, dW = dy^T · x over the positions for a tile of output channels and the
  input channels of their groups (keeping the block diagonal), summed in runs of positions into float32
  partials laid out like the gradient, which ``kernels.shared``'s second kernel adds in a fixed order
  (deterministic, no atomics).

Operands are 4-D (N, C, H, W) views with their own strides (a 1-D problem has H = 1), so one kernel
serves both layouts. float32 operands use TF32 exactly when the problem allows it. Offsets are
32-bit: the algorithms refuse operands of 2**31 elements or more.
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
    gradient_source,
    kernel,
    next_power_of_2,
    positions,
    run_positions,
    sizes,
    sum_partials,
    tf32,
)


def _lanes(channels: int) -> int:
    """A tile dimension that holds ``channels``: a power of two, 16 at least (``tl.dot``), 64 at most."""
    return min(64, max(16, next_power_of_2(channels)))


@triton.jit
def _packed_tile(count, WIDTH: tl.constexpr, OTHER: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's BLOCK_N channels (the second grid axis runs over the tiles) of an operand with ``count``
    channels in groups of WIDTH: GROUPS whole groups where a group is narrower than the tile, else (GROUPS = 1)
    one tile of a group. Returns the channels, which exist, and the first channel that the same groups have in
    the other operand (OTHER a group)."""
    blocks: tl.constexpr = (WIDTH + BLOCK_N - 1) // BLOCK_N  # the tiles a group takes (1 where it fits in one)
    first_group = (tl.program_id(1) // blocks) * GROUPS
    local = (tl.program_id(1) % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    channel = first_group * WIDTH + local
    return channel, (local < GROUPS * WIDTH) & (channel < count), first_group * OTHER


@kernel()
def _forward(x, w, y, total, P, Q, H, W, C, K,
             sxn, sxc, sxh, sxw, swk, swc, swr, sws, syn, syk, syp, syq,
             stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
             CG: tl.constexpr, KG: tl.constexpr, GROUPS: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
             TF32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    pos_ok, n, p, q = positions(total, P, Q, BLOCK_M)
    k, k_ok, c_first = _packed_tile(K, KG, CG, GROUPS, BLOCK_N)  # output channels; their groups' first input
    c_span: tl.constexpr = GROUPS * CG
    group_start = (k // KG) * CG  # each output channel's group's first input channel
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(R):
        h = p * stride_h - pad_h + r * dil_h
        for s in range(S):
            wi = q * stride_w - pad_w + s * dil_w
            ok = pos_ok & (h >= 0) & (h < H) & (wi >= 0) & (wi < W)
            rows = x + (n * sxn + h * sxh + wi * sxw)[:, None]
            for c0 in tl.static_range(0, c_span, BLOCK_C):
                c = c_first + c0 + tl.arange(0, BLOCK_C)
                c_ok = (c0 + tl.arange(0, BLOCK_C) < c_span) & (c < C)
                a = tl.load(rows + c[None, :] * sxc, mask=ok[:, None] & c_ok[None, :], other=0.0)
                within = c[:, None] - group_start[None, :]  # the input channel's place in the output's group
                b = tl.load(w + k[None, :] * swk + within * swc + r * swr + s * sws,
                            mask=c_ok[:, None] & k_ok[None, :] & (within >= 0) & (within < CG), other=0.0)
                acc = tl.dot(a, b, acc, input_precision="tf32" if TF32 else "ieee")
    offsets = (n * syn + p * syp + q * syq)[:, None] + k[None, :] * syk
    tl.store(y + offsets, acc.to(y.dtype.element_ty), mask=pos_ok[:, None] & k_ok[None, :])


@kernel()
def _backward_data(dy, w, dx, total, H, W, P, Q, K, C,
                   sdn, sdk, sdp, sdq, swk, swc, swr, sws, sxn, sxc, sxh, sxw,
                   stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                   CG: tl.constexpr, KG: tl.constexpr, GROUPS: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
                   TF32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    pos_ok, n, h, wi = positions(total, H, W, BLOCK_M)
    c, c_ok, k_first = _packed_tile(C, CG, KG, GROUPS, BLOCK_N)  # input channels; their groups' first output
    k_span: tl.constexpr = GROUPS * KG
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(R):
        p, p_ok = gradient_source(h, pad_h, r, dil_h, stride_h, P)
        for s in range(S):
            q, q_ok = gradient_source(wi, pad_w, s, dil_w, stride_w, Q)
            ok = pos_ok & p_ok & q_ok
            rows = dy + (n * sdn + p * sdp + q * sdq)[:, None]
            for j0 in tl.static_range(0, k_span, BLOCK_C):
                j = k_first + j0 + tl.arange(0, BLOCK_C)
                j_ok = (j0 + tl.arange(0, BLOCK_C) < k_span) & (j < K)
                a = tl.load(rows + j[None, :] * sdk, mask=ok[:, None] & j_ok[None, :], other=0.0)
                within = c[None, :] - ((j // KG) * CG)[:, None]  # the input channel's place in the output's group
                b = tl.load(w + j[:, None] * swk + within * swc + r * swr + s * sws,
                            mask=j_ok[:, None] & c_ok[None, :] & (within >= 0) & (within < CG), other=0.0)
                acc = tl.dot(a, b, acc, input_precision="tf32" if TF32 else "ieee")
    offsets = (n * sxn + h * sxh + wi * sxw)[:, None] + c[None, :] * sxc
    tl.store(dx + offsets, acc.to(dx.dtype.element_ty), mask=pos_ok[:, None] & c_ok[None, :])


@kernel()
def _backward_filter_partials(x, dy, partials, total, chunk, P, Q, H, W, C, K, size,
                              sxn, sxc, sxh, sxw, sdn, sdk, sdp, sdq, swk, swc, swr, sws,
                              stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                              CG: tl.constexpr, KG: tl.constexpr, GROUPS: tl.constexpr, R: tl.constexpr,
                              S: tl.constexpr, TF32: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_J: tl.constexpr,
                              BLOCK_C: tl.constexpr):
    # One program: one tap, a run of ``chunk`` positions, a tile of output channels and every input channel of
    # their groups, in tiles; its partial sums land where the gradient's elements lie (size apart per run).
    part = tl.program_id(0)  # the first grid axis: it has room for 2**31 - 1 runs (the others 65535)
    tap = tl.program_id(2)
    r = tap // S
    s = tap % S
    j, j_ok, c_first = _packed_tile(K, KG, CG, GROUPS, BLOCK_J)
    c_span: tl.constexpr = GROUPS * CG
    group_start = (j // KG) * CG
    start = part * chunk
    stop = tl.minimum(start + chunk, total)
    for c0 in tl.static_range(0, c_span, BLOCK_C):
        c = c_first + c0 + tl.arange(0, BLOCK_C)
        c_ok = (c0 + tl.arange(0, BLOCK_C) < c_span) & (c < C)
        acc = tl.zeros((BLOCK_J, BLOCK_C), dtype=tl.float32)
        for first in range(start, stop, BLOCK_P):
            pos_ok, n, p, q = run_positions(first, stop, P, Q, BLOCK_P)
            h = p * stride_h - pad_h + r * dil_h
            wi = q * stride_w - pad_w + s * dil_w
            ok = pos_ok & (h >= 0) & (h < H) & (wi >= 0) & (wi < W)
            grad = tl.load(dy + (n * sdn + p * sdp + q * sdq)[None, :] + j[:, None] * sdk,
                           mask=j_ok[:, None] & pos_ok[None, :], other=0.0)
            inp = tl.load(x + (n * sxn + h * sxh + wi * sxw)[:, None] + c[None, :] * sxc,
                          mask=ok[:, None] & c_ok[None, :], other=0.0)
            acc = tl.dot(grad, inp, acc, input_precision="tf32" if TF32 else "ieee")
        within = c[None, :] - group_start[:, None]  # the block diagonal: input channels of the output's group
        offsets = j[:, None] * swk + within * swc + r * swr + s * sws
        tl.store(partials + part * size + offsets, acc,
                 mask=j_ok[:, None] & c_ok[None, :] & (within >= 0) & (within < CG))


# -- launches ---------------------------------------------------------------------------------
def _packing(problem: ConvProblem, block: int, width: int) -> tuple[int, int]:
    """(groups a tile of ``block`` channels holds, programs along the second grid axis) over groups of ``width``
    (``_packed_tile``)."""
    groups = max(block // width, 1)
    return groups, cdiv(problem.groups, groups) * cdiv(width, block)


def grid_axes(problem: ConvProblem, tile: GemmTile) -> tuple[int, int]:
    """Programs along the second and third axes of the launch grid of ``problem``'s direction (CUDA holds 65535 on
    each): tiles of channels (``_packing``, as the launches below take them), and the weight gradient's taps."""
    cg, kg = problem.c // problem.groups, problem.k // problem.groups
    if problem.direction == "bwd_filter":
        r, s = geometry(problem)[:2]
        return _packing(problem, _lanes(kg), kg)[1], r * s
    width = kg if problem.direction == "fwd" else cg
    return _packing(problem, min(tile.channels, _lanes(width)), width)[1], 1


def _direct(kernel, problem: ConvProblem, tile: GemmTile, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
            computed: tuple[int, int], read: tuple[int, int], channels: int, summed: int) -> None:
    """Launch ``_forward`` or ``_backward_data``: programs over tiles of (positions of ``out``, whose spatial
    size is ``computed``, × ``out``'s channels, ``channels`` a group), each summing over ``summed`` channels a group
    of ``a`` per tap."""
    a4, w4, out4 = (as_4d(t, problem) for t in (a, w, out))
    r, s, *steps = geometry(problem)
    total = problem.n * computed[0] * computed[1]
    block = min(tile.channels, _lanes(channels))
    groups, tiles = _packing(problem, block, channels)
    grid = (cdiv(total, tile.positions), tiles)
    cg, kg = problem.c // problem.groups, problem.k // problem.groups
    kernel = for_layout(kernel, problem)
    launch(kernel, grid, a4, w4, out4, total, *computed, *read, summed * problem.groups, channels * problem.groups,
           *a4.stride(), *w4.stride(), *out4.stride(), *steps, CG=cg, KG=kg, GROUPS=groups,
           R=r, S=s, TF32=tf32(problem), BLOCK_M=tile.positions, BLOCK_N=block,
           BLOCK_C=_lanes(groups * summed), num_warps=tile.warps)


def forward(problem: ConvProblem, tile: GemmTile, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """y = the grouped convolution of x with w, into ``y``."""
    h, wd, p, q = sizes(problem)
    cg, kg = problem.c // problem.groups, problem.k // problem.groups
    _direct(_forward, problem, tile, x, w, y, (p, q), (h, wd), kg, cg)


def backward_data(problem: ConvProblem, tile: GemmTile, dy: torch.Tensor, w: torch.Tensor, dx: torch.Tensor) -> None:
    """dx = the gradient of the input from dy and w, into ``dx``."""
    h, wd, p, q = sizes(problem)
    cg, kg = problem.c // problem.groups, problem.k // problem.groups
    _direct(_backward_data, problem, tile, dy, w, dx, (h, wd), (p, q), cg, kg)


def backward_filter(problem: ConvProblem, tile: GemmTile, x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor,
                    partials: torch.Tensor) -> None:
    """dw = the gradient of the weight from x and dy, into ``dw`` (dense in its layout), through ``partials``
    (float32, (parts, dw.numel()): one partial sum per run of ``tile.chunk`` output positions)."""
    x4, dy4, dw4 = (as_4d(t, problem) for t in (x, dy, dw))
    h, wd, p, q = sizes(problem)
    cg, kg = problem.c // problem.groups, problem.k // problem.groups
    r, s, *steps = geometry(problem)
    total = problem.n * p * q
    parts, size = partials.shape
    block = _lanes(kg)
    groups, tiles = _packing(problem, block, kg)
    launch(for_layout(_backward_filter_partials, problem), (parts, tiles, r * s),
           x4, dy4, partials, total, tile.chunk, p, q, h, wd, problem.c, problem.k, size, *x4.stride(), *dy4.stride(),
           *dw4.stride(), *steps, CG=cg, KG=kg, GROUPS=groups, R=r, S=s, TF32=tf32(problem), BLOCK_P=tile.positions,
           BLOCK_J=block, BLOCK_C=_lanes(groups * cg), num_warps=tile.warps)
    sum_partials(partials, dw)
