"""find's search rules: the order it tries candidates in (``families_first``), the prices it prunes them by
(``SearchPrices``), and when it skips a candidate or stops (``SearchRules``). ``find`` follows them as it measures, and
``learned.simulated_find`` over recorded times: one copy of the rules, which the simulation shares with find (but for
the three of find's rules it leaves out, named in its docstring).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from .results import family_of

T = TypeVar("T")


def families_first(items: Sequence[T], name: Callable[[T], str]) -> tuple[list[T], int]:
    """``items`` (ranked best first) with the first of every ``family_of`` family ahead of the rest, and how many
    those are: the order ``find`` searches in (``find.search_order``), and its simulation (``learned``).

        >>> families_first(["cudnn:a", "triton:depthwise_fwd_p64", "cudnn:b", "gemm:1x1"], str)
        (['cudnn:a', 'triton:depthwise_fwd_p64', 'gemm:1x1', 'cudnn:b'], 3)
    """
    firsts: dict[str, T] = {}
    for item in items:
        firsts.setdefault(family_of(name(item)), item)
    head = list(firsts.values())
    return head + [item for item in items if item not in head], len(head)


class SearchPrices:
    """``get``'s predicted times as ``find`` prunes by them (``find``, and its simulation ``learned.simulated_find``).

    ``unpruned``: candidates never pruned by their price (``find``: a family's first try whose price is a guess of
    the learned model, ``learned.LearnedModel.guessed``: only running it tells). The first timing of a family sets
    its factor: where that candidate ran faster than predicted, the rest of the family is priced lower by as much
    (never higher, and later timings change nothing): a price off for a whole family (a kernel measured on few
    problems like this one) does not prune its other candidates too.

        >>> prices = SearchPrices({"triton:dw_fwd_a": 2.0, "triton:dw_fwd_b": 4.0, "cudnn:x": 1.0, "cudnn:y": 3.0},
        ...                       ["cudnn:x"])
        >>> prices("cudnn:x"), prices("triton:dw_fwd_b")
        (inf, 4.0)
        >>> prices.timed("cudnn:x", 2.0)  # slower than predicted: the family's prices stay
        >>> prices("cudnn:y")
        3.0
        >>> prices.timed("triton:dw_fwd_a", 0.5)  # a quarter of its price
        >>> prices("triton:dw_fwd_b"), prices("cudnn:z")
        (1.0, inf)
        >>> prices.timed("triton:dw_fwd_b", 0.01)  # the family's factor is set: a later timing changes nothing
        >>> prices("triton:dw_fwd_b")
        1.0
    """

    def __init__(self, predicted_ms: dict[str, float], unpruned: Sequence[str] = ()) -> None:
        self._predicted, self._unpruned = predicted_ms, frozenset(unpruned)
        self._scale: dict[str, float] = {}

    def __call__(self, name: str) -> float:
        """The time to prune ``name`` by (inf: never pruned; a candidate without a prediction is not)."""
        if name in self._unpruned:
            return math.inf
        return self._predicted.get(name, math.inf) * self._scale.get(family_of(name), 1.0)

    def timed(self, name: str, time_ms: float | None) -> None:
        """``name`` measured ``time_ms``: the first timing of its family sets the family's factor (a time that is not
        positive and finite sets nothing)."""
        family, predicted = family_of(name), self._predicted.get(name, math.inf)
        if family not in self._scale and time_ms is not None and 0 < time_ms < math.inf and 0 < predicted < math.inf:
            self._scale[family] = min(1.0, time_ms / predicted)


class SearchRules:
    """Which candidates of ``find``'s search run, in the order ``families_first`` gives, whose first ``head_size``
    are each family's first try, and when the search stops:

    - the prune: a candidate priced (``prices``) over ``prune_factor`` times the best measured is skipped (0: never);
    - the patience: once ``patience`` timed candidates in a row after the first tries gained nothing beyond
      ``tolerance`` on the best measured before them (0: never), the search has converged and the rest are skipped,
      except ``contenders`` (``learned.LearnedModel.contenders``); one of them that gains starts the count again.

    ``find`` asks before each candidate (``why_skipped``; there a candidate needing less workspace than every one
    measured runs all the same: ``measure.Search.try_candidate``) and tells it each ok timing (``timed``).

        >>> rules = SearchRules(SearchPrices({"a:x": 1.0, "a:y": 1.0, "a:z": 30.0}), 1, patience=1, tolerance=0.02,
        ...                     prune_factor=10.0, contenders=["a:z"])
        >>> rules.why_skipped("a:y", 1.0) is None
        True
        >>> rules.timed(1, "a:x", 1.0, best_before_ms=math.inf, best_ms=1.0)  # a family's first try: not counted
        >>> rules.timed(2, "a:y", 1.0, best_before_ms=1.0, best_ms=1.0)  # no faster: a patience of 1 runs out
        >>> rules.why_skipped("a:w", 1.0)
        'search converged: 1 candidates in a row were no faster than the best'
        >>> rules.why_skipped("a:z", 1.0)  # a contender runs after convergence, unless its price prunes it
        'predicted 30 ms, over 10x the best measured (1 ms)'
    """

    def __init__(self, prices: SearchPrices, head_size: int, *, patience: int, tolerance: float,
                 prune_factor: float, contenders: Iterable[str] = ()) -> None:
        self.prices, self.head_size = prices, head_size
        self.patience, self.tolerance, self.prune_factor = patience, tolerance, prune_factor
        self.contenders = frozenset(contenders)
        self._without_gain = 0  # timed candidates in a row, after the first tries, that gained nothing

    def why_skipped(self, name: str, best_ms: float) -> str | None:
        """Why the candidate ``name`` is not run, ``best_ms`` being the best measured so far; None: it runs."""
        if self.patience and self._without_gain >= self.patience and name not in self.contenders:
            return f"search converged: {self.patience} candidates in a row were no faster than the best"
        return self.pruned(self.prices(name), best_ms)

    def pruned(self, price_ms: float, best_ms: float) -> str | None:
        """Why a candidate priced ``price_ms`` is not run, ``best_ms`` being the best measured so far; None: it runs
        (an infinite price or best prunes nothing)."""
        prune = self.prune_factor
        if prune and math.isfinite(best_ms) and math.isfinite(price_ms) and price_ms > prune * best_ms:
            return f"predicted {price_ms:.4g} ms, over {prune:g}x the best measured ({best_ms:.4g} ms)"
        return None

    def no_gain(self, index: int) -> None:
        """The candidate at ``index`` ran and gave nothing the count takes as a result (find's runs for determinism's
        sake that were not deterministic): after the first tries, one more without gain, whatever the best."""
        if index > self.head_size:
            self._without_gain += 1

    def timed(self, index: int, name: str, time_ms: float | None, *, best_before_ms: float, best_ms: float) -> None:
        """The candidate ``name``, at ``index`` (from 1) in the search's order, timed ``time_ms``, and the best
        measured went from ``best_before_ms`` to ``best_ms``: its family's prices take it in (``SearchPrices.timed``),
        and after the first tries the patience count (a gain beyond the tolerance, or a first best, starts it again)."""
        self.prices.timed(name, time_ms)
        if index > self.head_size:
            gained = best_ms < best_before_ms * (1 - self.tolerance)
            self._without_gain = 0 if gained or not math.isfinite(best_before_ms) else self._without_gain + 1
