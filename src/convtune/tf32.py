"""PyTorch's TF32 switches, read and set through whichever of its two interfaces holds them.

PyTorch has flags (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``) and, since 2.9,
float32 precisions per backend and operation (``torch.backends.fp32_precision``,
``torch.backends.cuda.matmul.fp32_precision``, ``torch.backends.cudnn.conv.fp32_precision``, ...), each ``'none'``
deferring to the one above it. Reading a flag raises where the two interfaces disagree (a user who set a precision,
or a convolutions' precision unlike the RNNs'), and setting a flag does not override a precision set above it. So:

- ``conv_allowed`` and ``matmul_allowed`` read the flag where it answers, else the operation's precision (whose
  getter answers what it resolves to);
- ``cudnn_conv`` and ``matmul`` switch TF32 for a block: through the flag where setting it takes effect (every
  PyTorch, and the usual case: the flag then keeps its meaning for code that reads it meanwhile), else through the
  operation's own precision, which overrides its parents; each puts back what it changed.
- ``Settings``: what an algorithm's run switches them to (``Algorithm.tf32_settings``), and which of them a run
  would change now (``Settings.changes``).

The switches are the process's, not a thread's: a layer runs under them only for its own call; one thread switches
at a time (two threads' overlapping switches would each put back what the other set, and leave it so); and the
background worker switches none (``refused_here``: the caller's work runs meanwhile): it does not measure a candidate
whose run would change them (``measure``), and a run that would all the same raises ``SwitchRefused``.

What is put back is what each setting read: a precision that read the same as its parent's is put back as
deferring to it (PyTorch tells no other), so a precision set explicitly to its parent's value comes back deferring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_UNCHANGED = contextlib.nullcontext()
_LOCK = threading.RLock()  # one thread's switch at a time
_REFUSING = threading.local()  # .on: this thread may not switch (refused_here)


class SwitchRefused(RuntimeError):
    """A switch of PyTorch's process-wide TF32 settings on a thread that may not switch them (``refused_here``)."""


@contextlib.contextmanager
def refused_here() -> Iterator[None]:
    """While inside, on this thread, a switch that would change a setting raises ``SwitchRefused`` (the background
    worker's thread: the caller's work, which runs meanwhile, would compute under it)."""
    _REFUSING.on = True
    try:
        yield
    finally:
        _REFUSING.on = False


def _refuse_on_this_thread(what: str) -> None:
    if getattr(_REFUSING, "on", False):
        raise SwitchRefused(f"this run switches PyTorch's process-wide {what}, which this thread may not (the "
                            f"background worker: the caller's work runs meanwhile)")


def _precision_allows(*scopes: Any) -> bool:
    """Whether the first of ``scopes`` with a precision other than 'none' says 'tf32' (False where none has one)."""
    for scope in scopes:
        precision = getattr(scope, "fp32_precision", "none")
        if precision != "none":
            return precision == "tf32"
    return False


def conv_allowed() -> bool:
    """Whether cuDNN's convolutions may compute float32 in TF32 now: ``torch.backends.cudnn.allow_tf32``, or, where
    that flag has no one value, the convolutions' own precision ('none' defers to cuDNN's, then PyTorch's)."""
    cudnn = torch.backends.cudnn
    try:
        return bool(cudnn.allow_tf32)
    except RuntimeError:
        return _precision_allows(getattr(cudnn, "conv", None), cudnn, torch.backends)


def matmul_allowed() -> bool:
    """Whether CUDA float32 matrix products may use TF32 now: ``torch.backends.cuda.matmul.allow_tf32``, or, where
    that flag disagrees with a precision set through the newer interface, the matrix products' precision."""
    matmul = torch.backends.cuda.matmul
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return _precision_allows(matmul, torch.backends)


def _legacy_matmul() -> str | None:
    """``torch.get_float32_matmul_precision()`` ('highest', 'high', 'medium'); None where it raises (the interfaces
    mixed)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


def _put_back(scope: Any, precision: str) -> None:
    """``scope.fp32_precision`` as it read (``precision``): 'none' again where that reads the same (the getter
    answers what the precision resolves to), so a precision that deferred to its parent keeps deferring."""
    scope.fp32_precision = "none"
    if scope.fp32_precision != precision:
        scope.fp32_precision = precision


@contextlib.contextmanager
def _switched(flag_scope: Any, operation: Any, allowed: bool, reads: Callable[[], bool],
              touched: tuple[Any, ...] = (), matmul_precision: bool = False) -> Iterator[None]:
    """TF32 as ``allowed`` inside (``reads`` tells what holds): ``flag_scope.allow_tf32`` where setting it takes
    effect, else ``operation.fp32_precision`` too; then as before. ``touched``: other precisions that setting the
    flag also sets (the RNNs' for cuDNN's flag; oneDNN's matrix products' for the legacy matmul precision).
    ``matmul_precision``: the flag is the matrix products', which also sets ``torch.get_float32_matmul_precision()``
    (put back too: 'medium' is not a flag's value)."""
    _refuse_on_this_thread("TF32 setting")
    with _LOCK:
        saved = [(scope, scope.fp32_precision) for scope in (operation, *touched) if scope is not None]
        legacy = _legacy_matmul() if matmul_precision else None
        try:
            flag: bool | None = bool(flag_scope.allow_tf32)
        except RuntimeError:
            flag = None  # the interfaces disagree: the flag has no value to put back
        try:
            if flag is not None:
                flag_scope.allow_tf32 = allowed
            if operation is not None and (flag is None or reads() != allowed):
                operation.fp32_precision = "tf32" if allowed else "ieee"  # a precision above the flag decides
            yield
        finally:
            if flag is not None:
                flag_scope.allow_tf32 = flag  # (setting a flag also sets precisions: put back below)
            if legacy is not None and _legacy_matmul() != legacy:
                torch.set_float32_matmul_precision(legacy)  # ('medium' is not a flag's value)
            for scope, precision in saved:
                _put_back(scope, precision)


@contextlib.contextmanager
def cudnn_conv(allowed: bool) -> Iterator[None]:
    """cuDNN on, its convolutions computing float32 in TF32 exactly when ``allowed``, while inside; then as before.
    Only those two switches: cuDNN's benchmark mode, its limit, determinism and the RNNs' precision are left as
    they are (``torch.backends.cudnn.flags`` would set them too)."""
    cudnn = torch.backends.cudnn
    if not cudnn.enabled:
        _refuse_on_this_thread("cuDNN switch")
    with _LOCK:
        enabled = cudnn.enabled
        cudnn.enabled = True
        conv = getattr(cudnn, "conv", None)
        switch = (contextlib.nullcontext() if conv_allowed() == allowed else
                  _switched(cudnn, conv, allowed, conv_allowed,
                            (getattr(cudnn, "rnn", None),) if conv is not None else ()))
        try:
            with switch:
                yield
        finally:
            cudnn.enabled = enabled


def matmul(device: str, allowed: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, CUDA float32 matrix products use TF32 exactly when ``allowed``.

    Every algorithm that promises (or forbids) TF32 in its notes sets it around its GEMMs. A no-op on the CPU, and
    where the switch is already as asked (a shared null context then: runs ask on every call)."""
    if device != "cuda" or matmul_allowed() == allowed:
        return _UNCHANGED
    matmul_scope = torch.backends.cuda.matmul
    per_operation = hasattr(matmul_scope, "fp32_precision")
    onednn = getattr(torch.backends.mkldnn, "matmul", None) if per_operation else None
    return _switched(matmul_scope, matmul_scope if per_operation else None, allowed, matmul_allowed,
                     (onednn,) if onednn is not None else (), matmul_precision=True)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The TF32 settings a run switches PyTorch's process-wide switches to, on CUDA: cuDNN's convolutions' (with
    cuDNN on) and the matrix products'; None leaves one as it is."""

    conv: bool | None = None
    matmul: bool | None = None

    def changes(self, device: str) -> list[str]:
        """Which switches a run on ``device`` would change now, in words (none on the CPU)."""
        if device != "cuda":
            return []
        out = []
        if self.conv is not None and (not torch.backends.cudnn.enabled or conv_allowed() != self.conv):
            out.append(f"cuDNN on, its convolutions' TF32 {'on' if self.conv else 'off'}")
        if self.matmul is not None and matmul_allowed() != self.matmul:
            out.append(f"the matrix products' TF32 {'on' if self.matmul else 'off'}")
        return out

    def switched(self, device: str) -> contextlib.AbstractContextManager[None]:
        """Inside the block, the switches as these settings say (on CUDA; the CPU has none)."""
        if device != "cuda" or (self.conv is None and self.matmul is None):
            return _UNCHANGED
        return self._switched()

    @contextlib.contextmanager
    def _switched(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.conv is not None:
                stack.enter_context(cudnn_conv(self.conv))
            if self.matmul is not None:
                stack.enter_context(matmul("cuda", self.matmul))
            yield
