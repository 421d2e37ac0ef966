"""The analytic cost model behind ``get``: a predicted time for (algorithm, problem), running nothing.

Each algorithm declares its own cost next to its code (``Algorithm.cost(problem, workspace_bytes)``,
a ``Cost`` of roofline terms: the FLOPs it really performs at a fraction of the device's peak, the
bytes it moves, the operations it launches); a backend whose algorithms depend on the problem
(cuDNN's execution plans) declares one for them all (``Backend.cost``). This module keeps what is common:

- the roofline arithmetic: the longer of compute (``hardware.peaks``) and traffic, plus fixed
  per-call costs that decide small problems (``roofline_ms``);
- the helpers families share (``shape_factor``, ``gemm_dims``, ``taps``);
- the prices from measurements (``Corrections``): where a database holds measurements on this
  device, the learned model of them (``learned``: how each candidate ran on the nearest measured
  problems) prices, on top of the model installed for this device where there is one.

convtune's own algorithms, chains of PyTorch operations, reach a fraction of what one vendor
kernel does (``COMPOSED_FACTOR``); FFT and Winograd compute in float32 whatever the dtype, so
a float16 problem does not get the tensor-core peak for them. The efficiencies are rough on
purpose: the tuning database corrects them.

    >>> from convtune.problem import ConvProblem
    >>> p = ConvProblem("fwd", n=8, c=64, k=64, input_size=(28, 28), kernel_size=1)
    >>> predict_ms("gemm:1x1", p) < predict_ms("direct:taps", p)
    True
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, cast

from . import forks, hardware, learned
from .problem import ConvProblem

log = logging.getLogger(__name__)

# Seconds of fixed cost per launched operation: Python + dispatcher on the CPU, the gap between
# kernels on a GPU (the tuner times CUDA graphs, so host launch overhead is not in its numbers).
LAUNCH_S = {"cpu": 6e-6, "cuda": 4e-6}
# Backward passes run the same arithmetic with less friendly access patterns.
DIRECTION_FACTOR = {"fwd": 1.0, "bwd_data": 1.1, "bwd_filter": 1.2}
# float16/bfloat16 on a CPU mostly convert to float32 and back, far from the float32 peak.
CPU_HALF_FACTOR = 0.3
# convtune's own algorithms chain several PyTorch operations with intermediates in memory; the
# vendors' paths (oneDNN, cuDNN) run fused kernels. Measured: about 1/3 on a 2-core CPU, 1/2 on an H200.
COMPOSED_FACTOR = {"cpu": 0.3, "cuda": 0.5}
# Used when the device's ceilings cannot be read (a CUDA problem ranked on a machine without one).
FALLBACK_PEAKS = {"cpu": (1e11, 1e10), "cuda": (50e12, 2e12)}


@dataclasses.dataclass(frozen=True)
class Cost:
    """One family's estimate: FLOPs at a given efficiency, bytes moved, operations launched."""

    flops: float
    efficiency: float
    bytes: float
    launches: int
    extra_flops: float = 0.0  # transforms and other low-intensity arithmetic
    extra_efficiency: float = 0.15
    float32_inside: bool = False  # computes in float32 whatever the dtype (no half-precision peak)
    composed: bool = True  # a chain of PyTorch operations (convtune's own), not one vendor kernel
    measured_factor: float = 1.0  # measured times over this roofline's work (not its launches), where fitted


def _peaks(device: str, dtype: str, tf32: bool) -> tuple[float, float]:
    return _device_peaks(device, dtype, tf32, _priced_gpu(device))


def _priced_gpu(device: str) -> str | None:
    """The GPU ``hardware.measured_on`` prices ``device``'s problems for (None: this machine's own device)."""
    return hardware.assumed_gpu() if device == "cuda" else None


@functools.cache
def _device_peaks(device: str, dtype: str, tf32: bool, assumed_gpu: str | None) -> tuple[float, float]:
    """The peaks of ``device`` here, or of the GPU ``hardware.measured_on`` names (part of the cache key)."""
    try:
        return hardware.peaks(device, dtype, tf32)
    except Exception as exc:  # noqa: BLE001 - no such device here: rank with nominal figures
        log.debug("no peaks for %s (%s); using nominal figures", device, exc)
        return FALLBACK_PEAKS[device]


def shape_factor(*dims: float) -> float:
    """How much of the peak a matrix product with these dimensions reaches: small ones waste lanes."""
    smallest = max(1.0, min(dims))
    return max(0.05, min(1.0, smallest / 64.0) ** 0.5)


def taps(p: ConvProblem) -> int:
    return math.prod(p.kernel_size)


def gemm_dims(p: ConvProblem) -> tuple[int, int, int]:
    """(M, N, K) of the per-group matrix product that lowers ``p``."""
    return p.n * math.prod(p.output_size), p.k // p.groups, (p.c // p.groups) * taps(p)


def generic_cost(p: ConvProblem, workspace_bytes: int) -> Cost:
    """What an algorithm that declares no cost of its own is assumed to cost: a modest GEMM-like path."""
    return Cost(p.flops, 0.3 * shape_factor(*gemm_dims(p)), p.min_bytes + 2 * workspace_bytes, 2)


# A backend that ranks its candidates (cuDNN, by its own heuristics, which know more than a roofline) lists
# them best first: among candidates the model cannot tell apart, each later one is priced this much higher.
BACKEND_ORDER_STEP = 0.03


def order_factor(order: int | None) -> float:
    """The price factor of a candidate's place in its backend's heuristic order (1 where it has none)."""
    return 1.0 if order is None else 1.0 + BACKEND_ORDER_STEP * order


def roofline_ms(cost: Cost, problem: ConvProblem, tf32: bool = False) -> float:
    """The model's time in ms for ``cost`` on ``problem`` (tf32: float32 computed with TF32), before corrections."""
    dtype = "float32" if cost.float32_inside else problem.dtype
    peak_flops, bandwidth = _peaks(problem.device, dtype, bool(tf32 and problem.allow_tf32))
    scale = COMPOSED_FACTOR[problem.device] if cost.composed else 1.0
    if problem.device == "cpu" and dtype != "float32":
        scale *= CPU_HALF_FACTOR
    compute_s = cost.flops / (peak_flops * cost.efficiency * scale)
    compute_s += cost.extra_flops / (peak_flops * cost.extra_efficiency * scale)
    seconds = max(compute_s, cost.bytes / bandwidth) * cost.measured_factor + cost.launches * LAUNCH_S[problem.device]
    return 1e3 * seconds * DIRECTION_FACTOR[problem.direction]


def predict_ms(name: str, problem: ConvProblem, workspace_bytes: int = 0, tf32: bool = False) -> float:
    """The model's time in ms for the algorithm called ``name`` on ``problem``, before database corrections:
    the analytic price (``analytic_ms``) times the learned correction where this device has a model
    (``learned``).

    The cost is the one the registry's algorithm (or backend) of that name declares; a name nothing
    here declares (a stored result of a plug-in not registered now) gets ``generic_cost``.
    workspace_bytes: what the algorithm declares; tf32: whether it computes float32 with TF32.
    """
    from .algorithms.registry import generation

    return _predict_ms(name, problem, workspace_bytes, bool(tf32), generation(), learned.version(problem.device))


def analytic_ms(name: str, problem: ConvProblem, workspace_bytes: int = 0, tf32: bool = False) -> float:
    """The analytic model's time in ms for ``name`` on ``problem`` (its family's roofline terms alone)."""
    from .algorithms.registry import generation

    return _analytic_ms(name, problem, workspace_bytes, bool(tf32), generation())


@functools.lru_cache(maxsize=65536)  # a database's tens of thousands of results are priced when get first reads it
def _analytic_ms(name: str, problem: ConvProblem, workspace_bytes: int, tf32: bool, generation: int) -> float:
    from .algorithms.registry import declared_cost

    return roofline_ms(declared_cost(name)(problem, workspace_bytes), problem, tf32)


@functools.lru_cache(maxsize=8192)
def _predict_ms(name: str, problem: ConvProblem, workspace_bytes: int, tf32: bool, generation: int,
                model: int) -> float:
    base = analytic_ms(name, problem, workspace_bytes, tf32)
    return base * learned.correction(problem, name, base)


def clear_cache() -> None:
    """Forget cached predictions (tests that change the machine's peaks; ``hardware.measured_on`` on entry and exit:
    the caches that outlive it, ``get``'s answers and the correction tables, are keyed by the priced GPU)."""
    _predict_ms.cache_clear()
    _analytic_ms.cache_clear()


# -- corrections from the database -------------------------------------------------------------

_versions = itertools.count(1)  # of the tables built (Corrections.version)

@dataclasses.dataclass(frozen=True, eq=False)
class Corrections:
    """What ``get`` prices with beside the analytic model: the learned model (``learned``) of a database's
    measurements on this device, on top of the device's installed model where there is one; ``model`` None:
    the installed model alone, or nothing.

    Compared and hashed by identity; ``version`` is a number of its own, which ``get`` keys its answers on (an
    answer kept must not keep a replaced table's model alive).
    """

    model: learned.LearnedModel | None = None
    version: int = dataclasses.field(default_factory=lambda: next(_versions), init=False)
    analytic: bool = False  # with model None: the analytic price alone (no installed model looked up)

    def price(self, name: str, problem: ConvProblem, base_ms: float, place: int | None = None) -> float:
        """``get``'s time for ``name`` on ``problem`` from the analytic ``base_ms``: the model's price (with
        ``place``, the candidate's place in its backend's heuristic order), else ``base_ms`` times
        ``order_factor(place)``."""
        return self.prices(problem, [(name, base_ms, place)])[0]

    def prices(self, problem: ConvProblem, candidates: Sequence[tuple[str, float, int | None]]) -> list[float]:
        """``price`` of each (name, analytic ``base_ms``, place) of ``candidates`` on ``problem``, priced together (a
        ranking's: the model looks the problem's neighbours up once)."""
        factors = [1.0] * len(candidates) if self.analytic else learned.corrections(problem, candidates, self.model)
        return [base_ms * factor * order_factor(place) for (_, base_ms, place), factor in zip(candidates, factors)]

    def guessed(self, name: str, problem: ConvProblem, place: int | None = None) -> bool:
        """Whether the learned model prices ``name`` on ``problem`` by a guess, not from measurements of it on problems
        like this one (``learned.LearnedModel.guessed``); False with the analytic price alone."""
        model = self._learned(problem)
        try:
            return model is not None and model.guessed(problem, name, place)
        except Exception:  # noqa: BLE001 - a model that cannot answer prices analytically (learned.correction)
            return False

    def contenders(self, problem: ConvProblem, candidates: Sequence[tuple[str, int | None]],
                   factor: float) -> frozenset[str]:
        """The names of ``candidates`` ((name, place)) that a measured problem like ``problem`` timed within ``factor``
        of its best (``learned.LearnedModel.contenders``); none with the analytic price alone or ``factor`` 0."""
        if not factor:
            return frozenset()
        try:
            model = self._learned(problem)
            return frozenset() if model is None else frozenset(model.contenders(problem, candidates, factor))
        except Exception:  # noqa: BLE001 - a model that cannot answer leaves the search to its other rules
            return frozenset()

    def _learned(self, problem: ConvProblem) -> learned.LearnedModel | None:
        """The learned model this table prices ``problem`` with (None: the analytic price alone)."""
        return None if self.analytic else learned.active(problem.device) if self.model is None else self.model

    def resolved(self, device: str) -> Corrections:
        """This table where it has a model; else one of the model installed for ``device`` now (``learned.installed``),
        or of none: looked up once for a whole ranking, not per candidate (each look reads the settings that name
        the file), and the same throughout it should the file change meanwhile."""
        if self.model is not None or self.analytic:
            return self
        model, version = learned.installed(device)
        known = _installed_tables.get(device)
        if known is None or known[0] != version:
            known = _installed_tables[device] = (version, Corrections(model, analytic=model is None))
        return known[1]

    @staticmethod
    def of(measurements: Iterable[tuple[ConvProblem, Any]]) -> Corrections:
        """The table that ``measurements`` ((problem, result) pairs, as ``TuningDB.measurements`` gives them) make
        alone, priced for the GPU being priced now (``hardware.measured_on``)."""
        return Corrections(_extended(None, _samples(measurements), None, None))


NO_CORRECTIONS = Corrections()
_installed_tables: dict[str, tuple[int, Corrections]] = {}  # device -> (learned.installed's version, its table)
_tables: weakref.WeakKeyDictionary[Any, dict[str, _Table]] = weakref.WeakKeyDictionary()
_tables_lock = threading.RLock()  # find may store from a background thread while get reads
forks.renew_after_fork(globals(), _tables_lock=threading.RLock)  # (held while a database is read)


def _samples(measurements: Iterable[tuple[ConvProblem, Any]]) -> list[learned.Sample]:
    """The timed ok results of ``measurements`` as the learned model's samples, each with the place ``find``
    stored with it (``PerfResult.place``)."""
    return [learned.sample_of(problem, result, result.place) for problem, result in measurements
            if result.ok and learned.timed(result)]


class _Table:
    """A device's measurements as the learned model of them, on top of the device's installed model (``base``),
    kept up to date with what this process stores."""

    def __init__(self, measurements: list[tuple[ConvProblem, Any]], base: learned.LearnedModel | None,
                 version: int = 0) -> None:
        self.version, self.base = version, base  # the installed model the table was built on, and its version
        samples = _samples(measurements)
        if base is not None:  # where the model knows a problem's places and this database does not, its row holds
            placed = {s.problem for s in samples if s.order is not None}
            with_places = {r.problem for r in base.rows if r.placed}
            samples = [s for s in samples if s.problem in placed or s.problem not in with_places]
        self.corrections = Corrections(_extended(base, samples, None, base))

    def replace(self, problem: ConvProblem, results: Any) -> None:
        """``problem``'s measurements are now ``results`` (a find stored them): the model follows."""
        self.corrections = Corrections(_extended(self.corrections.model, _samples((problem, r) for r in results),
                                                 problem, self.base))


def _extended(model: learned.LearnedModel | None, samples: list[learned.Sample], replaced: ConvProblem | None,
              base: learned.LearnedModel | None) -> learned.LearnedModel | None:
    """``model`` (else ``base``) with ``samples``, in place of its rows of their problems and of ``replaced`` (where
    ``base`` has a row of a problem measured again with nothing timed, that row); a new model of ``samples``
    without either; None where no measured problem is left."""
    model = base if model is None else model
    if model is None:
        return learned.train(samples, "") if any(learned.usable(s) for s in samples) else None
    if not samples and replaced is None:
        return model
    try:
        return model.extended(samples, replaced=() if replaced is None else [replaced], fallback=base)
    except ValueError:  # its only problem measured again, nothing timed
        return None


def _table(db: Any, device: str, *, build: bool) -> _Table | None:
    try:
        per_device = _tables.setdefault(db, {})
    except TypeError:  # an object that cannot be weakly referenced: no caching
        per_device = {}
    # A table's floors and analytic prices are the priced GPU's: one table per priced GPU.
    slot = device if _priced_gpu(device) is None else f"{device}@{_priced_gpu(device)}"
    if slot in per_device and per_device[slot].version != learned.version(device):
        per_device.pop(slot, None)  # built on another installed model
    if slot not in per_device:
        if not build:
            return None
        base, version = learned.installed(device)
        try:
            per_device[slot] = _Table(list(db.measurements(device)), base, version)
        except Exception as exc:  # noqa: BLE001 - a broken database must not stop a heuristic answer
            log.warning("cost model: no corrections from the tuning database (%s: %s)", type(exc).__name__, exc)
            per_device[slot] = _Table([], base, version)
    return per_device[slot]


def corrections(db: Any, device: str) -> Corrections:
    """The prices of ``db``'s measurements on ``device``: read from it once per db object (and again when the
    installed model changes: the table is built on it), then kept up to date with what this process stores
    (``stored``)."""
    if db is None:
        return NO_CORRECTIONS
    with _tables_lock:
        return cast(_Table, _table(db, device, build=True)).corrections  # build=True always gives a table


def basis(db: Any, problem: ConvProblem) -> str:
    """What ``get`` prices ``problem`` from, in words: the measured problems nearest to it, or the analytic model."""
    model = corrections(db, problem.device).model or learned.active(problem.device)
    distance = None if model is None else model.nearest_distance(problem)
    if distance is None:
        measured = 0 if model is None else model.measured(problem.direction)
        order = " and cuDNN's order" if problem.device == "cuda" else ""  # cuDNN ranks only CUDA problems' plans
        return (f"the analytic model{order} ({measured} of this direction's problems measured here; "
                f"{learned.MIN_MEASURED} are needed to price from measurements)")
    return (f"how each candidate ran on the {learned.NEIGHBOURS} measured problems of this direction nearest to it "
            f"(the nearest at a distance of {distance:.2f}; 0: this one)")


def stored(db: Any, problem: ConvProblem, results: Any) -> None:
    """``results`` of ``problem`` were just stored in ``db`` (replacing its earlier ones): update the prices.

    Only this problem's row is replaced: a tuning run that stores after every find would otherwise
    re-read and decode the whole database each time (quadratic in the problems tuned).
    """
    with _tables_lock:
        table = _table(db, problem.device, build=False)
        if table is not None:
            table.replace(problem, [r for r in results if r.ok])
