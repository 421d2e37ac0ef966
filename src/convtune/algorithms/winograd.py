"""winograd:f2x3 and winograd:f4x3: Winograd's minimal filtering F(m x m, 3 x 3) (Lavin and Gray, 2016).

Each output tile of m outputs per dimension is computed from an input tile of alpha = m + 2
values by Y = A^T [ (G g) * (B^T d) ] (1-D; in d dimensions the Kronecker products of the 1-D
matrices act on the flattened tiles). The element-wise products over all tiles and channels
are alpha^d batched GEMMs. One code path per direction:

    fwd         V = Kron(B^T) @ tiles(x);  U = Kron(G) @ w;  M = U @ V;  y = scatter(Kron(A^T) @ M)
    bwd_data    Mt = Kron(A^T)^T @ tiles(dy);  dV = U^T @ Mt;  dx = scatter-add(Kron(B^T)^T @ dV)
    bwd_filter  V as fwd, Mt as bwd_data;  dU = Mt @ V^T;  dw = Kron(G)^T @ dU

bwd_data and bwd_filter are the adjoints (transposes) of the forward linear maps, so one set of
matrices serves all three. Kernel 3 in every spatial dimension, stride 1, dilation 1, any
padding; 1-D, 2-D and 3-D. Tiles are gathered with strided slice copies (tile t reads input
t·m + i - p), so no padded copy of the input is made; the last tile may be partial.

Arithmetic is float32 for every dtype: F(4x4, 3x3)'s transforms amplify rounding errors (the
points ±2 give entries up to 8 in A and 5 in B), which half precision cannot absorb.

    >>> B_T, G, A_T = transforms(2)
    >>> d, g = torch.tensor([1., 2., 3., 4.], dtype=torch.float64), torch.tensor([1., 0., -1.], dtype=torch.float64)
    >>> (A_T @ ((G @ g) * (B_T @ d))).tolist()  # correlation: d[i] - d[i + 2]
    [-2.0, -2.0]
"""

from __future__ import annotations

import functools
import math
from typing import cast

import torch

from .. import tf32
from ..costmodel import Cost, shape_factor
from ..problem import ConvProblem
from .base import SUPPORTED, Algorithm, Buffer, NumericNotes, Support, unsupported
from .registry import register
from .taps import TapSlice, TensorIndex, tap_slices

# Lavin and Gray's matrices: F(2, 3) on the points 0, 1, -1, inf; F(4, 3) on 0, 1, -1, 2, -2, inf.
_MATRICES = {
    2: (
        [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        [[1, 0, 0], [1 / 2, 1 / 2, 1 / 2], [1 / 2, -1 / 2, 1 / 2], [0, 0, 1]],
        [[1, 1, 1, 0], [0, 1, -1, -1]],
    ),
    4: (
        [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
         [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]],
        [[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
         [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]],
        [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
    ),
}
KERNEL = 3


def transforms(m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B^T, G, A^T) of F(m, 3) in float64: (alpha, alpha), (alpha, 3), (m, alpha)."""
    # _MATRICES holds three matrices per m
    return cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                tuple(torch.tensor(rows, dtype=torch.float64) for rows in _MATRICES[m]))


@functools.lru_cache(maxsize=16)
def kron_transforms(m: int, ndim: int, pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The d-dimensional (Kron(B^T), Kron(G), Kron(A^T)), float32 on the CPU, for row-major tiles.

    Built in float64 and rounded once, so 1/6 and 1/24 carry a single rounding error. ``pinned``:
    in page-locked memory, so copies to a GPU are asynchronous.
    """
    def kron(matrix: torch.Tensor) -> torch.Tensor:
        result = matrix
        for _ in range(ndim - 1):
            result = torch.kron(result, matrix)
        return result.to(torch.float32)

    matrices = tuple(kron(matrix) for matrix in transforms(m))
    # three matrices, as transforms gives them
    return cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                tuple(matrix.pin_memory() for matrix in matrices) if pinned else matrices)


@functools.lru_cache(maxsize=1024)
def _tiles(problem: ConvProblem, m: int) -> tuple[int, ...]:
    """Tiles per spatial dimension: enough m-wide tiles to cover the output."""
    return tuple(-(-p // m) for p in problem.output_size)


def _input_tiles(problem: ConvProblem, m: int) -> tuple[TapSlice, ...]:
    """For each in-tile offset e: the tiles whose input t·m + e - p lies inside x, and those inputs."""
    nd = problem.ndim
    return tap_slices(problem.input_size, _tiles(problem, m), (m + 2,) * nd, (m,) * nd, problem.padding, (1,) * nd)


def _output_tiles(problem: ConvProblem, m: int) -> tuple[TapSlice, ...]:
    """For each in-tile offset j: the tiles whose output t·m + j exists, and those outputs."""
    nd = problem.ndim
    return tap_slices(problem.output_size, _tiles(problem, m), (m,) * nd, (m,) * nd, (0,) * nd, (1,) * nd)


class Winograd(Algorithm):
    """F(m^d, 3^d) Winograd convolution; subclasses fix the output tile size ``m``."""

    m: int = 0

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        p, m = problem, self.m
        t, d = m + KERNEL - 1, p.ndim
        tiles = math.prod(-(-o // m) for o in p.output_size)
        cg, kg = p.c // p.groups, p.k // p.groups
        # t^d products per tile instead of m^d·r^d: the multiplications Winograd saves.
        products = 2.0 * p.n * p.k * cg * tiles * t**d
        transforms = 2.0 * d * (p.n * p.c * tiles * t ** (d + 1) + p.n * p.k * tiles * t**d * m
                                + p.k * cg * t ** (d + 1))
        # Tiles are gathered and scattered with a few strided copies per position in the tile.
        return Cost(products, 0.6 * shape_factor(p.n * tiles, kg, cg), p.min_bytes + 2 * workspace_bytes,
                    8 * t**d + 10, extra_flops=transforms, float32_inside=True)

    def _supports(self, problem: ConvProblem) -> Support:
        if any(r != KERNEL for r in problem.kernel_size):
            return unsupported(f"kernel_size={problem.kernel_size}: {self.name} computes 3-wide kernels only")
        if any(s != 1 for s in problem.stride):
            return unsupported(f"stride={problem.stride}: {self.name} computes stride-1 convolutions only")
        if any(d != 1 for d in problem.dilation):
            return unsupported(f"dilation={problem.dilation}: {self.name} computes undilated convolutions only")
        return SUPPORTED

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return NumericNotes(float32_inside=problem.dtype != "float32")

    def tf32_settings(self, problem: ConvProblem) -> tf32.Settings:
        return tf32.Settings(matmul=False)  # (its products stand in for exact float32 arithmetic)

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        nd, m = problem.ndim, self.m
        alpha, taps, outs = (m + 2) ** nd, KERNEL ** nd, m ** nd
        tiles = problem.n * math.prod(_tiles(problem, m))
        c, k, cg = problem.c, problem.k, problem.c // problem.groups
        # The stage buffers hold, in turn: fwd: 0 tiles(x) then M, 1 V then Y. bwd_data: 0 tiles(dy),
        # dV, then the float32 sum of dx; 1 Mt then dD. bwd_filter: 0 tiles(x) then tiles(dy), 1 Mt, 2 V.
        big = {
            "fwd": [max(alpha * c, alpha * k) * tiles, max(alpha * c, outs * k) * tiles],
            # (alpha·tiles >= the input in every dimension, so the dx sum always fits; kept explicit)
            "bwd_data": [max(outs * k * tiles, alpha * c * tiles, c * problem.n * math.prod(problem.input_size)),
                         max(alpha * k, alpha * c) * tiles],
            "bwd_filter": [max(alpha * c, outs * k) * tiles, alpha * k * tiles, alpha * c * tiles],
        }[problem.direction]
        f32 = torch.float32
        return [
            Buffer("kron_b", (alpha, alpha), f32),
            Buffer("kron_g", (alpha, taps), f32),
            Buffer("kron_a", (outs, alpha), f32),
            Buffer("filter_taps", (taps, k, cg), f32),
            Buffer("filter_wino", (alpha, k, cg), f32),
            *(Buffer(f"stage_{i}", (size,), f32) for i, size in enumerate(big)),
        ]

    def _run(self, problem, a, b, out, ws) -> None:
        # The transform matrices live in the workspace too: nothing is allocated on the device.
        pinned = problem.device == "cuda"
        for name, matrix in zip(("kron_b", "kron_g", "kron_a"), kron_transforms(self.m, problem.ndim, pinned)):
            ws[name].copy_(matrix, non_blocking=pinned)
        runner = {"fwd": _forward, "bwd_data": _backward_data, "bwd_filter": _backward_filter}[problem.direction]
        with self.tf32_settings(problem).switched(problem.device):
            runner(problem, self.m, a, b, out, ws)


class WinogradF2x3(Winograd):
    """F(2x2, 3x3): 16 products per 4 outputs (2.25x fewer than direct), small transforms."""

    name = "winograd:f2x3"
    m = 2


class WinogradF4x3(Winograd):
    """F(4x4, 3x3): 36 products per 16 outputs (4x fewer than direct), larger rounding errors.

    Measured in float32 on 3x3 layers with 256 channels: relative error 2-3e-6 in every
    direction (F(2x2, 3x3) and PyTorch's own: 3e-7 to 3e-6), well inside verify's 1e-4.
    """

    name = "winograd:f4x3"
    m = 4


# -- the three directions ---------------------------------------------------------------------------
# Tiles are stored (count, groups, N, *tiles, channels/groups), channels innermost: the gathers
# then copy runs of channels (measured faster on the CPU for both layouts), and each (count,
# group) block is a (N·tiles, channels) matrix, so the element-wise stage is a plain bmm.

def _stage(ws: dict[str, torch.Tensor], index: int, *shape: int) -> torch.Tensor:
    return ws[f"stage_{index}"][: math.prod(shape)].view(shape)


def _tile_stage(ws, index: int, problem: ConvProblem, m: int, count: int, channels: int) -> torch.Tensor:
    """Stage ``index`` viewed as tiles (count, groups, N, *tiles, channels/groups)."""
    g = problem.groups
    return _stage(ws, index, count, g, problem.n, *_tiles(problem, m), channels // g)


def _matrices(tiles: torch.Tensor) -> torch.Tensor:
    """Tiles (count, g, N, *T, cpg) as the GEMM batch (count·g, N·T, cpg)."""
    return tiles.view(tiles.shape[0] * tiles.shape[1], -1, tiles.shape[-1])


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(N, C, *S) -> the view (groups, C/groups, N, *S) that tiles index into."""
    return t.unflatten(1, (groups, t.shape[1] // groups)).movedim(0, 2)


def _flat_index(tap: tuple[int, ...], width: int) -> int:
    index = 0
    for i in tap:
        index = index * width + i
    return index


def _gather(tiles: torch.Tensor, source: torch.Tensor, slices: tuple[TapSlice, ...], width: int) -> None:
    """tiles[e] <- ``source`` (N, C, *S) at the positions each in-tile offset e reads; the rest zero."""
    tiles.zero_()
    view, src = tiles.movedim(-1, 2), _grouped(source, tiles.shape[1])
    for s in slices:
        view[_flat_index(s.tap, width)][cast(TensorIndex, (..., *s.out))].copy_(src[cast(TensorIndex, (..., *s.inp))])


def _filter_transform(problem: ConvProblem, w: torch.Tensor, ws) -> torch.Tensor:
    """U = Kron(G) @ the filter taps, as the GEMM batch (alpha^d·g, K/g, C/g)."""
    nd, g = problem.ndim, problem.groups
    taps = ws["filter_taps"]
    taps.view(*problem.kernel_size, *taps.shape[1:]).copy_(w.permute(*range(2, 2 + nd), 0, 1))
    u = ws["filter_wino"]
    torch.mm(ws["kron_g"], taps.view(taps.shape[0], -1), out=u.view(u.shape[0], -1))
    return u.view(-1, problem.k // g, problem.c // g)


def _forward(problem, m, x, w, y, ws) -> None:
    alpha, outs = (m + 2) ** problem.ndim, m ** problem.ndim
    tiles = _tile_stage(ws, 0, problem, m, alpha, problem.c)
    _gather(tiles, x, _input_tiles(problem, m), m + 2)
    v = _tile_stage(ws, 1, problem, m, alpha, problem.c)
    torch.mm(ws["kron_b"], tiles.view(alpha, -1), out=v.view(alpha, -1))
    u = _filter_transform(problem, w, ws)
    product = _tile_stage(ws, 0, problem, m, alpha, problem.k)  # the tiles are spent: V holds them
    torch.bmm(_matrices(v), u.mT, out=_matrices(product))  # M^T = V^T U^T, per (point, group)
    result = _tile_stage(ws, 1, problem, m, outs, problem.k)
    torch.mm(ws["kron_a"], product.view(alpha, -1), out=result.view(outs, -1))
    view, target = result.movedim(-1, 2), _grouped(y, problem.groups)
    for s in _output_tiles(problem, m):
        target[cast(TensorIndex, (..., *s.inp))].copy_(view[_flat_index(s.tap, m)][cast(TensorIndex, (..., *s.out))])


def _backward_data(problem, m, dy, w, dx, ws) -> None:
    nd, g = problem.ndim, problem.groups
    alpha, outs = (m + 2) ** nd, m ** nd
    grads = _tile_stage(ws, 0, problem, m, outs, problem.k)
    _gather(grads, dy, _output_tiles(problem, m), m)
    mt = _tile_stage(ws, 1, problem, m, alpha, problem.k)
    torch.mm(ws["kron_a"].mT, grads.view(outs, -1), out=mt.view(alpha, -1))
    u = _filter_transform(problem, w, ws)
    dv = _tile_stage(ws, 0, problem, m, alpha, problem.c)
    torch.bmm(_matrices(mt), u, out=_matrices(dv))  # dV^T = Mt^T U
    dd = _tile_stage(ws, 1, problem, m, alpha, problem.c)
    torch.mm(ws["kron_b"].mT, dv.view(alpha, -1), out=dd.view(alpha, -1))
    # Overlapping tiles add up; half outputs get a float32 sum (channels innermost, like the
    # tiles), rounded once at the end.
    target = _grouped(dx, g)
    if dx.dtype == torch.float32:
        total = target
    else:
        stored = _stage(ws, 0, problem.n, *problem.input_size, g, problem.c // g)
        total = stored.permute(nd + 1, nd + 2, 0, *range(1, nd + 1))
    total.zero_()
    view = dd.movedim(-1, 2)
    for s in _input_tiles(problem, m):
        total[cast(TensorIndex, (..., *s.inp))].add_(
            view[_flat_index(s.tap, m + 2)][cast(TensorIndex, (..., *s.out))])
    if total is not target:
        target.copy_(total)


def _backward_filter(problem, m, x, dy, dw, ws) -> None:
    nd = problem.ndim
    alpha, outs = (m + 2) ** nd, m ** nd
    tiles = _tile_stage(ws, 0, problem, m, alpha, problem.c)
    _gather(tiles, x, _input_tiles(problem, m), m + 2)
    v = _tile_stage(ws, 2, problem, m, alpha, problem.c)
    torch.mm(ws["kron_b"], tiles.view(alpha, -1), out=v.view(alpha, -1))
    grads = _tile_stage(ws, 0, problem, m, outs, problem.k)
    _gather(grads, dy, _output_tiles(problem, m), m)
    mt = _tile_stage(ws, 1, problem, m, alpha, problem.k)
    torch.mm(ws["kron_a"].mT, grads.view(outs, -1), out=mt.view(alpha, -1))
    du = ws["filter_wino"]
    # dU = Mt V^T: the GEMM's reduction runs over every tile of every image.
    torch.bmm(_matrices(mt).mT, _matrices(v), out=du.view(alpha * problem.groups, problem.k // problem.groups, -1))
    taps = ws["filter_taps"]
    torch.mm(ws["kron_g"].mT, du.view(alpha, -1), out=taps.view(taps.shape[0], -1))
    dw.permute(*range(2, 2 + nd), 0, 1).copy_(taps.view(*problem.kernel_size, *taps.shape[1:]))


register(WinogradF2x3())
register(WinogradF4x3())
