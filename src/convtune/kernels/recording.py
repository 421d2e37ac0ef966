"""Triton launches recorded as data, so that convtune's C++ runtime launches the same compiled kernels with no
Python on the call (``TritonAlgorithm.native_recipe``), or compiled without running (``TritonAlgorithm.prepare``).

Every launch of convtune's kernels goes through ``launch``. Inside ``compiling_only()`` a launch compiles its
kernel and runs nothing; inside ``intercepted(instead)`` it calls ``instead`` in its place (what a run would launch,
seen without running it: a test checks the grids, a benchmark compiles and counts the binaries). Inside
``recording()`` each launch runs as usual and
is also kept; ``describe`` then turns the kept launches into JSON types: per launch the compiled binary (cubin),
the kernel's name, its shared memory, warps and grid, and each argument the compiled kernel takes at run time
(Triton's launcher passes those in order, then its two scratch pointers): a tensor, named by the operand or
buffer it lies in (with its offset in bytes), or a number with the type Triton compiled it for. So a launch
function does all its work through ``launch``, into its operands and declared buffers: a tensor made between
launches (by a PyTorch call, which the C++ replay would not make) is refused by ``describe``, and the algorithm
stays on the Python path.
"""

from __future__ import annotations

import base64
import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

_active = threading.local()  # .records: the launches kept in this thread, or None; .compiling_only: compile, not run;
# .instead: what a launch calls in its place, or None
_INTEGER = {"i32": "i32", "i64": "i64"}  # Triton's argument types the C++ launcher passes as they are
_FLOAT = {"fp32": "f32"}


class NotRecordable(Exception):
    """An algorithm's run that the C++ runtime cannot repeat from its launches alone; the message says why."""


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    """``kernel[grid](*args, **kwargs)`` (and, inside ``recording()``, kept); inside ``compiling_only()``, Triton's
    ``kernel.warmup`` with the same arguments: compiled for them, nothing run; inside ``intercepted(instead)``,
    ``instead(kernel, grid, *args, **kwargs)``."""
    instead = getattr(_active, "instead", None)
    if instead is not None:
        return instead(kernel, tuple(grid), *args, **kwargs)
    if getattr(_active, "compiling_only", False):
        return kernel.warmup(*args, grid=grid, **kwargs)
    compiled = kernel[grid](*args, **kwargs)
    records = getattr(_active, "records", None)
    if records is not None:
        records.append((kernel, compiled, tuple(grid), args, kwargs))
    return compiled


@contextlib.contextmanager
def _in_this_thread(attribute: str, value: Any) -> Iterator[Any]:
    """``_active.<attribute>`` is ``value`` in this thread for the block (it yields it), then what it was."""
    outer = getattr(_active, attribute, None)
    setattr(_active, attribute, value)
    try:
        yield value
    finally:
        setattr(_active, attribute, outer)


def recording() -> contextlib.AbstractContextManager[list[tuple]]:
    """Keep every ``launch`` of this thread in the list it yields."""
    return _in_this_thread("records", [])


def compiling_only() -> contextlib.AbstractContextManager[bool]:
    """Every ``launch`` of this thread compiles its kernel for its arguments (``kernel.warmup``) and runs nothing:
    a run on operands that hold no data (PyTorch's meta device, whose tensors Triton specializes as aligned) compiles
    what a run on real ones would launch. Under Triton's ``AsyncCompileMode`` the compiles go to its threads."""
    return _in_this_thread("compiling_only", True)


def intercepted(instead: Callable[..., Any]) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """Every ``launch`` of this thread calls ``instead(kernel, grid, *args, **kwargs)`` in its place and returns what it
    returns: nothing is compiled or run (operands of PyTorch's meta device or the CPU will do)."""
    return _in_this_thread("instead", instead)


def describe(records: list[tuple], tensors: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The launches of ``records`` in JSON types, each tensor argument named by the one of ``tensors`` it lies in.
    Raises ``NotRecordable`` for a tensor that lies in none of them (made during the run), an argument type or a
    launch feature the C++ launcher does not pass (scratch memory, clusters, cooperative or dependent launches)."""
    spans = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for name, t in tensors.items()]
    launches = []
    for kernel, compiled, grid, args, kwargs in records:
        meta = compiled.metadata
        name = meta.name
        if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
            raise NotRecordable(f"{name} takes scratch memory from Triton's allocator")
        if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False) or \
                getattr(meta, "launch_pdl", False):
            raise NotRecordable(f"{name} launches as a cluster, cooperatively or dependent on the previous kernel")
        bound = dict(zip(kernel.arg_names, args))
        bound.update((k, v) for k, v in kwargs.items() if k in kernel.arg_names)
        params: list[list[Any]] = []
        for arg, ty in compiled.src.signature.items():
            if ty == "constexpr":
                continue
            if arg not in bound:
                raise NotRecordable(f"{name}'s argument {arg} was left to its default, which is not recorded")
            value = bound[arg]
            if isinstance(value, torch.Tensor):
                pointer = value.data_ptr()
                owner = next(((n, pointer - lo) for n, lo, hi in spans if lo <= pointer < hi), None)
                if owner is None:
                    raise NotRecordable(f"{name}'s argument {arg} is a tensor made during the run")
                params.append(["tensor", owner[0], owner[1]])
            elif ty in _INTEGER:
                params.append([_INTEGER[ty], int(value)])
            elif ty in _FLOAT:
                params.append([_FLOAT[ty], float(value)])
            else:
                raise NotRecordable(f"{name}'s argument {arg} has the type {ty}, which the C++ launcher does not pass")
        launches.append(dict(name=name, cubin=base64.b64encode(compiled.asm["cubin"]).decode("ascii"),
                             shared=int(meta.shared), warps=int(meta.num_warps),
                             grid=[int(g) for g in (*grid, 1, 1)[:3]], params=params))
    return launches
