"""Run-time workspaces: one scratch buffer per (device, stream), grown to the largest need.

Every tuned convolution on a stream runs after the previous one has finished with the
buffer, so one buffer per stream serves them all. It is a ``torch.empty`` uint8 tensor, so
the memory comes from PyTorch's caching allocator. On the CPU, where there are no streams,
each thread has its own buffer (threads may run convolutions at the same time).

Tuning reserves the selected algorithms' workspace up front (``reserve``): the current stream's
buffer is grown at once, and a stream (thread) met later gets its buffer at the full reserved
size on first use, so runs do not allocate again. That is what CUDA graphs need: memory
allocated during a capture comes from the graph's private pool, and replacing a buffer would
free memory that a captured graph still writes to. So a buffer that a capture has used is
never freed (an outgrown one is kept alive), and a capture allocates only when its stream has
no buffer yet (``torch.cuda.graph`` captures on a stream of its own: one allocation, at the
reserved size) or when a need was never reserved (a warning: tune before capturing).

    >>> ws = get(1024, "cpu")
    >>> ws.dtype, ws.numel()
    (torch.uint8, 1024)
    >>> buffer_bytes("cpu") >= 1024
    True
"""

from __future__ import annotations

import logging
import threading

import torch

from convtune import forks
from convtune.algorithms.base import Buffer, carve
from convtune.hardware import current_stream_handle

log = logging.getLogger(__name__)

_lock = threading.Lock()
forks.renew_after_fork(globals(), _lock=threading.Lock)
_buffers: dict[tuple, torch.Tensor] = {}  # slot (see _slot) -> buffer
_reserved: dict[tuple, int] = {}  # (device type, index) -> the largest need tuning reserved
_captured: set[tuple] = set()  # slots whose current buffer a graph capture has used
_retired: list[torch.Tensor] = []  # outgrown buffers that captured graphs may still use: never freed
_carved: dict[tuple, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}  # (slot, buffers) -> (buffer, its views)
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
        return "cuda", device.index, current_stream_handle(device.index)
    return device.type, threading.get_ident()


def _buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """The current slot's buffer, at least ``nbytes`` and the device's reserved size."""
    global _warned_capture
    slot = _slot(device)
    capturing = _capturing(device)
    with _lock:
        buf = _buffers.get(slot)
        if buf is not None and buf.numel() >= nbytes:
            if capturing:
                _captured.add(slot)
            return buf
        reserved = _reserved.get((device.type, device.index), 0)
        if capturing and nbytes > reserved and not _warned_capture:
            _warned_capture = True
            log.warning("a convtune workspace of %d bytes, more than tuning reserved (%d), was allocated inside a "
                        "CUDA graph capture; tune the model (convtune.optimize) on the shapes you capture, "
                        "before capturing", nbytes, reserved)
        if buf is not None and slot in _captured:
            _retired.append(buf)
        _buffers[slot] = buf = torch.empty(max(nbytes, reserved), dtype=torch.uint8, device=device)
        _forget_views(slot)
        if capturing:
            _captured.add(slot)
        else:
            _captured.discard(slot)  # a fresh buffer that no graph has seen
        return buf


def reserve(nbytes: int, device: str | torch.device) -> None:
    """Reserve ``nbytes`` on ``device``: the current stream's (thread's) buffer grows now, others on first use."""
    if nbytes < 0:
        raise ValueError(f"reserve(nbytes={nbytes}) must be >= 0 bytes")
    device = _device(device)
    with _lock:
        key = (device.type, device.index)
        _reserved[key] = max(_reserved.get(key, 0), nbytes)
    _buffer(nbytes, device)


def get(nbytes: int, device: str | torch.device) -> torch.Tensor:
    """A 1-D uint8 workspace of exactly ``nbytes`` on ``device``: the front of the current stream's buffer.

    Valid until the next convtune convolution on the same stream (thread, on the CPU).
    """
    if nbytes < 0:
        raise ValueError(f"workspace of nbytes={nbytes} must be >= 0 bytes")
    return _buffer(nbytes, _device(device))[:nbytes]


def carved(buffers: tuple[Buffer, ...], nbytes: int, device: str | torch.device) -> dict[str, torch.Tensor]:
    """``carve`` of the current stream's buffer for ``buffers`` (of ``nbytes`` in all), made once per buffer.

    The views share the buffer's lifetime: a buffer that grows or is released drops them.
    """
    device = _device(device)
    key = (_slot(device), buffers)
    entry = _carved.get(key)
    # Every run asks: views made for the slot's current buffer need no lock (a capture marks its use below).
    if entry is not None and entry[0] is _buffers.get(key[0]) and not _capturing(device):
        return entry[1]
    buf = _buffer(nbytes, device)
    with _lock:
        entry = _carved.get(key)
        if entry is None or entry[0] is not buf:
            entry = _carved[key] = (buf, carve(buf, buffers))
        return entry[1]


def _forget_views(slot: tuple) -> None:
    for key in [key for key in _carved if key[0] == slot]:
        del _carved[key]


def buffer_bytes(device: str | torch.device) -> int:
    """Size of the buffer of ``device``'s current stream (the CPU: this thread); 0 if none."""
    with _lock:
        buf = _buffers.get(_slot(_device(device)))
    return 0 if buf is None else buf.numel()


def release() -> None:
    """Drop every buffer that no captured graph uses (the memory returns to PyTorch's allocator).

    Reservations stay: the next run on a stream allocates its buffer again, at the reserved size.
    """
    with _lock:
        for slot in list(_buffers):
            if slot not in _captured:
                del _buffers[slot]
                _forget_views(slot)
