"""The analytic cost model behind ``get``: a predicted time for (algorithm, problem), running nothing.

Each algorithm family, told by its name ('backend:variant'), gets a roofline of its own:

- arithmetic: the FLOPs it really performs (FFT's transforms ~ 5·L·log2(L) each plus the
  pointwise products, Winograd's reduced multiplications plus its transforms) at a fraction of
  the device's peak (``hardware.peaks``); skinny matrix products (few channels per group) reach
  less of it;
- traffic: the compulsory bytes, plus the workspace written and read back, plus what a family
  re-reads (the direct method reads the input once per kernel tap), at the peak bandwidth;
- the longer of the two, plus fixed per-call costs: one per operation launched (per tap, per
  sub-batch, per Python loop iteration), which decide small problems.

convtune's own algorithms, chains of PyTorch operations, reach a fraction of what one vendor
kernel does (``COMPOSED_FACTOR``); FFT and Winograd compute in float32 whatever the dtype, so
a float16 problem does not get the tensor-core peak for them.

The efficiencies are rough on purpose: the tuning database corrects them. For every
(algorithm, direction, dtype) measured on this device, the geometric mean of measured /
predicted multiplies later predictions; an algorithm never measured takes its backend's factor.

    >>> from convtune.problem import ConvProblem
    >>> p = ConvProblem("fwd", n=8, c=64, k=64, input_size=(28, 28), kernel_size=1)
    >>> predict_ms("gemm:1x1", p) < predict_ms("direct:taps", p)
    True
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
import weakref
from collections import defaultdict
from typing import Any

from . import hardware
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


@functools.cache
def _peaks(device: str, dtype: str, tf32: bool) -> tuple[float, float]:
    try:
        return hardware.peaks(device, dtype, tf32)
    except Exception as exc:  # noqa: BLE001 - no such device here: rank with nominal figures
        log.debug("no peaks for %s (%s); using nominal figures", device, exc)
        return FALLBACK_PEAKS[device]


def _shape_factor(*dims: float) -> float:
    """How much of the peak a matrix product with these dimensions reaches: small ones waste lanes."""
    smallest = max(1.0, min(dims))
    return max(0.05, min(1.0, smallest / 64.0) ** 0.5)


def _taps(p: ConvProblem) -> int:
    return math.prod(p.kernel_size)


def _gemm_dims(p: ConvProblem) -> tuple[int, int, int]:
    """(M, N, K) of the per-group matrix product that lowers ``p``."""
    return p.n * math.prod(p.output_size), p.k // p.groups, (p.c // p.groups) * _taps(p)


def _native(p: ConvProblem, ws: int) -> Cost:
    # On the CPU the measured 'peak' is one 512^3 product; oneDNN's convolutions reach about it.
    eff = 0.6 if p.device == "cuda" else 0.9
    # PyTorch's result is copied into the caller's output: a second operation.
    return Cost(p.flops, eff * _shape_factor(*_gemm_dims(p)), p.min_bytes, 2, composed=False)


def _gemm_1x1(p: ConvProblem, ws: int) -> Cost:
    # One matrix product straight on the operands: as good as a vendor kernel.
    return Cost(p.flops, 0.8 * _shape_factor(*_gemm_dims(p)), p.min_bytes + 2 * ws, p.groups + 1, composed=False)


_CHUNK = re.compile(r"chunk(\d+)")


def _im2col(p: ConvProblem, ws: int, name: str = "") -> Cost:
    # The column matrix is written once and read once by the product; a variant that lowers
    # sub-batches of b samples ('..._chunk{b}') repeats the per-tap copies and the product per sub-batch.
    match = _CHUNK.search(name)
    batches = -(-p.n // int(match.group(1))) if match and int(match.group(1)) > 0 else 1
    m, n, k = _gemm_dims(p)
    return Cost(p.flops, 0.7 * _shape_factor(m / batches, n, k), p.min_bytes + 2 * ws, batches * (_taps(p) + 1))


def _direct(p: ConvProblem, ws: int) -> Cost:
    m, n, _ = _gemm_dims(p)
    # Per tap, one batched product over the largest of the batch, leading spatial and group
    # dimensions, and a loop over the others; the filter gradient loops over every row.
    leading = [p.n, *p.output_size[:-1], p.groups]
    loops = p.n * math.prod(p.output_size[:-1]) if p.direction == "bwd_filter" else math.prod(leading) // max(leading)
    return Cost(p.flops, 0.5 * _shape_factor(m, n, p.c // p.groups), _taps(p) * p.min_bytes + 2 * ws,
                _taps(p) * loops + 1)


def _fft(p: ConvProblem, ws: int) -> Cost:
    length = math.prod(h + 2 * pad for h, pad in zip(p.input_size, p.padding))
    half = length // 2 + 1
    cg, kg = p.c // p.groups, p.k // p.groups
    transforms = p.n * p.c + p.k * cg + p.n * p.k  # input, filter, result (any direction)
    transform_flops = transforms * 5.0 * length * math.log2(max(2, length))
    # A complex multiply-add (8 real FLOPs) per frequency, batch, filter and input channel.
    pointwise = 8.0 * p.n * p.k * cg * half
    return Cost(pointwise, 0.6 * _shape_factor(p.n, kg, cg), p.min_bytes + 3 * ws, 40,
                extra_flops=transform_flops, float32_inside=True)


_WINOGRAD = re.compile(r"f(\d+)x(\d+)")


def _winograd(p: ConvProblem, ws: int, name: str) -> Cost:
    match = _WINOGRAD.search(name.split(":", 1)[1])
    m, r = (int(match.group(1)), int(match.group(2))) if match else (2, 3)
    t, d = m + r - 1, p.ndim
    tiles = math.prod(-(-o // m) for o in p.output_size)
    cg, kg = p.c // p.groups, p.k // p.groups
    # t^d products per tile instead of m^d·r^d: the multiplications Winograd saves.
    products = 2.0 * p.n * p.k * cg * tiles * t**d
    transforms = 2.0 * d * (p.n * p.c * tiles * t ** (d + 1) + p.n * p.k * tiles * t**d * m + p.k * cg * t ** (d + 1))
    # Tiles are gathered and scattered with a few strided copies per position in the tile.
    return Cost(products, 0.6 * _shape_factor(p.n * tiles, kg, cg), p.min_bytes + 2 * ws, 8 * t**d + 10,
                extra_flops=transforms, float32_inside=True)


def _vendor(efficiency: float):
    # A vendor's plan uses its workspace inside fused kernels (cuDNN's fp32 NCHW plans transpose
    # through 50 MB and still lead): the workspace is no traffic term here.
    def cost(p: ConvProblem, ws: int) -> Cost:
        return Cost(p.flops, efficiency * _shape_factor(*_gemm_dims(p)), p.min_bytes, 1, composed=False)

    return cost


def _unknown(p: ConvProblem, ws: int) -> Cost:
    return Cost(p.flops, 0.3 * _shape_factor(*_gemm_dims(p)), p.min_bytes + 2 * ws, 2)


_BACKENDS = {"torch": _native, "cudnn": _vendor(0.7), "cublas": _vendor(0.75), "triton": _vendor(0.6)}


def family_cost(name: str, problem: ConvProblem, workspace_bytes: int) -> Cost:
    """The cost of algorithm ``name`` on ``problem``: by backend, else by a keyword of the name."""
    backend = name.split(":", 1)[0]
    if backend in _BACKENDS:
        return _BACKENDS[backend](problem, workspace_bytes)
    lowered = name.lower()
    if "winograd" in lowered:
        return _winograd(problem, workspace_bytes, name)
    if "fft" in lowered:
        return _fft(problem, workspace_bytes)
    if "im2col" in lowered:
        return _im2col(problem, workspace_bytes, lowered)
    if "1x1" in lowered:
        return _gemm_1x1(problem, workspace_bytes)
    if "direct" in lowered:
        return _direct(problem, workspace_bytes)
    if "gemm" in lowered:
        return _im2col(problem, workspace_bytes)
    return _unknown(problem, workspace_bytes)


@functools.lru_cache(maxsize=8192)
def predict_ms(name: str, problem: ConvProblem, workspace_bytes: int = 0, tf32: bool = False) -> float:
    """The model's time in ms for algorithm ``name`` on ``problem``, before database corrections.

    workspace_bytes: what the algorithm declares; tf32: whether it computes float32 with TF32.
    """
    cost = family_cost(name, problem, workspace_bytes)
    dtype = "float32" if cost.float32_inside else problem.dtype
    peak_flops, bandwidth = _peaks(problem.device, dtype, bool(tf32 and problem.allow_tf32))
    scale = COMPOSED_FACTOR[problem.device] if cost.composed else 1.0
    if problem.device == "cpu" and dtype != "float32":
        scale *= CPU_HALF_FACTOR
    compute_s = cost.flops / (peak_flops * cost.efficiency * scale)
    compute_s += cost.extra_flops / (peak_flops * cost.extra_efficiency * scale)
    seconds = max(compute_s, cost.bytes / bandwidth) + cost.launches * LAUNCH_S[problem.device]
    return 1e3 * seconds * DIRECTION_FACTOR[problem.direction]


# -- corrections from the database -------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Corrections:
    """measured / predicted factors: per (algorithm, direction, dtype), and per backend.

    Compared and hashed by identity: each table built is a new version (``get`` keys on it).
    """

    by_algorithm: dict[tuple[str, str, str], float] = dataclasses.field(default_factory=dict)
    by_backend: dict[str, float] = dataclasses.field(default_factory=dict)

    def factor(self, name: str, problem: ConvProblem) -> float:
        exact = self.by_algorithm.get((name, problem.direction, problem.dtype))
        if exact is not None:
            return exact
        return self.by_backend.get(name.split(":", 1)[0], 1.0)


NO_CORRECTIONS = Corrections()
_tables: weakref.WeakKeyDictionary[Any, dict[str, _Table]] = weakref.WeakKeyDictionary()


def _log_ratios(problem: ConvProblem, results: Any) -> list[tuple[str, float]]:
    """(algorithm, log(measured / predicted)) of each timed ok result of ``problem``."""
    out = []
    for result in results:
        if not result.ok or not result.time_ms or result.time_ms <= 0 or not math.isfinite(result.time_ms):
            continue
        predicted = predict_ms(result.algorithm, problem, result.workspace_bytes, result.uses_tf32)
        out.append((result.algorithm, math.log(result.time_ms / predicted)))
    return out


class _Table:
    """A device's measurements as log ratios per problem, and the corrections they make: the
    geometric means of measured / predicted time per (algorithm, direction, dtype) and per backend."""

    def __init__(self, measurements: list[tuple[ConvProblem, Any]]) -> None:
        by_problem: dict[ConvProblem, list[Any]] = defaultdict(list)
        for problem, result in measurements:
            by_problem[problem].append(result)
        self.ratios = {p: _log_ratios(p, results) for p, results in by_problem.items()}
        self.corrections = self._aggregate()

    def replace(self, problem: ConvProblem, results: Any) -> None:
        """``problem``'s measurements are now ``results`` (a find stored them): the corrections follow."""
        self.ratios[problem] = _log_ratios(problem, results)
        self.corrections = self._aggregate()

    def _aggregate(self) -> Corrections:
        logs: dict[tuple[str, str, str], list[float]] = defaultdict(list)
        backend_logs: dict[str, list[float]] = defaultdict(list)
        for problem, ratios in self.ratios.items():
            for algorithm, ratio in ratios:
                logs[(algorithm, problem.direction, problem.dtype)].append(ratio)
                backend_logs[algorithm.split(":", 1)[0]].append(ratio)

        def geomean(values: list[float]) -> float:
            return math.exp(sum(values) / len(values))

        return Corrections({k: geomean(v) for k, v in logs.items()}, {k: geomean(v) for k, v in backend_logs.items()})


def _table(db: Any, device: str, *, build: bool) -> _Table | None:
    try:
        per_device = _tables.setdefault(db, {})
    except TypeError:  # an object that cannot be weakly referenced: no caching
        per_device = {}
    if device not in per_device:
        if not build:
            return None
        try:
            per_device[device] = _Table(list(db.measurements(device)))
        except Exception as exc:  # noqa: BLE001 - a broken database must not stop a heuristic answer
            log.warning("cost model: no corrections from the tuning database (%s: %s)", type(exc).__name__, exc)
            per_device[device] = _Table([])
    return per_device[device]


def corrections(db: Any, device: str) -> Corrections:
    """The correction table of ``db`` for ``device``: read from it once per db object, then kept up to
    date with what this process stores (``stored``)."""
    if db is None:
        return NO_CORRECTIONS
    return _table(db, device, build=True).corrections


def stored(db: Any, problem: ConvProblem, results: Any) -> None:
    """``results`` of ``problem`` were just stored in ``db`` (replacing its earlier ones): update the corrections.

    Only this problem's ratios are recomputed: a tuning run that stores after every find would
    otherwise re-read and decode the whole database each time (quadratic in the problems tuned).
    """
    table = _table(db, problem.device, build=False)
    if table is not None:
        table.replace(problem, [r for r in results if r.ok])
