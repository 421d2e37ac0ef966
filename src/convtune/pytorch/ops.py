"""The Python path: the custom operators through which layers run algorithms that have no native
executable (convtune's own Python algorithms; see ``runtime`` for the native ones), so that
torch.compile traces them.

``convtune::conv(x, w, key, fwd, bwd_data, bwd_filter) -> y`` is the forward convolution of the
problem ``key`` (a ``ConvProblem.key`` of direction fwd) by the algorithm named ``fwd``. It is
differentiable: its backward runs ``convtune::run`` for bwd_data (when x needs a gradient) and
bwd_filter (when w does) with the algorithms named for them. ``convtune::run(a, b, key, algorithm)``
computes one direction of one problem, the direction the key names; it has no backward of its
own, so double backward (``create_graph=True``) is not supported.

Operands of other strides are laid out first (a copy; the modules convert them beforehand, but in a
compiled graph Inductor may choose another layout); the result is dense in the problem's layout.
Each op has a fake implementation (shapes and strides from the key) for tracing, and takes its
workspace from ``convtune.pytorch.workspace``, so a run allocates nothing but its output.

    >>> import convtune as ct
    >>> p = ct.ConvProblem("fwd", n=1, c=2, k=3, input_size=(5, 5), kernel_size=3, padding=1)
    >>> x, w = p.random_inputs()
    >>> y = torch.ops.convtune.conv(x, w, p.key, "torch:native", "", "")
    >>> y.shape
    torch.Size([1, 3, 5, 5])
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch

from convtune.algorithms.base import OPERAND_NAMES, buffers_bytes, check_tensor
from convtune.algorithms.registry import generation, get_algorithm
from convtune.problem import ConvProblem, empty_in_layout, is_in_layout, to_layout
from convtune.pytorch import runtime, workspace
from convtune.settings import settings

log = logging.getLogger(__name__)

LABEL_PREFIX, LABEL_SEP = "convtune:", " by "  # profiler ranges: 'convtune:<problem key> by <algorithm>'


@functools.lru_cache(maxsize=4096)
def problem_of(key: str) -> ConvProblem:
    """The problem of ``key`` (parsed once: ops are called with the same keys over and over)."""
    return ConvProblem.from_key(key)


@functools.lru_cache(maxsize=4096)
def key_for(key: str, direction: str) -> str:
    """The key of the same convolution in another direction."""
    return problem_of(key).with_direction(direction).key


def _dense(problem: ConvProblem, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, strides) of a tensor of ``shape`` dense in the problem's layout."""
    return shape, empty_in_layout(shape, problem.layout, problem.torch_dtype, "meta").stride()


@functools.lru_cache(maxsize=4096)
def _result_spec(problem: ConvProblem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, strides) of the problem's result, dense in its layout."""
    return _dense(problem, problem.operand_shapes[2])


def _result_like(problem: ConvProblem, a: torch.Tensor) -> torch.Tensor:
    # On a's device (cuda:1, say), not the problem's device type alone.
    return torch.empty_strided(*_result_spec(problem), dtype=a.dtype, device=a.device)


class Runner:
    """One algorithm on one problem, looked up and checked once: ops run it every step.

    Calling it runs the algorithm on operands (a, b) into a new result. Everything that does not
    change between calls (the problem, shapes and strides, the workspace's carving) is kept here,
    so a call costs little host time beyond the algorithm's own launches.
    """

    __slots__ = ("problem", "algorithm", "operands", "result", "buffer_bytes", "buffers", "generation", "_kind")

    def __init__(self, key: str, algorithm: str) -> None:
        self.generation = generation()  # the registry's: a re-registered name is looked up again
        problem = self.problem = problem_of(key)
        if not algorithm:
            raise ValueError(f"no algorithm was chosen for {key}; tune the layer (convtune.optimize) "
                             f"or name one of convtune.algorithms(problem)")
        algo = self.algorithm = get_algorithm(algorithm, problem)
        support = algo.supports(problem)
        if not support:
            raise ValueError(f"{algorithm} does not support {key}: {support.reason}")
        self.operands = tuple(_dense(problem, shape) for shape in problem.operand_shapes[:2])
        self._kind = (problem.torch_dtype, problem.device == "cuda")  # what _fits compares besides geometry
        self.result = _result_spec(problem)
        self.buffers = tuple(algo.buffers(problem))
        self.buffer_bytes = buffers_bytes(self.buffers)

    def _fits(self, t: torch.Tensor, index: int) -> bool:
        # The cheapest attributes first: a run asks this of both operands every call.
        return (t.dtype, t.is_cuda) == self._kind and (t.shape, t.stride()) == self.operands[index]

    def _admit(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The operands, after the quick check (shape, dtype, device, strides), or the full one: an operand of
        other strides is laid out (a copy, as the native ops and torch's convolution do; strides that differ
        only where a dimension has size 1, a 1x1 weight from ``to_layout``, are remembered instead, so those
        operands take the quick check next time); anything else raises naming the operand."""
        if self._fits(a, 0) and self._fits(b, 1):
            return a, b
        problem = self.problem
        admitted = []
        for index, (name, t, (shape, _)) in enumerate(zip(OPERAND_NAMES[problem.direction], (a, b), self.operands)):
            check_tensor(problem, name, t, shape, layout=False)
            if is_in_layout(t, problem.layout):
                self.operands = tuple((shape, t.stride()) if i == index else spec
                                      for i, spec in enumerate(self.operands))
            else:
                t = to_layout(t, problem.layout)
            admitted.append(t)
        return admitted[0], admitted[1]

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = self._admit(a, b)
        if self.algorithm.alignment > 1:  # a view that starts elsewhere is copied, as torch's convolution takes it
            a, b = (t if t.data_ptr() % self.algorithm.alignment == 0 else t.clone() for t in (a, b))
        device = a.device
        out = torch.empty_strided(*self.result, dtype=a.dtype, device=device)
        ws = workspace.carved(self.buffers, self.buffer_bytes, device) if self.buffers else {}
        kind = device.type
        # The algorithm computes in the problem's dtype: an autocast region around the model must not
        # recast the matmuls inside it. Under the profiler each run is a range named after its problem
        # and algorithm, so a trace tells which layer ran what (bench/e2e.py reads them).
        profiling = getattr(torch.autograd.profiler, "_is_profiler_enabled", True)
        other_gpu = kind == "cuda" and device.index != torch.cuda.current_device()
        if profiling or other_gpu:
            with contextlib.ExitStack() as scope:
                if other_gpu:
                    scope.enter_context(torch.cuda.device(device))
                if profiling:
                    scope.enter_context(torch.profiler.record_function(
                        f"{LABEL_PREFIX}{self.problem.key}{LABEL_SEP}{self.algorithm.name}"))
                return self._execute(kind, a, b, out, ws)
        return self._execute(kind, a, b, out, ws)

    def _execute(self, kind: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 ws: dict[str, torch.Tensor]) -> torch.Tensor:
        if not torch.is_autocast_enabled(kind):
            return self.algorithm.execute(self.problem, a, b, out, ws)
        torch.set_autocast_enabled(kind, False)  # cheaper than entering torch.autocast(enabled=False)
        try:
            return self.algorithm.execute(self.problem, a, b, out, ws)
        finally:
            torch.set_autocast_enabled(kind, True)


class NativeRunner:
    """What a ``Runner`` computes, by the algorithm's native executable (``runtime``): a layer on the Python
    path (one of its directions runs a Python algorithm) runs its other directions at the C++ op's host
    cost, from the executable a warm start loaded, with no workspace of the Python path's.

    The executable is made for each CUDA device the operands come on (the first for the current one); on a
    device where it cannot be made (logged), the Python path runs the algorithm there.
    """

    __slots__ = ("problem", "name", "generation", "_handles", "_python")

    def __init__(self, key: str, algorithm: str, handle: int) -> None:
        self.generation = generation()
        self.problem, self.name = problem_of(key), algorithm
        # handle 0: none yet on the current device either (refused for now: ``runtime.NotNativeNow``)
        self._handles = {torch.cuda.current_device() if self.problem.device == "cuda" else -1: handle} if handle \
            else {}
        self._python: Runner | None = None

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        index = a.get_device()  # -1 on the CPU
        handle = self._handles.get(index)
        if handle is None:
            try:
                handle = runtime.prepare(self.problem, self.name, device=a.device)[0]
            except runtime.NotNativeNow:  # (during a CUDA graph capture, say): asked again next call
                handle = 0
            except runtime.REFUSALS as exc:
                log.warning("%s on %s has no native executable on %s (%s); the Python path runs it there",
                            self.name, self.problem.key, a.device, exc)
                handle = self._handles[index] = 0
            else:
                self._handles[index] = handle
        if not handle:
            if self._python is None:
                self._python = Runner(self.problem.key, self.name)
            return self._python(a, b)
        return torch.ops.convtune.tuned_run.default(a, b, handle)


def native_handle(key: str, algorithm: str) -> int:
    """The handle of ``algorithm``'s native executable on the problem ``key`` (made now, on the current
    device, if a warm start did not load it), or 0 where the Python path runs it (``native_or_why``)."""
    return native_or_why(problem_of(key), algorithm)[0]


def native_or_why(problem: ConvProblem, algorithm: str, db: Any = None) -> tuple[int, str]:
    """(handle, '') of ``algorithm``'s native executable on ``problem`` (made from ``db``'s stored form where
    there is one: ``runtime.prepare``), or (0, why the Python path runs it): the native runtime is off or
    not built, the algorithm is one of convtune's Python ones, cuDNN refuses the execution plan here, or a
    Triton configuration's launches cannot be recorded (``runtime.NotNativeNow``: for now)."""
    if not settings.native:
        return 0, "the native runtime is off (CONVTUNE_NATIVE=0)"
    try:
        return runtime.prepare(problem, algorithm, db)[0], ""
    except runtime.REFUSALS as exc:
        return 0, str(exc)


@functools.lru_cache(maxsize=4096)
def _runner(key: str, algorithm: str, generation: int, native: bool) -> Runner | NativeRunner:
    if not native:
        return Runner(key, algorithm)
    try:
        handle = runtime.prepare(problem_of(key), algorithm)[0]
    except runtime.NotNativeNow:  # refused for now: the runner asks again on each call, the Python path meanwhile
        return NativeRunner(key, algorithm, 0)
    except runtime.REFUSALS:
        return Runner(key, algorithm)
    return NativeRunner(key, algorithm, handle)


def runner(key: str, algorithm: str) -> Runner | NativeRunner:
    """What runs ``algorithm`` on the problem ``key`` for a layer (one per registry generation): its native
    executable where it has one (``runtime.prepare``; refused for now: a ``NativeRunner`` that asks again on each
    call), else the ``Runner`` of the Python algorithm."""
    return _runner(key, algorithm, generation(), settings.native)


def compute(a: torch.Tensor, b: torch.Tensor, key: str, algorithm: str) -> torch.Tensor:
    """Run ``algorithm`` on the problem ``key`` with operands (a, b); a new result tensor."""
    return runner(key, algorithm)(a, b)


class Call:
    """What a tuned layer runs: the forward problem's key and an algorithm per direction, with their runners.

    The runners are looked up on first use and again when the registry changes.
    """

    __slots__ = ("key", "fwd", "bwd_data", "bwd_filter", "_runners")

    def __init__(self, key: str, fwd: str, bwd_data: str = "", bwd_filter: str = "") -> None:
        self.key, self.fwd, self.bwd_data, self.bwd_filter = key, fwd, bwd_data, bwd_filter
        self._runners: dict[str, Runner | NativeRunner] = {}

    def __repr__(self) -> str:
        return f"Call({self.key!r}, fwd={self.fwd!r}, bwd_data={self.bwd_data!r}, bwd_filter={self.bwd_filter!r})"

    def __reduce__(self):
        # Copies and pickles carry the names, not the runners: those hold algorithms (a cuDNN execution plan
        # holds its graph and a lock) and are looked up again where the copy runs.
        return Call, self.names()

    def runner(self, direction: str) -> Runner | NativeRunner:
        r = self._runners.get(direction)
        if r is None or r.generation != generation():
            key = self.key if direction == "fwd" else key_for(self.key, direction)
            r = self._runners[direction] = runner(key, getattr(self, direction))
        return r

    def names(self) -> tuple[str, str, str, str]:
        """The op's arguments: (key, fwd, bwd_data, bwd_filter)."""
        return self.key, self.fwd, self.bwd_data, self.bwd_filter


# The operators, defined through torch.library's low-level API: a call goes from the dispatcher
# straight to the kernel below (torch.library.custom_op's wrapper adds checks that cost ~5 us per
# call on a fast host: bench/results/tuning_cost_cpu.md in git history). pt2_compliant: they take and return plain
# dense tensors and mutate nothing, so torch.compile may trace them.
_LIB = torch.library.Library("convtune", "FRAGMENT")  # the C++ extension adds tuned_conv and tuned_run
_TAGS = (torch.Tag.pt2_compliant_tag,)
_LIB.define("run(Tensor a, Tensor b, str key, str algorithm) -> Tensor", tags=_TAGS)
_LIB.define("conv(Tensor x, Tensor w, str key, str fwd, str bwd_data, str bwd_filter) -> Tensor", tags=_TAGS)


def _run_kernel(a: torch.Tensor, b: torch.Tensor, key: str, algorithm: str) -> torch.Tensor:
    """One direction of the problem ``key`` by ``algorithm``: fwd (x, w), bwd_data (dy, w), bwd_filter (x, dy)."""
    return runner(key, algorithm)(a, b)


def _conv_kernel(x: torch.Tensor, w: torch.Tensor, key: str, fwd: str, bwd_data: str, bwd_filter: str) -> torch.Tensor:
    """The forward convolution ``key`` by ``fwd``; differentiable through ``bwd_data`` and ``bwd_filter``."""
    return runner(key, fwd)(x, w)


def _run_fake(a: torch.Tensor, b: torch.Tensor, key: str, algorithm: str) -> torch.Tensor:
    return _result_like(problem_of(key), a)


def _conv_fake(x: torch.Tensor, w: torch.Tensor, key: str, fwd: str, bwd_data: str, bwd_filter: str) -> torch.Tensor:
    return _result_like(problem_of(key), x)


_LIB.impl("run", _run_kernel, "CompositeExplicitAutograd")
_LIB.impl("conv", _conv_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("convtune::run", _run_fake, lib=_LIB)
torch.library.register_fake("convtune::conv", _conv_fake, lib=_LIB)
run = torch.ops.convtune.run.default
conv = torch.ops.convtune.conv.default


def _setup_context(ctx, inputs, output) -> None:
    x, w, key, fwd, bwd_data, bwd_filter = inputs
    ctx.save_for_backward(x, w)
    ctx.call = Call(key, fwd, bwd_data, bwd_filter)


def _gradients(ctx, dy: torch.Tensor, run_one) -> tuple:
    """(dx, dw, None...) of a conv call saved in ``ctx``; ``run_one(call, direction, a, b)`` computes each."""
    x, w = ctx.saved_tensors
    call = ctx.call
    # Autograd hands over whatever strides the consumer produced; the algorithms want the layout.
    dy = to_layout(dy, problem_of(call.key).layout)
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = run_one(call, "bwd_data", dy, w)
    if ctx.needs_input_grad[1]:
        dw = run_one(call, "bwd_filter", x, dy)
    return dx, dw, None, None, None, None


def _run_op(call: Call, direction: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Through the op, so that torch.compile traces the backward too.
    return run(a, b, key_for(call.key, direction), getattr(call, direction))


def _run_eager(call: Call, direction: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return call.runner(direction)(a, b)


def _backward(ctx, dy: torch.Tensor):
    return _gradients(ctx, dy, _run_op)


torch.library.register_autograd("convtune::conv", _backward, setup_context=_setup_context, lib=_LIB)


class _EagerConv(torch.autograd.Function):
    """``convtune::conv`` for eager calls: the same computation and gradients without the dispatcher.

    An op call passes the dispatcher twice (autograd, then the kernel), which costs more host time
    than a small layer's kernel takes on a data-centre GPU (bench/results/tuning_cost.md at revision
    bcebd49, in git history); eager code runs the layer's ``Call`` directly through this Function.
    Compiled code keeps the op, which torch.compile can trace.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, call: Call) -> torch.Tensor:  # type: ignore[override]
        # The ctx-taking form: a separate setup_context would bind the arguments by signature on every call.
        ctx.save_for_backward(x, w)
        ctx.call = call
        return call.runner("fwd")(x, w)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: the gradients' own gradients, which nothing here computes
            raise NotImplementedError(f"{ctx.call.key}: convtune's Python path has no derivative of its gradients, "
                                      f"so a tuned layer has no double backward (create_graph=True); run that model "
                                      f"on torch's convolutions")
        return _gradients(ctx, dy, _run_eager)[:3]


def conv_call(x: torch.Tensor, w: torch.Tensor, call: Call) -> torch.Tensor:
    """``torch.ops.convtune.conv(x, w, *call.names())`` under torch.compile; in eager code the same
    computation without the dispatcher."""
    if torch.compiler.is_compiling():
        return conv(x, w, *call.names())
    return _EagerConv.apply(x, w, call)
