"""The custom operators through which tuned convolutions run, so torch.compile traces them.

``convtune::conv(x, w, key, fwd, bwd_data, bwd_filter) -> y`` is the forward convolution of the
problem ``key`` (a ``ConvProblem.key`` of direction fwd) by the algorithm named ``fwd``. It is
differentiable: its backward runs ``convtune::run`` for bwd_data (when x needs a gradient) and
bwd_filter (when w does) with the algorithms named for them. ``convtune::run(a, b, key, algorithm)``
computes one direction of one problem, the direction the key names; it has no backward of its
own, so double backward (``create_graph=True``) is not supported.

Operands must be dense in the problem's layout (the modules convert them); the result is too.
Each op has a fake implementation (shapes and strides from the key) for tracing, and takes its
workspace from ``convtune.torch.workspace``, so a run allocates nothing but its output.

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
from typing import NamedTuple

import torch

from convtune.algorithms.base import OPERAND_NAMES, Algorithm, Buffer, buffers_bytes, carve, check_tensor
from convtune.algorithms.registry import generation, get_algorithm
from convtune.problem import ConvProblem, empty_in_layout, to_layout
from convtune.torch import workspace


LABEL_PREFIX, LABEL_SEP = "convtune:", " by "  # profiler ranges: 'convtune:<problem key> by <algorithm>'


@functools.lru_cache(maxsize=4096)
def problem_of(key: str) -> ConvProblem:
    """The problem of ``key`` (parsed once: ops are called with the same keys over and over)."""
    return ConvProblem.from_key(key)


@functools.lru_cache(maxsize=4096)
def key_for(key: str, direction: str) -> str:
    """The key of the same convolution in another direction."""
    return problem_of(key).with_direction(direction).key


class _Runner(NamedTuple):
    """What running one algorithm on one problem takes, looked up once (ops run every step)."""

    problem: ConvProblem
    algorithm: Algorithm
    operands: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (shape, dense strides) of a and b
    workspace_bytes: int
    buffers: tuple[Buffer, ...]

    def fits(self, t: torch.Tensor, index: int) -> bool:
        """The quick check of an operand: shape, dtype, device and strides as expected."""
        shape, stride = self.operands[index]
        return (t.shape == shape and t.dtype == self.problem.torch_dtype and t.device.type == self.problem.device
                and t.stride() == stride)


@functools.lru_cache(maxsize=4096)
def _runner(key: str, algorithm: str, generation: int) -> _Runner:
    # generation: the registry's, so a re-registered name is looked up again.
    problem = problem_of(key)
    if not algorithm:
        raise ValueError(f"no algorithm was chosen for {key}; tune the layer (convtune.optimize) "
                         f"or name one of convtune.algorithms(problem)")
    algo = get_algorithm(algorithm, problem)
    support = algo.supports(problem)
    if not support:
        raise ValueError(f"{algorithm} does not support {key}: {support.reason}")
    operands = tuple(_dense(problem, shape) for shape in problem.operand_shapes[:2])
    buffers = tuple(algo.buffers(problem))
    return _Runner(problem, algo, operands, buffers_bytes(buffers), buffers)


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


def compute(a: torch.Tensor, b: torch.Tensor, key: str, algorithm: str) -> torch.Tensor:
    """Run ``algorithm`` on the problem ``key`` with operands (a, b); a new result tensor."""
    r = _runner(key, algorithm, generation())
    problem = r.problem
    if not (r.fits(a, 0) and r.fits(b, 1)):  # the full check, with its error, only when the quick one fails
        for name, t, (shape, _) in zip(OPERAND_NAMES[problem.direction], (a, b), r.operands):
            check_tensor(problem, name, t, shape)
    out = _result_like(problem, a)
    # The algorithm computes in the problem's dtype: an autocast region around the model must not
    # recast the matmuls inside it. Under the profiler each run is a range named after its problem
    # and algorithm, so a trace tells which layer ran what (bench/e2e.py reads them).
    with contextlib.ExitStack() as scope:
        if a.device.type == "cuda" and a.device.index != torch.cuda.current_device():
            scope.enter_context(torch.cuda.device(a.device))
        if torch.is_autocast_enabled(a.device.type):
            scope.enter_context(torch.autocast(a.device.type, enabled=False))
        if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
            scope.enter_context(torch.profiler.record_function(f"{LABEL_PREFIX}{key}{LABEL_SEP}{algorithm}"))
        ws = workspace.get(r.workspace_bytes, a.device)
        return r.algorithm.execute(problem, a, b, out, carve(ws, r.buffers))


@torch.library.custom_op("convtune::run", mutates_args=())
def run(a: torch.Tensor, b: torch.Tensor, key: str, algorithm: str) -> torch.Tensor:
    """One direction of the problem ``key`` by ``algorithm``: fwd (x, w), bwd_data (dy, w), bwd_filter (x, dy)."""
    return compute(a, b, key, algorithm)


@run.register_fake
def _run_fake(a: torch.Tensor, b: torch.Tensor, key: str, algorithm: str) -> torch.Tensor:
    return _result_like(problem_of(key), a)


@torch.library.custom_op("convtune::conv", mutates_args=())
def conv(x: torch.Tensor, w: torch.Tensor, key: str, fwd: str, bwd_data: str, bwd_filter: str) -> torch.Tensor:
    """The forward convolution ``key`` by ``fwd``; differentiable through ``bwd_data`` and ``bwd_filter``."""
    return compute(x, w, key, fwd)


@conv.register_fake
def _conv_fake(x: torch.Tensor, w: torch.Tensor, key: str, fwd: str, bwd_data: str, bwd_filter: str) -> torch.Tensor:
    return _result_like(problem_of(key), x)


def _setup_context(ctx, inputs, output) -> None:
    x, w, key, _, bwd_data, bwd_filter = inputs
    ctx.save_for_backward(x, w)
    ctx.key, ctx.bwd_data, ctx.bwd_filter = key, bwd_data, bwd_filter


def _gradients(ctx, dy: torch.Tensor, run_one) -> tuple:
    """(dx, dw, None...) of a conv call saved in ``ctx``; ``run_one(a, b, key, algorithm)`` computes each."""
    x, w = ctx.saved_tensors
    # Autograd hands over whatever strides the consumer produced; the algorithms want the layout.
    dy = to_layout(dy, problem_of(ctx.key).layout)
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = run_one(dy, w, key_for(ctx.key, "bwd_data"), ctx.bwd_data)
    if ctx.needs_input_grad[1]:
        dw = run_one(x, dy, key_for(ctx.key, "bwd_filter"), ctx.bwd_filter)
    return dx, dw, None, None, None, None


def _backward(ctx, dy: torch.Tensor):
    return _gradients(ctx, dy, run)  # through the op, so that torch.compile traces the backward too


conv.register_autograd(_backward, setup_context=_setup_context)


class _EagerConv(torch.autograd.Function):
    """``convtune::conv`` for eager calls: the same computation and gradients without the dispatcher.

    An op call passes the dispatcher twice (autograd, then the kernel), which costs more host time
    than a small layer's kernel takes on a data-centre GPU (bench/results/tuning_cost.md); eager
    code calls ``compute`` directly through this Function. Compiled code keeps the op, which
    torch.compile can trace.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, key: str, fwd: str, bwd_data: str,  # type: ignore[override]
                bwd_filter: str) -> torch.Tensor:
        # The ctx-taking form: a separate setup_context would bind the arguments by signature on every call.
        _setup_context(ctx, (x, w, key, fwd, bwd_data, bwd_filter), None)
        return compute(x, w, key, fwd)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        return _gradients(ctx, dy, compute)


def conv_call(x: torch.Tensor, w: torch.Tensor, key: str, fwd: str, bwd_data: str, bwd_filter: str) -> torch.Tensor:
    """``torch.ops.convtune.conv(...)`` under torch.compile, the same without the dispatcher in eager code."""
    if torch.compiler.is_compiling():
        return conv(x, w, key, fwd, bwd_data, bwd_filter)
    return _EagerConv.apply(x, w, key, fwd, bwd_data, bwd_filter)
