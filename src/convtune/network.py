"""Tuning a network, the one way convtune does it: select every layer, then plan under a workspace budget.

The command line (``convtune tune``) and ``optimize`` both tune many layers this way:
``select_layers`` asks ``Tuning.select`` for each layer (a progress bar shows it), and where a
workspace budget is given ``plan_layers`` makes ``convtune.plan``'s choices of least total time
within it, from the stored measurements; ``planned_rows`` puts the plan's choices back in the
layers' rows. What each caller does with a budget that cannot be met is its own: the command line
refuses it, ``optimize`` keeps each layer's own choice.

    >>> from convtune import ConvProblem
    >>> p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(6, 6), kernel_size=3, padding=1)
    >>> rows = select_layers([("conv1", p, 2)], Tuning(mode="get"), show_progress=False)
    >>> rows[0].name, rows[0].count, rows[0].result is not None
    ('conv1', 2, True)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from . import background
from .errors import NoAlgorithmError, check_one_of, check_type
from .hardware import roofline_ms
from .policy import DEFAULT_POLICY, Policy
from .problem import ConvProblem, pytorch_deterministic
from .progress import tuning_bar
from .results import PerfResult
from .select import MEASURES, READS_DB, SELECTION_MODES, select, stored

if TYPE_CHECKING:
    from .plan import Plan


def deterministic_where_pytorch_asks(policy: Policy) -> Policy:
    """``policy``, asking for determinism where PyTorch is asked for it now (``problem.pytorch_deterministic``), as
    PyTorch's own convolutions then compute: a model tuned there gets no algorithm that may differ run to run
    (atomics)."""
    if policy.deterministic or not pytorch_deterministic():
        return policy
    return dataclasses.replace(policy, deterministic=True)


class Tuning:
    """How layers choose: ``select(problem, policy, mode, db)``, with a memo of the answers; the policy deterministic
    where PyTorch is asked for deterministic algorithms when the Tuning is made (``deterministic_where_pytorch_asks``).

    db: a ``TuningDB`` (or its path: where it cannot be opened, the process's temporary database, warned;
    ``db.opened``); None takes the default ``TuningDB()`` for the modes that read one ('hybrid',
    'db_then_get'), opened on first need. Copies of a model share their Tuning; pickling keeps the
    database's path as given (or the opened database's), not its connection.
    """

    def __init__(self, policy: Policy | None = None, mode: str = "hybrid", db: Any = None) -> None:
        check_one_of("mode", mode, SELECTION_MODES)
        check_type(policy, Policy, "policy", optional=True)
        from convtune.db import check_db

        check_db(db, "the tuning")
        self.policy = deterministic_where_pytorch_asks(DEFAULT_POLICY if policy is None else policy)
        self.mode = mode
        self._db = db
        self._given = db  # what pickling keeps (a temporary database standing in for a path is this process's)
        self._opened = False  # _db is what to use from now on (a path is opened once; None may be the answer)
        self._memo: dict[str, PerfResult] = {}
        self._waiting: dict[str, int] = {}  # mode 'background': key -> generation its model choice was made at

    def __repr__(self) -> str:
        return f"Tuning(policy={self.policy}, mode={self.mode!r})"

    @property
    def db(self) -> Any:
        if self._opened:
            return self._db
        if isinstance(self._db, (str, os.PathLike)):
            from convtune.db import opened

            self._db = opened(self._db)  # where it cannot be opened: a temporary one, warned
        elif self._db is None and self.mode in READS_DB:
            from convtune.db import opened

            self._db = opened()
        else:
            return self._db  # None in a mode that reads no database: decided again if the mode changes
        self._opened = True
        return self._db

    @property
    def measures(self) -> bool:
        """Whether this tuning's mode measures what the database does not know ('hybrid', 'find')."""
        return self.mode in MEASURES

    def select(self, problem: ConvProblem) -> PerfResult:
        """The choice for ``problem``, asked once per Tuning; in mode 'background' a choice of the cost model is
        asked again once its measurement has finished (``waiting_since``). Raises ``NoAlgorithmError``."""
        key = problem.key
        known = self._memo.get(key)
        if known is not None:
            since = self._waiting.get(key)
            if since is None or since == background.generation():
                return known
            if background.queued(problem, self.policy, self.db):  # others finished: still waiting
                self._waiting[key] = background.generation()
                return known
            del self._memo[key]  # measured (or failed) since: the database, else the model, again
            self._waiting.pop(key, None)
        at = background.generation()  # before queuing: a measurement that finishes at once still shows
        chosen = self._memo[key] = select(problem, self.policy, self.mode, self.db)
        # In mode 'background' the cost model's choice waits on its measurement while queued, or while a
        # generation has passed (it may have finished already; one that failed before is not queued again).
        if self.mode == "background" and chosen.time_ms is None and (
                background.queued(problem, self.policy, self.db) or background.generation() != at):
            self._waiting[key] = at
        return chosen

    def waiting_since(self, key: str) -> int | None:
        """The ``background.generation()`` at which the choice for ``key`` was last made while its measurement
        was queued, or None when it is not waiting for one."""
        return self._waiting.get(key)

    def stored(self, problem: ConvProblem) -> PerfResult | None:
        """The database's answer for ``problem`` (what 'hybrid' selects without measuring), or None; an
        answer is remembered as the choice, so selecting it later reads nothing again."""
        if problem.key not in self._memo:
            hit = stored(problem, self.policy, self.db) if self.mode in READS_DB else None
            if hit is None:
                return None
            self._memo[problem.key] = hit
        return self._memo[problem.key]

    def __deepcopy__(self, memo: dict) -> Tuning:
        return self  # a choice, not state: copies of a model choose alike

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        given = self._given
        if not isinstance(given, (str, Path)):  # a database object: its path; None: the default, found again
            given = getattr(given, "path", None)
        state["_db"] = state["_given"] = None if given is None else str(given)
        state["_opened"] = False
        state["_memo"] = {}
        state["_waiting"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        # pickled before mode 'background' existed: no _waiting; before _given and _opened: neither
        self.__dict__.update({"_waiting": {}, "_opened": False, "_given": state.get("_db"), **state})


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One layer of a tuned network: its problem, how often it runs, what was chosen."""

    name: str
    problem: ConvProblem
    count: int
    result: PerfResult | None  # None when nothing could serve the layer
    error: str = ""

    @property
    def floor_ms(self) -> float:
        return roofline_ms(self.problem)

    def to_dict(self) -> dict:
        r = self.result
        return {"layer": self.name, "problem": self.problem.key, "count": self.count,
                "algorithm": r.algorithm if r else None, "status": r.status.value if r else "no_algorithm",
                "time_ms": r.time_ms if r else None, "workspace_bytes": r.workspace_bytes if r else None,
                "floor_ms": self.floor_ms, "message": (r.message if r else self.error)}


def select_layers(layers: Sequence[tuple[str, ConvProblem, int]], tuning: Tuning, label: str = "tuning",
                  console: Console | None = None, show_progress: bool = True, transient: bool = False,
                  groups: Sequence[Hashable] | None = None) -> list[LayerRow]:
    """A row per ``(name, problem, count)`` with ``tuning``'s choice, or, where no algorithm serves the
    problem under the policy, none and the reason; a progress bar (``label`` and the layer's name) on
    ``console`` (stderr by default) unless ``show_progress`` is off. ``groups`` (one per layer): once a
    layer of a group is not served, the later layers of that group are not selected (a module's
    backward directions after its forward: the module runs PyTorch's convolution anyway)."""
    rows: list[LayerRow] = []
    failed: dict[Hashable, str] = {}
    with tuning_bar(label, len(layers), console, disable=not show_progress, transient=transient) as (bar, task):
        for i, (name, problem, count) in enumerate(layers):
            bar.update(task, description=f"{label} {name}")
            group = groups[i] if groups is not None else i
            if group in failed:
                rows.append(LayerRow(name, problem, count, None, f"not selected: {failed[group]}"))
            else:
                try:
                    rows.append(LayerRow(name, problem, count, tuning.select(problem)))
                except NoAlgorithmError as exc:
                    rows.append(LayerRow(name, problem, count, None, str(exc)))
                    failed[group] = f"{problem.direction}: {exc}"
            bar.advance(task)
    return rows


# A plan lists every run of every layer (its 'divided' mode merges them one by one): 10,000 runs took 45 s and 2.3 GB
# on 2 cores, and a count of 10**23 in a layer file grew the list until the process was killed.
MAX_PLANNED_RUNS = 10_000


def check_plannable(counts: Sequence[int], what: str) -> None:
    """``ValueError`` naming ``what`` (the network) where its layers' ``counts`` add up to more runs than a plan
    takes (``MAX_PLANNED_RUNS``)."""
    total = sum(counts)
    if total > MAX_PLANNED_RUNS:
        raise ValueError(f"{what}: its layers run {total} times in all (their counts), more than a workspace plan "
                         f"takes ({MAX_PLANNED_RUNS} runs, each planned on its own); give smaller counts, or tune "
                         f"without a workspace budget")


def plan_layers(rows: Sequence[LayerRow], tuning: Tuning, workspace_budget: int, mode: str = "shared") -> Plan:
    """``convtune.plan`` of the served rows (a layer run ``count`` times is ``count`` problems, in order)
    within ``workspace_budget``, from ``tuning``'s database and policy, measuring what is missing where
    the tuning's mode measures. Raises ``InfeasibleBudgetError`` (with the smallest feasible budget),
    ``NoAlgorithmError`` (a problem without stored measurements, in a mode that never measures) and
    ``ValueError`` (more runs than a plan takes, ``check_plannable``)."""
    from .plan import plan

    check_plannable([row.count for row in rows if row.result], "the network")
    problems = [row.problem for row in rows if row.result for _ in range(row.count)]
    return plan(problems, workspace_budget, db=tuning.db, policy=tuning.policy, mode=mode,
                find_missing=tuning.measures)


def planned_rows(rows: Sequence[LayerRow], planned: Plan) -> list[LayerRow]:
    """``rows`` with the choices of ``planned`` (made by ``plan_layers`` from these rows): a row per layer and
    choice (a divided budget may give the runs of one layer different algorithms); rows the plan did not
    cover (nothing served them) as they were."""
    runs = iter(zip(planned.problems, planned.choices))
    out = []
    for row in rows:
        if not row.result or row.count < 1:  # nothing planned for it
            out.append(row)
            continue
        by_choice: dict[str, list[tuple[ConvProblem, PerfResult]]] = {}
        for problem, choice in (next(runs) for _ in range(row.count)):
            by_choice.setdefault(choice.algorithm, []).append((problem, choice))
        out += [LayerRow(row.name, same[0][0], len(same), same[0][1]) for same in by_choice.values()]
    return out


def run_names(rows: Sequence[LayerRow]) -> list[str]:
    """The layer name of each problem ``plan_layers`` plans, in its order (a name per run of a served row)."""
    return [row.name for row in rows if row.result for _ in range(row.count)]
