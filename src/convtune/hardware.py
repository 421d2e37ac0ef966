"""The machine: a fingerprint for the tuning database, software versions, and roofline ceilings."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import platform
import time
from collections.abc import Iterator
from pathlib import Path

import torch

KERNELS = Path(__file__).resolve().parent / "kernels"  # convtune's own kernels: their code's digest versions them

# Peak dense throughput (FLOP/s by dtype) and memory bandwidth (bytes/s) of known GPUs, by name
# fragment. H200 figures measured on the device (BENCHMARKING.md): bf16 GEMM ~790 TFLOP/s, copy 4.3 TB/s.
_GPU_PEAKS = {
    "H200": ({"float16": 790e12, "bfloat16": 790e12, "tf32": 395e12, "float32": 60e12}, 4.3e12),
    "H100": ({"float16": 700e12, "bfloat16": 700e12, "tf32": 350e12, "float32": 55e12}, 3.0e12),
    "A100": ({"float16": 280e12, "bfloat16": 280e12, "tf32": 140e12, "float32": 19e12}, 1.6e12),
}


def current_stream_handle(device_index: int) -> int:
    """The raw handle (cudaStream_t) of PyTorch's current stream on a CUDA device."""
    return torch.cuda.current_stream(device_index).cuda_stream


@functools.cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def nvidia_driver() -> str:
    """The NVIDIA kernel driver's version (Linux), else '?'."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            for word in f.readline().split():
                if word[:1].isdigit() and "." in word:
                    return word
    except OSError:
        pass
    return "?"


def fingerprint(device: str) -> str:
    """What identifies the hardware a measurement was made on: GPU name, compute capability,
    driver and CUDA versions; CPU model and threads."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"cuda|{props.name}|sm{props.major}{props.minor}|driver{nvidia_driver()}|cuda{torch.version.cuda or '?'}"
    return f"cpu|{cpu_model()}|threads{torch.get_num_threads()}"


@functools.cache
def kernels_digest() -> str:
    """Eight hex digits of a digest of convtune's own kernels' sources: a change of their code (which can change
    their numbers, their times and their compiled binaries, which the tuning database keeps for the C++ runtime)
    is a change of software, so nothing measured or compiled before it is reused after it."""
    digest = hashlib.blake2b(digest_size=4)
    for path in sorted(KERNELS.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


# How find measures a candidate, as a version: 2, as a tuned layer runs it (``Algorithm.launcher``: no copy of a
# result the algorithm hands over, no per-call operand check); 1, through ``Algorithm.run``, whose copy into the
# output made torch:native look slower than a tuned layer runs it. Measurements of another method are another
# software's: none is reused.
MEASUREMENT_METHOD = 2


@functools.cache
def software_versions() -> str:
    """Versions of everything whose change can change a measurement (``MEASUREMENT_METHOD`` too)."""
    from . import __version__

    parts = [f"torch{torch.__version__}", f"convtune{__version__}", f"kernels{kernels_digest()}",
             f"measured{MEASUREMENT_METHOD}"]
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if cudnn:
        parts.append(f"cudnn{cudnn}")
    for package in ("triton", "nvidia-cudnn-frontend"):
        try:
            parts.append(f"{package}{importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return "|".join(parts)


@functools.cache
def memory_bytes(device: str) -> int | None:
    """The memory of ``device`` ('cpu': the machine's RAM; 'cuda' or 'cuda:N': that GPU's), None if unknown."""
    import os

    if device == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not a POSIX system
            return None
    if device.startswith("cuda") and torch.cuda.is_available():
        index = int(device.partition(":")[2] or torch.cuda.current_device())
        if index < torch.cuda.device_count():
            return int(torch.cuda.get_device_properties(index).total_memory)
    return None


@functools.cache
def _cpu_peaks() -> tuple[float, float]:
    """Measured once a process: a float32 matrix product and a large copy (about 0.2 s)."""
    size = 1024  # large enough for every thread to reach its steady state
    generator = torch.Generator().manual_seed(0)  # not the user's: a seeded run draws the same with convtune or not
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    c = torch.empty(size, size)
    torch.mm(a, b, out=c)
    best_mm = min(_seconds(lambda: torch.mm(a, b, out=c)) for _ in range(7))
    src = torch.empty(16 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_copy = min(_seconds(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * size**3 / best_mm, 2 * src.numel() / best_copy


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


_assumed_gpu: str | None = None  # see measured_on


def assumed_gpu() -> str | None:
    """The GPU name ``measured_on`` prices CUDA problems for, None outside it (this machine's GPU)."""
    return _assumed_gpu


@contextlib.contextmanager
def measured_on(fingerprint: str) -> Iterator[None]:
    """Price CUDA problems for the GPU that ``fingerprint`` (a database row's, see ``fingerprint``) names
    rather than this machine's: to judge or train on another machine's measurements, on any machine.

    Process-wide: while it is active every thread prices CUDA problems for that GPU (it is meant for
    judging and training offline, not while a model tunes). Raises ValueError for a fingerprint that
    names no GPU of the peaks table.
    """
    from . import costmodel

    global _assumed_gpu
    kind, _, rest = fingerprint.partition("|")
    name = rest.partition("|")[0]
    if kind != "cuda" or not any(fragment in name for fragment in _GPU_PEAKS):
        raise ValueError(f"fingerprint {fingerprint!r}: not a GPU of convtune's peaks table "
                         f"({', '.join(_GPU_PEAKS)}); pass one of a CUDA row of the database")
    previous, _assumed_gpu = _assumed_gpu, name
    costmodel.clear_cache()
    try:
        yield
    finally:
        _assumed_gpu = previous
        costmodel.clear_cache()


H200_SHARED_MEMORY_PER_BLOCK = 232_448  # bytes a block may opt in to on the H100 and H200 (sm_90)


@functools.cache
def shared_memory_per_block() -> int:
    """The shared memory (bytes) a kernel's block may use on this machine's current GPU (opting in beyond the
    default 48 KiB, as Triton does); where no GPU is visible, or PyTorch does not report it, the H200's. Read once
    per process, from the device current then: on a machine whose GPUs differ, a kernel sized for the first may fail
    to launch on a smaller one (an error find reports, never a wrong result)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        optin = getattr(props, "shared_memory_per_block_optin", None)
        if optin:
            return int(optin)
    return H200_SHARED_MEMORY_PER_BLOCK


def peaks(device: str, dtype: str, tf32: bool = False) -> tuple[float, float]:
    """(FLOP/s, bytes/s) ceilings of ``device`` for ``dtype``: a table for known GPUs, measured on CPUs."""
    if device == "cuda":
        name = _assumed_gpu or torch.cuda.get_device_name()
        for fragment, (flops, bandwidth) in _GPU_PEAKS.items():
            if fragment in name:
                return flops["tf32" if dtype == "float32" and tf32 else dtype], bandwidth
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        # Unknown GPU: a rough figure from its size, good enough to rank, not to report.
        return props.multi_processor_count * 1e12, 1e12
    cpu_flops, cpu_bandwidth = _cpu_peaks()
    return cpu_flops, cpu_bandwidth


def roofline_ms(problem) -> float:
    """The floor of ``problem``'s time: max(FLOPs / peak, compulsory bytes / bandwidth), in ms.

    A depthwise problem (one input channel per group) has no matrix product for tensor cores to
    take: its multiply-adds are priced at the CUDA cores' float32 rate, whatever the dtype.
    """
    depthwise = problem.c == problem.groups and problem.groups > 1
    dtype = "float32" if depthwise else problem.dtype
    flops, bandwidth = peaks(problem.device, dtype, problem.allow_tf32 and not depthwise)
    return 1e3 * max(problem.flops / flops, problem.min_bytes / bandwidth)
