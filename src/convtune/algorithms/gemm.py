"""GEMM-based algorithms: ``gemm:1x1`` (no copy at all) and ``gemm:im2col[_chunk{b}]`` (explicit lowering).

A convolution over channels is a matrix product once every kernel tap's input is laid side by
side. A 1x1 kernel with stride 1 and no padding needs no lowering: the input already is the
matrix, so ``gemm:1x1`` multiplies views of the operands straight into ``out``. Any other kernel
is lowered by ``gemm:im2col`` into a column matrix (the workspace), ordered per layout so that
the GEMM's output *is* the output memory:

- channels_last: cols (N·P·Q, G, R·S·C/G) and y (N·P·Q, K) = cols @ Wmat^T, a channels_last
  weight being (K, R·S·C/G) in memory;
- channels_first: cols (N, G, C/G·R·S, P·Q) and y[n] (K, P·Q) = Wmat (K, C/G·R·S) @ cols[n].

Groups are a batch dimension of the GEMMs (one ``bmm`` over views). ``gemm:im2col_chunk{b}`` runs
the same method over sub-batches of b samples, one after another: the column matrix, and so the
workspace, shrink to b/n of the full one, for more and smaller GEMMs.

Half dtypes: PyTorch's GEMMs accumulate float16/bfloat16 products in float32 inside; where a
result is a sum of several GEMMs (a filter gradient over samples or sub-batches, a col2im sum of
overlapping taps) the sum is kept in a declared float32 buffer, never in the half dtype.

    >>> from convtune.problem import ConvProblem
    >>> from convtune.algorithms.registry import get_algorithm
    >>> p = ConvProblem("fwd", n=4, c=8, k=8, input_size=(6, 6), kernel_size=3, padding=1)
    >>> [get_algorithm(name).supports(p).ok for name in ("gemm:1x1", "gemm:im2col", "gemm:im2col_chunk2")]
    [False, True, True]
"""

from __future__ import annotations

import math
from typing import cast

import torch

from .. import tf32
from ..costmodel import Cost, gemm_dims, shape_factor, taps
from ..problem import ConvProblem, layout_order
from .base import SUPPORTED, Algorithm, Buffer, NativeRecipe, NumericNotes, Support, unsupported
from .registry import register
from .taps import problem_taps

CHUNKS = (1, 2, 4, 8, 16, 32, 64)


# -- helpers shared with direct.py -----------------------------------------------------------
def grouped_nsc(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(N, C, *spatial) in either layout -> the view (N, *spatial, groups, C/groups); never a copy."""
    return t.movedim(1, -1).unflatten(-1, (groups, t.shape[1] // groups))


def tap_index(tap: tuple[int, ...], kernel_size: tuple[int, ...]) -> int:
    """The row-major index of kernel position ``tap`` among the prod(kernel_size) taps."""
    index = 0
    for i, r in zip(tap, kernel_size):
        index = index * r + i
    return index


def is_half(problem: ConvProblem) -> bool:
    return problem.dtype != "float32"


def gemm_notes(problem: ConvProblem, sums_in_dtype: bool = False) -> NumericNotes:
    """Numeric notes of an algorithm made of PyTorch GEMMs (run under ``gemm_tf32``'s settings).

    ``sums_in_dtype``: the algorithm adds GEMM results together in a float16/bfloat16 tensor.
    """
    half = is_half(problem)
    if problem.device == "cuda":
        matmul = torch.backends.cuda.matmul
        # cuBLAS may reduce split-K partial sums in the half dtype unless PyTorch forbids it.
        allowed = matmul.allow_fp16_reduced_precision_reduction if problem.dtype == "float16" \
            else matmul.allow_bf16_reduced_precision_reduction
        tf32 = not half and problem.allow_tf32
        return NumericNotes(tensor_cores=half or tf32, tf32=tf32,
                            reduced_precision=half and (sums_in_dtype or bool(allowed)), float32_inside=half)
    return NumericNotes(float32_inside=half, reduced_precision=half and sums_in_dtype)


def gemm_tf32(problem: ConvProblem) -> tf32.Settings:
    """On CUDA, float32 GEMMs use TF32 exactly when ``problem.allow_tf32``. A float16/bfloat16 problem's
    GEMMs are in its dtype, where TF32 does not apply: PyTorch's process-wide switch is left alone."""
    return tf32.Settings(matmul=problem.allow_tf32) if problem.dtype == "float32" else tf32.Settings()


def gemm_sum_buffers(problem: ConvProblem, shape: tuple[int, ...], terms: int) -> list[Buffer]:
    """The buffers ``GemmSum`` needs to add ``terms`` GEMM results of ``shape`` without half-dtype rounding.

    None for float32 or a single term (the sum then lives in the output itself); for half dtypes
    the term in its dtype, its float32 widening and the float32 sum.
    """
    if not is_half(problem) or terms <= 1:
        return []
    return [Buffer("partial", shape, problem.torch_dtype), Buffer("widened", shape, torch.float32),
            Buffer("sum32", shape, torch.float32)]


class GemmSum:
    """``target`` = the sum of batched products a_i @ b_i, added one term at a time.

    Without ``sum32`` each term goes straight into ``target`` (``bmm``, then ``baddbmm_``). With
    it (half dtypes), each term lands in ``partial`` (the dtype), is widened into ``widened`` (a
    mixed-dtype ``add_`` would allocate that copy itself) and summed in ``sum32`` (float32);
    ``finish`` rounds the sum into ``target`` once (``target=None``: the caller reads ``sum32``).
    """

    def __init__(self, target: torch.Tensor | None, partial: torch.Tensor | None = None,
                 widened: torch.Tensor | None = None, sum32: torch.Tensor | None = None):
        self.target, self.partial, self.widened, self.sum32 = target, partial, widened, sum32
        self.terms = 0

    @classmethod
    def in_workspace(cls, target: torch.Tensor, ws: dict[str, torch.Tensor]) -> GemmSum:
        """A sum into ``target`` through the ``gemm_sum_buffers`` carved in ``ws`` (if any)."""
        return cls(target, ws.get("partial"), ws.get("widened"), ws.get("sum32"))

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        first = self.terms == 0
        self.terms += 1
        if self.sum32 is None:
            if first:
                torch.bmm(a, b, out=self.target)
            else:
                cast(torch.Tensor, self.target).baddbmm_(a, b)  # target=None comes only with sum32
            return
        # sum32 comes with partial and widened (gemm_sum_buffers)
        torch.bmm(a, b, out=self.partial)
        if first:
            self.sum32.copy_(cast(torch.Tensor, self.partial))
        else:
            cast(torch.Tensor, self.widened).copy_(cast(torch.Tensor, self.partial))
            self.sum32.add_(cast(torch.Tensor, self.widened))

    def finish(self) -> None:
        """Write the sum into ``target`` (zeros when no term was added)."""
        if self.terms == 0:
            # target=None comes only with sum32
            cast(torch.Tensor, self.target if self.sum32 is None else self.sum32).zero_()
        if self.sum32 is not None and self.target is not None:
            self.target.copy_(self.sum32)


def weight_matrix(w: torch.Tensor, problem: ConvProblem) -> torch.Tensor:
    """The (G, K/G, X) view of a weight (or its gradient), X = taps·C/G ordered as the layout stores it.

    channels_first: X = (C/G, *kernel); channels_last: X = (*kernel, C/G). Never a copy.
    """
    g = problem.groups
    stored = w if problem.layout == "channels_first" else w.movedim(1, -1)
    return stored.view(g, problem.k // g, -1)


def _rows_by_group(t: torch.Tensor, groups: int) -> torch.Tensor:
    """A channels_last (N, C, *spatial) tensor as the (G, N·spatial, C/G) batch of row matrices; a view.

    ``t`` must be dense in channels_last (a slice along N is): every run checks its operands so.
    Element (n, c, s) then sits at n·S·C + s·C + c, so one ``as_strided`` makes the view that
    movedim, view and transpose would, at a third of their host cost (runs make it every call).
    """
    c = t.shape[1]
    return t.as_strided((groups, t.numel() // c, c // groups), (c // groups, c, 1), t.storage_offset())


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A channels_last (N, C, *spatial) tensor as the (N·spatial, C) row matrix; a view (as ``_rows_by_group``)."""
    c = t.shape[1]
    return t.as_strided((t.numel() // c, c), (c, 1), t.storage_offset())


def _per_sample(t: torch.Tensor, groups: int) -> torch.Tensor:
    """A channels_first (N, C, *spatial) tensor as the view (N, G, C/G, prod(spatial))."""
    return t.view(t.shape[0], groups, t.shape[1] // groups, -1)


# -- gemm:1x1 --------------------------------------------------------------------------------
class Gemm1x1(Algorithm):
    """A 1x1 convolution as one matrix product of views, written straight into ``out``.

    channels_last: y (N·HW, K) = x (N·HW, C) @ W^T, dx = dy @ W, dW = dy^T @ x, each one GEMM
    (batched over groups). channels_first: y[n] = W @ x[n] as one broadcast GEMM over the batch;
    dW = sum over n of dy[n] @ x[n]^T, accumulated in the gradient itself (float32) or, for half
    dtypes over several samples, in a float32 buffer of the weight's size.
    """

    name = "gemm:1x1"

    def _supports(self, problem: ConvProblem) -> Support:
        if not problem.is_1x1:
            return unsupported(f"needs a 1x1 kernel, got kernel_size={problem.kernel_size}; "
                               f"gemm:im2col and direct:taps take any kernel")
        if any(s != 1 for s in problem.stride):
            return unsupported(f"stride={problem.stride} skips input positions, so the input is no longer one "
                               f"matrix without a copy; gemm:1x1_strided copies the slice it reads")
        if any(problem.padding):
            return unsupported(f"padding={problem.padding} adds a zero border that a GEMM cannot read in place; "
                               f"use gemm:im2col, which writes the border into its column matrix")
        return SUPPORTED

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        if problem.direction != "bwd_filter" or problem.layout == "channels_last":
            return []
        g = problem.groups
        return gemm_sum_buffers(problem, (g, problem.k // g, problem.c // g), problem.n)

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return gemm_notes(problem)

    def tf32_settings(self, problem: ConvProblem) -> tf32.Settings:
        return gemm_tf32(problem)

    def native_recipe(self, problem: ConvProblem) -> NativeRecipe:
        return NativeRecipe("gemm_1x1")

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        # One matrix product straight on the operands: as good as a vendor kernel.
        return Cost(problem.flops, 0.8 * shape_factor(*gemm_dims(problem)), problem.min_bytes + 2 * workspace_bytes,
                    problem.groups + 1, composed=False)

    def _run(self, problem, a, b, out, ws) -> None:
        g = problem.groups
        with self.tf32_settings(problem).switched(problem.device):
            if problem.layout == "channels_last":
                self._channels_last(problem.direction, a, b, out, g)
            else:
                self._channels_first(problem.direction, a, b, out, g, ws)

    @staticmethod
    def _channels_last(direction, a, b, out, g) -> None:
        if g == 1:  # one matrix product: mm costs less host time than a batched product of one matrix
            if direction == "fwd":
                torch.mm(_rows(a), b.view(b.shape[0], -1).t(), out=_rows(out))
            elif direction == "bwd_data":
                torch.mm(_rows(a), b.view(b.shape[0], -1), out=_rows(out))
            else:
                torch.mm(_rows(b).t(), _rows(a), out=out.view(out.shape[0], -1))
            return
        if direction == "fwd":  # y (G, M, Kg) = x (G, M, Cg) @ W^T (G, Cg, Kg)
            w = b.view(g, b.shape[0] // g, -1)
            torch.bmm(_rows_by_group(a, g), w.transpose(1, 2), out=_rows_by_group(out, g))
        elif direction == "bwd_data":  # dx (G, M, Cg) = dy (G, M, Kg) @ W (G, Kg, Cg)
            w = b.view(g, b.shape[0] // g, -1)
            torch.bmm(_rows_by_group(a, g), w, out=_rows_by_group(out, g))
        else:  # dW (G, Kg, Cg) = dy^T (G, Kg, M) @ x (G, M, Cg)
            dw = out.view(g, out.shape[0] // g, -1)
            torch.bmm(_rows_by_group(b, g).transpose(1, 2), _rows_by_group(a, g), out=dw)

    @staticmethod
    def _channels_first(direction, a, b, out, g, ws) -> None:
        if direction == "bwd_filter":  # dW (G, Kg, Cg) = sum_n dy[n] (G, Kg, HW) @ x[n]^T (G, HW, Cg)
            x, dy = _per_sample(a, g), _per_sample(b, g)
            total = GemmSum.in_workspace(out.view(g, out.shape[0] // g, -1), ws)
            for n in range(x.shape[0]):
                total.add(dy[n], x[n].transpose(1, 2))
            total.finish()
            return
        w = b.view(g, b.shape[0] // g, -1)
        if direction == "bwd_data":
            w = w.transpose(1, 2)
        src, dst = _per_sample(a, g), _per_sample(out, g)
        if g == 1:  # one GEMM broadcast over the batch: (K, C) @ (N, C, HW) -> (N, K, HW)
            torch.matmul(w[0], src[:, 0], out=dst[:, 0])
            return
        for n in range(src.shape[0]):  # a 4-D broadcast matmul would copy the expanded weight
            torch.bmm(w, src[n], out=dst[n])


class Gemm1x1Strided(Algorithm):
    """A strided 1x1 convolution (no padding) as ``gemm:1x1`` on a cheap slice.

    With stride s and no padding, output position o reads input o·s: the input's every s-th
    position is the whole input of an unstrided 1x1 convolution. fwd and bwd_filter copy that
    slice (1/s^d of the input) into the workspace; bwd_data computes the slice's gradient there
    and scatters it into a zeroed dx.
    """

    name = "gemm:1x1_strided"

    def _supports(self, problem: ConvProblem) -> Support:
        if not problem.is_1x1:
            return unsupported(f"needs a 1x1 kernel, got kernel_size={problem.kernel_size}")
        if all(s == 1 for s in problem.stride):
            return unsupported("stride 1 needs no slice: gemm:1x1 reads the input in place")
        if any(problem.padding):
            return unsupported(f"padding={problem.padding}: a strided slice has no zero border; use gemm:im2col")
        return SUPPORTED

    @staticmethod
    def sliced(problem: ConvProblem) -> ConvProblem:
        """The unstrided 1x1 problem on the input's every stride-th position."""
        return problem.replace(input_size=problem.output_size, stride=1)

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        inner = self.sliced(problem)
        order = layout_order(len(inner.x_shape), problem.layout)
        stored = tuple(inner.x_shape[i] for i in order)
        return [Buffer("slice", stored, problem.torch_dtype), *_GEMM_1X1.buffers(inner)]

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return gemm_notes(problem)

    def tf32_settings(self, problem: ConvProblem) -> tf32.Settings:
        return gemm_tf32(problem)

    def native_recipe(self, problem: ConvProblem) -> NativeRecipe:
        return NativeRecipe("gemm_1x1_strided")

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        return _GEMM_1X1.cost(problem, workspace_bytes)  # the slice copy is in the workspace traffic

    def _run(self, problem, a, b, out, ws) -> None:
        inner = self.sliced(problem)
        order = layout_order(len(inner.x_shape), problem.layout)
        inverse = sorted(range(len(order)), key=lambda i: order[i])
        xs = ws["slice"].permute(inverse)  # (N, C, *output_size) in the problem's layout
        every = (slice(None), slice(None), *(slice(None, None, s) for s in problem.stride))
        if problem.direction == "bwd_data":
            _GEMM_1X1._run(inner, a, b, xs, ws)
            out.zero_()
            out[every].copy_(xs)
            return
        xs.copy_(a[every])
        _GEMM_1X1._run(inner, xs, b, out, ws)


_GEMM_1X1 = Gemm1x1()


# -- gemm:im2col and gemm:im2col_chunk{b} ---------------------------------------------------
def taps_overlap(problem: ConvProblem) -> bool:
    """Whether two kernel taps can read the same input position (col2im then sums several terms there).

    In a dimension, taps i and i+δ read the same input for outputs o and o' when δ·dilation =
    (o' - o)·stride with o' - o < output size.
    """
    for r, s, d, out in zip(problem.kernel_size, problem.stride, problem.dilation, problem.output_size):
        if any(delta * d % s == 0 and delta * d // s < out for delta in range(1, r)):
            return True
    return False


class Im2col(Algorithm):
    """Explicit lowering: the column matrix in the workspace, one GEMM per sub-batch (batched over groups).

    ``chunk=None`` lowers the whole batch at once; ``chunk=b`` runs sub-batches of b samples one
    after another, so the workspace is b/n of the full one (supported only when b < n).
    """

    def __init__(self, chunk: int | None = None):
        self.chunk = chunk
        self.name = "gemm:im2col" if chunk is None else f"gemm:im2col_chunk{chunk}"
        super().__init__()

    def _supports(self, problem: ConvProblem) -> Support:
        if self.chunk is not None and self.chunk >= problem.n:
            return unsupported(f"runs sub-batches of {self.chunk} samples, which needs n > {self.chunk} "
                               f"(n={problem.n}); gemm:im2col is the same method on the whole batch")
        return SUPPORTED

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        # The column matrix is written once and read once by the product; sub-batches of b samples
        # repeat the per-tap copies and the product per sub-batch.
        batches = -(-problem.n // self._batch(problem))
        m, n, k = gemm_dims(problem)
        return Cost(problem.flops, 0.7 * shape_factor(m / batches, n, k), problem.min_bytes + 2 * workspace_bytes,
                    batches * (taps(problem) + 1))

    def _batch(self, problem: ConvProblem) -> int:
        return problem.n if self.chunk is None else min(self.chunk, problem.n)

    def _filter_terms(self, problem: ConvProblem) -> int:
        # channels_first: dy[n] and cols[n] only form matrices per sample, so dW sums n GEMMs.
        if problem.layout == "channels_first":
            return problem.n
        return -(-problem.n // self._batch(problem))

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        b, g, t = self._batch(problem), problem.groups, math.prod(problem.kernel_size)
        cg = problem.c // g
        shape = (b, *problem.output_size, g, t, cg) if problem.layout == "channels_last" \
            else (b, g, cg, t, *problem.output_size)
        buffers = [Buffer("cols", shape, problem.torch_dtype)]
        if problem.direction == "bwd_data" and is_half(problem) and taps_overlap(problem):
            buffers += [Buffer("dx32", (math.prod(problem.input_size) * problem.c,), torch.float32),
                        Buffer("widened", (math.prod(problem.output_size) * problem.c,), torch.float32)]
        if problem.direction == "bwd_filter":
            shape = (g, problem.k // g, cg * t)
            buffers += gemm_sum_buffers(problem, shape, self._filter_terms(problem))
        return buffers

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return gemm_notes(problem)

    def tf32_settings(self, problem: ConvProblem) -> tf32.Settings:
        return gemm_tf32(problem)

    def _run(self, problem, a, b, out, ws) -> None:
        step = self._batch(problem)
        w = None if problem.direction == "bwd_filter" else weight_matrix(b, problem)
        total = GemmSum.in_workspace(weight_matrix(out, problem), ws) if problem.direction == "bwd_filter" else None
        with self.tf32_settings(problem).switched(problem.device):
            for start in range(0, problem.n, step):
                rows = slice(start, min(start + step, problem.n))
                cols = ws["cols"][: rows.stop - rows.start]
                # w is set for fwd and bwd_data, total for bwd_filter
                if problem.direction == "fwd":
                    im2col(problem, a[rows], cols)
                    _cols_gemm(problem, cast(torch.Tensor, w), cols, out[rows])
                elif problem.direction == "bwd_data":
                    _cols_gemm(problem, cast(torch.Tensor, w), cols, a[rows], transposed=True)
                    col2im(problem, cols, out[rows], ws)
                else:
                    im2col(problem, a[rows], cols)
                    _cols_filter_terms(problem, b[rows], cols, cast(GemmSum, total))
            if total is not None:
                total.finish()


def _cols_logical(problem: ConvProblem, cols: torch.Tensor) -> torch.Tensor:
    """The column buffer (either memory order) as the view (n, *out, G, taps, C/G)."""
    if problem.layout == "channels_last":
        return cols
    d = problem.ndim
    return cols.permute(0, *range(4, 4 + d), 1, 3, 2)


def im2col(problem: ConvProblem, x: torch.Tensor, cols: torch.Tensor) -> None:
    """Fill ``cols`` (a sub-batch of the column buffer) from ``x``: each tap's strided input region
    into its slot, zeros where the tap reads padding."""
    g, kernel, out_size = problem.groups, problem.kernel_size, problem.output_size
    slots = _cols_logical(problem, cols)
    src = grouped_nsc(x, g)
    present = set()
    for tap in problem_taps(problem):
        t = tap_index(tap.tap, kernel)
        present.add(t)
        slot = slots.select(-2, t)  # (n, *out, G, Cg)
        slot[(slice(None), *tap.out)].copy_(src[(slice(None), *tap.inp)])
        _zero_outside(slot, tap.out, out_size)
    for t in set(range(math.prod(kernel))) - present:  # taps that read only padding
        slots.select(-2, t).zero_()


def _zero_outside(slot: torch.Tensor, region: tuple[slice, ...], size: tuple[int, ...]) -> None:
    """Zero the positions of ``slot`` (n, *size, ...) outside ``region``, as at most two slabs per dimension."""
    inside: list[slice] = []
    for sl, extent in zip(region, size):
        if sl.start > 0:
            slot[(slice(None), *inside, slice(0, sl.start))].zero_()
        if sl.stop < extent:
            slot[(slice(None), *inside, slice(sl.stop, extent))].zero_()
        inside.append(sl)


def col2im(problem: ConvProblem, cols: torch.Tensor, dx: torch.Tensor, ws: dict[str, torch.Tensor]) -> None:
    """dx = the sum over taps of each slot of ``cols`` scattered back to the input region it came from.

    With ``ws["dx32"]`` (half dtype, overlapping taps) each sample is summed in float32 there, every
    slot widened first into ``ws["widened"]`` (a mixed-dtype ``add_`` would allocate that copy).
    """
    g, kernel = problem.groups, problem.kernel_size
    slots = _cols_logical(problem, cols)
    taps = [(tap, tap_index(tap.tap, kernel)) for tap in problem_taps(problem)]
    target = grouped_nsc(dx, g)
    if "dx32" not in ws:
        target.zero_()
        for tap, t in taps:
            target[(slice(None), *tap.inp)].add_(slots.select(-2, t)[(slice(None), *tap.out)])
        return
    sum32 = ws["dx32"].view(*problem.input_size, g, -1)
    for i in range(dx.shape[0]):
        sum32.zero_()
        for tap, t in taps:
            slot = slots[i].select(-2, t)[tap.out]
            sum32[tap.inp].add_(ws["widened"][: slot.numel()].view(slot.shape).copy_(slot))
        target[i].copy_(sum32)


def _cols_gemm(problem: ConvProblem, w: torch.Tensor, cols: torch.Tensor, y: torch.Tensor,
               transposed: bool = False) -> None:
    """fwd: y = the convolution of the lowered sub-batch ``cols`` with ``w`` (G, Kg, X).
    ``transposed`` (bwd_data): cols = the lowered gradient, from dy passed as ``y``."""
    g, n = problem.groups, cols.shape[0]
    if problem.layout == "channels_last":
        c = cols.view(-1, g, cols.shape[-2] * cols.shape[-1]).transpose(0, 1)  # (G, M, X)
        rows = _rows_by_group(y, g)
        if transposed:  # dcols (G, M, X) = dy (G, M, Kg) @ W (G, Kg, X)
            torch.bmm(rows, w, out=c)
        else:  # y (G, M, Kg) = cols (G, M, X) @ W^T (G, X, Kg)
            torch.bmm(c, w.transpose(1, 2), out=rows)
        return
    c = cols.view(n, g, -1, math.prod(problem.output_size))  # (n, G, X, PQ)
    yv = _per_sample(y, g)  # (n, G, Kg, PQ)
    a, src, dst = (w.transpose(1, 2), yv, c) if transposed else (w, c, yv)
    if g == 1:  # one GEMM broadcast over the sub-batch
        torch.matmul(a[0], src[:, 0], out=dst[:, 0])
        return
    for i in range(n):
        torch.bmm(a, src[i], out=dst[i])


def _cols_filter_terms(problem: ConvProblem, dy: torch.Tensor, cols: torch.Tensor, total: GemmSum) -> None:
    """Add this sub-batch's dW (G, Kg, X) = dy^T @ cols to ``total``."""
    g, n = problem.groups, cols.shape[0]
    if problem.layout == "channels_last":
        c = cols.view(-1, g, cols.shape[-2] * cols.shape[-1]).transpose(0, 1)  # (G, M, X)
        total.add(_rows_by_group(dy, g).transpose(1, 2), c)
        return
    c = cols.view(n, g, -1, math.prod(problem.output_size))  # (n, G, X, PQ)
    dyv = _per_sample(dy, g)  # (n, G, Kg, PQ)
    for i in range(n):
        total.add(dyv[i], c[i].transpose(1, 2))


register(_GEMM_1X1)
register(Gemm1x1Strided())
register(Im2col())
for _chunk in CHUNKS:
    register(Im2col(_chunk))
