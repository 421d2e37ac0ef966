"""Which micro-batch split ``find`` tries (mu-cuDNN, Oyama et al., CLUSTER 2018): choosing, where
``algorithms.microbatch`` runs a split.

``best_split`` is mu-cuDNN's dynamic program. Given, for some sub-batch sizes b, the time T(b) and workspace W(b) of
an algorithm on b samples, the fastest way to cover n samples with sub-batches run one after another is
best(n) = min over b of T(b) + best(n - b), its workspace the largest W(b) used. ``micro_batch_offers`` is what
``find`` calls under ``Policy(micro_batching=True, workspace_limit=...)``: it measures the sub-batch problems (with
the ``find`` it is given) and offers, per algorithm, the split that pays.

    >>> best_split(6, {4: (3.0, 400, "a"), 2: (1.0, 200, "a"), 1: (0.9, 100, "a")}, workspace_limit=300)
    (3.0, 200, [(2, 3, 'a')])
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from .algorithms.base import Algorithm
from .algorithms.microbatch import MicroBatch, accumulator_bytes, sub_problem
from .policy import Policy
from .problem import ConvProblem
from .ranking import usable
from .results import PerfResult, Status

log = logging.getLogger(__name__)

# Divisors of n, besides the powers of two, tried as sub-batch sizes (the largest ones): each
# size costs a find of its own.
EXTRA_DIVISORS = 4
# Splits offered to find per search, best predicted first: each is verified and timed.
MAX_OFFERS = 4
# Whole-batch statuses that say the algorithm's workspace did not fit, so a split may rescue it.
DID_NOT_FIT = (Status.OVER_WORKSPACE_LIMIT, Status.OUT_OF_MEMORY)

Option = tuple[float, int, Any]  # (time_ms, workspace_bytes, algorithm) of one sub-batch size


def best_split(n: int, options: Mapping[int, Option],
               workspace_limit: int | None = None) -> tuple[float, int, list[tuple[int, int, Any]]] | None:
    """The fastest cover of a batch of ``n`` by sub-batches, each size's time and workspace given.

    options: sub-batch size b -> (time_ms, workspace_bytes, algorithm) of running b samples;
    sizes above ``n``, non-finite times and workspaces over ``workspace_limit`` (None: no limit)
    are left out. Returns (total time_ms, workspace_bytes = the largest used,
    [(b, count, algorithm), ...] largest b first), among equal times the smallest workspace; or
    None when the usable sizes cannot add up to ``n``. Raises ``ValueError`` for ``n`` < 1.

        >>> best_split(5, {2: (1.0, 50, "x"), 1: (0.6, 10, "x")})
        (2.6, 50, [(2, 2, 'x'), (1, 1, 'x')])
        >>> best_split(3, {2: (1.0, 50, "x")}) is None
        True
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"best_split(n={n!r}): the batch must be an int >= 1")
    fits = sorted((b, t, w) for b, (t, w, _) in options.items()
                  if 1 <= b <= n and math.isfinite(t) and (workspace_limit is None or w <= workspace_limit))
    # best[m]: (time, workspace, last size) of the best cover of m samples; None: no cover.
    best: list[tuple[float, int, int] | None] = [None] * (n + 1)
    best[0] = (0.0, 0, 0)
    for m in range(1, n + 1):
        for b, t, w in fits:
            if b > m:
                break
            rest = best[m - b]
            if rest is None:
                continue
            # Time adds and workspace is a max, so (time, workspace) in that order has optimal substructure.
            candidate = (rest[0] + t, max(rest[1], w), b)
            current = best[m]
            if current is None or candidate[:2] < current[:2]:
                best[m] = candidate
    final = best[n]
    if final is None:
        return None
    counts: dict[int, int] = {}
    m = n
    while m:
        b = cast(tuple[float, int, int], best[m])[2]  # every m on the path back from n has a cover
        counts[b] = counts.get(b, 0) + 1
        m -= b
    split = [(b, counts[b], options[b][2]) for b in sorted(counts, reverse=True)]
    return final[0], final[1], split


def sub_batch_sizes(n: int, extra_divisors: int = EXTRA_DIVISORS) -> list[int]:
    """The sub-batch sizes worth measuring for a batch of ``n``: the powers of two below ``n``
    and its largest ``extra_divisors`` other divisors below ``n``, ascending.

        >>> sub_batch_sizes(24)
        [1, 2, 3, 4, 6, 8, 12, 16]
    """
    powers = {1 << i for i in range(n.bit_length()) if 1 << i < n}
    divisors = [d for d in range(2, n) if n % d == 0 and d not in powers]
    return sorted(powers | set(divisors[max(0, len(divisors) - extra_divisors):]))


@dataclasses.dataclass(frozen=True)
class Offer:
    """One split ``find`` should try: the algorithm, the sum of its sub-batch times, why it is offered."""

    algorithm: MicroBatch
    predicted_ms: float
    note: str


def micro_batch_offers(problem: ConvProblem, policy: Policy, results: Sequence[PerfResult],
                       find_sub: Callable[[ConvProblem, Policy], list[PerfResult]],
                       candidates: Sequence[Algorithm] | None = None) -> list[Offer]:
    """The splits worth trying for ``problem`` after its whole-batch search gave ``results``.

    find_sub(sub_problem, policy): ``find`` on a sub-batch problem (micro-batching off there).
    candidates: the algorithms the search was given (None: the registry's, resolved by name per
    sub-batch). For each algorithm, its usable sub-batch results and whole-batch one feed
    ``best_split`` under the workspace limit (less what a split adds: bwd_filter's sum); a split
    of more than one sub-batch is offered when it beats the best whole-batch time or the
    algorithm's own whole-batch run did not fit (over the limit, out of memory). At most
    ``MAX_OFFERS``, fastest predicted first. Nothing for n = 1 or without a workspace limit.
    """
    if problem.n < 2 or policy.workspace_limit is None:
        return []
    sub_policy = dataclasses.replace(policy, micro_batching=False)
    options: dict[str, dict[int, Option]] = {}
    for b in sub_batch_sizes(problem.n):
        for r in find_sub(sub_problem(problem, b), sub_policy):
            if usable(r, sub_policy, problem.dtype):
                # usable: time_ms is not None
                options.setdefault(r.algorithm, {})[b] = (cast(float, r.time_ms), r.workspace_bytes, r.algorithm)
    whole = {r.algorithm: r for r in results}
    for r in results:
        if usable(r, policy, problem.dtype):
            options.setdefault(r.algorithm, {})[problem.n] = (cast(float, r.time_ms), r.workspace_bytes, r.algorithm)
    best_whole_ms = min((cast(float, r.time_ms) for r in results if usable(r, policy, problem.dtype)), default=math.inf)
    # Policy parses a workspace_limit given as a size string to its int bytes.
    limit = cast(int, policy.workspace_limit) - accumulator_bytes(problem)
    by_name = {a.name: a for a in candidates or ()}
    offers = []
    for name, sizes in options.items():
        found = best_split(problem.n, sizes, limit)
        if found is None or found[2] == [(problem.n, 1, name)]:
            continue
        time_ms, _, split = found
        counterpart = whole.get(name)
        rescued = counterpart is not None and counterpart.status in DID_NOT_FIT
        if not (time_ms < best_whole_ms or rescued):
            continue
        parts = " + ".join(f"{c} x {b}" for b, c, _ in split)
        why = f"its whole batch was {cast(PerfResult, counterpart).status.value}" if rescued else (
            f"the best whole batch took {best_whole_ms:.4g} ms")
        offers.append(Offer(MicroBatch(by_name.get(name, name), [(b, c) for b, c, _ in split]), time_ms,
                            f"micro-batched {parts} samples; sub-batch times sum to {time_ms:.4g} ms ({why})"))
    offers.sort(key=lambda o: o.predicted_ms)
    for offer in offers:
        log.info("micro-batching offers %s: %s", offer.algorithm.name, offer.note)
    return offers[:MAX_OFFERS]
