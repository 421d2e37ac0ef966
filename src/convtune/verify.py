"""Checking results: the float64 reference, relative error, per-dtype tolerances, memory honesty.

Tolerances are relative L2 errors ||result - ref|| / ||ref||, the reference computed in float64
from the same (already rounded) inputs, so only the algorithm's own arithmetic counts:

- float32, IEEE arithmetic: 1e-4. Summing C·R·S products in float32 gives a relative error
  near sqrt(C·R·S)·2^-24 (about 1e-5 at C·R·S = 4608); FFT and Winograd F(4x4,3x3) transforms
  add a few units of that. 1e-4 leaves room, while a wrong index is off by O(1).
- float32 with TF32: 5e-3. TF32 keeps 10 mantissa bits: inputs rounded to 2^-11 relative give
  about 5e-4..1e-3 in a sum of many terms.
- float16: 2e-3. The output is rounded to 11 bits (about 3e-4 relative RMS) after a float32 sum.
- bfloat16: 1.6e-2. The output is rounded to 8 bits (about 2.3e-3 relative RMS), with margin.
- Algorithms whose numeric notes say reduced-precision accumulation get 4 times the above.

NaN or Inf in a result never passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .algorithms.base import NumericNotes
from .algorithms.native import native_conv
from .problem import ConvProblem

TOLERANCES = {"float32": 1e-4, "tf32": 5e-3, "float16": 2e-3, "bfloat16": 1.6e-2}
REDUCED_PRECISION_FACTOR = 4.0


def reference(problem: ConvProblem, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact-as-possible result of ``problem`` on (a, b): float64 on the CPU."""
    a64 = a.detach().to(device="cpu", dtype=torch.float64)
    b64 = b.detach().to(device="cpu", dtype=torch.float64)
    return native_conv(problem, a64, b64)


def rel_error(result: torch.Tensor, ref: torch.Tensor) -> float:
    """||result - ref|| / ||ref|| in float64; ``inf`` when ``result`` holds NaN or Inf."""
    r = result.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(r).all()):
        return math.inf
    denom = float(torch.linalg.vector_norm(ref))
    diff = float(torch.linalg.vector_norm(r - ref))
    return diff / denom if denom > 0 else diff


def tolerance(problem: ConvProblem, notes: NumericNotes) -> float:
    """The largest relative L2 error a correct algorithm with ``notes`` may show on ``problem``."""
    key = "tf32" if problem.dtype == "float32" and notes.tf32 else problem.dtype
    tol = TOLERANCES[key]
    return tol * REDUCED_PRECISION_FACTOR if notes.reduced_precision else tol


def peak_allocated_bytes(fn: Callable[[], object], device: str) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before it.

    CUDA: the caching allocator's peak counter. CPU: the profiler's record of every allocation
    and free, replayed in time order.
    """
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak
