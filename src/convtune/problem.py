"""ConvProblem: one convolution, fully described, validated once and hashable.

A problem is its own cache key: ``ConvProblem.from_key(p.key) == p``.

    >>> p = ConvProblem(direction="fwd", n=2, c=8, k=16, input_size=(10, 10), kernel_size=3, padding=1)
    >>> p.output_size, p.flops
    ((10, 10), 460800)
    >>> ConvProblem.from_key(p.key) == p
    True
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from . import tf32
from .errors import check_one_of, not_one_of
from .units import MAX_BYTES

DIRECTIONS = ("fwd", "bwd_data", "bwd_filter")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICES = ("cpu", "cuda")
LAYOUTS = ("channels_first", "channels_last")
_LAYOUT_ALIASES = {
    "channels_first": "channels_first", "nchw": "channels_first", "ncl": "channels_first",
    "ncdhw": "channels_first", "ncw": "channels_first",
    "channels_last": "channels_last", "nhwc": "channels_last", "nlc": "channels_last",
    "ndhwc": "channels_last", "nwc": "channels_last",
}
MAX_DIM = 2**31 - 1  # any size, channel count or batch beyond this is no real convolution (and overflows int32 kernels)
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}


def _tuple(field: str, value: Any, ndim: int, minimum: int) -> tuple[int, ...]:
    """Turn an int or a sequence into a tuple of ``ndim`` ints >= ``minimum``."""
    if isinstance(value, bool):
        raise TypeError(f"ConvProblem.{field} must be an int or a tuple of ints, got {value!r}")
    if isinstance(value, int):
        values = (value,) * ndim
    elif isinstance(value, (str, bytes, dict, set, frozenset)):  # unordered or not numbers: never sizes
        raise TypeError(f"ConvProblem.{field} must be an int or a tuple of ints, got {value!r}")
    else:
        try:
            values = tuple(value)
        except TypeError:
            raise TypeError(f"ConvProblem.{field} must be an int or a tuple of ints, got {value!r}") from None
        if len(values) != ndim:
            raise ValueError(
                f"ConvProblem.{field}={value!r} has {len(values)} dimension(s) but input_size has {ndim}; "
                f"give {ndim} value(s) (1, 2 and 3 spatial dimensions are supported, all fields alike)"
            )
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"ConvProblem.{field} must hold ints, got {value!r}")
        if v < minimum:
            raise ValueError(f"ConvProblem.{field}={value!r} is invalid: every value must be >= {minimum}")
        if v > MAX_DIM:
            raise ValueError(f"ConvProblem.{field}={value!r} is invalid: every value must be <= {MAX_DIM}")
    return values


def _positive_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ConvProblem.{field} must be an int, got {value!r}")
    if not 1 <= value <= MAX_DIM:
        raise ValueError(f"ConvProblem.{field}={value} is invalid: it must be >= 1 and <= {MAX_DIM}")
    return value


def normalize_dtype(value: Any) -> str:
    """'float16', torch.float16, 'fp16' and 'half' all give 'float16'."""
    if isinstance(value, torch.dtype):
        for name, dtype in DTYPES.items():
            if dtype == value:
                return name
        raise not_one_of("dtype", value, DTYPES)
    if isinstance(value, str):
        name = _DTYPE_ALIASES.get(value.lower(), value.lower())
        if name in DTYPES:
            return name
    raise not_one_of("dtype", value, DTYPES)


def normalize_layout(value: Any) -> str:
    if isinstance(value, str) and value.lower() in _LAYOUT_ALIASES:
        return _LAYOUT_ALIASES[value.lower()]
    raise ValueError(
        f"layout={value!r} is not supported; use 'channels_first' (NCHW, NCL, NCDHW) "
        f"or 'channels_last' (NHWC, NLC, NDHWC)"
    )


def normalize_device(value: Any) -> str:
    if isinstance(value, torch.device):
        value = value.type
    if isinstance(value, str):
        kind, _, index = value.lower().partition(":")
        if kind in DEVICES and (not index or index.isdigit()):  # 'cuda:1' names a device; 'cpu:x' nothing
            return kind
    raise ValueError(f"device={value!r} is not supported; use 'cpu' or 'cuda' (or 'cuda:N')")


def pytorch_deterministic() -> bool:
    """Whether PyTorch is asked for deterministic algorithms now (``torch.use_deterministic_algorithms``, warn_only
    too, or ``torch.backends.cudnn.deterministic``): its convolutions then ask cuDNN for deterministic ones."""
    return torch.are_deterministic_algorithms_enabled() or bool(torch.backends.cudnn.deterministic)


@dataclasses.dataclass(frozen=True)
class ConvProblem:
    """One convolution: direction, shapes, dtype, layout and device.

    Raises ``ValueError``/``TypeError`` naming the field, the value and what is allowed.
    """

    direction: str
    n: int
    c: int
    k: int
    # Annotated with the types __post_init__ normalises to; what the constructor accepts is
    # spelled out for the type checker by the __init__ signature below.
    input_size: tuple[int, ...]
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...] = cast("tuple[int, ...]", 1)  # an int default, made a tuple by __post_init__
    padding: tuple[int, ...] = cast("tuple[int, ...]", 0)  # an int default, made a tuple by __post_init__
    dilation: tuple[int, ...] = cast("tuple[int, ...]", 1)  # an int default, made a tuple by __post_init__
    groups: int = 1
    dtype: str = "float32"
    layout: str = "channels_first"
    device: str = "cpu"
    allow_tf32: bool = True

    if TYPE_CHECKING:
        # The signature dataclasses generates at runtime, with the inputs __post_init__ accepts.
        def __init__(
            self, direction: str, n: int, c: int, k: int, input_size: int | Sequence[int],
            kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
            dilation: int | Sequence[int] = 1, groups: int = 1, dtype: str | torch.dtype = "float32",
            layout: str = "channels_first", device: str | torch.device = "cpu", allow_tf32: bool = True,
        ) -> None: ...

    def __post_init__(self) -> None:
        check_one_of("direction", self.direction, DIRECTIONS)
        for name in ("n", "c", "k", "groups"):
            _positive_int(name, getattr(self, name))
        size = self.input_size
        if isinstance(size, int) and not isinstance(size, bool):
            size = (size,)
        if isinstance(size, (str, bytes)) or not hasattr(size, "__len__"):
            raise TypeError(f"ConvProblem.input_size must be a tuple of 1 to 3 ints, got {self.input_size!r}")
        ndim = len(size)
        if ndim not in (1, 2, 3):
            raise ValueError(f"ConvProblem.input_size={self.input_size!r} has {ndim} dimensions; use 1, 2 or 3")
        set_ = object.__setattr__
        set_(self, "input_size", _tuple("input_size", size, ndim, 1))
        set_(self, "kernel_size", _tuple("kernel_size", self.kernel_size, ndim, 1))
        set_(self, "stride", _tuple("stride", self.stride, ndim, 1))
        set_(self, "padding", _tuple("padding", self.padding, ndim, 0))
        set_(self, "dilation", _tuple("dilation", self.dilation, ndim, 1))
        set_(self, "dtype", normalize_dtype(self.dtype))
        set_(self, "layout", normalize_layout(self.layout))
        set_(self, "device", normalize_device(self.device))
        if not isinstance(self.allow_tf32, bool):
            raise TypeError(f"ConvProblem.allow_tf32 must be a bool, got {self.allow_tf32!r}")
        for name, channels in (("c", self.c), ("k", self.k)):
            if channels % self.groups:
                raise ValueError(
                    f"ConvProblem.{name}={channels} is not divisible by groups={self.groups}; "
                    f"channels must be a multiple of groups"
                )
        for i, (h, r, p, d) in enumerate(zip(self.input_size, self.kernel_size, self.padding, self.dilation)):
            if d * (r - 1) + 1 > h + 2 * p:
                raise ValueError(
                    f"ConvProblem.kernel_size={self.kernel_size} with dilation={self.dilation} spans "
                    f"{d * (r - 1) + 1} in dimension {i}, more than the padded input_size "
                    f"{h} + 2*{p} = {h + 2 * p}; use a smaller kernel or dilation, or more padding"
                )
        for operand, shape in (("input", self.x_shape), ("weight", self.w_shape), ("output", self.y_shape)):
            nbytes = math.prod(shape) * self.element_bytes
            if nbytes > MAX_BYTES:  # no device allocates it, and byte offsets into it overflow int64
                raise ValueError(f"ConvProblem's {operand} {shape} in {self.dtype} takes {nbytes} bytes, more than "
                                 f"any tensor can ({MAX_BYTES}, 8 EiB); use smaller sizes")
        # the cached sizes computed now (the output's above), not on a first read in code Dynamo traces: there, on
        # Python 3.11, the cache's lock is a context manager it cannot trace
        for name in ("flops", "min_bytes"):
            getattr(self, name)

    # -- shapes -------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Number of spatial dimensions (1, 2 or 3)."""
        return len(self.input_size)

    @functools.cached_property  # a frozen problem's sizes never change: the cost model asks per candidate
    def output_size(self) -> tuple[int, ...]:
        return tuple(
            (h + 2 * p - d * (r - 1) - 1) // s + 1
            for h, r, s, p, d in zip(self.input_size, self.kernel_size, self.stride, self.padding, self.dilation)
        )

    @property
    def x_shape(self) -> tuple[int, ...]:
        return (self.n, self.c, *self.input_size)

    @property
    def w_shape(self) -> tuple[int, ...]:
        return (self.k, self.c // self.groups, *self.kernel_size)

    @property
    def y_shape(self) -> tuple[int, ...]:
        return (self.n, self.k, *self.output_size)

    @property
    def operand_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(a, b, result) shapes: fwd (x, w) -> y; bwd_data (dy, w) -> dx; bwd_filter (x, dy) -> dw."""
        x, w, y = self.x_shape, self.w_shape, self.y_shape
        return {"fwd": (x, w, y), "bwd_data": (y, w, x), "bwd_filter": (x, y, w)}[self.direction]

    # -- costs ---------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_bytes(self) -> int:
        return self.torch_dtype.itemsize

    @functools.cached_property
    def flops(self) -> int:
        """2·N·K·(output positions)·(C/groups)·(kernel taps); the same for every direction."""
        return 2 * self.n * self.k * math.prod(self.output_size) * (self.c // self.groups) * math.prod(self.kernel_size)

    @functools.cached_property
    def min_bytes(self) -> int:
        """Compulsory traffic: every element of input, filter and output moved once."""
        return self.element_bytes * sum(math.prod(s) for s in (self.x_shape, self.w_shape, self.y_shape))

    @property
    def is_1x1(self) -> bool:
        return all(r == 1 for r in self.kernel_size)

    # -- identity ------------------------------------------------------------------------
    @functools.cached_property  # a frozen problem's key never changes; databases ask for it on every row
    def key(self) -> str:
        """A stable string that identifies the problem; ``from_key`` inverts it."""
        def dims(t: tuple[int, ...]) -> str:
            return "x".join(map(str, t))

        return (
            f"{self.direction}|n{self.n}|c{self.c}|k{self.k}|in{dims(self.input_size)}|r{dims(self.kernel_size)}"
            f"|s{dims(self.stride)}|p{dims(self.padding)}|d{dims(self.dilation)}|g{self.groups}"
            f"|{self.dtype}|{self.layout}|{self.device}|tf32={int(self.allow_tf32)}"
        )

    _KEY = re.compile(  # (matched whole, in ASCII: '$' would let a newline end it, '\d' other scripts' digits)
        r"(?P<direction>\w+)\|n(?P<n>\d+)\|c(?P<c>\d+)\|k(?P<k>\d+)\|in(?P<input_size>[\dx]+)"
        r"\|r(?P<kernel_size>[\dx]+)\|s(?P<stride>[\dx]+)\|p(?P<padding>[\dx]+)\|d(?P<dilation>[\dx]+)"
        r"\|g(?P<groups>\d+)\|(?P<dtype>\w+)\|(?P<layout>\w+)\|(?P<device>\w+)\|tf32=(?P<allow_tf32>[01])",
        re.ASCII,
    )

    @classmethod
    def from_key(cls, key: str) -> ConvProblem:
        """Rebuild a problem from its ``key``; a malformed key raises ``ValueError``.

        Parsed once per key (a warm start asks for the same keys many times); problems are immutable,
        so every caller may share the one made.
        """
        if cls is ConvProblem and isinstance(key, str):
            return _from_key(key)
        return cls._parse_key(key)

    @classmethod
    def _parse_key(cls, key: str) -> ConvProblem:
        match = cls._KEY.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            shown = key[:200] if isinstance(key, str) else key
            raise ValueError(f"{shown!r} is not a ConvProblem key (expected the form of ConvProblem.key)")
        f = match.groupdict()
        try:
            spatial = {name: tuple(int(v) for v in f[name].split("x"))
                       for name in ("input_size", "kernel_size", "stride", "padding", "dilation")}
            n, c, k, groups = (int(f[name]) for name in ("n", "c", "k", "groups"))
        except ValueError:  # (an empty size, or one of more digits than int() reads)
            raise ValueError(f"{key[:200]!r} is not a ConvProblem key: malformed numbers") from None
        return cls(
            direction=f["direction"], n=n, c=c, k=k, groups=groups,
            dtype=f["dtype"], layout=f["layout"], device=f["device"], allow_tf32=f["allow_tf32"] == "1",
            **spatial,
        )

    def replace(self, **changes: Any) -> ConvProblem:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_direction(self, direction: str) -> ConvProblem:
        """The same convolution in another direction (nothing else changes, so nothing else is checked again)."""
        if direction == self.direction:
            return self
        check_one_of("direction", direction, DIRECTIONS)
        other = copy.copy(self)
        other.__dict__.pop("key", None)  # the cached key names the direction
        object.__setattr__(other, "direction", direction)
        return other

    def __str__(self) -> str:
        return self.key

    # -- construction from PyTorch --------------------------------------------------------
    @classmethod
    def from_module(cls, module: torch.nn.Module, input_shape: tuple[int, ...], direction: str = "fwd",
                    *, dtype: Any = None, layout: str = "channels_first", device: Any = None,
                    allow_tf32: bool | None = None) -> ConvProblem:
        """The problem that ``module`` (an ``nn.Conv1d/2d/3d``) solves on an input of ``input_shape``.

        ``input_shape`` includes the batch: (N, C, *spatial). dtype and device default to the
        module's weight. A ``padding_mode`` other than zeros, and ``padding='same'`` with an odd
        total, pad the input explicitly first (as PyTorch does), so the problem sees the padded size.

            >>> conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
            >>> ConvProblem.from_module(conv, (4, 3, 32, 32)).output_size
            (16, 16)
        """
        conv_types = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
        if not isinstance(module, conv_types) or isinstance(module, torch.nn.modules.conv._ConvTransposeNd):
            raise TypeError(
                f"from_module needs an nn.Conv1d, nn.Conv2d or nn.Conv3d, got {type(module).__name__}"
            )
        ndim = module.weight.dim() - 2
        if isinstance(input_shape, torch.Tensor):  # a tensor, not its shape: said in one line, not printed whole
            raise TypeError(f"from_module takes the input's shape, got a tensor of shape {tuple(input_shape.shape)}: "
                            f"pass x.shape")
        input_shape = tuple(input_shape)
        if len(input_shape) != ndim + 2:
            raise ValueError(
                f"input_shape={input_shape} does not fit {type(module).__name__}: give (N, C, {ndim} spatial size(s))"
            )
        weight = module.weight  # torch computes with the weight as it is, whatever the module's attributes say
        if weight.shape[1] * module.groups != input_shape[1]:
            raise ValueError(
                f"input_shape={input_shape} has {input_shape[1]} channels but the module's weight of shape "
                f"{tuple(weight.shape)} in {module.groups} group(s) takes {weight.shape[1] * module.groups}"
            )
        spatial = list(input_shape[2:])
        padding = explicit_padding(module)
        if module.padding_mode != "zeros" or any(lo != hi for lo, hi in padding):
            # PyTorch pads explicitly here; the convolution itself then pads symmetrically.
            sym = [lo if module.padding_mode == "zeros" else 0 for lo, hi in padding]
            spatial = [h + lo + hi - 2 * s for h, (lo, hi), s in zip(spatial, padding, sym)]
            pad = tuple(sym)
        else:
            pad = tuple(lo for lo, _ in padding)
        return cls(
            direction=direction, n=input_shape[0], c=input_shape[1], k=weight.shape[0],
            input_size=tuple(spatial), kernel_size=tuple(weight.shape[2:]), stride=per_dimension(module.stride, ndim),
            padding=pad, dilation=per_dimension(module.dilation, ndim), groups=module.groups,
            dtype=dtype if dtype is not None else weight.dtype,
            layout=layout, device=device if device is not None else weight.device,
            allow_tf32=tf32.conv_allowed() if allow_tf32 is None else allow_tf32,
        )

    # -- tensors ---------------------------------------------------------------------------
    def require_device(self, who: str) -> None:
        """Raise ``ValueError`` naming ``who`` (what was asked) where this problem's device is not here: a CUDA
        problem where PyTorch sees no CUDA device (``get`` still ranks it, running nothing)."""
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{who}: {self.key} is a CUDA problem, but PyTorch sees no CUDA device here; run it "
                             f"where there is one, or give device='cpu' (convtune.get ranks it without running "
                             f"anything)")

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised tensor of logical ``shape`` in this problem's layout, dtype and device."""
        return empty_in_layout(shape, self.layout, dtype or self.torch_dtype, self.device)

    def random_inputs(self, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The two operands of this direction, random normal (never zeros), in the problem's layout.

        Drawn on the problem's device (a seed gives the same values on every run there; CPU and
        CUDA draw different ones): drawing a batch-128 ResNet-50 layer's operands on the host and
        copying them over took 0.2-0.7 s on the GPU machine, on the GPU a few milliseconds
        (bench/results/tuning_cost_v2.md against tuning_cost.md, at revision bcebd49, in git history).
        """
        self.require_device("ConvProblem.random_inputs()")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"ConvProblem.random_inputs(seed=...) takes an integer, got {type(seed).__name__} "
                            f"{seed!r}")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        a_shape, b_shape, _ = self.operand_shapes
        out = []
        for shape in (a_shape, b_shape):
            values = torch.randn(shape, generator=gen, dtype=torch.float32, device=self.device)
            t = self.empty(shape)
            t.copy_(values)
            out.append(t)
        return out[0], out[1]


class ConvGeometry(Protocol):
    """What ``explicit_padding`` reads of a conv module (``nn.Conv1d/2d/3d`` have it)."""

    kernel_size: tuple[int, ...]
    dilation: tuple[int, ...]
    padding: str | tuple[int, ...]


def explicit_padding(module: ConvGeometry) -> list[tuple[int, int]]:
    """(before, after) padding per spatial dimension of a conv module, string paddings resolved (from its weight's
    kernel, as torch's functional convolution resolves them, where it has a weight)."""
    weight = getattr(module, "weight", None)
    kernel = tuple(weight.shape[2:]) if isinstance(weight, torch.Tensor) else tuple(module.kernel_size)
    ndim = len(kernel)
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return [(0, 0)] * ndim
        pads = []
        for d, r in zip(per_dimension(module.dilation, ndim), kernel):
            total = d * (r - 1)
            pads.append((total // 2, total - total // 2))
        return pads
    return [(p, p) for p in per_dimension(module.padding, ndim)]


def per_dimension(value: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    """A conv module's stride, padding or dilation as one number a spatial dimension (torch's functional
    convolution takes one number for all of them too)."""
    return (value,) * ndim if isinstance(value, int) else tuple(value)


def layout_order(ndim_total: int, layout: str) -> tuple[int, ...]:
    """Dimension order of memory, outermost first: (0, 1, 2, ...) or (0, 2, ..., 1)."""
    if layout == "channels_last":
        return (0, *range(2, ndim_total), 1)
    return tuple(range(ndim_total))


def empty_in_layout(shape: tuple[int, ...], layout: str, dtype: torch.dtype,
                    device: str | torch.device) -> torch.Tensor:
    order = layout_order(len(shape), layout)
    stored = torch.empty([shape[i] for i in order], dtype=dtype, device=device)
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    return stored.permute(inverse)


_MEMORY_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def is_in_layout(tensor: torch.Tensor, layout: str) -> bool:
    """Whether ``tensor`` is dense in ``layout``'s memory order (size-1 strides do not matter)."""
    # PyTorch's own flags answer the same question (ignoring size-1 dimensions) without a permuted view.
    if layout == "channels_first":
        return tensor.is_contiguous()
    memory_format = _MEMORY_FORMATS.get(tensor.dim())
    if memory_format is not None:
        return tensor.is_contiguous(memory_format=memory_format)
    return tensor.permute(layout_order(tensor.dim(), layout)).is_contiguous()


def to_layout(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """A copy of ``tensor`` (N, C, *spatial) dense in ``layout`` (or ``tensor`` if it already is)."""
    layout = normalize_layout(layout)
    if is_in_layout(tensor, layout):
        return tensor
    out = empty_in_layout(tuple(tensor.shape), layout, tensor.dtype, tensor.device)
    return out.copy_(tensor)


@functools.lru_cache(maxsize=8192)
def _from_key(key: str) -> ConvProblem:
    return ConvProblem._parse_key(key)
