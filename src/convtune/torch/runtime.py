"""The native runtime's control plane: an executable per (problem, algorithm), known by an integer handle.

``executable(problem, algorithm)`` makes (once per process) the C++ executable that computes what
``algorithm`` computes on ``problem``, as the algorithm's ``native_recipe`` describes, and returns
its handle; the ops ``torch.ops.convtune.tuned_conv`` and ``tuned_run`` (``convtune/csrc/ops.cpp``)
run it. A handle is a hash of everything the executable is made from, so the same choice gets the
same handle in every process: code that torch.compile cached in one process names the right
executable in the next, once the layers are tuned there. An algorithm without a recipe (one of
convtune's Python algorithms) raises ``NotNative``; its layer runs on the Python path.

    >>> import convtune as ct
    >>> p = ct.ConvProblem("fwd", n=1, c=2, k=3, input_size=(5, 5), kernel_size=3, padding=1)
    >>> if available():
    ...     h = executable(p, ct.get_algorithm("torch:native", p))
    ...     x, w = p.random_inputs()
    ...     assert torch.ops.convtune.tuned_run(x, w, h).shape == (1, 3, 5, 5)
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from convtune import extension
from convtune.algorithms.base import Algorithm
from convtune.problem import ConvProblem, empty_in_layout

DIRECTION_INDEX = {"fwd": 0, "bwd_data": 1, "bwd_filter": 2}


class NotNative(Exception):
    """The algorithm (or this build) has no native executable for the problem; the message says why."""


def available() -> bool:
    """Whether the C++ extension is loaded (built on first call; False, warned once, when it cannot be)."""
    return extension.load() is not None


def handle_of(description: str) -> int:
    """The handle of the executable made from ``description``: a positive 63-bit hash, never 0 (0 means none)."""
    digest = int.from_bytes(hashlib.blake2b(description.encode(), digest_size=8).digest(), "little")
    return (digest >> 1) | 1


def _strides(problem: ConvProblem, shape: tuple[int, ...]) -> list[int]:
    return list(empty_in_layout(shape, problem.layout, problem.torch_dtype, "meta").stride())


def _geometry(module: Any, problem: ConvProblem, algorithm: Algorithm) -> Any:
    shapes = [list(s) for s in problem.operand_shapes]
    return module.geometry(
        direction=DIRECTION_INDEX[problem.direction], dtype=problem.dtype, device=problem.device,
        channels_last=problem.layout == "channels_last", allow_tf32=problem.allow_tf32, groups=problem.groups,
        stride=list(problem.stride), padding=list(problem.padding), dilation=list(problem.dilation), shapes=shapes,
        strides=[_strides(problem, s) for s in problem.operand_shapes],
        label=f"convtune:{problem.key} by {algorithm.name}")


def executable(problem: ConvProblem, algorithm: Algorithm, device: torch.device | None = None) -> int:
    """The handle of the native executable of ``algorithm`` on ``problem`` (made on first call).

    device: for a cuDNN plan, the CUDA device it is built for (None: the current one).
    Raises ``NotNative`` when the extension is not loaded, the algorithm has no recipe, or this
    build cannot make it (a cuDNN plan in a build without cuDNN); ``RuntimeError`` when cuDNN
    refuses to build the tuned plan.
    """
    module = extension.load()
    if module is None:
        raise NotNative(f"convtune's C++ extension is not available ({extension.status()['error'] or 'disabled'})")
    recipe = algorithm.native_recipe(problem)
    if recipe is None:
        raise NotNative(f"{algorithm.name} runs in Python only (it has no native executable)")
    options = dict(recipe.options)
    if recipe.kind == "cudnn":
        if not module.with_cudnn():
            raise NotNative(f"{algorithm.name}: this build of the extension has no cuDNN (its headers were not found "
                            f"when it was built); set CONVTUNE_CUDNN_HOME and run `convtune native --rebuild`")
        index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        options["device_index"] = index
    description = f"{problem.key}|{algorithm.name}|{recipe.kind}|{sorted(options.items())}"
    handle = handle_of(description)
    if module.has(handle):
        return handle
    geometry = _geometry(module, problem, algorithm)
    if recipe.kind == "native":
        module.add_native(handle, description, geometry)
    elif recipe.kind in ("gemm_1x1", "gemm_1x1_strided"):
        buffers = [(b.name, list(b.shape), str(b.dtype).removeprefix("torch.")) for b in algorithm.buffers(problem)]
        module.add_gemm_1x1(handle, description, geometry, recipe.kind == "gemm_1x1_strided", buffers)
    elif recipe.kind == "cudnn":
        module.add_cudnn(handle, description, geometry, options["device_index"], [list(s) for s in options["shapes"]],
                         [list(s) for s in options["strides"]], list(options["stride"]), list(options["padding"]),
                         list(options["dilation"]), options["tag"])
    else:
        raise NotNative(f"{algorithm.name}: no native executable of kind {recipe.kind!r} in this version")
    return handle


def tuned_conv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, handles: tuple[int, int, int]) -> torch.Tensor:
    """``torch.ops.convtune.tuned_conv(x, w, bias, *handles)``: a layer's forward, differentiable."""
    return torch.ops.convtune.tuned_conv.default(x, w, bias, *handles)
