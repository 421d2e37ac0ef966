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

A norm cannot see one wrong element among many, so every element is bounded too:
|result_i - ref_i| <= element_factor · tolerance · (|ref_i| + rms(ref)), element_factor a setting (5;
``CONVTUNE_ELEMENT_FACTOR``, 0 turns the bound off). A correct algorithm's errors are spread over the
output (rounding), so its worst element stays within a few times its RMS error, itself under the
tolerance: on the H200, over 34,716 runs that passed the norm-wise check (every cuDNN execution plan and
convtune's algorithms, on a small set of problems and on the training-step layers of ResNet-50,
ResNeXt-50 and MobileNetV2), the worst element came within 3.1 tolerances (a depthwise weight gradient in
float16; ``bench/verification_margins.py``). A wrong or missing element is off by about |ref_i|, which
breaks the bound unless the element is near zero: within element_factor · tolerance of the RMS, 0.05% of
it in float32, 2.5% with TF32, 1% in float16 and 8% in bfloat16, where a normal reference's elements are
at about 0.04%, 2%, 0.8% and 7% of the positions. The check runs on two input sets, so an element zeroed at
a fixed position goes unseen on both at about the square of that (bfloat16: 0.5%). An algorithm whose notes
say reduced-precision accumulation has four times the tolerance, and so four times the bound: on CUDA
that is every GEMM algorithm in float16 and bfloat16 while PyTorch allows cuBLAS reduced-precision
reductions (its default), where a zeroed element goes unseen at 3% (float16) and 36% (bfloat16) of the
positions, 0.1% and 13% on both input sets.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from typing import cast

import torch

from .algorithms.base import Algorithm, NumericNotes
from .algorithms.native import native_conv
from .problem import ConvProblem
from .settings import settings

TOLERANCES = {"float32": 1e-4, "tf32": 5e-3, "float16": 2e-3, "bfloat16": 1.6e-2}
REDUCED_PRECISION_FACTOR = 4.0


# Bytes of float64 columns the lowered reference unfolds at once (a sub-batch at a time).
LOWERED_CHUNK_BYTES = 1 << 30


def reference(problem: ConvProblem, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact-as-possible result of ``problem`` on (a, b): float64, on the operands' device.

    1-D and 2-D problems on CUDA: ``lowered_reference``, PyTorch's unfold/fold and float64 matrix
    products, a few milliseconds per batch-128 ResNet-50 layer on an H200 (cuDNN's float64 path
    took up to 0.4 s longer on the first layer's data gradient: bench/results/tuning_cost_v1.md
    against tuning_cost_v2.md, in git history). 3-D problems on CUDA: ``tapwise_reference``. On the
    CPU, PyTorch's own float64 convolution (no TF32, no reduced precision). No path touches cuDNN's
    flags, which are the process's: a reference computed by the background worker must not change
    them under the user's own convolutions.
    """
    a, b = a.detach().double(), b.detach().double()
    if not a.is_cuda:
        return native_conv(problem, a, b)
    return lowered_reference(problem, a, b) if problem.ndim <= 2 else tapwise_reference(problem, a, b)


def lowered_reference(problem: ConvProblem, a: torch.Tensor, b: torch.Tensor,
                      chunk_bytes: int = LOWERED_CHUNK_BYTES) -> torch.Tensor:
    """``problem`` (1-D or 2-D) on (a, b) as PyTorch's ``unfold``/``fold`` and batched matrix products.

    Computes in the operands' dtype (float64 for a reference; no TF32 applies to it), over
    sub-batches whose unfolded columns fit ``chunk_bytes``. Its own few lines, sharing nothing
    with convtune's algorithms, so it checks them independently.

        >>> p = ConvProblem("bwd_data", n=2, c=4, k=6, input_size=(7, 5), kernel_size=3, padding=1, groups=2)
        >>> dy, w = p.random_inputs()
        >>> dx = lowered_reference(p, dy.double(), w.double())
        >>> rel_error(dx, native_conv(p, dy.double(), w.double())) < 1e-12
        True
    """
    if problem.ndim > 2:
        raise ValueError(f"lowered_reference computes 1-D and 2-D problems, not {problem.ndim}-D ({problem.key})")
    lift = problem.ndim == 1  # as 2-D of height 1

    def two_d(values: tuple[int, ...], fill: int) -> tuple[int, ...]:
        return (fill, *values) if lift else values

    geometry = dict(kernel_size=two_d(problem.kernel_size, 1), dilation=two_d(problem.dilation, 1),
                    padding=two_d(problem.padding, 0), stride=two_d(problem.stride, 1))
    g, n, positions = problem.groups, problem.n, math.prod(problem.output_size)
    kg, taps = problem.k // g, problem.c // g * math.prod(problem.kernel_size)

    def columns(x: torch.Tensor) -> torch.Tensor:  # (n', g, C/g·R·S, P·Q)
        x = x.unsqueeze(2) if lift else x
        return torch.nn.functional.unfold(x, **geometry).view(x.shape[0], g, taps, positions)

    def rows(t: torch.Tensor) -> torch.Tensor:  # an output-shaped (n', K, *out) tensor as (n', g, K/g, P·Q)
        return t.reshape(t.shape[0], g, kg, positions)

    step = max(1, min(n, chunk_bytes // max(1, problem.c * math.prod(problem.kernel_size) * positions * 8)))
    batches = [slice(i, i + step) for i in range(0, n, step)]
    if problem.direction == "fwd":
        w = b.reshape(g, kg, taps)
        y = torch.cat([torch.matmul(w, columns(a[s])) for s in batches])
        return y.view(problem.y_shape)
    if problem.direction == "bwd_data":
        wt = b.reshape(g, kg, taps).transpose(1, 2)
        size = two_d(problem.input_size, 1)
        dx = torch.cat([torch.nn.functional.fold(torch.matmul(wt, rows(a[s])).reshape(a[s].shape[0], -1, positions),
                                                 output_size=size, **geometry) for s in batches])
        return dx.view(problem.x_shape)
    # batches is never empty (n >= 1), so the sum is a tensor, not its start value 0.
    dw = cast(torch.Tensor, sum(torch.einsum("ngkl,ngcl->gkc", rows(b[s]), columns(a[s])) for s in batches))
    return dw.reshape(problem.w_shape)


def tapwise_reference(problem: ConvProblem, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``problem`` (any number of spatial dimensions) on (a, b) as one batched matrix product per kernel tap.

    For each tap, the padded input's strided window that the tap meets is a (n, C, *output) view;
    the forward sums weight-tap times window, the data gradient adds into the window, the weight
    gradient contracts the window with the output gradient. Computes in the operands' dtype,
    without cuDNN (whose flags are the process's), for the 3-D problems ``lowered_reference`` does not take.

        >>> p = ConvProblem("bwd_filter", n=2, c=4, k=6, input_size=(5, 4, 3), kernel_size=(3, 2, 1), padding=1,
        ...                 stride=(2, 1, 1), dilation=(1, 2, 1), groups=2)
        >>> x, dy = p.random_inputs()
        >>> rel_error(tapwise_reference(p, x.double(), dy.double()), native_conv(p, x.double(), dy.double())) < 1e-12
        True
    """
    g, n, k, c = problem.groups, problem.n, problem.k, problem.c
    positions = math.prod(problem.output_size)
    padded = tuple(size + 2 * p for size, p in zip(problem.input_size, problem.padding))

    def spatial(index: Iterable[int | slice]) -> tuple[int | slice, ...]:  # every sample and channel, these positions
        return (slice(None), slice(None), *index)

    def window(t: torch.Tensor, tap: tuple[int, ...]) -> torch.Tensor:  # the tap's strided (n, C, *out) view
        return t[spatial(slice(i * d, i * d + (o - 1) * s + 1, s)
                         for i, d, o, s in zip(tap, problem.dilation, problem.output_size, problem.stride))]

    def grouped(t: torch.Tensor) -> torch.Tensor:  # (n, C', *out) as (n, g, C'/g, P·Q)
        return t.reshape(n, g, t.shape[1] // g, positions)

    def weight(tap: tuple[int, ...]) -> torch.Tensor:  # (g, K/g, C/g)
        return b[spatial(tap)].reshape(g, k // g, c // g)

    def padded_input(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, [side for p in reversed(problem.padding) for side in (p, p)])

    taps = list(itertools.product(*(range(r) for r in problem.kernel_size)))
    if problem.direction == "fwd":
        xp = padded_input(a)
        y = sum(torch.matmul(weight(tap), grouped(window(xp, tap))) for tap in taps)
        return cast(torch.Tensor, y).reshape(problem.y_shape)
    if problem.direction == "bwd_data":
        dxp = a.new_zeros((n, c, *padded))
        dy = grouped(a)
        for tap in taps:
            window(dxp, tap).add_(torch.matmul(weight(tap).transpose(1, 2), dy).reshape(n, c, *problem.output_size))
        return dxp[spatial(slice(p, p + size) for p, size in zip(problem.padding, problem.input_size))].contiguous()
    xp, dy = padded_input(a), grouped(b)
    dw = a.new_empty(problem.w_shape)
    for tap in taps:
        dw[spatial(tap)] = torch.einsum("ngkl,ngcl->gkc", dy, grouped(window(xp, tap))).reshape(k, c // g)
    return dw


def rel_error(result: torch.Tensor, ref: torch.Tensor) -> float:
    """||result - ref|| / ||ref|| in float64; ``inf`` when ``result`` holds NaN or Inf (``errors``'s first)."""
    return errors(result, ref)[0]


def errors(result: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error, worst element error) of ``result`` against ``ref``, both ``inf`` when ``result``
    holds NaN or Inf. The worst element error is max |result_i - ref_i| / (|ref_i| + rms(ref)). A float16,
    bfloat16 or float32 result is compared in float32 with ``ref`` rounded to float32 (the rounding, and float32's
    sums and quotients, move either figure by at most a few parts in 100,000 of itself);
    two float32 tensors of the result's size at a time, half the memory and traffic of float64's. A float64 result
    is compared in float64.

        >>> ref = torch.tensor([1.0, -2.0, 3.0, 4.0], dtype=torch.float64)
        >>> rel, worst = errors(torch.tensor([1.0, -2.0, 3.0, 0.0]), ref)
        >>> round(rel, 3), round(worst, 3)  # the last element lost: 73% of the norm, 59% of |4| + rms
        (0.73, 0.594)
    """
    result = result.detach()
    if result.device != ref.device:
        result = result.to(ref.device)
    if not result.numel():
        return 0.0, 0.0
    if result.shape != ref.shape:
        raise ValueError(f"errors: the result's shape {tuple(result.shape)} is not the reference's {tuple(ref.shape)}")
    # Every figure computed on the device and read back at once: one synchronization, not four (a find
    # checks each candidate three times); and few passes over the reference-sized tensors, whose traffic is most of
    # a check's time on a large layer.
    finite = torch.isfinite(result).all()
    work = torch.float64 if result.dtype == torch.float64 else torch.float32
    near = ref.to(work, copy=True)  # the reference in the working precision, turned into the scale below
    # result - ref: on CUDA in one pass that converts the result as it reads it (on the CPU a loop over mixed types
    # is slower than converting first)
    diff = torch.sub(result, near) if result.device.type == "cuda" else result.to(work).sub(near)
    # (in the working precision: asked for float64, a float32 norm would copy its input into float64 first)
    ref_norm = torch.linalg.vector_norm(near).to(torch.float64)
    diff_norm = torch.linalg.vector_norm(diff).to(torch.float64)
    rms = ref_norm / math.sqrt(ref.numel())
    # |ref_i| + rms(ref), or 1 where ref is all zeros (then |ref_i| is 0 too)
    scale = near.abs_().add_(torch.where(rms > 0, rms, torch.ones_like(rms)).to(work))
    worst_t = diff.abs_().div_(scale).max()
    is_finite, norm, diff_l2, worst = torch.stack([finite.to(torch.float64), ref_norm, diff_norm,
                                                    worst_t.to(torch.float64)]).tolist()
    if not is_finite:
        return math.inf, math.inf
    rel = diff_l2 / norm if norm > 0 else diff_l2
    return rel, worst


def element_bound(bound: float) -> float:
    """The worst element error (``errors``' second figure) allowed under the relative bound ``bound``: the setting
    ``element_factor`` times it, ``inf`` where the setting is 0 (the norm alone)."""
    factor = settings.element_factor
    return factor * bound if factor else math.inf


def judge(rel: float, worst: float, bound: float) -> tuple[bool, str]:
    """Whether errors (``errors``) pass the relative bound ``bound`` and its element bound, and the message."""
    if not math.isfinite(rel):
        return False, "result holds NaN or Inf (or elements left unwritten)"
    if rel > bound:
        return False, f"relative error {rel:.2e} exceeds the tolerance {bound:.1e}"
    if worst > element_bound(bound):
        return False, (f"one or more elements are wrong: the worst is off by {worst:.2e} of |ref| + rms(ref), over "
                       f"{settings.element_factor:g} x the tolerance {bound:.1e} (relative error {rel:.2e} within it)")
    return True, f"relative error {rel:.2e} within {bound:.1e}"


def tolerance(problem: ConvProblem, notes: NumericNotes) -> float:
    """The largest relative L2 error a correct algorithm with ``notes`` may show on ``problem``."""
    return default_tolerance(problem.dtype, notes.tf32, notes.reduced_precision)


def default_tolerance(dtype: str, tf32: bool, reduced_precision: bool) -> float:
    """The largest relative L2 error a correct result in ``dtype`` may show (TF32 products in float32, or a
    reduced-precision accumulation, loosen it): what ``Policy(max_rel_error=None)`` allows."""
    tol = TOLERANCES["tf32" if dtype == "float32" and tf32 else dtype]
    return tol * REDUCED_PRECISION_FACTOR if reduced_precision else tol


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
    # Every allocation and free in time order (the profiler's results, as its own memory timeline reads
    # them): an op's net self-memory would hide a temporary that the op allocates and frees inside itself.
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type().name == "CPU")
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def allocated_while(fn: Callable[[], object]) -> tuple[int, bool]:
    """(bytes, exact): what ``fn`` allocates on the current CUDA device above what was allocated before it, read from
    the caching allocator's statistics without resetting them (a caller's own peak figure stays as it was).

    Exact where ``fn`` takes the process past its earlier peak (the peak's rise, from what was allocated before);
    otherwise an upper bound, the lesser of the room under that earlier peak and every byte ``fn`` allocated (freed
    or not). Another thread's allocations at the same time count as ``fn``'s.
    """
    def allocated_in_all() -> int:
        return int(torch.cuda.memory_stats().get("allocated_bytes.all.allocated", 0))

    torch.cuda.synchronize()
    base, peak, total = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), allocated_in_all()
    fn()
    torch.cuda.synchronize()
    new_peak = torch.cuda.max_memory_allocated()
    if new_peak > peak:
        return new_peak - base, True
    return min(peak - base, allocated_in_all() - total), False


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
          *, max_rel_error: float | None = None, poison: float = math.nan) -> tuple[float, bool, str]:
    """Run ``algorithm`` once into ``out`` (poisoned first: NaN, or ``poison``) and compare with ``ref``.

    inputs: the operands (a, b) of ``reference_case``; ref: their float64 result; workspace: as
    for ``Algorithm.run``. The bound is ``max_rel_error`` when given (a policy's), else
    ``tolerance(problem, algorithm.notes(problem))``. Returns (rel_error, ok, message); NaN or
    Inf anywhere in the result never passes, nor does an element left unwritten, nor one wrong element
    (the element bound of the module's docstring). Exceptions of
    the algorithm propagate (the tuner turns them into statuses).

        >>> from convtune.algorithms.registry import get_algorithm
        >>> p = ConvProblem("fwd", n=1, c=2, k=3, input_size=(5, 5), kernel_size=3)
        >>> inputs, ref = reference_case(p)
        >>> err, ok, message = check(get_algorithm("torch:native"), p, inputs, ref, p.empty(p.y_shape), None)
        >>> ok
        True
    """
    # Poisoned, so an element the algorithm forgets to write shows up as NaN.
    out.fill_(poison)
    algorithm.run(problem, *inputs, workspace=workspace, out=out)
    err, worst = errors(out, ref)
    bound = max_rel_error if max_rel_error is not None else tolerance(problem, algorithm.notes(problem))
    ok, message = judge(err, worst, bound)
    return err, ok, message
