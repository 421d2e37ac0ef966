"""Algorithm: one way to compute a convolution, and the support it needs (workspace carving, checks).

An algorithm knows whether it supports a problem (and why not), how much workspace it needs
(and whether that is known yet without costly work: ``known_workspace_bytes``), whether it is
deterministic, its numeric behaviour, and how to run. It never times and never
chooses: the timer and the tuner do that.

Workspace honesty: every scratch tensor an algorithm uses is carved from the buffer it is
given, through the same ``buffers`` list that ``buffer_bytes`` sums, so the declaration and
the use cannot drift apart.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import costmodel, tf32
from ..costmodel import Cost
from ..problem import DIRECTIONS, ConvProblem, is_in_layout
from ..results import backend_of

OPERAND_NAMES = {"fwd": ("x", "w", "y"), "bwd_data": ("dy", "w", "dx"), "bwd_filter": ("x", "dy", "dw")}
ALIGN_BYTES = 256
# Former names of Algorithm's methods, and what replaced them (deprecated aliases below).
_RENAMED = {"scratch_bytes": "workspace_bytes", "known_scratch_bytes": "known_workspace_bytes"}
_NAME = re.compile(r"^[a-z0-9_]+:[A-Za-z0-9_.=\-]+$")


@dataclasses.dataclass(frozen=True)
class NumericNotes:
    """How an algorithm computes, as far as accuracy is concerned."""

    tensor_cores: bool = False
    tf32: bool = False  # float32 inputs rounded to TF32 inside
    reduced_precision: bool = False  # partial sums kept in float16/bfloat16
    float32_inside: bool = False  # float16/bfloat16 inputs computed in float32 inside

    def describe(self) -> str:
        parts = [name for name, on in (("tensor cores", self.tensor_cores), ("TF32", self.tf32),
                                       ("reduced-precision accumulation", self.reduced_precision),
                                       ("computes in float32", self.float32_inside)) if on]
        return ", ".join(parts) or "exact dtype arithmetic"


@dataclasses.dataclass(frozen=True)
class Support:
    """Whether an algorithm supports a problem; falsy with a reason when it does not."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


SUPPORTED = Support(True)


@dataclasses.dataclass(frozen=True)
class NativeRecipe:
    """How convtune's C++ runtime runs an algorithm on a problem, with no Python on the call.

    kind: the native executable that computes what the algorithm computes ('native', 'gemm_1x1',
    'gemm_1x1_strided', 'cudnn'); options: what that executable is made from besides the problem
    and the algorithm's declared buffers (a cuDNN execution plan's engine and knobs), as (name, value) pairs.
    """

    kind: str
    options: tuple[tuple[str, Any], ...] = ()


class NoNativeRecipe(Exception):
    """An algorithm with native executables has none on a problem: the message says why. transient: it may
    have one later (a CUDA graph was being captured, memory ran out), so the runtime asks again next time."""

    def __init__(self, why: str, transient: bool = False) -> None:
        super().__init__(why)
        self.transient = transient


def unsupported(reason: str) -> Support:
    return Support(False, reason)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One scratch tensor carved from the workspace: a name, a contiguous shape and a dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def buffers_bytes(buffers: Sequence[Buffer]) -> int:
    return sum(_aligned(b.nbytes) for b in buffers if b.nbytes)


def carve(workspace: torch.Tensor, buffers: Sequence[Buffer]) -> dict[str, torch.Tensor]:
    """Views of ``workspace`` (a 1-D uint8 tensor) for each buffer, in order, aligned."""
    views: dict[str, torch.Tensor] = {}
    offset = 0
    for b in buffers:
        if not b.nbytes:
            views[b.name] = torch.empty(b.shape, dtype=b.dtype, device=workspace.device)
            continue
        raw = workspace[offset: offset + b.nbytes]
        views[b.name] = raw.view(b.dtype).view(b.shape)
        offset += _aligned(b.nbytes)
    return views


def allocate_workspace(nbytes: int, device: str | torch.device) -> torch.Tensor:
    """The workspace tensor an algorithm expects: 1-D uint8 of ``nbytes`` on ``device``."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def check_aligned(algorithm: Algorithm, problem: ConvProblem, *tensors: torch.Tensor) -> None:
    """Raises ValueError naming the operand where one of ``tensors`` (a, b[, out]) starts at an address
    ``algorithm`` does not take (its ``alignment``: a view into another tensor may start anywhere)."""
    if algorithm.alignment > 1:
        for name, t in zip(OPERAND_NAMES[problem.direction], tensors):
            if t.data_ptr() % algorithm.alignment:
                raise ValueError(f"convtune:{problem.key} by {algorithm.name}: operand {name} starts at an address "
                                 f"not aligned to {algorithm.alignment} bytes, which it assumes; pass a fresh tensor "
                                 f"(clone it)")


class Algorithm(abc.ABC):
    """Base of every algorithm. Subclasses set the class attributes and implement ``_run``.

    name: stable 'backend:variant'. devices/directions: what it can ever run on.
    deterministic: bit-identical results from run to run. splits_batch: it runs the batch in parts
    (micro-batching), which only a policy with ``micro_batching`` allows. place: for a candidate of a backend
    that ranks its candidates by its own heuristics (cuDNN's), its fixed place in that order for its problem
    (0: the heuristics' first choice), which get prices (``costmodel.order_factor``) and its learned
    model reads; None for everything else. host_kind: which of the host costs the Python path's runs of it pay
    (``convtune.pytorch.host_costs.host_overheads_us``; where it has no native executable): 'python', or
    'triton' for a Triton kernel, whose launcher costs more host time. alignment: the bytes to which its operands'
    first elements must be aligned (1: any address), which ``run`` and a tuned layer's Python path check.
    """

    name: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")
    directions: tuple[str, ...] = DIRECTIONS
    deterministic: bool = True
    splits_batch: bool = False
    place: int | None = None
    host_kind: str = "python"
    alignment: int = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The former names are read by nothing: an override of one would be ignored without a word.
        for old, new in _RENAMED.items():
            if old in vars(cls):
                warnings.warn(f"{cls.__name__}.{old} overrides a name convtune no longer calls; override {new} "
                              "(the whole workspace a run needs; buffer_bytes is the part it carves)",
                              FutureWarning, stacklevel=3)  # the class statement (ABCMeta.__new__ is level 2)

    def __init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"algorithm name {self.name!r} must look like 'backend:variant' (letters, digits, _)")

    @property
    def backend(self) -> str:
        return backend_of(self.name)

    def __repr__(self) -> str:
        return f"<Algorithm {self.name}>"

    # -- what subclasses describe -------------------------------------------------------------
    def _supports(self, problem: ConvProblem) -> Support:
        """Problem-specific support beyond device and direction."""
        return SUPPORTED

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        """The scratch tensors ``_run`` carves from the workspace (empty: zero workspace)."""
        return []

    def notes(self, problem: ConvProblem) -> NumericNotes:
        return NumericNotes()

    def tf32_settings(self, problem: ConvProblem) -> tf32.Settings:
        """The TF32 settings a run on ``problem`` switches PyTorch's process-wide switches to (``tf32.Settings``:
        none by default). A run that switches them says so here, where find sees it (``isolation.wanted``)."""
        return tf32.Settings()

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        """The roofline terms of a run on ``problem`` with this workspace (``costmodel``); a family that
        declares none is priced as a modest GEMM-like path."""
        return costmodel.generic_cost(problem, workspace_bytes)

    def native_recipe(self, problem: ConvProblem) -> NativeRecipe | None:
        """How the C++ runtime runs this algorithm on ``problem``; None: it runs in Python only. Raises
        ``NoNativeRecipe`` where an algorithm that has native executables has none on ``problem`` (why in it)."""
        return None

    def is_deterministic(self, problem: ConvProblem) -> bool:
        """Bit-identical results from run to run for ``problem`` (the class default unless overridden)."""
        return self.deterministic

    @property
    def origin(self) -> str:
        """The module whose code computes this algorithm's results: where isolation (``settings.isolate``)
        decides whether convtune vouches for it. A wrapper answers for what it wraps."""
        return type(self).__module__

    @abc.abstractmethod
    def _run(self, problem: ConvProblem, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
             ws: dict[str, torch.Tensor]) -> None:
        """Write the result into ``out`` (every element), using only the carved buffers ``ws``."""

    # -- the public surface ----------------------------------------------------------------------
    def supports(self, problem: ConvProblem) -> Support:
        """Whether this algorithm can compute ``problem``, with the reason when it cannot."""
        if problem.device not in self.devices:
            return unsupported(f"runs on {'/'.join(self.devices)}, not {problem.device}")
        if problem.direction not in self.directions:
            return unsupported(f"computes {'/'.join(self.directions)}, not {problem.direction}")
        return self._supports(problem)

    def buffer_bytes(self, problem: ConvProblem) -> int:
        """Bytes of the buffer ``run`` carves its scratch tensors from (``buffers``); it never uses more."""
        return buffers_bytes(self.buffers(problem))

    def library_bytes(self, problem: ConvProblem) -> int:
        """Bytes the libraries ``run`` calls allocate by themselves, outside the buffer (cuFFT's result and
        work buffers, say): memory a budget must count but cannot carve. 0 by default."""
        return 0

    def workspace_bytes(self, problem: ConvProblem) -> int:
        """All the memory a run needs beside its operands: the buffer plus what libraries allocate themselves.

        What ``PerfResult.workspace_bytes`` reports and what policies and plans count against a limit.
        """
        return self.buffer_bytes(problem) + self.library_bytes(problem)

    def known_workspace_bytes(self, problem: ConvProblem) -> int | None:
        """``workspace_bytes(problem)`` if it is known without costly work, else None.

        An algorithm whose size is learned only by real work (a cuDNN execution plan is built to learn its
        workspace, up to a second) returns None until that work was done. The tuner asks this
        where the size only orders or skips candidates, and ``workspace_bytes`` where a decision
        depends on it. By default the size is always known.
        """
        return self.workspace_bytes(problem)

    def prepare(self, problem: ConvProblem) -> None:
        """Do, ahead of the first run on ``problem``, the work that needs neither its operands nor the GPU's time
        (a Triton kernel's compile), so that ``find`` can have it done while it measures another candidate. Nothing
        by default; whatever it raises, the run does the work itself."""
        return None

    def scratch_bytes(self, problem: ConvProblem) -> int:
        """Deprecated: ``workspace_bytes``, the name ``PerfResult`` and ``Policy`` use for the same figure."""
        warnings.warn("Algorithm.scratch_bytes is now Algorithm.workspace_bytes (the whole workspace a run needs; "
                      "buffer_bytes is the part it carves)", DeprecationWarning, stacklevel=2)
        return self.workspace_bytes(problem)

    def known_scratch_bytes(self, problem: ConvProblem) -> int | None:
        """Deprecated: ``known_workspace_bytes``."""
        warnings.warn("Algorithm.known_scratch_bytes is now Algorithm.known_workspace_bytes", DeprecationWarning,
                      stacklevel=2)
        return self.known_workspace_bytes(problem)

    def run(self, problem: ConvProblem, a: torch.Tensor, b: torch.Tensor,
            workspace: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Compute ``problem``: fwd (x, w) -> y; bwd_data (dy, w) -> dx; bwd_filter (x, dy) -> dw.

        ``workspace``: a 1-D uint8 tensor of at least ``buffer_bytes(problem)`` bytes on the
        problem's device (None: allocated here). ``out``: where to write the result (None: a new
        tensor in the problem's layout). Bad tensors raise ``ValueError`` naming the operand.
        """
        support = self.supports(problem)
        if not support:
            raise ValueError(f"{self.name} does not support {problem.key}: {support.reason}")
        a_name, b_name, out_name = OPERAND_NAMES[problem.direction]
        a_shape, b_shape, out_shape = problem.operand_shapes
        check_tensor(problem, a_name, a, a_shape)
        check_tensor(problem, b_name, b, b_shape)
        if out is None:
            out = problem.empty(out_shape)
        else:
            check_tensor(problem, out_name, out, out_shape)
        check_aligned(self, problem, a, b, out)
        buffers = self.buffers(problem)
        need = buffers_bytes(buffers)
        if workspace is None:
            workspace = allocate_workspace(need, problem.device)
        elif not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8 or workspace.dim() != 1:
            raise ValueError(f"workspace for {self.name} must be a 1-D torch.uint8 tensor (allocate_workspace)")
        elif workspace.numel() < need:
            raise ValueError(
                f"workspace of {workspace.numel()} bytes is smaller than the {need} bytes {self.name} "
                f"declares for {problem.key}; pass buffer_bytes(problem) bytes or more"
            )
        elif workspace.device.type != problem.device:
            raise ValueError(f"workspace is on {workspace.device} but the problem is on {problem.device}")
        return into(problem, self.execute(problem, a, b, out, carve(workspace, buffers)), out)

    def execute(self, problem: ConvProblem, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                ws: dict[str, torch.Tensor]) -> torch.Tensor:
        """The run itself, nothing checked, for callers that checked the operands once (the custom ops).

        Writes the result into ``out`` and returns it; an algorithm whose library allocates its own
        result (torch:native) may return that instead, dense in the problem's layout, and leave ``out``
        alone. ``run`` calls it and always leaves the result in ``out`` (``into``).
        """
        self._run(problem, a, b, out, ws)
        return out

    def launcher(self, problem: ConvProblem, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 workspace: torch.Tensor) -> Callable[[], torch.Tensor]:
        """A call that runs ``problem`` on these operands as a tuned layer does (``execute``, the workspace
        carved once), returning the result: ``out``, or the library's own tensor where the algorithm hands
        that over (torch:native). What ``find`` times, so a measurement holds no copy and no per-call
        check that the layer does not make; the operands must have passed ``run``'s checks before."""
        ws = carve(workspace, self.buffers(problem))
        return lambda: self.execute(problem, a, b, out, ws)


def into(problem: ConvProblem, result: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` holding ``result``, what ``execute`` returned: copied where it is a tensor of the algorithm's own,
    which must fit the problem's output as ``out`` does (a mismatch raises, naming it, rather than broadcast)."""
    if result is not out:
        name = OPERAND_NAMES[problem.direction][2]
        check_tensor(problem, f"{name} (the result execute handed over)", result, problem.operand_shapes[2])
        out.copy_(result)
    return out


def check_tensor(problem: ConvProblem, name: str, t: object, shape: tuple[int, ...], layout: bool = True) -> None:
    """Raise ``ValueError``/``TypeError`` naming ``name`` unless ``t`` fits the problem (its strides too: dense in
    the problem's layout, unless ``layout`` is False)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{problem.direction} operand {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{problem.direction} operand {name} has shape {tuple(t.shape)}, the problem needs {shape}")
    if t.dtype != problem.torch_dtype:
        raise ValueError(f"{problem.direction} operand {name} has dtype {t.dtype}, the problem needs {problem.dtype}")
    if t.device.type != problem.device:
        raise ValueError(f"{problem.direction} operand {name} is on {t.device}, the problem is on {problem.device}")
    if layout and not is_in_layout(t, problem.layout):
        raise ValueError(
            f"{problem.direction} operand {name} is not dense in the {problem.layout} layout the problem "
            f"declares; convert it with convtune.to_layout(t, {problem.layout!r})"
        )


class Backend(abc.ABC):
    """A family whose algorithms depend on the problem (cuDNN's execution plans, say): it lists them per problem.

    ``prefix`` is the backend part of every name it hands out ('cudnn' for 'cudnn:eng0').
    """

    prefix: str = ""
    splits_batch: bool = False  # its algorithms run the batch in parts (as Algorithm.splits_batch)

    @abc.abstractmethod
    def algorithms(self, problem: ConvProblem) -> list[Algorithm]:
        """The algorithms this backend offers for ``problem`` (each supporting it)."""

    def unavailable(self, problem: ConvProblem) -> str | None:
        """Why this backend offers nothing for ``problem`` (None when it offers something)."""
        return None

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        """The roofline terms of one of this backend's algorithms on ``problem`` (generic unless declared)."""
        return costmodel.generic_cost(problem, workspace_bytes)

    def declared_cost(self, name: str) -> Callable[[ConvProblem, int], Cost]:
        """The cost of the algorithm called ``name`` (one of this backend's), without making it for a problem."""
        return self.cost

    def get(self, name: str, problem: ConvProblem) -> Algorithm:
        """The algorithm called ``name`` for ``problem``; ``KeyError`` if it is not offered."""
        for algorithm in self.algorithms(problem):
            if algorithm.name == name:
                return algorithm
        raise KeyError(f"{self.prefix} offers no {name!r} for {problem.key}")
