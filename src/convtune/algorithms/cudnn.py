"""cuDNN's engines through the cuDNN frontend (``pip install convtune[cuda]``).

For a problem, the backend builds the cuDNN graph (conv_fprop, conv_dgrad or conv_wgrad; float32
compute) and asks heuristics modes A and FALLBACK for every engine configuration they offer. Each
execution plan ("plan" in this module; a network's workspace plan is ``convtune.plan``'s) becomes an
algorithm named ``cudnn:<plan name>`` (``cudnn:eng62_k2=5_k13=1...``). Building a plan costs from 0.1 ms
to about a second (runtime-compiled engines), so plans are built lazily, the
first time their workspace is asked for (``workspace_bytes``) or they run, and kept per problem for
the process. Until then ``known_workspace_bytes`` is None: ``find`` orders and skips candidates
without building them, and builds only the plans whose workspace decides something (see ``find``).

Determinism is not exposed per plan by the frontend's Python API: a plan's ``is_deterministic``
is None (unknown) until the tuner has compared two of its results on the same inputs bit for bit.
TF32: a float32 problem with ``allow_tf32=False`` deselects the engines with the tensor-core and
down-conversion numerical notes, as PyTorch does; their build then fails and they are unsupported.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, cast

# An ImportError here leaves the backend out (registry.OPTIONAL_MODULES). The ignore: the optional
# frontend is not installed where mypy runs.
import cudnn  # type: ignore[import-not-found]  # noqa: I001
import torch

from ..costmodel import Cost
from ..hardware import current_stream_handle
from ..problem import ConvProblem, empty_in_layout
from ..settings import settings
from .base import Algorithm, Backend, Buffer, NativeRecipe, NumericNotes, Support, unsupported
from .cudnn_cost import execution_plan_cost
from .registry import register

log = logging.getLogger(__name__)

_IO_TYPES = {"float32": cudnn.data_type.FLOAT, "float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16}
HEURISTICS = {"A": cudnn.heur_mode.A, "B": cudnn.heur_mode.B, "FALLBACK": cudnn.heur_mode.FALLBACK}
_MAX_GRAPHS = 512  # problems whose built plans are kept in the process
try:  # engine ids from here on are the frontend's own engines, not cuDNN backend engines
    from cudnn.engines.engine_ids import (  # type: ignore[import-not-found]  # optional frontend, not installed here
        CPP_OSS_ENGINE_ID_BASE as _FRONTEND_ENGINE_IDS,
    )
except ImportError:  # an older frontend: it has only backend engines
    _FRONTEND_ENGINE_IDS = 1 << 62


@functools.cache
def _handle(device_index: int):
    """The device's cuDNN handle, for every thread: a plan runs on the handle it was built with."""
    with torch.cuda.device(device_index):
        return cudnn.create_handle()


# Setting the handle's stream and launching on it, as one step: the background worker launches on a
# stream of its own while the caller's threads launch on PyTorch's current one (the autograd engine's too).
_LAUNCH_LOCK = threading.Lock()


def _as_2d(problem: ConvProblem) -> dict:
    """cuDNN convolves 2-D and 3-D: a 1-D problem is a 2-D one of height 1."""
    lift = problem.ndim == 1
    def dims(t, fill):
        return [fill, *t] if lift else list(t)
    return dict(padding=dims(problem.padding, 0), stride=dims(problem.stride, 1), dilation=dims(problem.dilation, 1))


def _descr(problem: ConvProblem, shape: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(dims, strides) of a tensor of ``shape`` in the problem's layout, 1-D lifted to 2-D."""
    meta = empty_in_layout(shape, problem.layout, problem.torch_dtype, "meta")
    if problem.ndim == 1:
        meta = meta.unsqueeze(2)
    return list(meta.shape), list(meta.stride())


class ProblemGraph:
    """The cuDNN graph of one problem: its ranked plans and the ones built so far."""

    def __init__(self, problem: ConvProblem, modes: tuple[str, ...] = ("A", "FALLBACK")) -> None:
        self.problem = problem
        self.lock = threading.Lock()
        io = _IO_TYPES[problem.dtype]
        fp = cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=fp, compute_data_type=fp,
                          handle=_handle(torch.cuda.current_device()))
        x_dims, x_strides = _descr(problem, problem.x_shape)
        w_dims, w_strides = _descr(problem, problem.w_shape)
        y_dims, y_strides = _descr(problem, problem.y_shape)
        conv = _as_2d(problem)
        if problem.direction == "fwd":
            a = g.tensor(name="x", dim=x_dims, stride=x_strides, data_type=io)
            b = g.tensor(name="w", dim=w_dims, stride=w_strides, data_type=io)
            out = g.conv_fprop(image=a, weight=b, compute_data_type=fp, **conv)
            out.set_output(True).set_dim(y_dims).set_stride(y_strides).set_data_type(io)
        elif problem.direction == "bwd_data":
            a = g.tensor(name="dy", dim=y_dims, stride=y_strides, data_type=io)
            b = g.tensor(name="w", dim=w_dims, stride=w_strides, data_type=io)
            out = g.conv_dgrad(loss=a, filter=b, compute_data_type=fp, **conv)
            out.set_output(True).set_dim(x_dims).set_stride(x_strides).set_data_type(io)
        else:
            a = g.tensor(name="x", dim=x_dims, stride=x_strides, data_type=io)
            b = g.tensor(name="dy", dim=y_dims, stride=y_strides, data_type=io)
            out = g.conv_wgrad(image=a, loss=b, compute_data_type=fp, **conv)
            out.set_output(True).set_dim(w_dims).set_stride(w_strides).set_data_type(io)
        g.validate()
        g.build_operation_graph()
        if problem.dtype == "float32" and not problem.allow_tf32:
            g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS])
        g.create_execution_plans([HEURISTICS[m] for m in modes])
        self.graph, self.operands = g, (a, b, out)
        self.names = [g.get_plan_name_at_index(i) for i in range(g.get_execution_plan_count())]
        self.workspace: dict[int, int] = {}  # built plans: index -> workspace bytes
        self.failed: dict[int, str] = {}  # plans that did not build: index -> why
        # built plans: index -> launch (see _launcher)
        self._launchers: dict[int, Callable[[Any, int, int, int, int], None]] = {}

    def build(self, index: int) -> int:
        """Build plan ``index`` (once) and return its workspace bytes; raises if it cannot be built."""
        with self.lock:
            if index in self.failed:
                raise RuntimeError(self.failed[index])
            if index not in self.workspace:
                try:
                    self.graph.build_plan_at_index(index)
                    self.workspace[index] = int(self.graph.get_workspace_size_plan_at_index(index))
                except Exception as exc:  # the frontend raises several types for "cannot build"
                    self.failed[index] = f"cuDNN could not build plan {self.names[index]}: {exc}"
                    raise RuntimeError(self.failed[index]) from None
            return self.workspace[index]

    def execute(self, index: int, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor) -> None:
        launch = self._launchers.get(index)
        if launch is None:
            self.build(index)
            launch = self._launchers[index] = self._launcher(index)
        device_index = a.device.index if a.device.index is not None else torch.cuda.current_device()
        handle = _handle(device_index)
        with _LAUNCH_LOCK:
            # The handle follows PyTorch's current stream, so CUDA-graph capture records this launch.
            _follow_stream(handle, device_index)
            # A 1-D problem's tensors are 2-D ones of height 1 to cuDNN: the same memory, the same pointers.
            launch(handle, a.data_ptr(), b.data_ptr(), out.data_ptr(), workspace.data_ptr() if workspace.numel() else 0)

    def _launcher(self, index: int):
        """``launch(handle, a_ptr, b_ptr, out_ptr, workspace_ptr)`` of built plan ``index``.

        The frontend's public execute re-describes and re-checks every operand in Python on each
        call (about 35 us of host time a call on the H200's host: bench/results/tuning_cost.md at
        revision bcebd49, in git history); the operands here were checked once by whoever calls
        (ops.Runner, Algorithm.run). So a plan
        that the frontend runs through its C++ graph is launched there directly, by operand uid, as
        the public call ends up doing; anything else (a frontend without that layout, a plan of
        the frontend's own Python engines) takes the public call.
        """
        g, operands = self.graph, self.operands
        direct = _direct_launch(g, index, tuple(t.uid for t in operands)) if settings.cudnn_direct else None
        if direct is not None:
            return direct

        def public(handle, pa: int, pb: int, pout: int, pws: int) -> None:
            pack = dict(zip(operands, (pa, pb, pout)))
            g.execute_plan_at_index(pack, pws or None, index, handle=handle)

        return public


def _direct_launch(g, index: int, uids: tuple[int, int, int]):
    """The C++ launch of plan ``index`` of frontend graph ``g`` (see ``ProblemGraph._launcher``), or None."""
    try:
        lowered, plan = g._lowered_graph, g._materialize_backend_plan(index)
        usable = (plan.cpp_index is not None and g._engine_for(plan) is None and not g._data_bindings
                  and index not in g._barred_indices() and callable(lowered._execute_plan_at_index))
    except (AttributeError, TypeError) as exc:  # another frontend's internals: the public call is right there
        log.info("cuDNN frontend %s: launching plans through its public execute (%s)", cudnn.__version__, exc)
        return None
    if not usable:
        return None
    cpp_index = plan.cpp_index
    ua, ub, uout = uids

    def launch(handle, pa: int, pb: int, pout: int, pws: int) -> None:
        lowered._execute_plan_at_index({ua: pa, ub: pb, uout: pout}, pws, cpp_index, handle.backend_handle,
                                       None, None, None)

    return launch


_handle_streams: dict[int, int] = {}  # id(handle) -> the stream last set on it


def _follow_stream(handle, device_index: int) -> None:
    """Set ``handle``'s stream to PyTorch's current one on the device (a frontend call only when it changed)."""
    stream = current_stream_handle(device_index)
    if _handle_streams.get(id(handle)) != stream:
        cudnn.set_stream(handle=handle, stream=stream)
        _handle_streams[id(handle)] = stream


class CudnnExecutionPlan(Algorithm):
    """One cuDNN engine configuration for one problem."""

    devices = ("cuda",)
    deterministic = True  # unknown per plan: see is_deterministic
    alignment = 16  # what the frontend's tensors declare, and so the tuned plans assume (csrc/cudnn.cpp too)

    def __init__(self, graph: ProblemGraph, index: int, name: str) -> None:
        self.name = name
        super().__init__()
        self.graph, self.index = graph, index
        self.place = index  # the heuristics' order (modes A, then FALLBACK), whichever plans fail to build

    def _supports(self, problem: ConvProblem) -> Support:
        if problem != self.graph.problem:
            return unsupported("a cuDNN execution plan belongs to the problem it was built for")
        if self.index in self.graph.failed:
            return unsupported(self.graph.failed[self.index])
        return Support(True)

    def is_deterministic(self, problem: ConvProblem) -> bool | None:  # type: ignore[override]
        return None

    def notes(self, problem: ConvProblem) -> NumericNotes:
        half = problem.dtype != "float32"
        return NumericNotes(tensor_cores=half or problem.allow_tf32, tf32=not half and problem.allow_tf32)

    def known_workspace_bytes(self, problem: ConvProblem) -> int | None:
        # Only a built plan knows its workspace (None: not built, or failed); then the same figure as
        # workspace_bytes, which counts the buffer as carved (aligned).
        return self.workspace_bytes(problem) if self.index in self.graph.workspace else None

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        return BACKEND.cost(problem, workspace_bytes)

    def native_recipe(self, problem: ConvProblem) -> NativeRecipe | None:
        # The C++ runtime builds the same operation graph through cuDNN's backend API and, among its
        # heuristics' configurations, the one with this plan's tag (the frontend's name for it). Not
        # for the frontend's own (Python) engines, which the backend does not know.
        engine_id, _ = self.graph.graph.get_engine_and_knobs_at_index(self.index)
        if not 0 <= engine_id < _FRONTEND_ENGINE_IDS:
            return None
        operands = tuple(_descr(problem, shape) for shape in (problem.x_shape, problem.w_shape, problem.y_shape))
        conv = _as_2d(problem)
        return NativeRecipe("cudnn", (
            ("tag", self.graph.names[self.index]),
            ("shapes", tuple(tuple(dims) for dims, _ in operands)),
            ("strides", tuple(tuple(strides) for _, strides in operands)),
            ("stride", tuple(conv["stride"])), ("padding", tuple(conv["padding"])),
            ("dilation", tuple(conv["dilation"])),
        ))

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        # cuDNN gets its workspace whole; building the plan is what tells its size.
        return [Buffer("workspace", (self.graph.build(self.index),), torch.uint8)]

    def _run(self, problem, a, b, out, ws) -> None:
        self.graph.execute(self.index, a, b, out, ws["workspace"])


class CudnnBackend(Backend):
    """Lists, per problem, the plans of cuDNN's heuristics modes A and FALLBACK, in their order."""

    prefix = "cudnn"

    def __init__(self) -> None:
        self._graphs: dict[ConvProblem, ProblemGraph | None] = {}
        self._plans: dict[ConvProblem, list[CudnnExecutionPlan]] = {}
        self._lock = threading.Lock()

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        return execution_plan_cost(problem, workspace_bytes)

    def unavailable(self, problem: ConvProblem) -> str | None:
        if problem.device != "cuda":
            return "cuDNN runs on CUDA devices only"
        if not torch.cuda.is_available():
            return "no CUDA device is visible to PyTorch"
        return None

    def graph(self, problem: ConvProblem) -> ProblemGraph | None:
        """The problem's graph (made once; None when cuDNN supports no plan for it)."""
        with self._lock:
            if problem in self._graphs:
                return self._graphs[problem]
            try:
                graph: ProblemGraph | None = ProblemGraph(problem)
            except Exception as exc:  # cudnnGraphNotSupportedError and friends
                log.info("cuDNN offers no plan for %s: %s", problem.key, exc)
                graph = None
            if len(self._graphs) >= _MAX_GRAPHS:
                oldest = next(iter(self._graphs))
                self._graphs.pop(oldest)
                self._plans.pop(oldest, None)
            self._graphs[problem] = graph
            return graph

    def algorithms(self, problem: ConvProblem) -> list[Algorithm]:
        if self.unavailable(problem):
            return []
        if problem not in self._plans:
            graph = self.graph(problem)
            plans, seen = [], set()
            for i, name in enumerate(graph.names if graph else []):
                full = f"cudnn:{name}" if name not in seen else f"cudnn:{name}_i{i}"
                seen.add(name)
                plans.append(CudnnExecutionPlan(cast(ProblemGraph, graph), i, full))  # names come from a graph
            self._plans[problem] = plans
        return [p for p in self._plans[problem] if p.index not in p.graph.failed]

    def heuristic_choice(self, problem: ConvProblem, mode: str = "A") -> str | None:
        """The name of cuDNN's own first choice under heuristics ``mode`` ('A' or 'B'), or None."""
        try:
            graph = ProblemGraph(problem, modes=(mode,))
        except Exception as exc:
            log.info("cuDNN heuristics %s offer nothing for %s: %s", mode, problem.key, exc)
            return None
        if not graph.names:
            return None
        name = f"cudnn:{graph.names[0]}"
        offered = [p.name for p in self.algorithms(problem)]
        return name if name in offered else None


BACKEND = register(CudnnBackend())
