"""direct:taps: shift-and-accumulate over the kernel taps, with (near) zero workspace.

For each kernel tap, the output region it contributes to and the strided input region it reads
(``taps.problem_taps``) are multiplied over channels and added into the result:

- fwd:        y[out region]  += x[in region] @ W[tap]^T
- bwd_data:   dx[in region]  += dy[out region] @ W[tap]
- bwd_filter: dW[tap]        += dy[out region]^T @ x[in region]

A region is strided, so it is not one matrix: its rows (the last spatial dimension, positions by
channels) are, and the other dimensions (batch, leading spatial, groups) index a batch of such
matrices. One ``baddbmm_`` runs over the largest of them and Python loops over the rest; BLAS
takes the row stride, so nothing is copied. For bwd_filter the leading dimensions are summed,
so only groups batch and the loop runs over every row.

Copies are needed only where no stride of a matrix is 1, in channels_first: the weight's taps
(stride kernel-size apart, copied once into a (taps, K, C/G) buffer) and, with a stride > 1 in
the last dimension, the strided input rows (gathered into a one-batch scratch). A contraction
of length one (depthwise fwd, C/G = 1; bwd_data with K/G = 1) is a broadcast multiply-add over
the whole region instead of a GEMM.

Half dtypes: each GEMM sums in float32 inside, but fwd and bwd_data add the taps' results in
the output's dtype (notes: reduced precision); bwd_filter sums its many row terms in a float32
buffer of the weight's size.

    >>> from convtune.problem import ConvProblem
    >>> from convtune.algorithms.registry import get_algorithm
    >>> p = ConvProblem("fwd", n=2, c=4, k=4, input_size=(6, 6), kernel_size=3, padding=1)
    >>> get_algorithm("direct:taps").buffer_bytes(p.replace(layout="channels_last"))
    0
"""

from __future__ import annotations

import itertools
import math
from typing import cast

import torch

from .. import tf32
from ..costmodel import Cost, gemm_dims, shape_factor, taps
from ..problem import ConvProblem
from .base import Algorithm, Buffer, NumericNotes
from .gemm import GemmSum, gemm_notes, gemm_tf32, grouped_nsc, is_half, tap_index
from .registry import register
from .taps import TensorIndex, problem_taps


def _elementwise(problem: ConvProblem) -> bool:
    """Whether each tap's product has a contraction of length one (a broadcast multiply-add)."""
    g = problem.groups
    return (problem.direction == "fwd" and problem.c == g) or (problem.direction == "bwd_data" and problem.k == g)


def _batch_dim(problem: ConvProblem) -> int:
    """Which index dimension (batch, leading output dims..., groups) the bmm runs over: the largest.

    bwd_filter sums over every dimension but groups, so it batches groups.
    """
    sizes = (problem.n, *problem.output_size[:-1], problem.groups)
    if problem.direction == "bwd_filter":
        return len(sizes) - 1
    return max(range(len(sizes)), key=lambda i: sizes[i])


def _needs_gather(problem: ConvProblem) -> bool:
    # channels_first rows (positions x channels) have strides (stride[-1], H·W): no unit stride
    # once the last spatial stride is above 1, and BLAS (through PyTorch) would copy them itself.
    return problem.layout == "channels_first" and problem.stride[-1] > 1 and not _elementwise(problem)


def _gather_elems(problem: ConvProblem) -> int:
    """Elements of the scratch holding one bmm's strided rows: (batch, last output size, C/G)."""
    sizes = (problem.n, *problem.output_size[:-1], problem.groups)
    return sizes[_batch_dim(problem)] * problem.output_size[-1] * (problem.c // problem.groups)


class DirectTaps(Algorithm):
    """Direct convolution, tap by tap: batched GEMMs over channels on strided views."""

    name = "direct:taps"

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        m, n, _ = gemm_dims(problem)
        # Per tap, one batched product over the largest of the batch, leading spatial and group
        # dimensions, and a loop over the others; the filter gradient loops over every row.
        leading = [problem.n, *problem.output_size[:-1], problem.groups]
        loops = (problem.n * math.prod(problem.output_size[:-1]) if problem.direction == "bwd_filter"
                 else math.prod(leading) // max(leading))
        return Cost(problem.flops, 0.5 * shape_factor(m, n, problem.c // problem.groups),
                    taps(problem) * problem.min_bytes + 2 * workspace_bytes, taps(problem) * loops + 1)

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        g, taps = problem.groups, math.prod(problem.kernel_size)
        kg, cg = problem.k // g, problem.c // g
        cf = problem.layout == "channels_first"
        buffers = []
        if problem.direction != "bwd_filter" and cf and taps > 1 and not _elementwise(problem):
            buffers.append(Buffer("w_taps", (taps, problem.k, cg), problem.torch_dtype))
        if _needs_gather(problem):
            buffers.append(Buffer("rows", (_gather_elems(problem),), problem.torch_dtype))
        if problem.direction == "bwd_filter":
            if is_half(problem):  # many row terms per tap: sum them in float32
                buffers += [Buffer("sum32", (taps, g, kg, cg), torch.float32),
                            Buffer("partial", (g, kg, cg), problem.torch_dtype),
                            Buffer("widened", (g, kg, cg), torch.float32)]
            elif cf and taps > 1:  # a channels_first dW[tap] has no unit stride: sum per tap apart
                buffers.append(Buffer("sum32", (taps, g, kg, cg), torch.float32))
        return buffers

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return gemm_notes(problem, sums_in_dtype=problem.direction != "bwd_filter")

    def tf32_settings(self, problem: ConvProblem) -> tf32.Settings:
        return gemm_tf32(problem)

    def _run(self, problem, a, b, out, ws) -> None:
        with self.tf32_settings(problem).switched(problem.device):
            if problem.direction == "bwd_filter":
                _filter(problem, a, b, out, ws)
            else:
                _data(problem, a, b, out, ws)


def _weight_taps(problem: ConvProblem, w: torch.Tensor, ws: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight as (taps, G, K/G, C/G), each tap's matrix with a unit stride (copied if need be)."""
    d, g = problem.ndim, problem.groups
    taps = w.permute(*range(2, 2 + d), 0, 1)  # (*kernel, K, C/G)
    if "w_taps" in ws:
        taps = ws["w_taps"].view(taps.shape).copy_(taps)
    return taps.view(-1, g, problem.k // g, problem.c // g)


def _data(problem: ConvProblem, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
          ws: dict[str, torch.Tensor]) -> None:
    """fwd: y = sum over taps of x-region @ W[tap]^T; bwd_data: dx = sum over taps of dy-region @ W[tap]."""
    g, fwd = problem.groups, problem.direction == "fwd"
    wt = _weight_taps(problem, w, ws)
    src, dst = grouped_nsc(a, g), grouped_nsc(out, g)
    out.zero_()
    for tap in problem_taps(problem):
        wtap = wt[tap_index(tap.tap, problem.kernel_size)]  # (G, Kg, Cg)
        src_region, dst_region = (tap.inp, tap.out) if fwd else (tap.out, tap.inp)
        s = src[(slice(None), *src_region)]  # (n, *region, G, X)
        o = dst[(slice(None), *dst_region)]  # (n, *region, G, M)
        if _elementwise(problem):  # contraction of length one: (..., G, 1) * (G, M)
            o.addcmul_(s, wtap.squeeze(-1) if fwd else wtap.squeeze(-2))
            continue
        _rows_gemm(o, s, wtap.transpose(1, 2) if fwd else wtap, _batch_dim(problem), ws.get("rows"),
                   gather_input=fwd)


def _rows_gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch_dim: int,
               rows: torch.Tensor | None, gather_input: bool) -> None:
    """out[..., q, g, :] += a[..., q, g, :] @ b[g] for every index of the leading dims.

    out (*L, Q, G, M), a (*L, Q, G, X), b (G, X, M). One ``baddbmm_`` per index of the dimensions
    (*L, G) other than ``batch_dim``. ``rows``: scratch for operands without a unit stride, the
    input rows (``gather_input``) or the output rows (computed there, then added).
    """
    lead = out.dim() - 3
    out = out.transpose(-3, -2).movedim(batch_dim, 0)  # (B, *rest, Q, M)
    a = a.transpose(-3, -2).movedim(batch_dim, 0)
    group_batched = batch_dim == lead
    for index in itertools.product(*(range(size) for size in out.shape[1:-2])):
        o, x = out[cast(TensorIndex, (slice(None), *index))], a[cast(TensorIndex, (slice(None), *index))]
        m = b if group_batched else b[index[-1]].expand(o.shape[0], *b.shape[1:])
        if rows is None:
            _add_products(o, x, m)
        elif gather_input:
            _add_products(o, rows[: x.numel()].view(x.shape).copy_(x), m)
        else:
            scratch = rows[: o.numel()].view(o.shape)
            o.add_(torch.bmm(x, m, out=scratch))


def _add_products(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b (batched), computed as out^T += b^T @ a^T when ``out`` is column-major.

    PyTorch's CPU bmm is about twice as fast writing a row-major result (measured on the
    channels_first rows, where the output positions are the unit stride).
    """
    if out.stride(-1) != 1 and out.shape[-1] > 1:
        out.transpose(1, 2).baddbmm_(b.transpose(1, 2), a.transpose(1, 2))
    else:
        out.baddbmm_(a, b)


def _filter(problem: ConvProblem, x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor,
            ws: dict[str, torch.Tensor]) -> None:
    """dW[tap] = sum over the batch and every output row of dy-rows^T @ x-rows, batched over groups."""
    g, d = problem.groups, problem.ndim
    xs, dys = grouped_nsc(x, g), grouped_nsc(dy, g)
    sum32 = ws.get("sum32")
    if sum32 is not None:
        sum32.zero_()  # taps that read only padding stay zero
        target_of = None
    else:  # float32 channels_last (or one tap): dW[tap] (G, Kg, Cg) has a unit stride
        dw.zero_()
        dw_taps = dw.permute(*range(2, 2 + d), 0, 1).view(-1, g, problem.k // g, problem.c // g)
        target_of = dw_taps.__getitem__
    half = "partial" in ws
    for tap in problem_taps(problem):
        t = tap_index(tap.tap, problem.kernel_size)
        if half:
            # "partial" comes with "sum32" (buffers)
            total = GemmSum(None, ws["partial"], ws["widened"], cast(torch.Tensor, sum32)[t])
        else:  # without target_of, sum32 was given
            total = GemmSum(target_of(t) if target_of else cast(torch.Tensor, sum32)[t])
        dy_region = dys[(slice(None), *tap.out)]  # (n, *region, G, Kg)
        x_region = xs[(slice(None), *tap.inp)]  # (n, *region, G, Cg)
        for index in itertools.product(*(range(size) for size in dy_region.shape[:-3])):
            dy_rows = dy_region[index].permute(1, 2, 0)  # (G, Kg, Q)
            x_rows = x_region[index].transpose(0, 1)  # (G, Q, Cg)
            if "rows" in ws:
                x_rows = ws["rows"][: x_rows.numel()].view(x_rows.shape).copy_(x_rows)
            total.add(dy_rows, x_rows)
        total.finish()
    if sum32 is not None:
        dw.permute(*range(2, 2 + d), 0, 1).copy_(sum32.view(*problem.kernel_size, problem.k, -1))


register(DirectTaps())
