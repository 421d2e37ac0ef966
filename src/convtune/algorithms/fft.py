"""fft:rfft: convolution through real FFTs (stride 1, any dilation, 1-D to 3-D), channel sums as complex GEMMs.

The zero-padded operands are transformed over their spatial dimensions; per frequency the
channel sum is one small complex matrix product, batched over frequencies and groups:

    fwd         Y  = irfft( X  @ conj(W) )      read at [0, P)          X (N, C/g), W (C/g, K/g)
    bwd_data    DX = irfft( DY @ W^T )          read at [p, p + H)      DY (N, K/g)
    bwd_filter  DW = irfft( conj(DY)^T @ X )    read at the taps r·d    (the batch N is summed)

Every real buffer is laid out (*L, groups, rows, cols): transforming its leading dimensions
gives spectra (*F, groups, rows, cols), which is directly a (F·groups, rows, cols) GEMM batch.
The transform length per dimension is the smallest 2,3,5-smooth size >= the padded input, so
the circular products never wrap around onto the outputs that are read. Filters are not padded
and transformed: their spectrum is one GEMM of a DFT matrix with the few taps (and dw is read
back at the taps by the transposed GEMM), which saves an L-sized real copy of every filter.

Workspace: one real buffer (each padded image in turn) and three spectra, the filter's F·C·K/g
the largest for small batches. That is the honest price of the method. float16 and bfloat16
operands are converted into the float32 buffers, so the arithmetic is float32. On CUDA,
torch.fft also allocates buffers of its own (``library_bytes``).

    >>> from convtune.problem import ConvProblem
    >>> p = ConvProblem("fwd", n=1, c=2, k=3, input_size=(6, 7), kernel_size=3, padding=1)
    >>> transform_sizes(p), spectrum_sizes(p)
    ((8, 9), (8, 5))
"""

from __future__ import annotations

import functools
import math

import torch

from .. import tf32
from ..costmodel import Cost, shape_factor
from ..problem import ConvProblem
from .base import SUPPORTED, Algorithm, Buffer, NumericNotes, Support, unsupported
from .registry import register


def smooth_size(n: int) -> int:
    """The smallest integer >= ``n`` whose only prime factors are 2, 3 and 5 (fast FFT lengths).

    >>> [smooth_size(n) for n in (1, 7, 11, 58, 97)]
    [1, 8, 12, 60, 100]
    """
    n = max(1, n)
    best = 1 << (n - 1).bit_length()  # a power of two always qualifies
    five = 1
    while five < best:  # every 5^a * 3^b below the best so far, times the least power of two that reaches n
        odd = five
        while odd < best:
            candidate = odd << max(0, (-(-n // odd) - 1).bit_length())
            best = min(best, candidate)
            odd *= 3
        five *= 5
    return best


@functools.lru_cache(maxsize=1024)
def transform_sizes(problem: ConvProblem) -> tuple[int, ...]:
    """FFT length per spatial dimension: 2,3,5-smooth and >= the padded input ``H + 2p``."""
    return tuple(smooth_size(h + 2 * p) for h, p in zip(problem.input_size, problem.padding))


def spectrum_sizes(problem: ConvProblem) -> tuple[int, ...]:
    """Spectrum size per spatial dimension: the last one halved by the real transform."""
    sizes = transform_sizes(problem)
    return (*sizes[:-1], sizes[-1] // 2 + 1)


def _operands(problem: ConvProblem) -> dict[str, tuple[int, int]]:
    """(rows, cols) per group of each matrix whose spectrum the method holds."""
    g = problem.groups
    n, cg, kg = problem.n, problem.c // g, problem.k // g
    return {"input": (n, cg), "output": (n, kg), "filter": (cg, kg), "filter_grad": (kg, cg)}


# Per direction: (first spectrum, second spectrum, their product), each an entry of _operands.
_SPECTRA = {
    "fwd": ("input", "filter", "output"),
    "bwd_data": ("output", "filter", "input"),
    "bwd_filter": ("input", "output", "filter_grad"),
}


@functools.lru_cache(maxsize=8)
def tap_dft(sizes: tuple[int, ...], kernel_size: tuple[int, ...], dilation: tuple[int, ...],
            inverse: bool, pinned: bool = False) -> torch.Tensor:
    """The DFT between the filter taps and the half spectrum, complex64 on the CPU.

    Not inverse: (F, R^d), entry exp(-2 pi i sum_j f_j r_j d_j / L_j): the spectrum of each tap
    of a filter placed (dilated) in an L-sized signal. Inverse: (R^d, F), ``irfftn`` of a half
    spectrum read at the taps only (real part of the product): conjugate phases, 1/L, and weight
    2 on the bins of the halved dimension whose mirror image the half spectrum leaves out.
    Rows and columns are flattened row-major, like the buffers. Built in float64, rounded once.
    ``pinned``: in page-locked memory, so copies to a GPU are asynchronous.
    """
    matrix = torch.ones(1, 1, dtype=torch.complex128)
    for dim, (length, r, d) in enumerate(zip(sizes, kernel_size, dilation)):
        halved = dim == len(sizes) - 1
        freqs = torch.arange(length // 2 + 1 if halved else length, dtype=torch.float64)
        phase = torch.outer(freqs, torch.arange(r, dtype=torch.float64) * d) * (-2 * math.pi / length)
        per_dim = torch.polar(torch.ones_like(phase), phase)
        if inverse:
            weight = torch.ones(len(freqs), dtype=torch.float64)
            if halved:
                weight[1:] = 2
                if length % 2 == 0:
                    weight[-1] = 1  # the Nyquist bin is its own mirror image
            per_dim = (per_dim.conj() * (weight / length)[:, None]).T.contiguous()
        matrix = torch.kron(matrix, per_dim)
    matrix = matrix.to(torch.complex64)
    return matrix.pin_memory() if pinned else matrix


def _dft_shape(problem: ConvProblem) -> tuple[int, int]:
    freqs, taps = math.prod(spectrum_sizes(problem)), math.prod(problem.kernel_size)
    return (taps, freqs) if problem.direction == "bwd_filter" else (freqs, taps)


def _spatial_major(t: torch.Tensor, groups: int, ndim: int) -> torch.Tensor:
    """(N, C, *S) -> the view (*S, groups, N, C/groups), with no copy."""
    grouped = t.unflatten(1, (groups, t.shape[1] // groups))
    return grouped.permute(*range(3, 3 + ndim), 1, 0, 2)


def _filter_view(t: torch.Tensor, groups: int, ndim: int, k_first: bool) -> torch.Tensor:
    """(K, C/g, *R) -> the view (*R, g, K/g, C/g) if ``k_first`` else (*R, g, C/g, K/g), no copy."""
    grouped = t.unflatten(0, (groups, t.shape[0] // groups))
    spatial = range(3, 3 + ndim)
    return grouped.permute(*spatial, 0, 1, 2) if k_first else grouped.permute(*spatial, 0, 2, 1)


class FFT(Algorithm):
    """Cross-correlation through ``torch.fft`` real transforms and batched complex GEMMs."""

    name = "fft:rfft"

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        p = problem
        length = math.prod(h + 2 * pad for h, pad in zip(p.input_size, p.padding))
        half = length // 2 + 1
        cg, kg = p.c // p.groups, p.k // p.groups
        transforms = p.n * p.c + p.k * cg + p.n * p.k  # input, filter, result (any direction)
        transform_flops = transforms * 5.0 * length * math.log2(max(2, length))
        # A complex multiply-add (8 real FLOPs) per frequency, batch, filter and input channel.
        pointwise = 8.0 * p.n * p.k * cg * half
        return Cost(pointwise, 0.6 * shape_factor(p.n, kg, cg), p.min_bytes + 3 * workspace_bytes, 40,
                    extra_flops=transform_flops, float32_inside=True)

    def _supports(self, problem: ConvProblem) -> Support:
        if any(s != 1 for s in problem.stride):
            return unsupported(
                f"stride={problem.stride}: the FFT method computes stride-1 convolutions only "
                f"(a strided one would compute and discard most outputs); use a GEMM or direct algorithm"
            )
        return SUPPORTED

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return NumericNotes(float32_inside=problem.dtype != "float32")

    def tf32_settings(self, problem: ConvProblem) -> tf32.Settings:
        return tf32.Settings(matmul=False)  # (its products stand in for exact float32 arithmetic)

    def library_bytes(self, problem: ConvProblem) -> int:
        """Bytes ``torch.fft`` allocates by itself during ``run``, outside the workspace.

        The ``out=`` forms of torch.fft compute into a fresh tensor and copy it out, on every
        device; no torch API lets a transform write into carved memory. Measured (CPU: MKL,
        torch 2.13; CUDA: H200, torch 2.11): a real-to-complex transform allocates its spectrum,
        a complex-to-real one its signal plus its spectrum (a copy, or the multi-dimensional
        complex pass). cuFFT also takes a work area from the caching allocator: 1.07 (2-D 56x56)
        to 1.71 (3-D 15x15x12) spectra measured, 2 declared. Budgets add these bytes.
        """
        groups, per_group = problem.groups, _operands(problem)
        length, freqs = math.prod(transform_sizes(problem)), math.prod(spectrum_sizes(problem))
        work_area = 2 if problem.device == "cuda" else 0  # in spectra

        def spectrum_bytes(name: str) -> int:
            return 8 * freqs * groups * math.prod(per_group[name])

        first, second, product = _SPECTRA[problem.direction]
        transformed = [first, second] if problem.direction == "bwd_filter" else [first]
        costs = [(1 + work_area) * spectrum_bytes(name) for name in transformed]
        if problem.direction != "bwd_filter":
            signal = 4 * length * groups * math.prod(per_group[product])
            costs.append((1 + work_area) * spectrum_bytes(product) + signal)
        return max(costs)

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        groups, per_group = problem.groups, _operands(problem)
        length, freqs = math.prod(transform_sizes(problem)), math.prod(spectrum_sizes(problem))
        first, second, product = _SPECTRA[problem.direction]
        # Only images pass through the real buffer: filters go through the tap DFT.
        real = max(length * groups * math.prod(per_group[name]) for name in ("input", "output"))

        def spectrum(name: str) -> tuple[int]:
            return (freqs * groups * math.prod(per_group[name]),)

        return [
            Buffer("real", (real,), torch.float32),
            Buffer("spectrum_a", spectrum(first), torch.complex64),
            Buffer("spectrum_b", spectrum(second), torch.complex64),
            Buffer("spectrum_out", spectrum(product), torch.complex64),
            Buffer("filter_taps", (math.prod(problem.kernel_size), problem.k * problem.c // groups), torch.complex64),
            Buffer("filter_dft", _dft_shape(problem), torch.complex64),
        ]

    def _run(self, problem, a, b, out, ws) -> None:
        runner = {"fwd": _forward, "bwd_data": _backward_data, "bwd_filter": _backward_filter}[problem.direction]
        # The DFT matrix lives in the workspace too: nothing is allocated on the device.
        pinned = problem.device == "cuda"
        dft = tap_dft(transform_sizes(problem), problem.kernel_size, problem.dilation,
                      inverse=problem.direction == "bwd_filter", pinned=pinned)
        ws["filter_dft"].copy_(dft, non_blocking=pinned)
        with self.tf32_settings(problem).switched(problem.device):
            runner(problem, a, b, out, ws)


def _image_spectrum(problem: ConvProblem, image: torch.Tensor, region: tuple[slice, ...],
                    real_ws: torch.Tensor, spectrum_ws: torch.Tensor) -> torch.Tensor:
    """The spectrum of ``image`` (N, C, *S) placed at ``region`` of a zeroed L-sized signal.

    Returns a view of ``spectrum_ws`` shaped (F·g, N, C/g), ready for ``bmm``.
    """
    nd, sizes = problem.ndim, transform_sizes(problem)
    source = _spatial_major(image, problem.groups, nd)
    batch = tuple(source.shape[nd:])
    real = real_ws[: math.prod(sizes) * math.prod(batch)].view(*sizes, *batch)
    real.zero_()
    real[region].copy_(source)
    spectrum = spectrum_ws.view(*spectrum_sizes(problem), *batch)
    torch.fft.rfftn(real, dim=tuple(range(nd)), out=spectrum)
    return spectrum.view(-1, *batch[1:])


def _image(problem: ConvProblem, product: torch.Tensor, region: tuple[slice, ...],
           real_ws: torch.Tensor, image: torch.Tensor) -> None:
    """image (N, C, *S) <- the real signal of the spectra ``product`` (F·g, N, C/g) at ``region``."""
    nd, sizes = problem.ndim, transform_sizes(problem)
    batch = (problem.groups, *product.shape[1:])
    real = real_ws[: math.prod(sizes) * math.prod(batch)].view(*sizes, *batch)
    torch.fft.irfftn(product.view(*spectrum_sizes(problem), *batch), s=sizes, dim=tuple(range(nd)), out=real)
    _spatial_major(image, problem.groups, nd).copy_(real[region])


def _filter_spectrum(problem: ConvProblem, w: torch.Tensor, ws: dict[str, torch.Tensor]) -> torch.Tensor:
    """The spectrum of the filter as (F·g, C/g, K/g), one GEMM: the DFT matrix @ the taps.

    Padding the filter to the transform size and transforming it would cost an L-sized real copy
    of every filter (L·C·K/g values) and an FFT each; the taps are few, so a GEMM over them is
    cheaper in both.
    """
    g = problem.groups
    taps = ws["filter_taps"]
    taps.view(*problem.kernel_size, g, problem.c // g, problem.k // g).copy_(_filter_view(w, g, problem.ndim, False))
    spectrum = ws["spectrum_b"].view(ws["filter_dft"].shape[0], -1)
    torch.mm(ws["filter_dft"], taps, out=spectrum)
    return spectrum.view(-1, problem.c // g, problem.k // g)


def _padded(problem: ConvProblem) -> tuple[slice, ...]:
    return tuple(slice(p, p + h) for p, h in zip(problem.padding, problem.input_size))


def _outputs(problem: ConvProblem) -> tuple[slice, ...]:
    return tuple(slice(0, o) for o in problem.output_size)


def _product(ws: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return ws.view(-1, rows, cols)


def _forward(problem, x, w, y, ws) -> None:
    xs = _image_spectrum(problem, x, _padded(problem), ws["real"], ws["spectrum_a"])
    # Cross-correlation multiplies by the conjugate filter spectrum: the filter is real, so
    # conjugating the small DFT matrix gives it, and bmm keeps plain operands (a lazily
    # conjugated operand is copied by bmm).
    ws["filter_dft"].conj_physical_()
    fs = _filter_spectrum(problem, w, ws)
    ys = _product(ws["spectrum_out"], xs.shape[1], fs.shape[2])
    torch.bmm(xs, fs, out=ys)
    _image(problem, ys, _outputs(problem), ws["real"], y)


def _backward_data(problem, dy, w, dx, ws) -> None:
    dys = _image_spectrum(problem, dy, _outputs(problem), ws["real"], ws["spectrum_a"])
    fs = _filter_spectrum(problem, w, ws)
    dxs = _product(ws["spectrum_out"], dys.shape[1], fs.shape[1])
    torch.bmm(dys, fs.mT, out=dxs)  # convolution (no conjugate): the adjoint of the correlation
    _image(problem, dxs, _padded(problem), ws["real"], dx)


def _backward_filter(problem, x, dy, dw, ws) -> None:
    g = problem.groups
    xs = _image_spectrum(problem, x, _padded(problem), ws["real"], ws["spectrum_a"])
    # conj(DY) in place: bmm copies an operand viewed as conjugated (measured with .mH).
    dys = _image_spectrum(problem, dy, _outputs(problem), ws["real"], ws["spectrum_b"]).conj_physical_()
    dws = _product(ws["spectrum_out"], dys.shape[2], xs.shape[2])
    torch.bmm(dys.mT, xs, out=dws)  # the batch N is the GEMM's reduction
    taps = ws["filter_taps"]
    # The inverse DFT is evaluated at the taps only; the product is Hermitian, so its real part.
    torch.mm(ws["filter_dft"], dws.view(ws["filter_dft"].shape[1], -1), out=taps)
    grad = taps.view(*problem.kernel_size, g, problem.k // g, problem.c // g).real
    _filter_view(dw, g, problem.ndim, True).copy_(grad)


register(FFT())
