"""What convtune's kernel families share: 4-D views of a problem's operands, the decode of a program's
positions, and the fixed-order sum of partial results."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ..problem import ConvProblem
from .recording import launch


@dataclasses.dataclass(frozen=True)
class GemmTile:
    """One configuration of an implicit GEMM on the tensor cores (``kernels.grouped``, ``kernels.folded``): positions
    per program, output (or, for the data gradient, input) channels per program, warps, and (weight gradient)
    positions per partial sum."""

    positions: int
    channels: int
    warps: int = 4
    chunk: int = 0


# The arguments of a kernel that say how large the image (or the batch) is, not how it is laid out: Triton would
# compile a kernel again for each of them divisible by 16 against each that is not, so the layers of one network (a
# 112-row stage and a 56-row one, batch 32 and batch 8) would each compile their own copy of every configuration.
# Their divisibility is not specialized (a value of 1 still is: a 1-D problem's single row, a row of one strip, fold
# away). The width (W, Q) is, in channels_first only, where it runs along the contiguous axis and its divisibility
# lets a tile load in vectors (``for_layout``). The channel counts and the strides stay specialized, and so do a
# tile's own sizes (the rows a partial sum covers: rows_per_part, chunk), a configuration's constants whose
# divisibility shortens the weight gradients' loops (bench/sass_counts.py).
IMAGE_SIZES = frozenset({"N", "P", "H", "total", "rows", "strips", "parts_per_image"})
WIDTHS = frozenset({"W", "Q"})


def kernel(*fixed: str) -> Callable[[Callable[..., Any]], Any]:
    """``triton.jit`` for a kernel the host launches: its arguments of ``IMAGE_SIZES`` not specialized on their
    divisibility, so that a configuration compiles once for the heights and batches of a network's layers, and
    ``fixed`` not specialized at all; its ``channels_last`` attribute the same kernel with the width (``WIDTHS``) not
    specialized on its divisibility either, for operands whose width is not their contiguous axis (``for_layout``)."""
    def decorate(fn: Callable[..., Any]) -> Any:
        names = list(inspect.signature(fn).parameters)
        unknown = [name for name in fixed if name not in names]
        assert not unknown, f"{fn.__name__} has no parameters {unknown}"
        sizes = [name for name in names if name in IMAGE_SIZES]
        jitted = triton.jit(do_not_specialize=list(fixed), do_not_specialize_on_alignment=sizes)(fn)
        jitted.channels_last = triton.jit(do_not_specialize=list(fixed), do_not_specialize_on_alignment=[
            name for name in names if name in IMAGE_SIZES | WIDTHS])(fn)
        return jitted
    return decorate


def for_layout(kernel: Any, problem: ConvProblem) -> Any:
    """The copy of ``kernel`` (made by ``kernel``) for ``problem``'s layout: in channels_last the one whose width is
    not specialized either, so that a configuration compiles once for every image size of a network."""
    return kernel.channels_last if problem.layout == "channels_last" else kernel


def cdiv(a: int, b: int) -> int:
    """a / b rounded up, for the host's launch arithmetic and the algorithms' checks: triton.cdiv (and
    triton.next_power_of_2) are functions Triton's compiler can call at compile time, and from Python each call
    costs about 3 µs."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two not below n (0 for 0), as triton.next_power_of_2 gives it, at a Python call's cost
    (see ``cdiv``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def as_4d(t: torch.Tensor, problem: ConvProblem) -> torch.Tensor:
    """A 1-D problem's operand (N, C, L) as the view (N, C, 1, L); a 2-D one's as it is."""
    return t if problem.ndim == 2 else t.unsqueeze(2)


def geometry(problem: ConvProblem) -> tuple[int, ...]:
    """(R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w) of the 4-D view of ``problem``."""
    if problem.ndim == 2:
        (r, s), (sh, sw), (ph, pw), (dh, dw) = problem.kernel_size, problem.stride, problem.padding, problem.dilation
        return r, s, sh, sw, ph, pw, dh, dw
    return 1, problem.kernel_size[0], 1, problem.stride[0], 0, problem.padding[0], 1, problem.dilation[0]


def sizes(problem: ConvProblem) -> tuple[int, int, int, int]:
    """(H, W, P, Q) of the 4-D view of ``problem``."""
    if problem.ndim == 2:
        (h, w), (p, q) = problem.input_size, problem.output_size
        return h, w, p, q
    return 1, problem.input_size[0], 1, problem.output_size[0]


def tf32(problem: ConvProblem) -> bool:
    """Whether tensor-core products may round float32 operands to TF32 (the half dtypes are not affected)."""
    return problem.dtype != "float32" or problem.allow_tf32


@triton.jit
def run_positions(first, stop, rows, cols, BLOCK_POS: tl.constexpr):
    """The BLOCK_POS positions (n, row, col) of an (N, rows, cols) grid from position ``first`` on, and which lie
    before ``stop``."""
    pos = first + tl.arange(0, BLOCK_POS)
    return pos < stop, pos // (rows * cols), (pos // cols) % rows, pos % cols


@triton.jit
def positions(total, rows, cols, BLOCK_POS: tl.constexpr):
    """This program's positions (n, row, col) of an (N, rows, cols) grid, and which exist."""
    return run_positions(tl.program_id(0) * BLOCK_POS, total, rows, cols, BLOCK_POS)


@triton.jit
def patch_positions(total, rows, cols, BLOCK_POS: tl.constexpr, PATCH_W: tl.constexpr):
    """As ``positions``, but (PATCH_W > 0) a patch of BLOCK_POS // PATCH_W rows × PATCH_W columns of one
    sample's (rows, cols) grid: a program's taps then read input its own earlier taps read (kept in the
    cache) rather than rows other programs read. The grid's first axis: N × patches per sample."""
    if PATCH_W == 0:
        ok, sample, row, col = positions(total, rows, cols, BLOCK_POS)
    else:
        index = tl.arange(0, BLOCK_POS)
        across = (cols + PATCH_W - 1) // PATCH_W
        patches = ((rows + BLOCK_POS // PATCH_W - 1) // (BLOCK_POS // PATCH_W)) * across
        program = tl.program_id(0)
        patch = program % patches
        sample = program // patches + index * 0
        row = (patch // across) * (BLOCK_POS // PATCH_W) + index // PATCH_W
        col = (patch % across) * PATCH_W + index % PATCH_W
        ok = (row < rows) & (col < cols)
    return ok, sample, row, col


@triton.jit
def gradient_source(i, pad, tap, dilation, stride, size):
    """The output position whose gradient input position ``i`` receives through kernel tap ``tap`` (along one
    axis), and whether there is one: whole (the stride divides it) and inside the output's ``size``."""
    t = i + pad - tap * dilation
    o = t // stride
    return o, (t >= 0) & (t - o * stride == 0) & (o < size)


@kernel("parts")  # (how many partial sums: one, for a small layer, needs no copy of its own)
def _sum_partials(partials, out, parts, size, BLOCK_PARTS: tl.constexpr, BLOCK: tl.constexpr):
    # BLOCK_PARTS rows of partials a turn, each into its own sum (row j into sum j mod BLOCK_PARTS, in order), the
    # sums added at the end: that many independent loads in flight per element, where one row a turn waited on each
    # load in turn (a 7x7 weight gradient of 96 channels in runs of 8 rows has 224 rows).
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < size
    rows = tl.arange(0, BLOCK_PARTS)
    acc = tl.zeros((BLOCK_PARTS, BLOCK), dtype=tl.float32)
    for first in range(0, parts, BLOCK_PARTS):
        part = first + rows
        acc += tl.load(partials + (part * size)[:, None] + i[None, :], mask=(part < parts)[:, None] & ok[None, :],
                       other=0.0)
    tl.store(out + i, tl.sum(acc, axis=0).to(out.dtype.element_ty), mask=ok)


def sum_partials(partials: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (dense) = the sum over the first axis of ``partials`` (float32, (parts, out.numel()), each row
    laid out as ``out``'s memory), in an order fixed for a given problem (every 16th row in order into one of 16
    sums, those added in an order the compiled layout fixes; no atomics) and rounded once: deterministic, though
    the bits may differ with Triton's version or the GPU."""
    size = out.numel()
    block = 128
    launch(_sum_partials, (cdiv(size, block),), partials, out, partials.shape[0], size, BLOCK_PARTS=16,
           BLOCK=block, num_warps=4)
