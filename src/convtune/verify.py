"""Checking results: the float64 reference, relative error, per-dtype tolerances, the candidate
check of the tuner (``reference_case`` once per problem, ``check`` once per candidate), memory honesty.

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

from .algorithms.base import Algorithm, NumericNotes
from .algorithms.native import native_conv
from .problem import ConvProblem
from .settings import settings

TOLERANCES = {"float32": 1e-4, "tf32": 5e-3, "float16": 2e-3, "bfloat16": 1.6e-2}
REDUCED_PRECISION_FACTOR = 4.0


def reference(problem: ConvProblem, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact-as-possible result of ``problem`` on (a, b): float64, on the operands' device.

    On CUDA the float64 path is a trusted one (no TF32, no reduced precision) and fast enough on
    data-centre GPUs; on the CPU it is PyTorch's own float64 convolution.
    """
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False, benchmark=False, deterministic=True):
        return native_conv(problem, a.detach().double(), b.detach().double())


def rel_error(result: torch.Tensor, ref: torch.Tensor) -> float:
    """||result - ref|| / ||ref|| in float64; ``inf`` when ``result`` holds NaN or Inf."""
    r = result.detach().to(device=ref.device, dtype=torch.float64)
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
    # Every allocation and free in time order: an op's net self-memory would hide a temporary
    # that the op allocates and frees inside itself.
    cpu = torch._C._autograd.DeviceType.CPU
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == cpu)
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def reference_case(problem: ConvProblem,
                   seed: int | None = None) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Fresh random operands of ``problem`` (never zeros) and their float64 reference result.

    Computed once per problem and shared by every candidate of one search. ``seed`` defaults to
    ``settings.verify_seed``.

        >>> p = ConvProblem("fwd", n=1, c=2, k=3, input_size=(5, 5), kernel_size=3)
        >>> (x, w), ref = reference_case(p)
        >>> tuple(ref.shape), ref.dtype
        ((1, 3, 3, 3), torch.float64)
    """
    inputs = problem.random_inputs(settings.verify_seed if seed is None else seed)
    return inputs, reference(problem, *inputs)


def check(algorithm: Algorithm, problem: ConvProblem, inputs: tuple[torch.Tensor, torch.Tensor],
          ref: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor | None,
          *, max_rel_error: float | None = None) -> tuple[float, bool, str]:
    """Run ``algorithm`` once into ``out`` (poisoned with NaN first) and compare with ``ref``.

    inputs: the operands (a, b) of ``reference_case``; ref: their float64 result; workspace: as
    for ``Algorithm.run``. The bound is ``max_rel_error`` when given (a policy's), else
    ``tolerance(problem, algorithm.notes(problem))``. Returns (rel_error, ok, message); NaN or
    Inf anywhere in the result never passes, nor does an element left unwritten. Exceptions of
    the algorithm propagate (the tuner turns them into statuses).

        >>> from convtune.algorithms.registry import get_algorithm
        >>> p = ConvProblem("fwd", n=1, c=2, k=3, input_size=(5, 5), kernel_size=3)
        >>> inputs, ref = reference_case(p)
        >>> err, ok, message = check(get_algorithm("torch:native"), p, inputs, ref, p.empty(p.y_shape), None)
        >>> ok
        True
    """
    # Poisoned, so an element the algorithm forgets to write shows up as NaN.
    out.fill_(math.nan)
    algorithm.run(problem, *inputs, workspace=workspace, out=out)
    err = rel_error(out, ref)
    bound = max_rel_error if max_rel_error is not None else tolerance(problem, algorithm.notes(problem))
    if not math.isfinite(err):
        return err, False, "result holds NaN or Inf (or elements left unwritten)"
    if err > bound:
        return err, False, f"relative error {err:.2e} exceeds the tolerance {bound:.1e}"
    return err, True, f"relative error {err:.2e} within {bound:.1e}"
