"""What convtune's Triton algorithms share: where they run, what they refuse, how they are named.

A Triton family is one algorithm per direction and tile configuration, so that ``find``'s verified
measurement is the kernels' autotuner (no second tuning loop). They run on CUDA, and on the CPU in
Triton's interpreter (``TRITON_INTERPRET=1``: how the tests check them without a GPU). Triton
compiles a configuration the first time it meets a problem shape (a second or so; Triton keeps the
binaries on disk, so once per machine). ``settings.triton`` (``CONVTUNE_TRITON=0``) leaves them out.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
import math
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from ..problem import ConvProblem, empty_in_layout
from ..settings import settings
from .base import (
    SUPPORTED,
    Algorithm,
    Buffer,
    NativeRecipe,
    NoNativeRecipe,
    NumericNotes,
    Support,
    allocate_workspace,
    buffers_bytes,
    carve,
    unsupported,
)
from .registry import register

log = logging.getLogger(__name__)
INDEX_LIMIT = 2**31  # the kernels' offsets are 32-bit
GRID_AXIS_LIMIT = 65535  # programs along a launch grid's second and third axes (CUDA's limit)
# Each configuration's measured times over its family's roofline price, fitted on a GPU by bench/fit_triton_prices.py
PRICES_FILE = Path(__file__).resolve().parent.parent / "data" / "triton_prices.json"


@functools.cache
def measured_factors() -> dict[str, float]:
    """The fitted factors by algorithm name (``PRICES_FILE``); empty where the file is missing or unreadable, and
    without an entry that is not a positive finite number (each warned once)."""
    try:
        factors = json.loads(PRICES_FILE.read_text())["factors"]
        entries = factors.items()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("the Triton kernels' fitted prices (%s) cannot be read (%s: %s); their roofline prices serve",
                    PRICES_FILE, type(exc).__name__, exc)
        return {}
    out = {}
    for name, factor in entries:
        if isinstance(factor, (int, float)) and not isinstance(factor, bool) and math.isfinite(factor) and factor > 0:
            out[str(name)] = float(factor)
        else:
            log.warning("the Triton kernels' fitted prices (%s): %s's factor %r is not a positive number; it is "
                        "priced as its family's others", PRICES_FILE, name, factor)
    return out


def measured_factor_of(name: str, factors: dict[str, float]) -> float:
    """The factor of the configuration ``name`` in ``factors``; one never fitted takes the median of its family's in
    its direction (the names that differ from it in the last part only), and a family never fitted 1."""
    if name in factors:
        return factors[name]
    stem = name.rsplit("_", 1)[0] + "_"  # triton:<family>_<direction>_
    kin = [f for other, f in factors.items() if other.startswith(stem) and "_" not in other[len(stem):]]
    return statistics.median(kin) if kin else 1.0


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (its documented ``TRITON_INTERPRET`` switch)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def _kernels_module(kernels: str) -> Any:
    """convtune.kernels.<kernels>, imported once: pricing asks for it per candidate, and an algorithm keeps no module
    of its own (it goes to worker processes by pickle)."""
    return importlib.import_module(f"convtune.kernels.{kernels}")


class TritonAlgorithm(Algorithm):
    """One direction of a Triton kernel family with one tile configuration.

    Subclasses set ``family`` (the name's stem), ``kernels`` (the module under ``convtune.kernels``, with
    ``forward``, ``backward_data`` and ``backward_filter``) and ``tile_type`` (its configuration class's
    name there), refuse what their kernels do not compute in ``_family_supports``, and give the shape of
    the weight gradient's float32 partial sums in ``partials_shape`` where it is not (the kernels module's
    ``partial_sums``, channels, taps).
    """

    devices = ("cuda", "cpu")
    host_kind = "triton"
    family = ""
    kernels = ""
    tile_type = ""
    tile_args: tuple[int, ...]

    def __init__(self, direction: str, positions: int, channels: int, warps: int, chunk: int = 0):
        self._configure(direction, (positions, channels, warps, chunk),
                        f"p{positions}c{channels}w{warps}" + (f"s{chunk}" if chunk else ""))

    def _configure(self, direction: str, tile_args: tuple[int, ...], label: str) -> None:
        """Take the direction and the configuration (the tile class's arguments), named by ``label``."""
        self.tile_args = tile_args
        self.name = f"triton:{self.family}_{direction}_{label}"
        self.directions = (direction,)
        super().__init__()

    def measured_factor(self) -> float:
        """How this configuration's measured times stand to its family's roofline price (``Cost.measured_factor``):
        fitted on a GPU (``measured_factors``, ``measured_factor_of``)."""
        return measured_factor_of(self.name, measured_factors())

    def module(self) -> Any:
        """The kernels' module, imported on first use (it imports Triton)."""
        return _kernels_module(self.kernels)

    @functools.cached_property
    def tile(self) -> Any:
        """The configuration's tile (the kernels' module's ``tile_type`` of ``tile_args``), made once."""
        return getattr(self.module(), self.tile_type)(*self.tile_args)

    def _supports(self, problem: ConvProblem) -> Support:
        if not settings.triton:
            return unsupported("convtune's Triton kernels are off (settings.triton, CONVTUNE_TRITON=0)")
        kind = self.kind(problem)  # first: the kind of problem a family computes says most (not the machine)
        if not kind:
            return kind
        if problem.device == "cpu" and not interpreting():
            return unsupported("Triton kernels run on the CPU only in Triton's interpreter (TRITON_INTERPRET=1)")
        if importlib.util.find_spec("triton") is None:
            return unsupported("needs Triton: pip install triton")
        if problem.ndim not in (1, 2):
            return unsupported(f"handles 1-D and 2-D convolutions, got {problem.ndim}-D")
        family = self._family_supports(problem)
        if not family:
            return family
        shapes = list(problem.operand_shapes)
        if problem.direction == "bwd_filter":
            shapes.append(self.partials_shape(problem))  # the weight gradient's partial sums too
        biggest = max(math.prod(shape) for shape in shapes)
        if biggest >= INDEX_LIMIT:
            return unsupported(f"a tensor of {biggest} elements needs 64-bit offsets; these kernels use 32-bit "
                               f"ones (below {INDEX_LIMIT}); torch:native and cuDNN take it")
        return SUPPORTED

    def kind(self, problem: ConvProblem) -> Support:
        """Whether ``problem`` is of the kind the family computes (depthwise, grouped): checked first."""
        return SUPPORTED

    def _family_supports(self, problem: ConvProblem) -> Support:
        return SUPPORTED

    def partials_shape(self, problem: ConvProblem) -> tuple[int, ...]:
        """The shape of the weight gradient's float32 partial sums: one per (run of the kernels module's
        ``partial_sums``, channel, tap); a family whose partial sums are laid out otherwise says so here."""
        return (self.module().partial_sums(problem, self.tile), problem.k, math.prod(problem.kernel_size))

    def buffers(self, problem: ConvProblem) -> list[Buffer]:
        if problem.direction != "bwd_filter":
            return []
        return [Buffer("partials", self.partials_shape(problem), torch.float32)]

    def native_recipe(self, problem: ConvProblem) -> NativeRecipe | None:
        """On CUDA (not in Triton's interpreter): the launches of one run on random operands, recorded
        (``convtune.kernels.recording``), which the C++ runtime repeats with the same compiled kernels and the
        same arguments (the operands' shapes and strides are the problem's; only their addresses change). None
        elsewhere; ``NoNativeRecipe`` where the run makes a tensor between launches or launches what the C++
        launcher does not, where it fails (Triton's compiler; logged), and, transient, while a CUDA graph is
        being captured or where memory ran out."""
        if problem.device != "cuda" or interpreting() or not self.supports(problem):
            return None
        if torch.cuda.is_current_stream_capturing():
            raise NoNativeRecipe("its launches are recorded outside a CUDA graph capture", transient=True)
        from ..kernels import recording

        try:
            a, b = problem.random_inputs(seed=0)
            out = problem.empty(problem.operand_shapes[2])
            buffers = self.buffers(problem)
            ws = carve(allocate_workspace(buffers_bytes(buffers), problem.device), buffers)
            with recording.recording() as records:
                self._run(problem, a, b, out, ws)
            launches = recording.describe(records, {"a": a, "b": b, "out": out, **ws})
        except recording.NotRecordable as exc:
            raise NoNativeRecipe(f"its launches cannot be repeated from C++: {exc}") from None
        except torch.cuda.OutOfMemoryError as exc:
            raise NoNativeRecipe(f"out of memory while its launches were recorded: {exc}", transient=True) from None
        except Exception as exc:  # noqa: BLE001  (Triton's compiler and resource errors are not RuntimeErrors)
            log.warning("%s on %s: its launches could not be recorded (%s: %s); it runs on the Python path",
                        self.name, problem.key, type(exc).__name__, exc)
            raise NoNativeRecipe(f"its launches could not be recorded ({type(exc).__name__}: {exc})") from None
        return NativeRecipe("cubin", (("launches", launches),))

    def prepare(self, problem: ConvProblem) -> None:
        """On CUDA (not in Triton's interpreter): compile the kernels one run on ``problem`` launches, for its
        operands' dtypes, shapes and strides, running nothing (operands on PyTorch's meta device, which hold no data
        and which Triton specializes as aligned, as the caching allocator's are)."""
        if problem.device != "cuda" or interpreting() or not self.supports(problem):
            return
        from ..kernels import recording

        a, b, out = (empty_in_layout(shape, problem.layout, problem.torch_dtype, "meta")
                     for shape in problem.operand_shapes)
        buffers = self.buffers(problem)
        with recording.compiling_only():
            self._run(problem, a, b, out, carve(allocate_workspace(buffers_bytes(buffers), "meta"), buffers))

    def _run(self, problem, a, b, out, ws) -> None:
        module = self.module()
        if problem.direction == "fwd":
            module.forward(problem, self.tile, a, b, out, **ws)
        elif problem.direction == "bwd_data":
            module.backward_data(problem, self.tile, a, b, out, **ws)
        else:
            module.backward_filter(problem, self.tile, a, b, out, ws["partials"])


def whole_gradient_runs(problem: ConvProblem, chunk: int) -> tuple[int, int]:
    """The shape of a weight gradient's float32 partial sums where each run of ``chunk`` output positions sums the
    whole gradient (the implicit GEMMs'): (runs, the gradient's elements)."""
    return -(-problem.n * math.prod(problem.output_size) // chunk), math.prod(problem.w_shape)


def tensor_core_notes(problem: ConvProblem) -> NumericNotes:
    """The numeric notes of a family that multiplies on the tensor cores: half operands summed in float32, float32
    ones rounded to TF32 exactly where the problem allows it."""
    half = problem.dtype != "float32"
    tf32 = not half and problem.allow_tf32
    return NumericNotes(tensor_cores=half or tf32, tf32=tf32, float32_inside=half)


def grid_axis_fits(programs: int, what: str, others: str) -> Support:
    """Whether ``programs`` fit a launch grid's second or third axis (CUDA's ``GRID_AXIS_LIMIT``); if not, the reason,
    naming ``what`` the programs are and ``others``, what takes the problem instead."""
    if programs > GRID_AXIS_LIMIT:
        return unsupported(f"launches {programs} programs along a grid axis that holds {GRID_AXIS_LIMIT} ({what}); "
                           f"{others} take it")
    return SUPPORTED


def depthwise_only(problem: ConvProblem) -> Support:
    """What the depthwise families refuse first: a problem that is not depthwise (groups == c)."""
    if problem.groups != problem.c:
        return unsupported(f"needs a depthwise problem (groups == c == {problem.c}), got groups={problem.groups}")
    return SUPPORTED


def register_family(family: type[TritonAlgorithm], tiles: dict[str, tuple[tuple[Any, ...], ...]]) -> None:
    """Register one algorithm of ``family`` per direction and tile configuration (each the arguments of
    ``family`` after the direction)."""
    for direction, configurations in tiles.items():
        for tile in configurations:
            register(family(direction, *tile))
