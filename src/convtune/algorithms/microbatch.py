"""Micro-batching (mu-cuDNN, Oyama et al., CLUSTER 2018): one algorithm run over slices of the batch.

An algorithm whose workspace grows with the batch may not fit a workspace limit on the whole
batch, yet fit it on a sub-batch. Run over consecutive sub-batches one after another, it needs
the largest sub-batch's workspace only, and takes the sum of the sub-batch times. The batch is
the outermost dimension in both layouts, so every slice ``t[i:j]`` is dense in the problem's
layout and no operand is copied: fwd ``y[i:j] = inner(x[i:j], w)``; bwd_data
``dx[i:j] = inner(dy[i:j], w)``; bwd_filter ``dw = sum of inner(x[i:j], dy[i:j])``, summed into one
gradient (through a float32 accumulator for float16/bfloat16, rounded once at the end).

Name: ``mb:<inner backend>.<inner variant>_s<b1>x<c1>_<b2>x<c2>...``: ``c1`` slices of ``b1``
samples, then ``c2`` of ``b2``, in that order. The ``mb`` backend resolves such a name for a
problem, so results stored in the database run again; it lists nothing itself: ``find`` asks
``convtune.microbatch_search.micro_batch_offers`` which splits to try, then verifies and times each like any
candidate.

    >>> from convtune import ConvProblem, get_algorithm
    >>> p = ConvProblem("fwd", n=5, c=4, k=4, input_size=(6, 6), kernel_size=3)
    >>> mb = get_algorithm("mb:torch.native_s2x2_1x1", p)
    >>> mb.inner_name, mb.split, mb.slices()
    ('torch:native', ((2, 2), (1, 1)), [(0, 2), (2, 4), (4, 5)])
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import cast

import torch

from .. import tf32
from ..costmodel import Cost
from ..problem import ConvProblem, layout_order
from ..results import MICRO_BATCH_BACKEND
from .base import (
    SUPPORTED,
    Algorithm,
    Backend,
    Buffer,
    NumericNotes,
    Support,
    buffers_bytes,
    unsupported,
)
from .registry import declared_cost, get_algorithm, register, splits_batch_of

log = logging.getLogger(__name__)

_MB_NAME = re.compile(rf"^{MICRO_BATCH_BACKEND}:(?P<backend>[a-z0-9_]+)\.(?P<variant>[A-Za-z0-9_.=\-]+)"
                      r"_s(?P<split>\d+x\d+(?:_\d+x\d+)*)$")


def micro_batch_name(inner_name: str, split: Sequence[tuple[int, int]]) -> str:
    """The name of ``inner_name`` run over ``split`` ((sub-batch size, count) pairs, in order).

        >>> micro_batch_name("gemm:im2col", [(4, 2), (1, 1)])
        'mb:gemm.im2col_s4x2_1x1'
    """
    backend, variant = inner_name.split(":", 1)
    return f"{MICRO_BATCH_BACKEND}:{backend}.{variant}_s" + "_".join(f"{b}x{c}" for b, c in split)


def parse_micro_batch_name(name: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """(inner name, split) of a micro-batched algorithm's name; ``KeyError`` if it is not one.

    The split is the name's last ``_s...`` part (it holds no letter 's'), so an inner variant
    may itself contain ``_s``.

        >>> parse_micro_batch_name("mb:triton.igemm_64x64_s3_w4_s8x3_2x1")
        ('triton:igemm_64x64_s3_w4', ((8, 3), (2, 1)))
    """
    match = _MB_NAME.match(name) if isinstance(name, str) else None
    if match is None:
        raise KeyError(f"{name!r} is not a micro-batched algorithm name; expected "
                       f"'mb:<backend>.<variant>_s<size>x<count>[_<size>x<count>...]', e.g. 'mb:gemm.im2col_s4x2'")
    split = tuple(tuple(int(v) for v in part.split("x")) for part in match["split"].split("_"))
    return f"{match['backend']}:{match['variant']}", split  # type: ignore[return-value]


@functools.lru_cache(maxsize=1024)
def sub_problem(problem: ConvProblem, n: int) -> ConvProblem:
    """``problem`` with a batch of ``n`` (cached: runs ask for the same few again and again)."""
    return problem.replace(n=n)


def _dense_view(raw: torch.Tensor, layout: str) -> torch.Tensor:
    """A contiguous buffer stored in ``layout``'s memory order, seen in logical (N, C, *spatial) order."""
    order = layout_order(raw.dim(), layout)
    return raw.permute(sorted(range(len(order)), key=lambda i: order[i]))


def _stored_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    return tuple(shape[i] for i in layout_order(len(shape), layout))


def accumulator_buffers(problem: ConvProblem) -> list[Buffer]:
    """The scratch a split bwd_filter adds to the inner's: the weight gradient of one slice
    (``partial``) and, for float16/bfloat16, the float32 sum (``accumulator``). None otherwise."""
    if problem.direction != "bwd_filter":
        return []
    shape = _stored_shape(problem.w_shape, problem.layout)
    extra = [Buffer("partial", shape, problem.torch_dtype)]
    if problem.dtype != "float32":
        extra.append(Buffer("accumulator", shape, torch.float32))
    return extra


class MicroBatch(Algorithm):
    """``inner`` run over consecutive sub-batches: ``split`` is ((size, count), ...) in order.

    inner: an ``Algorithm`` used for every sub-batch (algorithms of fixed name), or an algorithm
    name resolved per sub-batch problem through ``get_algorithm`` (a backend's candidates belong to
    one problem each). A bad split or a micro-batched inner raises ``ValueError``.
    """

    splits_batch = True

    def __init__(self, inner: Algorithm | str, split: Sequence[tuple[int, int]]) -> None:
        self.inner_name = inner.name if isinstance(inner, Algorithm) else inner
        if not isinstance(self.inner_name, str) or ":" not in self.inner_name:
            raise ValueError(f"MicroBatch inner={inner!r} must be an Algorithm or a 'backend:variant' name")
        if splits_batch_of(self.inner_name):
            raise ValueError(f"MicroBatch inner={self.inner_name!r} is micro-batched already; split its inner once")
        pairs = tuple(tuple(pair) for pair in split)
        if not pairs or any(len(p) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in p)
                            for p in pairs):
            raise ValueError(f"MicroBatch split={pairs!r} must be a non-empty sequence of (size, count) "
                             f"pairs of ints >= 1, e.g. [(4, 2), (1, 1)]")
        self._inner = inner if isinstance(inner, Algorithm) else None
        # Every pair has length 2: checked just above.
        self.split = cast(tuple[tuple[int, int], ...], pairs)
        self.name = micro_batch_name(self.inner_name, self.split)
        super().__init__()
        if self._inner is not None:
            self.devices, self.directions = self._inner.devices, self._inner.directions

    @property
    def origin(self) -> str:
        # The sub-batches run the inner algorithm's code: a plug-in's, where it is one.
        if self._inner is not None:
            return self._inner.origin
        try:
            return get_algorithm(self.inner_name).origin
        except KeyError:  # a backend's candidate (it needs its problem) or nothing registered: convtune's backends
            return type(self).__module__

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        # The sub-batches do the inner algorithm's work on the whole batch, one after another.
        return declared_cost(self.inner_name)(problem, workspace_bytes)

    @property
    def n(self) -> int:
        """The batch this split covers."""
        return sum(b * c for b, c in self.split)

    @property
    def sizes(self) -> list[int]:
        """The distinct sub-batch sizes."""
        return sorted({b for b, _ in self.split})

    def slices(self) -> list[tuple[int, int]]:
        """(start, stop) of every sub-batch, in the order they run."""
        out, start = [], 0
        for b, count in self.split:
            for _ in range(count):
                out.append((start, start + b))
                start += b
        return out

    def inner_for(self, sub: ConvProblem) -> Algorithm:
        """The inner algorithm of one sub-batch problem (``KeyError`` if its name is not offered for it)."""
        return self._inner if self._inner is not None else get_algorithm(self.inner_name, sub)

    def _subs(self, problem: ConvProblem) -> list[tuple[ConvProblem, Algorithm]]:
        return [(s, self.inner_for(s)) for s in (sub_problem(problem, b) for b in self.sizes)]

    # -- what the base class asks --------------------------------------------------------------
    def _supports(self, problem: ConvProblem) -> Support:
        if problem.n != self.n:
            return unsupported(f"splits a batch of {self.n}, the problem's batch is {problem.n}")
        for b in self.sizes:
            sub = sub_problem(problem, b)
            try:
                support = self.inner_for(sub).supports(sub)
            except KeyError as exc:
                return unsupported(f"{self.inner_name} is not offered for a sub-batch of {b}: {exc}")
            if not support:
                return unsupported(f"{self.inner_name} on a sub-batch of {b}: {support.reason}")
        alignment = max(self.inner_for(sub_problem(problem, b)).alignment for b in self.sizes)
        if alignment > 1:  # a sub-batch's operands start its first sample's bytes into the batch's
            batched = [problem.operand_shapes[i] for i in ((0, 1) if problem.direction == "bwd_filter" else (0, 2))]
            for start, _ in self.slices():
                offset = max(start * math.prod(shape[1:]) * problem.torch_dtype.itemsize % alignment
                             for shape in batched)
                if offset:
                    return unsupported(f"the sub-batch from sample {start} starts {offset} bytes past an address "
                                       f"aligned to the {alignment} bytes {self.inner_name} assumes")
        return SUPPORTED

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        # One workspace serves every sub-batch in turn: the largest need is enough.
        inner_bytes = max(inner.buffer_bytes(sub) for sub, inner in self._subs(problem))
        extra = accumulator_buffers(problem) if len(self.slices()) > 1 else []
        return [Buffer("inner", (inner_bytes,), torch.uint8), *extra]

    def library_bytes(self, problem: ConvProblem) -> int:
        return max(inner.library_bytes(sub) for sub, inner in self._subs(problem))

    def known_workspace_bytes(self, problem: ConvProblem) -> int | None:
        # Known once every sub-batch's inner knows its own: asking builds no cuDNN execution plan of a split.
        if any(inner.known_workspace_bytes(sub) is None for sub, inner in self._subs(problem)):
            return None
        return self.workspace_bytes(problem)

    def tf32_settings(self, problem: ConvProblem) -> tf32.Settings:
        sub, inner = self._subs(problem)[0]  # (every sub-batch has the problem's dtype and TF32 setting)
        return inner.tf32_settings(sub)

    def notes(self, problem: ConvProblem) -> NumericNotes:
        notes = [inner.notes(sub) for sub, inner in self._subs(problem)]
        fields = dataclasses.fields(NumericNotes)
        return NumericNotes(**{f.name: any(getattr(n, f.name) for n in notes) for f in fields})

    def is_deterministic(self, problem: ConvProblem) -> bool | None:  # type: ignore[override]
        # The slices and the sum run in a fixed order: as deterministic as the inner is.
        answers = [inner.is_deterministic(sub) for sub, inner in self._subs(problem)]
        if any(a is False for a in answers):
            return False
        return None if any(a is None for a in answers) else True

    def _run(self, problem: ConvProblem, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
             ws: dict[str, torch.Tensor]) -> None:
        workspace = ws["inner"]
        inners = {sub.n: (sub, inner) for sub, inner in self._subs(problem)}
        if problem.direction != "bwd_filter":
            for start, stop in self.slices():
                sub, inner = inners[stop - start]
                inner.run(sub, a[start:stop], b, workspace=workspace, out=out[start:stop])
            return
        partial = _dense_view(ws["partial"], problem.layout) if "partial" in ws else None
        acc = _dense_view(ws["accumulator"], problem.layout) if "accumulator" in ws else None
        # The first slice writes the gradient itself; each later one its own part, added in.
        total = acc if acc is not None else out
        for i, (start, stop) in enumerate(self.slices()):
            sub, inner = inners[stop - start]
            inner.run(sub, a[start:stop], b[start:stop], workspace=workspace, out=out if i == 0 else partial)
            if i == 0:
                if acc is not None:
                    acc.copy_(out)
            else:
                # bwd_filter's buffers always include "partial" (accumulator_buffers)
                total.add_(cast(torch.Tensor, partial))
        if acc is not None:
            out.copy_(acc)  # rounded to the half dtype once, after the whole sum


def accumulator_bytes(problem: ConvProblem) -> int:
    """Workspace bytes a split adds to its inner's for ``problem`` (bwd_filter's sum; 0 otherwise)."""
    return buffers_bytes(accumulator_buffers(problem))


class MicroBatchBackend(Backend):
    """Resolves ``mb:...`` names for a problem. It lists nothing: ``find`` offers the splits."""

    prefix = MICRO_BATCH_BACKEND
    splits_batch = True

    def algorithms(self, problem: ConvProblem) -> list[Algorithm]:
        return []

    def declared_cost(self, name: str) -> Callable[[ConvProblem, int], Cost]:
        # Its inner algorithm's cost on the whole batch: the sub-batches do the same work in turn.
        return declared_cost(parse_micro_batch_name(name)[0])

    def get(self, name: str, problem: ConvProblem) -> Algorithm:
        """The micro-batched algorithm ``name`` for ``problem``; ``KeyError`` naming why if there is none."""
        inner_name, split = parse_micro_batch_name(name)
        algorithm = MicroBatch(inner_name, split)
        support = algorithm.supports(problem)
        if not support:
            raise KeyError(f"{name!r} cannot compute {problem.key}: {support.reason}")
        return algorithm


BACKEND = register(MicroBatchBackend())
