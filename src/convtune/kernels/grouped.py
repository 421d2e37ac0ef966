"""Grouped convolution kernels (2 to 64 input channels per group), 1-D and 2-D, in Triton: an implicit
GEMM per group on the tensor cores.

A group's convolution is a matrix product once each kernel tap's input is gathered: for the forward,
positions × (taps, channels of the group) times (taps, channels) × output channels of the group. The
kernels never write that matrix out: a program gathers a tile of it per tap straight from the input
(zeros where a tap reads padding) and multiplies it with the tap's weights (``tl.dot``), summing in
float32. A group narrower than the tensor cores' 16 lanes is padded with masked lanes.

- ``forward``: programs over (output positions) × (group, output channels of the group).
- ``backward_data``: the same over input positions; a tap contributes where the output position it
  maps to is whole (divisible by the stride) and inside the output.
- ``backward_filter``: per tap, dW = dy^T · x over the positions, summed in runs of positions into
  float32 partials laid out like the gradient, which ``kernels.depthwise``'s second kernel adds in a
  fixed order (deterministic, no atomics).

Operands are 4-D (N, C, H, W) views with their own strides (a 1-D problem has H = 1), so one kernel
serves both layouts. float32 operands use TF32 exactly when the problem allows it. Offsets are
32-bit: the algorithms refuse operands of 2**31 elements or more.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..problem import ConvProblem
from .recording import launch
from .shared import as_4d, geometry, gradient_source, positions, sizes, sum_partials


@dataclasses.dataclass(frozen=True)
class GemmTile:
    """One configuration: positions per program, output (or, for the data gradient, input) channels per
    program, warps, and (weight gradient) positions per partial sum."""

    positions: int
    channels: int
    warps: int = 4
    chunk: int = 0


def _lanes(channels: int) -> int:
    """A tile dimension that holds ``channels``: a power of two, 16 at least (``tl.dot``), 64 at most."""
    return min(64, max(16, triton.next_power_of_2(channels)))


@triton.jit
def _group_tile(channels, BLOCK_N: tl.constexpr):
    """This program's group and tile of its ``channels`` (the second grid axis runs over both), and which exist."""
    blocks = tl.cdiv(channels, BLOCK_N)
    index = (tl.program_id(1) % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.program_id(1) // blocks, index, index < channels


@triton.jit
def _forward(x, w, y, total, P, Q, H, W, CG, KG,
             sxn, sxc, sxh, sxw, swk, swc, swr, sws, syn, syk, syp, syq,
             stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
             R: tl.constexpr, S: tl.constexpr, TF32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_C: tl.constexpr):
    pos_ok, n, p, q = positions(total, P, Q, BLOCK_M)
    g, j, j_ok = _group_tile(KG, BLOCK_N)  # output channels of the group
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(R):
        h = p * stride_h - pad_h + r * dil_h
        for s in range(S):
            wi = q * stride_w - pad_w + s * dil_w
            ok = pos_ok & (h >= 0) & (h < H) & (wi >= 0) & (wi < W)
            rows = x + (n * sxn + h * sxh + wi * sxw)[:, None] + g * CG * sxc
            for c0 in range(0, CG, BLOCK_C):
                c = c0 + tl.arange(0, BLOCK_C)
                c_ok = c < CG
                a = tl.load(rows + c[None, :] * sxc, mask=ok[:, None] & c_ok[None, :], other=0.0)
                b = tl.load(w + (g * KG + j)[None, :] * swk + c[:, None] * swc + r * swr + s * sws,
                            mask=c_ok[:, None] & j_ok[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision="tf32" if TF32 else "ieee")
    offsets = (n * syn + p * syp + q * syq)[:, None] + (g * KG + j)[None, :] * syk
    tl.store(y + offsets, acc.to(y.dtype.element_ty), mask=pos_ok[:, None] & j_ok[None, :])


@triton.jit
def _backward_data(dy, w, dx, total, H, W, P, Q, CG, KG,
                   sdn, sdk, sdp, sdq, swk, swc, swr, sws, sxn, sxc, sxh, sxw,
                   stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                   R: tl.constexpr, S: tl.constexpr, TF32: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    pos_ok, n, h, wi = positions(total, H, W, BLOCK_M)
    g, c, c_ok = _group_tile(CG, BLOCK_N)  # input channels of the group
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(R):
        p, p_ok = gradient_source(h, pad_h, r, dil_h, stride_h, P)
        for s in range(S):
            q, q_ok = gradient_source(wi, pad_w, s, dil_w, stride_w, Q)
            ok = pos_ok & p_ok & q_ok
            rows = dy + (n * sdn + p * sdp + q * sdq)[:, None] + g * KG * sdk
            for j0 in range(0, KG, BLOCK_C):
                j = j0 + tl.arange(0, BLOCK_C)  # output channels of the group: the sum
                j_ok = j < KG
                a = tl.load(rows + j[None, :] * sdk, mask=ok[:, None] & j_ok[None, :], other=0.0)
                b = tl.load(w + (g * KG + j)[:, None] * swk + c[None, :] * swc + r * swr + s * sws,
                            mask=j_ok[:, None] & c_ok[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision="tf32" if TF32 else "ieee")
    offsets = (n * sxn + h * sxh + wi * sxw)[:, None] + (g * CG + c)[None, :] * sxc
    tl.store(dx + offsets, acc.to(dx.dtype.element_ty), mask=pos_ok[:, None] & c_ok[None, :])


@triton.jit
def _backward_filter_partials(x, dy, partials, total, chunk, P, Q, H, W, CG, KG, size,
                              sxn, sxc, sxh, sxw, sdn, sdk, sdp, sdq, swk, swc, swr, sws,
                              stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                              R: tl.constexpr, S: tl.constexpr, TF32: tl.constexpr, BLOCK_P: tl.constexpr,
                              BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr):
    # One program: one group and tap, a run of ``chunk`` positions, all of the group's (output, input)
    # channel pairs in tiles; its partial sum lands where the gradient's element lies (size apart per run).
    part = tl.program_id(0)  # the first grid axis: it has room for 2**31 - 1 runs (the others 65535)
    g = tl.program_id(1)
    tap = tl.program_id(2)
    r = tap // S
    s = tap % S
    start = part * chunk
    stop = tl.minimum(start + chunk, total)
    for j0 in range(0, KG, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_ok = j < KG
        for c0 in range(0, CG, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_ok = c < CG
            acc = tl.zeros((BLOCK_J, BLOCK_C), dtype=tl.float32)
            for first in range(start, stop, BLOCK_P):
                pos = first + tl.arange(0, BLOCK_P)
                pos_ok = pos < stop
                q = pos % Q
                p = (pos // Q) % P
                n = pos // (P * Q)
                h = p * stride_h - pad_h + r * dil_h
                wi = q * stride_w - pad_w + s * dil_w
                ok = pos_ok & (h >= 0) & (h < H) & (wi >= 0) & (wi < W)
                grad = tl.load(dy + (n * sdn + p * sdp + q * sdq)[None, :] + (g * KG + j)[:, None] * sdk,
                               mask=j_ok[:, None] & pos_ok[None, :], other=0.0)
                inp = tl.load(x + (n * sxn + h * sxh + wi * sxw)[:, None] + (g * CG + c)[None, :] * sxc,
                              mask=ok[:, None] & c_ok[None, :], other=0.0)
                acc = tl.dot(grad, inp, acc, input_precision="tf32" if TF32 else "ieee")
            offsets = (g * KG + j)[:, None] * swk + c[None, :] * swc + r * swr + s * sws
            tl.store(partials + part * size + offsets, acc, mask=j_ok[:, None] & c_ok[None, :])


# -- launches ---------------------------------------------------------------------------------
def _tf32(problem: ConvProblem) -> bool:
    """Whether the products may round float32 to TF32 (the half dtypes are not affected by the switch)."""
    return problem.dtype != "float32" or problem.allow_tf32


def _group_tiles(problem: ConvProblem, tile: GemmTile, channels: int) -> int:
    """Programs along the second grid axis: every group times the tiles of its ``channels``."""
    return problem.groups * triton.cdiv(channels, min(tile.channels, _lanes(channels)))


def _direct(kernel, problem: ConvProblem, tile: GemmTile, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
            computed: tuple[int, int], read: tuple[int, int], channels: int, summed: int) -> None:
    """Launch ``_forward`` or ``_backward_data``: programs over tiles of (positions of ``out``, whose spatial
    size is ``computed``, × a group's ``channels`` of it), each summing over ``summed`` channels per tap."""
    a4, w4, out4 = (as_4d(t, problem) for t in (a, w, out))
    r, s, *steps = geometry(problem)
    total = problem.n * computed[0] * computed[1]
    grid = (triton.cdiv(total, tile.positions), _group_tiles(problem, tile, channels))
    cg, kg = problem.c // problem.groups, problem.k // problem.groups
    launch(kernel, grid, a4, w4, out4, total, *computed, *read, cg, kg, *a4.stride(), *w4.stride(), *out4.stride(),
           *steps,
           R=r, S=s, TF32=_tf32(problem), BLOCK_M=tile.positions, BLOCK_N=min(tile.channels, _lanes(channels)),
           BLOCK_C=_lanes(summed), num_warps=tile.warps)


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
    launch(_backward_filter_partials, (parts, problem.groups, r * s),
           x4, dy4, partials, total, tile.chunk, p, q, h, wd, cg, kg, size, *x4.stride(), *dy4.stride(),
           *dw4.stride(), *steps, R=r, S=s, TF32=_tf32(problem), BLOCK_P=tile.positions, BLOCK_J=_lanes(kg),
           BLOCK_C=_lanes(cg), num_warps=tile.warps)
    sum_partials(partials, dw)
