"""A learned correction of the cost model: trained on one device's measurements, used on that device.

The analytic model (``costmodel``) prices a candidate from its family's roofline terms. The learned
model predicts, for a (problem, candidate) pair, how far the measured time lies from that price:
log2(measured / analytic), from features of the problem (sizes, strides, groups, direction, dtype,
layout, FLOPs and bytes, all as logarithms or switches), of the candidate (its name's parts, hashed:
a cuDNN execution plan's engine and knobs, a tile configuration, a family; for a backend that lists its
candidates best first by its own heuristics, cuDNN's, the candidate's place in that list) and the analytic
price itself. It is three small multilayer perceptrons in PyTorch (no other dependency; about 30 thousand
weights in all), trained from different seeds and their predictions averaged, which makes the picks steadier than one
network's; queried in tens of microseconds. Each is trained on the squared error of its log2 factor and on
each problem's order of its candidates (a listwise cross-entropy: which is fastest matters more than by
how much). ``get`` multiplies the analytic price by its correction where a model
trained on this device (its fingerprint) is installed, and the database's measurement corrections
apply on top, as before; everywhere else the analytic model serves alone.

Train one from a tuning database with ``convtune train-get`` (or ``train`` and ``save``): it is
stored as ``learned_get_<device>.pt`` in the cache folder (beside the default database), or where
``settings.learned_model`` points: that is where ``get`` looks. A file that is damaged, of another
feature version or of another device is ignored with a warning, never used; one trained with other
software (a new cuDNN) is used, with a warning, until it is trained again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .files import write_whole
from .problem import DIRECTIONS, ConvProblem
from .results import backend_of
from .settings import settings

log = logging.getLogger(__name__)

FEATURE_VERSION = 3  # 2: an ensemble of MEMBERS networks; 3: a candidate's place in its backend's heuristic order
NAME_BUCKETS = 64
HIDDEN = 64
MEMBERS = 3  # networks trained from different seeds, their predictions averaged: steadier picks than one
ORDER_DROPOUT = 0.2  # of the samples with a known place, trained as if it were not known (the database's
# corrections price measurements without it), so the model answers both ways
MAX_LOG2_FACTOR = 6.0  # a correction of at most 64x either way
# Training also asks each problem's candidates to come out in their measured order (``_listwise``), beside
# the squared error, with this weight (what it changed on held-out networks: docs/performance.md).
LISTWISE_WEIGHT = 1.0
LISTWISE_TEMPERATURE = 0.1  # log2 units: candidates 7% apart differ by one unit of the softmax
RECHECK_S = 1.0  # how often get looks at the model file again (train-get and save() are seen at once)
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


def name_features(name: str) -> list[float]:
    """The candidate's identity: its backend and each part of its variant ('eng58', 'k25=1'), hashed."""
    backend, _, variant = name.partition(":")
    tokens = [backend, *(f"{backend}:{part}" for part in variant.split("_") if part)]
    vector = [0.0] * NAME_BUCKETS
    for token in tokens:
        vector[zlib.crc32(token.encode()) % NAME_BUCKETS] = 1.0
    return vector


def order_features(order: int | None) -> list[float]:
    """The candidate's place in its backend's heuristic order (0: the backend's first choice; None: not known,
    or a candidate of no ranking backend)."""
    if order is None:
        return [0.0, 0.0, 0.0]
    return [1.0, math.log2(1 + order), float(order == 0)]


def features(problem: ConvProblem, name: str, analytic_ms: float, order: int | None = None) -> list[float]:
    return [*problem_features(problem), *name_features(name), *order_features(order),
            math.log2(max(analytic_ms, 1e-9))]


FEATURES = len(features(ConvProblem("fwd", n=1, c=1, k=1, input_size=(1,), kernel_size=1), "x:y", 1.0))


def _member() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))


class _Ensemble(torch.nn.Module):
    """The mean prediction of several networks of the same shape."""

    def __init__(self, members: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.members = torch.nn.ModuleList(members)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([member(x) for member in self.members]).mean(0)


def _network() -> torch.nn.Module:
    return _Ensemble([_member() for _ in range(MEMBERS)])


@dataclasses.dataclass(frozen=True)
class Sample:
    """One measurement: the candidate ``name`` took ``measured_ms`` on ``problem``; the analytic model said
    ``analytic_ms``; ``order``: its place in its backend's heuristic order (None: not known or none)."""

    problem: ConvProblem
    name: str
    analytic_ms: float
    measured_ms: float
    order: int | None = None


class LearnedModel:
    """A trained correction for one device (``fingerprint``); ``log2_factor`` answers a batch of pairs."""

    def __init__(self, network: torch.nn.Module, mean: torch.Tensor, std: torch.Tensor, fingerprint: str,
                 samples: int, software: str = "") -> None:
        self.network, self.mean, self.std = network.eval(), mean, std
        self.fingerprint, self.samples, self.software = fingerprint, samples, software

    def log2_factor(self, rows: Sequence[Sequence[float]]) -> list[float]:
        """log2(measured / analytic) per row of features, within ±MAX_LOG2_FACTOR (a model far outside what
        it was trained on says no more than that)."""
        with torch.no_grad():
            x = (torch.tensor(rows, dtype=torch.float32) - self.mean) / self.std
            y = self.network(x).squeeze(1).nan_to_num(0.0).clamp(-MAX_LOG2_FACTOR, MAX_LOG2_FACTOR)
            return y.tolist()

    def factor(self, problem: ConvProblem, name: str, analytic_ms: float, order: int | None = None) -> float:
        """measured / analytic, as predicted for ``name`` on ``problem`` (``order``: its place in its backend's
        heuristic order, where known)."""
        return 2.0 ** self.log2_factor([features(problem, name, analytic_ms, order)])[0]

    def save(self, path: str | os.PathLike) -> Path:
        """Write the model to ``path`` (written to a temporary name, then renamed)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        from .hardware import software_versions

        payload = {"feature_version": FEATURE_VERSION, "features": FEATURES, "hidden": HIDDEN, "members": MEMBERS,
                   "fingerprint": self.fingerprint, "software": self.software or software_versions(),
                   "samples": self.samples, "saved_at": time.time(),
                   "mean": self.mean, "std": self.std, "state": self.network.state_dict()}
        write_whole(path, lambda target: torch.save(payload, target))
        forget()  # this process sees the new file at once
        return path


def load(path: str | os.PathLike) -> LearnedModel:
    """The model stored at ``path``; ``ValueError`` naming the file and the fault when it is not one."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same fault for the caller
        raise ValueError(f"{path} is not a learned cost model ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a learned cost model")
    shape = {"feature_version": FEATURE_VERSION, "features": FEATURES, "hidden": HIDDEN, "members": MEMBERS}
    other = {k: data.get(k) for k, v in shape.items() if data.get(k) != v}
    if other:
        raise ValueError(f"{path} holds a model of other features or shape "
                         f"({', '.join(f'{k} {v!r}' for k, v in other.items())}; this convtune reads "
                         f"{', '.join(f'{k} {shape[k]}' for k in other)}); train it again with convtune train-get")
    network = _network()
    try:
        network.load_state_dict(data["state"])
        mean, std = data["mean"], data["std"]
        shapes_ok = tuple(mean.shape) == tuple(std.shape) == (FEATURES,)
    except (KeyError, RuntimeError, AttributeError, TypeError) as exc:
        raise ValueError(f"{path} is a damaged learned cost model ({type(exc).__name__}: {exc})") from None
    floats = shapes_ok and mean.dtype == std.dtype == torch.float32
    finite = floats and all(bool(torch.isfinite(t).all()) for t in (mean, std, *network.state_dict().values()))
    samples, fingerprint = data.get("samples"), data.get("fingerprint")
    if not finite or not bool((std > 0).all()) or not isinstance(samples, int) or not isinstance(fingerprint, str):
        raise ValueError(f"{path} is a damaged learned cost model (non-finite or malformed weights or fields)")
    return LearnedModel(network, mean, std, fingerprint, samples, str(data.get("software", "")))


def train(samples: Sequence[Sample], fingerprint: str, *, epochs: int = 400, seed: int = 0) -> LearnedModel:
    """A model fitted to ``samples`` (measurements of one device, ``fingerprint``): log2(measured / analytic)
    by mean squared error, Adam, batches of 1024, each of the ``MEMBERS`` networks from its own seed (seed,
    seed + 1, ...); deterministic for a seed. ``ValueError`` without samples."""
    usable = [s for s in samples if s.measured_ms > 0 and s.analytic_ms > 0 and math.isfinite(s.measured_ms)]
    if not usable:
        raise ValueError("no usable measurements to train on: tune some problems first (convtune tune, find)")
    dropped = random.Random(seed)
    known = [s.order if s.order is None or dropped.random() >= ORDER_DROPOUT else None for s in usable]
    x = torch.tensor([features(s.problem, s.name, s.analytic_ms, order) for s, order in zip(usable, known)],
                     dtype=torch.float32)
    y = torch.tensor([math.log2(s.measured_ms / s.analytic_ms) for s in usable], dtype=torch.float32)
    mean, std = x.mean(0), x.std(0, unbiased=False)
    std = torch.where(std < 1e-3, torch.ones_like(std), std)  # a column constant here (no places known, say)
    # stays near 0 when it varies at serving time, instead of growing a thousandfold
    x = (x - mean) / std
    keys = {key: i for i, key in enumerate(dict.fromkeys(s.problem.key for s in usable))}
    group = torch.tensor([keys[s.problem.key] for s in usable])
    # what ranks a problem's candidates: log2 of the analytic price times the correction
    base = torch.tensor([math.log2(s.analytic_ms) for s in usable], dtype=torch.float32)
    members = [_fit(x, y, group, base, epochs, seed + i) for i in range(MEMBERS)]
    return LearnedModel(_Ensemble(members), mean, std, fingerprint, len(usable))


def _listwise(predicted: torch.Tensor, measured: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """The cross-entropy, per problem (``group``), between where the measured log2 times put the probability of
    being fastest and where the predicted ones do (a softmax of each problem's negated log2 times), averaged over
    the problems: the same for any offset per problem, and least where the prediction is the measurement up to
    such an offset."""
    def log_softmax(values: torch.Tensor) -> torch.Tensor:
        scaled = -values / LISTWISE_TEMPERATURE
        top = torch.full((int(group.max()) + 1,), -math.inf).scatter_reduce(0, group, scaled.detach(), "amax")
        shifted = scaled - top[group]
        sums = torch.zeros_like(top).index_add(0, group, shifted.exp())
        return shifted - sums.log()[group]

    target = log_softmax(measured).exp()
    loss = -(target * log_softmax(predicted))
    problems = torch.unique(group).numel()
    return loss.sum() / problems


def _problem_batches(per_problem: list[torch.Tensor], batch: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Each problem's sample indices (``per_problem``) in a random order, cut into batches of whole problems of
    about ``batch`` samples each."""
    batches, current, size = [], [], 0
    for i in torch.randperm(len(per_problem), generator=generator).tolist():
        current.append(per_problem[i])
        size += len(per_problem[i])
        if size >= batch:
            batches.append(torch.cat(current))
            current, size = [], 0
    if current:
        batches.append(torch.cat(current))
    return batches


def _fit(x: torch.Tensor, y: torch.Tensor, group: torch.Tensor, base: torch.Tensor, epochs: int,
         seed: int) -> torch.nn.Module:
    """One member network fitted to the normalized features ``x`` and targets ``y`` (mean squared error), and to
    each problem's order of its candidates (``_listwise``, weighted LISTWISE_WEIGHT; ``group``: each sample's
    problem, ``base``: its log2 analytic price), in batches of whole problems."""
    generator = torch.Generator().manual_seed(seed)
    torch_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        network = _member()
    finally:
        torch.random.set_rng_state(torch_state)
    optimizer = torch.optim.Adam(network.parameters(), lr=3e-3, weight_decay=1e-5)
    batch = 1024
    per_problem = [torch.nonzero(group == g).squeeze(1) for g in range(int(group.max()) + 1)]
    for _ in range(epochs):
        for rows in _problem_batches(per_problem, batch, generator):
            optimizer.zero_grad()
            predicted = network(x[rows]).squeeze(1)
            loss = torch.nn.functional.mse_loss(predicted, y[rows])
            if LISTWISE_WEIGHT:
                _, local = torch.unique(group[rows], return_inverse=True)
                loss = loss + LISTWISE_WEIGHT * _listwise(base[rows] + predicted, base[rows] + y[rows], local)
            loss.backward()
            optimizer.step()
    return network


def samples_from(db: Any, device: str, fingerprint: str | None = None,
                 orders: Mapping[str, Sequence[str]] | None = None) -> list[Sample]:
    """Every timed result ``db`` holds for this machine's ``device`` (or for the machine ``fingerprint``
    names: price them within ``hardware.measured_on``), with the analytic model's price and its place in
    its backend's heuristic order: from ``orders`` (problem key: the backend's candidates in its order, as
    recorded on the machine that measured, ``bench/cudnn_order.py``; a problem not in it has no places),
    else asked of this machine's backends for its own measurements (``registry.backend_places``) and none
    for another machine's (only the machine that measured knows its heuristics' order)."""
    from .algorithms.registry import backend_places
    from .costmodel import analytic_ms

    places: dict[str, dict[str, int]] = {}

    def place(problem: ConvProblem, name: str) -> int | None:
        if problem.key not in places:
            if orders is not None:
                places[problem.key] = positions(orders.get(problem.key, ()))
            elif fingerprint is None:
                places[problem.key] = backend_places(problem)
            else:  # another machine's order is not this one's to tell
                places[problem.key] = {}
        return places[problem.key].get(name)

    out = []
    for problem, result in db.measurements(device, fingerprint):
        if result.time_ms and result.time_ms > 0 and math.isfinite(result.time_ms):
            out.append(Sample(problem, result.algorithm,
                              analytic_ms(result.algorithm, problem, result.workspace_bytes, result.uses_tf32),
                              result.time_ms, place(problem, result.algorithm)))
    return out


def positions(names: Sequence[str]) -> dict[str, int]:
    """Each name's place among the names of its own backend ('cudnn:eng3' second of 'cudnn:...' names: 1)."""
    from .results import backend_of

    seen: dict[str, int] = {}
    out = {}
    for name in names:
        backend = backend_of(name)
        out[name] = seen.get(backend, 0)
        seen[backend] = out[name] + 1
    return out


def default_path(device: str) -> Path:
    """Where ``train-get`` stores the model of ``device`` and where ``get`` looks for it."""
    configured = settings.learned_model
    if configured:
        return Path(configured.replace("{device}", device))
    return Path(settings.cache_dir) / f"learned_get_{device}.pt"


_loaded: dict[str, tuple[Any, LearnedModel | None, int]] = {}  # device -> (file identity, model or None, version)
_checked_at: dict[str, float] = {}  # device -> when the file was last looked at (time.monotonic)
_warned: set[str] = set()
_versions = iter(range(1, 2**62))


def forget() -> None:
    """Look at the model files again on next use (``save`` calls it; tests that write files do too)."""
    _loaded.clear()
    _checked_at.clear()


def _current(device: str) -> tuple[LearnedModel | None, int]:
    now = time.monotonic()
    known = _loaded.get(device)
    if known is not None and now - _checked_at.get(device, -math.inf) < RECHECK_S:
        return known[1], known[2]
    _checked_at[device] = now
    path = default_path(device)
    try:
        stat = path.stat()
        identity: Any = (str(path), stat.st_mtime_ns, stat.st_size)
    except OSError:
        identity = (str(path), None)
    if known is not None and known[0] == identity:
        return known[1], known[2]
    model = None
    if identity[1] is not None:
        try:
            model = load(path)
            from .hardware import fingerprint

            here = fingerprint(device)
            if model.fingerprint != here:
                _warn(f"{path} was trained on another machine ({model.fingerprint}, this one is {here}); "
                      f"the analytic cost model serves instead; train one here with convtune train-get")
                model = None
            else:
                from .hardware import software_versions

                if model.software != software_versions():
                    _warn(f"{path} was trained with other software ({model.software or 'unknown'}; now "
                          f"{software_versions()}): used until convtune train-get trains it again")
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with the file, the analytic model serves
            _warn(f"{exc}; the analytic cost model serves instead")
            model = None
    version = 0 if model is None else next(_versions)
    _loaded[device] = (identity, model, version)
    return model, version


def active(device: str) -> LearnedModel | None:
    """The model ``get`` uses on ``device``: the file at ``default_path`` if it is a model of this machine
    (looked at again at most once a second)."""
    return _current(device)[0]


def correction(problem: ConvProblem, name: str, analytic_ms: float, order: int | None = None) -> float:
    """measured / analytic for ``name`` on ``problem`` as this device's model predicts it (``order``: its place
    in its backend's heuristic order, where known); 1 without a model (or where the model cannot answer,
    with a warning)."""
    model = active(problem.device)
    if model is None:
        return 1.0
    try:
        return model.factor(problem, name, analytic_ms, order)
    except Exception as exc:  # noqa: BLE001 - a model that cannot answer leaves the analytic price
        _warn(f"the learned cost model could not price {name} ({type(exc).__name__}: {exc}); the analytic "
              f"price serves")
        return 1.0


def version(device: str) -> int:
    """A number that changes when the model ``get`` uses on ``device`` changes (caches key on it; 0: none)."""
    return _current(device)[1]


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def holdout_report(samples: Sequence[Sample], fingerprint: str, *, fraction: float = 0.2, seed: int = 0,
                   epochs: int = 400) -> dict[str, float]:
    """Trained on most problems, judged on the rest (whole problems held out): for each held-out
    problem, the time of the candidate each model ranks first over the best measured, as a geometric
    mean and worst case, and how often each picks the best (top-1), learned against analytic."""
    problems = sorted({s.problem for s in samples}, key=lambda p: p.key)
    random.Random(seed).shuffle(problems)
    held = set(problems[:max(1, int(len(problems) * fraction))])
    model = train([s for s in samples if s.problem not in held], fingerprint, epochs=epochs, seed=seed)
    scores: dict[str, list[float]] = {"learned": [], "analytic": []}
    for problem in held:
        rows = [s for s in samples if s.problem == problem]
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

    corrections = model.log2_factor([features(s.problem, s.name, s.analytic_ms, s.order) for s in rows])
    prices = [math.log2(s.analytic_ms * order_factor(s.order)) + c for s, c in zip(rows, corrections)]
    keyed = sorted(zip(prices, (s.name for s in rows), rows), key=lambda k: (k[0], k[1]))
    return [(s, 2.0 ** price) for price, _, s in keyed]


def simulated_find(order: Sequence[tuple[Sample, float]], patience: int, tolerance: float,
                   prune_factor: float) -> tuple[float, int, float]:
    """(best time found, candidates run, their summed times) of ``find``'s search over ``order`` (``ranked``'s
    answer), from the candidates' measured times: each backend's best-ranked candidate first, then the rest in
    order; a candidate predicted over ``prune_factor`` times the best measured is skipped, and once ``patience``
    candidates in a row after the first tries gained nothing beyond ``tolerance``, the rest are (0: never). Two
    of find's rules are left out: a skipped candidate still runs where it may need less workspace than every
    one measured (samples carry no workspace), and ``get``'s tie rule (times within the policy's tolerance go
    to the smaller workspace, then to torch:native) does not reorder ``order``."""
    firsts: dict[str, tuple[Sample, float]] = {}
    for entry in order:
        firsts.setdefault(backend_of(entry[0].name), entry)
    head = list(firsts.values())
    best, run, spent, without_gain = math.inf, 0, 0.0, 0
    for index, (sample, predicted) in enumerate(head + [e for e in order if e not in head], 1):
        if patience and without_gain >= patience:
            break
        if prune_factor and math.isfinite(best) and predicted > prune_factor * best:
            continue
        run += 1
        spent += sample.measured_ms
        before = best
        best = min(best, sample.measured_ms)
        if index > len(head):
            gained = sample.measured_ms < before * (1 - tolerance)
            without_gain = 0 if gained or not math.isfinite(before) else without_gain + 1
    return best, run, spent


def summarize(ratios: Sequence[float]) -> dict[str, float]:
    """Picked time over best time across problems: geometric mean, worst, share of best picks, count
    (empty without ratios)."""
    if not ratios:
        return {}
    return {"geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)), "worst": max(ratios),
            "top1": sum(r <= 1.0 + 1e-9 for r in ratios) / len(ratios), "problems": float(len(ratios))}
