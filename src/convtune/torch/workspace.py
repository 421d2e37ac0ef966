"""Run-time workspaces: one scratch buffer per (device, stream), grown to the largest need.

Every tuned convolution on a stream runs after the previous one has finished with the
buffer, so one buffer per stream serves them all. It is a ``torch.empty`` uint8 tensor, so
the memory comes from PyTorch's caching allocator. On the CPU, where there are no streams,
each thread has its own buffer (threads may run convolutions at the same time).

Tuning reserves the selected algorithms' workspace up front (``reserve``), so a run finds the
buffer big enough and allocates nothing. That is what CUDA graphs need: memory allocated during
a capture belongs to the graph's private pool, and growing a buffer would free memory that an
earlier graph still writes to. So during a capture a buffer is never replaced (a too-small one
gets a one-off allocation, with a warning), and a buffer that a capture has used is kept alive
when it is later outgrown.

    >>> ws = get(1024, "cpu")
    >>> ws.dtype, ws.numel()
    (torch.uint8, 1024)
    >>> reserved_bytes("cpu") >= 1024
    True
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_buffers: dict[tuple, torch.Tensor] = {}  # slot -> buffer
_captured: set[tuple] = set()  # slots whose buffer a graph capture has used
_retired: list[torch.Tensor] = []  # outgrown buffers that captured graphs may still use: never freed
_warned_capture = False


def _device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _slot(device: torch.device) -> tuple:
    """Who may use one buffer: a CUDA stream, or a CPU thread."""
    if device.type == "cuda":
        return "cuda", device.index, torch.cuda.current_stream(device).cuda_stream
    return device.type, threading.get_ident()


def _buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """The current slot's buffer, grown to at least ``nbytes`` (never replaced during a capture)."""
    global _warned_capture
    slot = _slot(device)
    capturing = _capturing(device)
    with _lock:
        buf = _buffers.get(slot)
        if capturing:
            _captured.add(slot)
        if buf is not None and buf.numel() >= nbytes:
            return buf
        if capturing:
            if not _warned_capture:
                _warned_capture = True
                log.warning("a convtune workspace of %d bytes was allocated inside a CUDA graph capture; "
                            "tune the model (convtune.optimize) on the shapes you capture, before capturing", nbytes)
            return torch.empty(nbytes, dtype=torch.uint8, device=device)  # the graph's pool owns it
        if buf is not None and slot in _captured:
            _retired.append(buf)
            _captured.discard(slot)
        _buffers[slot] = buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf


def reserve(nbytes: int, device: str | torch.device) -> None:
    """Grow the buffer of ``device``'s current stream (the CPU: this thread) to at least ``nbytes`` now."""
    if nbytes < 0:
        raise ValueError(f"reserve(nbytes={nbytes}) must be >= 0 bytes")
    _buffer(nbytes, _device(device))


def get(nbytes: int, device: str | torch.device) -> torch.Tensor:
    """A 1-D uint8 workspace of exactly ``nbytes`` on ``device``: the front of the current stream's buffer.

    Valid until the next convtune convolution on the same stream (thread, on the CPU).
    """
    if nbytes < 0:
        raise ValueError(f"workspace of nbytes={nbytes} must be >= 0 bytes")
    return _buffer(nbytes, _device(device))[:nbytes]


def reserved_bytes(device: str | torch.device) -> int:
    """Size of the buffer of ``device``'s current stream (the CPU: this thread); 0 if none."""
    with _lock:
        buf = _buffers.get(_slot(_device(device)))
    return 0 if buf is None else buf.numel()


def release() -> None:
    """Drop every buffer that no captured graph uses (the memory returns to PyTorch's allocator)."""
    with _lock:
        for slot in list(_buffers):
            if slot not in _captured:
                del _buffers[slot]
