"""torch:native: PyTorch's own convolution and ``aten.convolution_backward``, the reference path.

PyTorch manages this path's workspace itself (oneDNN on the CPU, cuDNN on CUDA), so its declared
workspace is zero: that memory is not convtune's to carve or count.
"""

from __future__ import annotations

import contextlib

import torch

from .. import tf32
from ..costmodel import Cost, gemm_dims, shape_factor
from ..problem import ConvProblem, empty_in_layout, pytorch_deterministic, to_layout
from .base import Algorithm, NativeRecipe, NumericNotes
from .registry import register


def native_conv(problem: ConvProblem, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The result of ``problem`` on operands (a, b) through PyTorch's own kernels, freshly allocated.

    The operands' dtype rules, not the problem's: the float64 reference runs through here too.
    """
    nd = problem.ndim
    args = dict(stride=list(problem.stride), padding=list(problem.padding), dilation=list(problem.dilation),
                transposed=False, output_padding=[0] * nd, groups=problem.groups)
    cudnn = torch.backends.cudnn
    # The usual case: no switching per call. cuDNN's flags are the process's: never switched where it is not used.
    as_set = not a.is_cuda or (cudnn.enabled and tf32.conv_allowed() == problem.allow_tf32)
    flags = contextlib.nullcontext() if as_set else tf32.cudnn_conv(problem.allow_tf32)
    if _bfloat16_on_cpu(a):
        return native_conv(problem, a.float(), b.float()).to(torch.bfloat16)  # rounded once, at the end
    with flags:
        if problem.direction == "fwd":
            return torch.ops.aten.convolution(a, b, None, **args)
        if problem.direction == "bwd_data":
            x = empty_in_layout(problem.x_shape, problem.layout, a.dtype, a.device)
            dx, _, _ = torch.ops.aten.convolution_backward(a, x, b, None, **args, output_mask=[True, False, False])
            return dx
        w = empty_in_layout(problem.w_shape, problem.layout, a.dtype, a.device)
        _, dw, _ = torch.ops.aten.convolution_backward(b, a, w, None, **args, output_mask=[False, True, False])
        return dw


def wrong_in_pytorch(problem: ConvProblem) -> bool:
    """Whether PyTorch's own kernels may compute ``problem`` wrongly (``_bfloat16_on_cpu``): a layer that chose
    torch:native in every direction then runs it through convtune's op, which computes it right, rather
    than through PyTorch's call."""
    return problem.device == "cpu" and problem.dtype == "bfloat16"


def _bfloat16_on_cpu(x: torch.Tensor) -> bool:
    """Whether PyTorch's CPU kernels may compute these operands wrongly: bfloat16 on the CPU.

    There (PyTorch 2.13 at least) ``aten.convolution_backward`` leaves garbage in weight taps that a
    stride lets touch only padding (input 1 wide, kernel 3, stride 2, padding 1, say), in channels_last
    and, on some CPUs, in channels_first too (a tensor dense in both orders, size-1 spatial dimensions,
    takes the channels_last kernels); and ``aten.convolution`` of a grouped 3-D problem whose input is
    1x1x1 under a 3x3x3 kernel is off by 5-50 % in channels_last. The float32 kernels are right, and
    convtune's CPU algorithms compute half precision in float32 anyway (``NumericNotes.float32_inside``):
    so does torch:native, rounding once at the end.
    """
    return x.device.type == "cpu" and x.dtype == torch.bfloat16


class Native(Algorithm):
    """PyTorch's convolution: oneDNN or its own kernels on the CPU, cuDNN's heuristics on CUDA."""

    name = "torch:native"

    def native_recipe(self, problem: ConvProblem) -> NativeRecipe:
        return NativeRecipe("native")

    def cost(self, problem: ConvProblem, workspace_bytes: int) -> Cost:
        # On the CPU the measured 'peak' is one 512^3 product; oneDNN's convolutions reach about it.
        # A second operation: the copy into a caller's output that ``run`` makes. A tuned layer and find's
        # timing take PyTorch's result as it is (``execute``); the term stays in the analytic price, which the
        # database's corrections and get's learned model are fitted against.
        efficiency = 0.6 if problem.device == "cuda" else 0.9
        return Cost(problem.flops, efficiency * shape_factor(*gemm_dims(problem)), problem.min_bytes, 2,
                    composed=False)

    def is_deterministic(self, problem: ConvProblem) -> bool:
        # cuDNN's heuristics may pick atomics-based backward kernels unless PyTorch is told not to
        return problem.device == "cpu" or problem.direction == "fwd" or pytorch_deterministic()

    def tf32_settings(self, problem: ConvProblem) -> tf32.Settings:
        return tf32.Settings(conv=problem.allow_tf32)  # (native_conv switches only where the process's differ)

    def notes(self, problem: ConvProblem) -> NumericNotes:
        half = problem.dtype != "float32"
        if problem.device == "cuda":
            return NumericNotes(tensor_cores=half or problem.allow_tf32, tf32=not half and problem.allow_tf32)
        return NumericNotes(float32_inside=half)

    def execute(self, problem, a, b, out, ws):
        # PyTorch allocates the result itself: hand that over rather than copy it into ``out``.
        return to_layout(native_conv(problem, a, b), problem.layout)

    def _run(self, problem, a, b, out, ws) -> None:
        out.copy_(self.execute(problem, a, b, out, ws))  # a direct call of _run too leaves the result in ``out``


register(Native())
