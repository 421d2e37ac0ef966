"""Where each kernel tap reads: the valid output region and the input region it maps to.

Output position o of a tap r reads input position o·stride - padding + r·dilation. For every
tap, the outputs whose input lies inside the (unpadded) input form one contiguous range, and
the inputs they read form one strided range. Lowering (im2col), its adjoint (col2im), the
direct tap-by-tap method and Winograd's tile gathering all index through these ranges, so no
algorithm needs a padded copy of its input.

    >>> [t.out for t in tap_slices((4,), (4,), (3,), (1,), (1,), (1,))]
    [(slice(1, 4, 1),), (slice(0, 4, 1),), (slice(0, 3, 1),)]
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from types import EllipsisType
from typing import cast

# A tensor index built from regions, e.g. ``(..., *tap.out)``: mypy joins such a tuple's items to
# ``object``, so the places that index a tensor with one cast it to this.
TensorIndex = tuple[EllipsisType | slice | int, ...]


@dataclasses.dataclass(frozen=True)
class TapSlice:
    tap: tuple[int, ...]  # kernel index per spatial dimension
    out: tuple[slice, ...]  # output positions (step 1) that this tap contributes to
    inp: tuple[slice, ...]  # the input positions they read (step = stride)


def _range(size_in: int, size_out: int, offset: int, stride: int) -> tuple[slice, slice] | None:
    # smallest o >= 0 with o*stride + offset >= 0
    lo = 0 if offset >= 0 else -(offset // stride)  # ceil(-offset / stride)
    # largest o < size_out with o*stride + offset <= size_in - 1
    hi = min(size_out - 1, (size_in - 1 - offset) // stride)
    if hi < lo:
        return None
    start = lo * stride + offset
    return slice(lo, hi + 1, 1), slice(start, hi * stride + offset + 1, stride)


@functools.lru_cache(maxsize=4096)
def tap_slices(input_size: tuple[int, ...], output_size: tuple[int, ...], kernel_size: tuple[int, ...],
               stride: tuple[int, ...], padding: tuple[int, ...], dilation: tuple[int, ...]) -> tuple[TapSlice, ...]:
    """Every tap whose region is not empty, in kernel order (taps reading only padding are left out)."""
    per_dim = []
    for h, p_out, r, s, p, d in zip(input_size, output_size, kernel_size, stride, padding, dilation):
        per_dim.append([_range(h, p_out, i * d - p, s) for i in range(r)])
    out = []
    for tap in itertools.product(*(range(r) for r in kernel_size)):
        ranges = [per_dim[dim][i] for dim, i in enumerate(tap)]
        if any(rg is None for rg in ranges):
            continue
        found = cast(list[tuple[slice, slice]], ranges)  # none is None: checked just above
        out.append(TapSlice(tap, tuple(rg[0] for rg in found), tuple(rg[1] for rg in found)))
    return tuple(out)


def problem_taps(problem) -> tuple[TapSlice, ...]:
    """``tap_slices`` for a ConvProblem."""
    return tap_slices(problem.input_size, problem.output_size, problem.kernel_size,
                      problem.stride, problem.padding, problem.dilation)
