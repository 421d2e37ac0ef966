"""A learned correction of the cost model: built from one device's measurements, used on that device.

The analytic model (``costmodel``) prices a candidate from its family's roofline terms; on a real GPU its
order of the candidates is often wrong. The learned model answers from what was measured on problems like
the one asked: the ``NEIGHBOURS`` measured problems of the same direction nearest to it (by the distance of
their features: sizes, strides, groups, dtype and layout, as logarithms or switches, each scaled to unit
spread), weighted by closeness. A candidate's price is the best time the neighbours suggest for the problem
(their best measured time over the problem's floor, ``hardware.roofline_ms``, carried to this problem's
floor) times how far from their best the candidate measured on them (a weighted mean of log2(time / best)).
A candidate is known by its name (a cuDNN execution plan's engine and knobs, a tile configuration) and, for
a backend that lists its candidates best first by its own heuristics (cuDNN), also by its place in that list
when it is one of the first ``PLACE_KEYS``: "cuDNN's second plan" is a candidate that means something on
every problem, where a plan's name may be measured on few. A candidate known to the neighbours by its place
but not by its name is priced no better than half what its engine's best plan measured on them (``ENGINE_MARGIN``):
cuDNN's first plan can be of an engine that ran many times slower than the best on every one of them. A candidate
measured on too few of the
neighbours (less than ``MIN_SUPPORT`` of their weight) is priced as the neighbours' typical candidate, or
by its analytic price times their typical correction if that is higher: it is not picked on a guess. No price
is below the problem's floor, and the model answers for a direction only once ``MIN_MEASURED`` problems of it
are measured (fewer said less than the analytic model).

Why neighbours and not a fitted network: judged on networks left out of the data (bench/learned_get.py,
docs/performance.md), picking by how candidates fared on the nearest problems beat three multilayer
perceptrons trained on the same measurements (which priced every candidate, then ranked by the prices)
and, over all directions together, cuDNN's own heuristics; it needs no training (``train`` builds a table
in a second, deterministically) and answers a new problem in about a millisecond.

``get`` prices with the model of the database it is given (``costmodel.Corrections``: built from the
database's measurements on this device when first asked, then extended with each problem ``find`` stores), on
top of the model installed for this device (its fingerprint) where there is one; with neither, the analytic
model serves alone.

Install one built from a tuning database with ``convtune train-get`` (or ``train`` and ``save``), so that
``get`` without that database (another process, another database) answers from it too: it is stored as
``learned_get_<device>.pt`` in the cache folder (beside the default database), or where
``settings.learned_model`` points: that is where ``get`` looks. A file that is damaged, of another
feature version or of another device is ignored with a warning, never used; one built with other
software (a new cuDNN) is used, with a warning, until it is built again.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import math
import os
import pickle
import random
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from . import hardware
from .errors import first_line
from .files import writable, write_whole
from .problem import DIRECTIONS, ConvProblem
from .results import backend_of
from .search_rules import SearchPrices, SearchRules, families_first
from .settings import settings

log = logging.getLogger(__name__)

FEATURE_VERSION = 9  # 4-9: the nearest measured problems (5: each row's count; 6: corrections taken against prices
# with the Triton configurations' measured factors; 7: places up to 8; 8: engines; 9: the folded kernels' factors);
# 3 and before: multilayer perceptrons
NEIGHBOURS = 30  # measured problems a price is taken from (20 to 50 judged alike: docs/performance.md)
MIN_MEASURED = 2 * NEIGHBOURS  # with fewer problems of a direction measured, no answer for it: a database of a few
# problems picked far worse than the analytic model, one of about 30 a direction a little worse (docs/performance.md)
MIN_SUPPORT = 0.7  # of the neighbours' weight that must have measured a candidate for its own price
PLACE_KEYS = 8  # a candidate among the first PLACE_KEYS of its backend's order is also known by its place (4 left find
# one held-out layer whose best plan was cuDNN's fifth: docs/performance.md)
ENGINE_MARGIN = 1.0  # log2: a price from a candidate's place alone is at least half its engine's (1-2 alike, 0.5 worse)
MAX_LOG2_FACTOR = 20.0  # a price at most a million times the analytic one either way (a guard, not a model)
RECHECK_S = 1.0  # how often get looks at the model file again (train-get and save() are seen at once)
MEMO_PROBLEMS = 4096  # neighbourhoods kept per model
_DTYPES = ("float32", "float16", "bfloat16")


def problem_features(p: ConvProblem) -> list[float]:
    """What the model knows of a problem: sizes as log2, shapes of the computation, switches."""
    def log2(value: float) -> float:
        return math.log2(max(value, 1))

    taps = math.prod(p.kernel_size)
    return [
        log2(p.n), log2(p.c), log2(p.k), log2(p.groups), log2(p.c // p.groups), log2(p.k // p.groups),
        log2(math.prod(p.input_size)), log2(math.prod(p.output_size)), log2(taps), float(max(p.stride)),
        float(max(p.dilation)), float(any(p.padding)), float(p.ndim), float(len(set(p.kernel_size)) > 1),
        log2(p.flops), log2(p.min_bytes), float(p.groups == p.c > 1),
        *(float(p.direction == d) for d in DIRECTIONS), *(float(p.dtype == d) for d in _DTYPES),
        float(p.dtype == "float32" and p.allow_tf32), float(p.layout == "channels_last"),
    ]


def keys(name: str, order: int | None) -> list[str]:
    """What a candidate is known by: its name, and its place in its backend's heuristic order where that is one of
    the first ``PLACE_KEYS`` ('cudnn@1': cuDNN's second plan)."""
    if order is None or not 0 <= order < PLACE_KEYS:
        return [name]
    return [name, f"{backend_of(name)}@{order}"]


def engine_key(name: str) -> str:
    """The key of the engine a plan belongs to: its name up to its first knob ('cudnn:eng1*' for
    'cudnn:eng1_k2=0_k3=0', 'cudnn:eng1_i7' and 'cudnn:eng1'). A row keeps under it the best of the engine's plans it
    measured, for the backends that placed their candidates there (``_rows``); a price taken from a candidate's place
    alone is held to it (``_log2_price``)."""
    backend, _, variant = name.partition(":")
    return f"{backend}:{variant.split('_', 1)[0]}*"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One measurement: the candidate ``name`` took ``measured_ms`` on ``problem``; the analytic model said
    ``analytic_ms``; ``order``: its place in its backend's heuristic order (None: not known or none)."""

    problem: ConvProblem
    name: str
    analytic_ms: float
    measured_ms: float
    order: int | None = None


_MISSING = object()


@dataclasses.dataclass(frozen=True)
class _Neighbourhood:
    """The neighbours of one asked problem: their indices and weights, and what they say of it as log2 values:
    its best time, its typical candidate's distance from the best, and the typical analytic correction."""

    indices: list[int]
    weights: list[float]
    floor: float
    best: float
    typical: float
    correction: float
    regrets: list[dict[str, float]]  # each neighbour's (its row's regrets), in the order of ``indices``
    total: float  # the weights' sum


@dataclasses.dataclass(frozen=True)
class _Row:
    """One measured problem as the model keeps it: log2(best time / floor), the medians over its candidates of
    log2(time / best) and of log2(time / analytic price), and per candidate key (``keys``) log2(time / best), and per
    engine of a backend that placed its candidates (``engine_key``) the best of its plans' log2(time / best)."""

    problem: ConvProblem
    best: float
    typical: float
    correction: float
    regrets: dict[str, float]
    count: int  # the measurements it was made of
    features: list[float] = dataclasses.field(init=False, repr=False, compare=False)

    @property
    def placed(self) -> bool:
        """Whether any of its candidates is known by its place in its backend's order (``keys``)."""
        return any("@" in key for key in self.regrets)

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", problem_features(self.problem))


def _score(near: _Neighbourhood, key: str) -> float | None:
    """The weighted mean of the neighbours' log2(time / their best) for ``key``, where enough of them measured it
    (``MIN_SUPPORT`` of their weight); else None."""
    support = weighted = 0.0  # over the neighbours that measured it, in their order
    for regrets, w in zip(near.regrets, near.weights):
        r = regrets.get(key)
        if r is not None:
            support += w
            weighted += r * w
    return weighted / support if support >= MIN_SUPPORT * near.total else None


def _scores(near: _Neighbourhood, name: str, order: int | None) -> list[float]:
    """``_score`` of each key of the candidate (``keys``) that enough of the neighbours measured."""
    return [score for key in keys(name, order) if (score := _score(near, key)) is not None]


def _log2_price(near: _Neighbourhood, name: str, log2_base: float, order: int | None) -> float:
    """``LearnedModel.log2_price`` of ``name`` from the asked problem's neighbours, given log2 of its analytic price
    times ``costmodel.order_factor`` of its place (``log2_base``). A candidate that the neighbours know by its place
    but not by its name (its backend's heuristics put it there, on them another plan stood there) is priced no
    better than ``ENGINE_MARGIN`` below what its engine's best plan measured on them: cuDNN's first plan on a
    problem can be an engine that ran many times slower than the best on every neighbour."""
    scores = {key: score for key in keys(name, order) if (score := _score(near, key)) is not None}
    if scores:  # never below the problem's floor: what the neighbours suggest, held to what is possible
        score = min(scores.values())
        if name not in scores and order is not None and (engine := _score(near, engine_key(name))) is not None:
            score = max(score, engine - ENGINE_MARGIN)
        return max(near.best + score, near.floor)
    return max(near.best + near.typical, log2_base + near.correction, near.floor)


def usable(s: Sample) -> bool:
    """Whether a sample can be learned from: positive, finite times."""
    return s.measured_ms > 0 and s.analytic_ms > 0 and math.isfinite(s.measured_ms) and math.isfinite(s.analytic_ms)


def _columns(rows: Sequence[_Row]) -> tuple[torch.Tensor, ...]:
    """The rows' features (unscaled), best, typical candidate, correction and direction (its place in
    ``DIRECTIONS``), a tensor each, a row a row (at least one row)."""
    features = torch.tensor([r.features for r in rows], dtype=torch.float64)
    values = (torch.tensor([getattr(r, f) for r in rows], dtype=torch.float64)
              for f in ("best", "typical", "correction"))
    directions = torch.tensor([DIRECTIONS.index(r.problem.direction) for r in rows], dtype=torch.int64)
    return (features, *values, directions)


def _rows(samples: Sequence[Sample]) -> list[_Row]:
    """One row per problem of ``samples`` with a timed candidate (the usable ones: positive, finite times)."""
    by_problem: dict[ConvProblem, list[Sample]] = defaultdict(list)
    for s in samples:
        if usable(s):
            by_problem[s.problem].append(s)
    out = []
    for problem, rows in by_problem.items():
        fastest = min(s.measured_ms for s in rows)
        regrets: dict[str, float] = {}
        ordered = {backend_of(s.name) for s in rows if s.order is not None}  # (its plans without a place too)
        for s in rows:
            engine = [engine_key(s.name)] if backend_of(s.name) in ordered else []
            for key in [*keys(s.name, s.order), *engine]:
                regrets[key] = min(regrets.get(key, math.inf), math.log2(s.measured_ms / fastest))
        out.append(_Row(problem, math.log2(fastest / max(hardware.roofline_ms(problem), 1e-9)),
                        statistics.median(math.log2(s.measured_ms / fastest) for s in rows),
                        statistics.median(math.log2(s.measured_ms / s.analytic_ms) for s in rows), regrets, len(rows)))
    return out


class LearnedModel:
    """Measured problems of one device (``fingerprint``), a ``_Row`` each. ``log2_factors`` answers a batch of
    candidates; ``extended`` gives the model with more measurements, cheaply (a tuning run adds one problem at a
    time). ``samples``: how many measurements it was built from."""

    def __init__(self, rows: Sequence[_Row], fingerprint: str, software: str = "") -> None:
        rows = list(rows)
        if not rows:
            raise ValueError("a learned model needs at least one measured problem")
        self._setup(rows, fingerprint, software, _columns(rows))

    def _setup(self, rows: list[_Row], fingerprint: str, software: str, columns: tuple[torch.Tensor, ...]) -> None:
        """The model of ``rows`` given their ``_columns``."""
        if not rows:
            raise ValueError("a learned model needs at least one measured problem")
        self.rows = rows
        self.fingerprint, self.software = fingerprint, software
        self.samples = sum(r.count for r in self.rows)
        self.problems = [r.problem for r in self.rows]
        x, self.best, self.typical, self.correction, directions = self._row_columns = columns
        spread = x.std(0, unbiased=False) if len(self.rows) > 1 else torch.ones(x.shape[1], dtype=torch.float64)
        self._scale = torch.where(spread < 1e-6, torch.ones_like(spread), spread)
        self._x = x / self._scale
        self._by_direction = {d: (directions == code).nonzero().flatten() for code, d in enumerate(DIRECTIONS)}
        self._memo: dict[tuple[ConvProblem, Any], Any] = {}

    def extended(self, samples: Sequence[Sample], replaced: Iterable[ConvProblem] = (),
                 fallback: LearnedModel | None = None) -> LearnedModel:
        """This model with ``samples``' problems in place of its own rows of them, and without the problems of
        ``replaced`` that ``samples`` does not hold (measured again, nothing timed), unless ``fallback`` has a row of
        such a problem: that row then. ``ValueError`` where no row is left. Cheap: the rows kept keep their columns
        (a tuning run extends the model once per problem it stores)."""
        new = _rows(samples)
        gone = {r.problem.key for r in new} | {p.key for p in replaced}  # (a problem's key is kept: quick to hash)
        emptied = gone - {r.problem.key for r in new}
        restored = [] if fallback is None else [r for r in fallback.rows if r.problem.key in emptied]
        kept = [i for i, r in enumerate(self.rows) if r.problem.key not in gone]
        added = new + restored
        index = torch.tensor(kept, dtype=torch.int64)
        columns = tuple(c[index] for c in self._row_columns)
        if added:
            columns = tuple(torch.cat([c, a]) for c, a in zip(columns, _columns(added)))
        model = LearnedModel.__new__(LearnedModel)
        model._setup([self.rows[i] for i in kept] + added, self.fingerprint, self.software, columns)
        return model

    def _neighbourhood(self, problem: ConvProblem) -> _Neighbourhood | None:
        key = (problem, hardware.assumed_gpu())  # the floors are the priced GPU's
        known = self._memo.get(key, _MISSING)
        if known is not _MISSING:
            return known
        candidates = self._by_direction.get(problem.direction)
        found = None
        if candidates is not None and len(candidates) >= MIN_MEASURED:  # fewer measured: no answer for it
            asked = torch.tensor(problem_features(problem), dtype=torch.float64) / self._scale
            distance = (self._x[candidates] - asked).norm(dim=1)
            nearest = torch.sort(distance, stable=True).indices[:NEIGHBOURS]
            indices = candidates[nearest]
            weights = 1.0 / (1e-3 + distance[nearest])
            total = float(weights.sum())

            def mean(values: torch.Tensor) -> float:
                return float((values[indices] * weights).sum()) / total

            floor = math.log2(max(hardware.roofline_ms(problem), 1e-9))
            found = _Neighbourhood(indices.tolist(), weights.tolist(), floor, floor + mean(self.best),
                                   mean(self.typical), mean(self.correction),
                                   [self.rows[i].regrets for i in indices.tolist()], sum(weights.tolist()))
        if len(self._memo) >= MEMO_PROBLEMS:
            self._memo = {}  # a new dict, not cleared: another thread may be reading the old one
        self._memo[key] = found
        return found

    def measured(self, direction: str) -> int:
        """How many problems of ``direction`` the model was made of (it answers for it from ``MIN_MEASURED``)."""
        return len(self._by_direction.get(direction, ()))

    def nearest_distance(self, problem: ConvProblem) -> float | None:
        """How far ``problem`` lies from the nearest measured problem of its direction (features scaled to unit
        spread; 0: measured itself), None where the model does not answer for its direction."""
        near = self._neighbourhood(problem)
        return None if near is None else max(1.0 / max(near.weights) - 1e-3, 0.0)

    def log2_price(self, problem: ConvProblem, name: str, analytic_ms: float, order: int | None = None) -> float | None:
        """log2 of the time in ms the neighbours suggest for ``name`` on ``problem`` (None: no measured problem of
        this direction to ask)."""
        from .costmodel import order_factor  # (costmodel imports this module)

        near = self._neighbourhood(problem)
        if near is None:
            return None
        return _log2_price(near, name, math.log2(max(analytic_ms * order_factor(order), 1e-12)), order)

    def guessed(self, problem: ConvProblem, name: str, order: int | None = None) -> bool:
        """Whether the model prices ``name`` on ``problem`` by a guess: it answers for the problem's direction, but
        too few of the neighbours measured the candidate (``MIN_SUPPORT``) by any of its keys, so it is priced as
        their typical candidate (or higher), not from its own measurements (``find`` gives such a family's first
        candidate its try all the same)."""
        near = self._neighbourhood(problem)
        return near is not None and not _scores(near, name, order)

    def contenders(self, problem: ConvProblem, candidates: Sequence[tuple[str, int | None]],
                   factor: float) -> frozenset[str]:
        """The names of ``candidates`` ((name, place in its backend's order)) that one of ``problem``'s neighbours
        measured within ``factor`` of its own best, by any key of the candidate (``keys``); none where the model does
        not answer for the problem's direction. A price is a weighted mean over the neighbours, so a candidate that a
        few of them found best can be priced far from the head of the order: ``find`` still runs these once its
        search has converged (``settings.find_contender_factor``)."""
        near = self._neighbourhood(problem)
        if near is None:
            return frozenset()
        within = math.log2(factor)
        return frozenset(name for name, order in candidates
                         if any(regrets.get(key, math.inf) <= within
                                for key in keys(name, order) for regrets in near.regrets))

    def log2_factors(self, rows: Sequence[tuple[ConvProblem, str, float, int | None]]) -> list[float]:
        """Per (problem, name, analytic ms, place) row, log2 of the price over the analytic price times
        ``costmodel.order_factor`` of the place, within ±MAX_LOG2_FACTOR (0 where the model cannot answer). A batch
        costs less a row than a row alone: each problem's neighbours are looked up once (a ranking prices one
        problem's candidates together)."""
        from .costmodel import order_factor  # (costmodel imports this module)

        out = []
        near_of: dict[ConvProblem, _Neighbourhood | None] = {}
        for problem, name, analytic_ms, order in rows:
            near = near_of.get(problem, _MISSING)
            if near is _MISSING:
                near = near_of[problem] = self._neighbourhood(problem)
            base = math.log2(max(analytic_ms * order_factor(order), 1e-12))
            price = None if near is None else _log2_price(near, name, base, order)  # type: ignore[arg-type]
            factor = 0.0 if price is None or not math.isfinite(price) else price - base
            out.append(min(max(factor, -MAX_LOG2_FACTOR), MAX_LOG2_FACTOR))
        return out

    def factor(self, problem: ConvProblem, name: str, analytic_ms: float, order: int | None = None) -> float:
        """The price over the analytic price (times ``costmodel.order_factor`` of ``order``, ``name``'s place in
        its backend's heuristic order, where known)."""
        return 2.0 ** self.log2_factors([(problem, name, analytic_ms, order)])[0]

    def save(self, path: str | os.PathLike) -> Path:
        """Write the model to ``path`` (written to a temporary name, then renamed; its folder made where missing).
        ``ValueError`` or ``OSError`` naming ``path`` where it cannot be written (``files.write_whole``)."""
        path = writable_model_path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot write {path}: its folder {path.parent} cannot be made ({exc.strerror}); give a "
                             f"path in a folder you can write") from None
        from .hardware import software_versions

        names: dict[str, int] = {}
        entries, regrets = [], []
        for index, row in enumerate(self.rows):
            for key, value in row.regrets.items():
                entries.append((index, names.setdefault(key, len(names))))
                regrets.append(value)
        payload = {"feature_version": FEATURE_VERSION, "fingerprint": self.fingerprint,
                   "software": self.software or software_versions(), "samples": self.samples,
                   "saved_at": time.time(), "problems": [p.key for p in self.problems], "names": list(names),
                   "best": self.best, "typical": self.typical, "correction": self.correction,
                   "entries": torch.tensor(entries, dtype=torch.int64).reshape(-1, 2),
                   "regrets": torch.tensor(regrets, dtype=torch.float64),
                   "counts": torch.tensor([r.count for r in self.rows], dtype=torch.int64)}
        buffer = io.BytesIO()  # serialized first: writing it is then a plain file's write, with OSError's reasons
        torch.save(payload, buffer)
        write_whole(path, lambda target: target.write_bytes(buffer.getbuffer()))
        forget()  # this process sees the new file at once
        return path


def writable_model_path(path: str | os.PathLike) -> Path:
    """``path``, checked as ``files.writable`` checks it, its missing folders to be made (``save`` makes them; before
    the model is built, ``convtune train-get`` asks this of its ``--out``); ``ValueError`` naming ``path``."""
    writable(path, make_folder=True)
    return Path(path)


def load(path: str | os.PathLike) -> LearnedModel:
    """The model stored at ``path``; ``ValueError`` naming the file and the fault when it is not one."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PyTorch's notes on a file's pickle protocol: the refusal below says why
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # PyTorch's message would advise loading it unchecked: never for such a file
        raise ValueError(f"{path} is not a learned cost model: it holds objects a model file never holds (not loaded: "
                         f"loading them could run code); build the model again with convtune train-get") from None
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same fault for the caller
        raise ValueError(f"{path} is not a learned cost model ({type(exc).__name__}: {first_line(exc)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a learned cost model")
    if data.get("feature_version") != FEATURE_VERSION:
        raise ValueError(f"{path} holds a model of other features (feature_version {data.get('feature_version')!r}; "
                         f"this convtune reads feature_version {FEATURE_VERSION}); build it again with "
                         f"convtune train-get")
    try:
        if not isinstance(data["problems"], list) or not isinstance(data["names"], list) or not data["problems"]:
            raise ValueError("'problems' and 'names' must be lists, and 'problems' not empty")
        problem_keys, names = list(data["problems"]), list(data["names"])
        per_problem = [data[k] for k in ("best", "typical", "correction")]
        entries, regrets, counts = data["entries"], data["regrets"], data["counts"]
        shapes_ok = (all(t.dtype == torch.float64 and tuple(t.shape) == (len(problem_keys),) for t in per_problem)
                     and entries.dtype == torch.int64 and regrets.dtype == torch.float64
                     and tuple(entries.shape) == (len(regrets), 2)
                     and counts.dtype == torch.int64 and tuple(counts.shape) == (len(problem_keys),)
                     and bool((counts > 0).all()))
        values_ok = shapes_ok and all(bool(torch.isfinite(t).all()) for t in (*per_problem, regrets))
        in_range = values_ok and (not len(entries) or (
            int(entries.min()) >= 0 and int(entries[:, 0].max()) < len(problem_keys)
            and int(entries[:, 1].max()) < len(names)))
        fingerprint = data.get("fingerprint")
        if not in_range or not isinstance(fingerprint, str) \
                or not all(isinstance(k, str) for k in (*problem_keys, *names)):
            raise ValueError("non-finite, malformed or out-of-range fields")
        measured: list[dict[str, float]] = [{} for _ in problem_keys]
        for (problem, name), regret in zip(entries.tolist(), regrets.tolist()):
            measured[problem][names[name]] = regret
        best, typical, correction = (t.tolist() for t in per_problem)
        rows = [_Row(ConvProblem.from_key(key), *row) for key, *row in zip(problem_keys, best, typical, correction,
                                                                           measured, counts.tolist())]
        return LearnedModel(rows, fingerprint, str(data.get("software", "")))
    except (KeyError, RuntimeError, AttributeError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"{path} is a damaged learned cost model ({type(exc).__name__}: {exc})") from None


def train(samples: Sequence[Sample], fingerprint: str) -> LearnedModel:
    """The model of ``samples`` (measurements of one device, ``fingerprint``; each problem's best time is what its
    candidates are measured against, so a problem counts once it has a timed candidate). Deterministic: the same
    samples give the same model. ``ValueError`` without usable samples."""
    rows = _rows(samples)
    if not rows:
        raise ValueError("no usable measurements to build the model from: tune some problems first "
                         "(convtune tune, find)")
    return LearnedModel(rows, fingerprint)


def samples_from(db: Any, device: str, fingerprint: str | None = None,
                 orders: Mapping[str, Sequence[str]] | None = None) -> list[Sample]:
    """Every timed result ``db`` holds for this machine's ``device`` (or for the machine ``fingerprint``
    names: price them within ``hardware.measured_on``), with the analytic model's price and its place in
    its backend's heuristic order: from ``orders`` (problem key: the backend's candidates in its order, as
    recorded on the machine that measured, ``bench/cudnn_order.py``; a problem not in it has no places),
    else as ``find`` stored it with the result (``PerfResult.place``), else, for a problem none of whose
    results has one (measured by an earlier version), asked of this machine's backends for its own
    measurements (``registry.backend_places``) and none for another machine's (only the machine that
    measured knows its heuristics' order)."""
    from .algorithms.registry import backend_places

    measured = list(db.measurements(device, fingerprint))
    stored = {problem.key for problem, result in measured if result.place is not None}
    places: dict[str, dict[str, int]] = {}

    def place(problem: ConvProblem, result: Any) -> int | None:
        if orders is None and problem.key in stored:
            return result.place
        if problem.key not in places:
            if orders is not None:
                places[problem.key] = positions(orders.get(problem.key, ()))
            elif fingerprint is None:
                places[problem.key] = backend_places(problem)
            else:  # another machine's order is not this one's to tell
                places[problem.key] = {}
        return places[problem.key].get(result.algorithm)

    return [sample_of(p, r, place(p, r)) for p, r in measured if timed(r)]


def timed(result: Any) -> bool:
    """Whether a stored result has a positive, finite time to learn from."""
    return bool(result.time_ms and result.time_ms > 0 and math.isfinite(result.time_ms))


def sample_of(problem: ConvProblem, result: Any, order: int | None) -> Sample:
    """A ``timed`` result of ``problem`` as a sample, priced by the analytic model, at its place ``order``."""
    from .costmodel import analytic_ms

    return Sample(problem, result.algorithm,
                  analytic_ms(result.algorithm, problem, result.workspace_bytes, result.uses_tf32), result.time_ms,
                  order)


def positions(names: Sequence[str]) -> dict[str, int]:
    """Each name's place among the names of its own backend ('cudnn:eng3' second of 'cudnn:...' names: 1)."""
    seen: dict[str, int] = {}
    out = {}
    for name in names:
        backend = backend_of(name)
        out[name] = seen.get(backend, 0)
        seen[backend] = out[name] + 1
    return out


def default_path(device: str) -> Path:
    """Where ``train-get`` stores the model of ``device`` and where ``get`` looks for it."""
    return _path_of(device, settings.learned_model, settings.cache_dir, os.environ.get("HOME"))


@functools.lru_cache(maxsize=64)
def _path_of(device: str, configured: str, cache_dir: str, home: str | None) -> Path:
    # asked for every candidate get prices: the path is made once per setting (and home folder, where "~" leads)
    if configured:
        return Path(configured.replace("{device}", device)).expanduser()
    return Path(cache_dir).expanduser() / f"learned_get_{device}.pt"


_loaded: dict[str, tuple[Any, LearnedModel | None, int]] = {}  # device -> (file identity, model or None, version)
_checked_at: dict[str, float] = {}  # device -> when the file was last looked at (time.monotonic)
_warned: set[str] = set()
_versions = iter(range(1, 2**62))


def forget() -> None:
    """Look at the model files again on next use (``save`` calls it; tests that write files do too)."""
    _loaded.clear()
    _checked_at.clear()


def installed(device: str) -> tuple[LearnedModel | None, int]:
    """``active``'s model and ``version``'s number, read together (the file may change between two reads)."""
    now = time.monotonic()
    known = _loaded.get(device)
    path = default_path(device)
    # the file is looked at again at most once a second, at once where the setting names another one
    if known is not None and known[0][0] == str(path) and now - _checked_at.get(device, -math.inf) < RECHECK_S:
        return known[1], known[2]
    _checked_at[device] = now
    try:
        stat = path.stat()
        identity: Any = (str(path), stat.st_mtime_ns, stat.st_size)
    except OSError:
        identity = (str(path), None)
    if known is not None and known[0] == identity:
        return known[1], known[2]
    model = None
    if identity[1] is None and settings.learned_model:
        _warn(f"settings.learned_model (CONVTUNE_LEARNED_MODEL) names {path}, where no file is; the analytic cost "
              f"model serves; build one with convtune train-get, or unset it for the cache folder's")
    if identity[1] is not None:
        try:
            model = load(path)
            from .hardware import fingerprint

            here = fingerprint(device)
            if model.fingerprint != here:
                _warn(f"{path} was built on another machine ({model.fingerprint}, this one is {here}); "
                      f"the analytic cost model serves instead; build one here with convtune train-get")
                model = None
            else:
                from .hardware import software_versions

                if model.software != software_versions():
                    _warn(f"{path} was built with other software ({model.software or 'unknown'}; now "
                          f"{software_versions()}): used until convtune train-get builds it again")
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with the file, the analytic model serves
            _warn(f"{exc}; the analytic cost model serves instead")
            model = None
    version = 0 if model is None else next(_versions)
    _loaded[device] = (identity, model, version)
    return model, version


def active(device: str) -> LearnedModel | None:
    """The model ``get`` uses on ``device``: the file at ``default_path`` if it is a model of this machine
    (looked at again at most once a second)."""
    return installed(device)[0]


def correction(problem: ConvProblem, name: str, analytic_ms: float, order: int | None = None,
               model: LearnedModel | None = None) -> float:
    """The price over the analytic price times ``costmodel.order_factor`` of ``order`` (``name``'s place in its
    backend's heuristic order, where known) for ``name`` on ``problem``, as ``model`` (default: this device's
    installed model, ``active``) prices it; 1 without a model (or where the model cannot answer, with a
    warning)."""
    return corrections(problem, [(name, analytic_ms, order)], model)[0]


def corrections(problem: ConvProblem, candidates: Sequence[tuple[str, float, int | None]],
                model: LearnedModel | None = None) -> list[float]:
    """``correction`` of each (name, analytic ms, place) of ``candidates`` on ``problem``, priced together (the
    problem's neighbours looked up once); a candidate the model cannot price gets 1, with a warning."""
    model = active(problem.device) if model is None else model
    if model is None:
        return [1.0] * len(candidates)
    try:
        return [2.0 ** f for f in model.log2_factors([(problem, *c) for c in candidates])]
    except Exception as exc:  # noqa: BLE001 - a model that cannot answer leaves the analytic price
        if len(candidates) > 1:  # one at a time: only a candidate that cannot be priced loses its price
            return [corrections(problem, [c], model)[0] for c in candidates]
        _warn(f"the learned cost model could not price {candidates[0][0]} ({type(exc).__name__}: {exc}); the "
              f"analytic price serves")
        return [1.0]


def version(device: str) -> int:
    """A number that changes when the model ``get`` uses on ``device`` changes (caches key on it; 0: none)."""
    return installed(device)[1]


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def held_out(samples: Sequence[Sample], fraction: float = 0.2, seed: int = 0) -> set[ConvProblem]:
    """The problems a random split holds out whole (``holdout_report``): ``fraction`` of those ``samples`` measured
    (at least one), drawn by ``seed``."""
    problems = sorted({s.problem for s in samples}, key=lambda p: p.key)
    random.Random(seed).shuffle(problems)
    return set(problems[:max(1, int(len(problems) * fraction))])


def holdout_report(samples: Sequence[Sample], fingerprint: str, *, fraction: float = 0.2,
                   seed: int = 0) -> dict[str, float]:
    """Built from most problems (drawn by ``seed``), judged on the rest (whole problems held out): for each held-out
    problem, the time of the candidate each model ranks first over the best measured, as a geometric
    mean and worst case, and how often each picks the best (top-1), learned against analytic."""
    held = held_out(samples, fraction, seed)
    model = train([s for s in samples if s.problem not in held], fingerprint)
    scores: dict[str, list[float]] = {"learned": [], "analytic": []}
    by_problem: dict[ConvProblem, list[Sample]] = defaultdict(list)
    for s in samples:
        if s.problem in held:
            by_problem[s.problem].append(s)
    for rows in by_problem.values():
        if len(rows) < 2:
            continue
        best = min(s.measured_ms for s in rows)
        for ranking, pick in first_picks(model, rows).items():
            scores[ranking].append(pick.measured_ms / best)
    report: dict[str, float] = {"train_samples": float(model.samples), "held_out_problems": float(len(held))}
    for name, ratios in scores.items():
        report.update({f"{name}_{key}": value for key, value in summarize(ratios).items() if key != "problems"})
    return report


def first_picks(model: LearnedModel, rows: Sequence[Sample]) -> dict[str, Sample]:
    """The measurement of one problem's candidate that each ranking puts first: 'learned' (the analytic
    price corrected by ``model``) and 'analytic', each price times ``costmodel.order_factor`` of the sample's
    place in its backend's heuristic order, as ``get`` ranks. Equal prices (a problem's cuDNN execution plans
    where their places are not known) go by name, never by the order of ``rows``: a database lists a
    problem's results fastest first, which would hand a tied ranking the measured best."""
    return {"learned": ranked(model, rows)[0][0], "analytic": analytic_first(rows)}


def analytic_first(rows: Sequence[Sample], first: str | None = None) -> Sample:
    """``first_picks``' 'analytic': the measurement the analytic price times ``costmodel.order_factor`` of its place
    puts first (ties by name); with ``first`` (a candidate's name), that candidate moved to the head of its backend's
    order and the ones before it one place down, as another heuristic's first choice would be ranked (where ``first``
    has no known place among ``rows``, the order is as it is)."""
    from .costmodel import order_factor

    head = next((s.order for s in rows if s.name == first and s.order is not None), None)
    backend = backend_of(first) if first else None

    def place(s: Sample) -> int | None:
        if head is None or s.order is None or backend_of(s.name) != backend:
            return s.order
        return 0 if s.name == first else s.order + 1 if s.order < head else s.order

    return min(rows, key=lambda s: (math.log2(s.analytic_ms * order_factor(place(s))), s.name))


def ranked(model: LearnedModel, rows: Sequence[Sample]) -> list[tuple[Sample, float]]:
    """One problem's measured candidates in the order ``get`` with ``model`` ranks them (``first_picks``'
    'learned' price; ties by name), each with that price in ms (what ``get`` predicts, and ``find`` compares
    against the best measured to prune)."""
    from .costmodel import order_factor

    corrections = model.log2_factors([(s.problem, s.name, s.analytic_ms, s.order) for s in rows])
    prices = [math.log2(s.analytic_ms * order_factor(s.order)) + c for s, c in zip(rows, corrections)]
    keyed = sorted(zip(prices, (s.name for s in rows), rows), key=lambda k: (k[0], k[1]))
    return [(s, 2.0 ** price) for price, _, s in keyed]


def simulated_find(order: Sequence[tuple[Sample, float]], patience: int, tolerance: float,
                   prune_factor: float, guessed: Iterable[str] = (),
                   contenders: Iterable[str] = ()) -> tuple[float, int, float]:
    """(best time found, candidates run, their summed times) of ``find``'s search over ``order`` (``ranked``'s
    answer), by find's own rules (``search_rules.SearchRules``) on the candidates' measured times: each family's
    best-ranked candidate first, then the rest in order; a candidate predicted over ``prune_factor`` times the best
    measured is skipped (``SearchPrices``: not a family's first try priced by a guess, one of ``guessed``; a family's
    prices scaled down by its first timing), and once ``patience`` candidates in a row after the first tries gained
    nothing beyond ``tolerance``, the rest are (0: never), except ``contenders`` (``LearnedModel.contenders``; one
    that gains starts the count again). A family's factor is set by its first timing here, as in ``find`` by its
    first ok result (there, one outside the policy's error bound, or one that ran only for needing less workspace,
    counts too). Three of find's rules are left out: a skipped candidate still runs where it may need less workspace
    than every one measured (samples carry no workspace), or where it is not known to be nondeterministic and the
    best is not deterministic (samples carry no determinism; find's ``_for_determinism``), and ``get``'s tie rule
    (times within the policy's tolerance go to the smaller workspace, then to torch:native) does not reorder
    ``order``."""
    searched, head = families_first(order, lambda entry: entry[0].name)
    guessed = set(guessed)
    prices = SearchPrices({s.name: predicted for s, predicted in order},
                          [s.name for s, _ in searched[:head] if s.name in guessed])
    rules = SearchRules(prices, head, patience=patience, tolerance=tolerance, prune_factor=prune_factor,
                        contenders=contenders)
    best, run, spent = math.inf, 0, 0.0
    for index, (sample, _) in enumerate(searched, 1):
        if rules.why_skipped(sample.name, best) is not None:
            continue
        run += 1
        spent += sample.measured_ms
        before, best = best, min(best, sample.measured_ms)
        rules.timed(index, sample.name, sample.measured_ms, best_before_ms=before, best_ms=best)
    return best, run, spent


def summarize(ratios: Sequence[float]) -> dict[str, float]:
    """Picked time over best time across problems: geometric mean, worst, share of best picks, count
    (empty without ratios)."""
    if not ratios:
        return {}
    return {"geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)), "worst": max(ratios),
            "top1": sum(r <= 1.0 + 1e-9 for r in ratios) / len(ratios), "problems": float(len(ratios))}
