"""Conv1d, Conv2d, Conv3d: drop-in ``torch.nn`` convolutions that run the algorithms convtune selects.

Same constructor, parameters, ``state_dict`` keys, bias, ``padding_mode`` and string padding
as ``torch.nn``; three keyword-only extras say how the layer chooses: ``policy``, ``mode`` (the
``select`` mode: 'hybrid' measures what the tuning database does not know) and ``db``. Each
input signature (shape, dtype, device, layout) is tuned on its first call, the backward
directions when a gradient will be needed (bwd_data only if the input requires grad, bwd_filter
only if the weight does), and remembered per module.

The convolution runs through the native op ``torch.ops.convtune.tuned_conv`` (bias included) where
the C++ extension has executables for the layer's algorithms (``runtime``), through PyTorch's own
convolution where every direction chose ``torch:native``, and otherwise on the Python path:
``torch.ops.convtune.conv`` under torch.compile (which traces it: tune the shapes first, then
compile) and, in eager code, the same computation without the dispatcher (``ops.conv_call``),
the bias a plain add after it, which Inductor can fuse. Under torch.compile an input of static shape chosen for
in eager code or by optimize calls its executables by handle (``tuned_conv``) or, where that costs compiled code
more than it gains, PyTorch's convolution; any other input calls the layer's op,
``torch.ops.convtune.layer_conv``, which looks every input shape up in C++ (``_convtune_traced_forward``;
docs/runtime.md). A
``padding_mode`` other than 'zeros' and an odd 'same' padding are padded explicitly first, as torch does.
A channels_last input makes a channels_last problem (the weight is converted to match). Inputs
convtune cannot describe (float64, say) and layers no algorithm serves run torch's own path.

    >>> import torch, convtune.nn
    >>> conv = convtune.nn.Conv2d(3, 4, 3, padding=1, mode="get")
    >>> x = torch.randn(2, 3, 8, 8)
    >>> torch.allclose(conv(x), torch.nn.functional.conv2d(x, conv.weight, conv.bias, padding=1), atol=1e-5)
    True
"""

from __future__ import annotations

import typing
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from convtune import background, extension
from convtune.policy import Policy
from convtune.problem import ConvProblem, explicit_padding, is_in_layout, per_dimension, to_layout
from convtune.pytorch import ops, runtime
from convtune.pytorch.tuning import LayerSelection, Signature, Tuning, directions_needed, layout_of, select_for_layer
from convtune.settings import settings

if TYPE_CHECKING:  # TunedConv is only ever mixed into a torch conv module: type it as one
    from torch.nn.modules.conv import _ConvNd as _ConvBase
else:
    _ConvBase = object


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype an enclosing autocast region makes a convolution compute in (None: no autocast)."""
    kind = x.device.type
    if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind) and x.is_floating_point() \
            and x.dtype != torch.float64:  # autocast leaves float64 alone
        return torch.get_autocast_dtype(kind)
    return None


class TunedConv(_ConvBase):
    """The behaviour that Conv1d/2d/3d add to their ``torch.nn`` base (a mixin placed before it)."""

    _convtune_tuning: Tuning
    _convtune_selections: dict[Signature, LayerSelection]

    def __init__(self, *args: Any, policy: Policy | None = None, mode: str = "hybrid", db: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_convtune(Tuning(policy, mode, db))

    def _init_convtune(self, tuning: Tuning) -> None:
        self._convtune_tuning = tuning
        self._convtune_selections = {}
        self._convtune_fast: dict[torch.Size, tuple[int, int, int] | TorchDirect | TorchCall] = {}  # see forward
        self._convtune_traced: dict[str, tuple[int, ...]] = {}  # see _convtune_traced_forward
        # likewise: static inputs traced without the layer op, () PyTorch's convolution, else the handles of tuned_conv
        self._convtune_static: dict[str, tuple[int, ...]] = {}
        # the weight's shape the choices are made for: a weight of another shape since makes them stale (see
        # _convtune_forward and _convtune_traced_forward)
        self._convtune_weight_shape: tuple[int, ...] = tuple(self.weight.shape)
        self._convtune_full_path = False  # see _convtune_update_full_path
        self._convtune_from_compiled: set[Signature] = set()  # signatures selected for at compiled code's request
        self._convtune_drop_layer()
        # mode 'background': signature -> background.generation() its selection waits on a measurement since
        self._convtune_provisional: dict[Signature, int] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        # A tuned choice belongs to the convolution the layer was: changing what it computes (stride,
        # padding, ...) after tuning drops the choices, and the next call tunes the layer it now is. One number
        # for every spatial dimension, as torch's functional convolution takes it, is stored per dimension.
        if name in _PER_DIMENSION and isinstance(value, int) and not isinstance(value, bool) \
                and "kernel_size" in self.__dict__:
            value = per_dimension(value, len(self.kernel_size))
        super().__setattr__(name, value)
        if name in _GEOMETRY and "_convtune_selections" in self.__dict__:
            self._convtune_reset()

    def _convtune_reset(self) -> None:
        """Drop every choice: the layer computes another convolution now (its geometry or its weight's shape)."""
        self._convtune_selections.clear()
        self._convtune_fast.clear()
        self._convtune_traced.clear()
        self._convtune_static.clear()
        self._convtune_weight_shape = tuple(self.weight.shape)
        self._convtune_from_compiled.clear()
        self._convtune_drop_layer()

    def __setstate__(self, state: dict) -> None:
        if "_convtune_plans" in state:  # pickled by a version that called the selections plans
            state["_convtune_selections"] = state.pop("_convtune_plans")
        super().__setstate__(state)
        self._convtune_fast = {}  # a copy's selections make their executables anew: the next call finds them
        for sig in state.get("_convtune_provisional", ()):  # a copy selects those again, in its own process
            self._convtune_selections.pop(sig, None)
        self._convtune_provisional = {}
        self._convtune_traced = {}
        self._convtune_static = {}
        if "_convtune_weight_shape" not in state:  # pickled by a version without it: the choices' own weight shape
            self._convtune_weight_shape = _tuned_weight_shape(self)
        self._convtune_full_path = False
        self._convtune_from_compiled = set(state.get("_convtune_from_compiled", ()))
        self._convtune_layer = 0  # the original's layer stays the original's: a copy makes its own
        for sig, selection in self._convtune_selections.items():
            self._convtune_select(sig, selection)

    @property
    def selections(self) -> dict[Signature, LayerSelection]:
        """What this layer runs for each input signature it has seen (read-only view, for ``explain``)."""
        return dict(self._convtune_selections)

    @property
    def plans(self) -> dict[Signature, LayerSelection]:
        """Deprecated: ``selections`` ("plan" is the network's workspace plan, ``convtune.plan``)."""
        warnings.warn("TunedConv.plans is now TunedConv.selections", DeprecationWarning, stacklevel=2)
        return self.selections

    def _convtune_select(self, sig: Signature, selection: LayerSelection) -> None:
        """Inputs of ``sig`` run ``selection`` from now on. Every choice made or dropped for one signature goes
        through here or ``_convtune_forget``, which keep the tables compiled code reads (``_convtune_static``,
        ``_convtune_traced``) in step; the methods that drop them all (``_init_convtune``, a geometry change in
        ``__setattr__``) and a copy's ``__setstate__`` empty or rebuild them themselves. An entry holds the handles
        its gradients need only (0 for the others), so that tuning another direction later leaves it as it was
        (but for the entry of calls needing no gradient, which the layer's judgement with its gradients may turn
        to PyTorch's call: ``LayerSelection.compiled_torch_no_grad``)."""
        self._convtune_selections[sig] = selection
        pads = self._convtune_pads_first()
        provisional = sig in self._convtune_provisional
        for (need_dx, need_dw), key in _traced_keys(sig, self._convtune_weight_shape):
            entry: tuple[int, ...] | None = None
            if not provisional and selection.covers(need_dx, need_dw):
                if (selection.call is None and selection.native is None) or selection.compiled_torch or (
                        selection.compiled_torch_no_grad and not need_dx and not need_dw and not pads):
                    entry = ()  # PyTorch's own call
                elif selection.native is not None and not pads:
                    fwd, bwd_data, bwd_filter = selection.native
                    entry = (fwd, bwd_data if need_dx else 0, bwd_filter if need_dw else 0)
            if entry is None:  # the Python path, a direction not tuned, a provisional choice: the full path
                self._convtune_traced.pop(key, None)
            else:
                self._convtune_traced[key] = entry
            # Compiled code that asked for this choice keeps its layer op: reading the choice there would
            # recompile the graph that asked (see _convtune_update_full_path); an entry it leaves unchanged stays.
            asked = sig in self._convtune_from_compiled
            if entry is not None and (not asked or self._convtune_static.get(key) == entry):
                self._convtune_static[key] = entry
            else:
                self._convtune_static.pop(key, None)
        self._convtune_update_full_path()
        layer, module = self._convtune_layer or self._convtune_make_layer(), extension.loaded()
        if layer and module is not None and not provisional and sig.dtype in _LAYER_DTYPES:
            module.layer_set(layer, *_layer_signature(sig), *_layer_entry(selection))

    def _convtune_compiled_as(self, sig: Signature) -> str:
        """What torch.compile traces for an input of ``sig``, read from the tables the traced forward reads:
        'torch' (PyTorch's convolution, for a static shape, whatever gradients a call needs), 'executables'
        (``tuned_conv`` on the chosen executables' handles, for a static shape; a call needing no gradient may call
        PyTorch's, ``LayerSelection.compiled_torch_no_grad``, which the note says), 'layer op' or 'by shape'
        (explain's ``compiled``)."""
        static = [self._convtune_static[key] for _, key in _traced_keys(sig, self._convtune_weight_shape)
                  if key in self._convtune_static]
        if static:  # read first, whatever the layer's other signatures are
            return "torch" if all(entry == () for entry in static) else "executables"
        return "by shape" if not self._convtune_layer or self._convtune_full_path else "layer op"

    def _convtune_adopt_landed(self, sig: Signature) -> None:
        """If a background measurement has finished since ``sig``'s provisional choice, forget that choice: the
        next selection finds the measurement."""
        provisional = self._convtune_provisional
        if provisional and sig in provisional and provisional[sig] != background.generation():
            del provisional[sig]
            self._convtune_forget(sig)

    def _convtune_forget(self, sig: Signature) -> None:
        """Inputs of ``sig`` are selected for again on their next call."""
        self._convtune_selections.pop(sig, None)
        self._convtune_from_compiled.discard(sig)
        for _, key in _traced_keys(sig, self._convtune_weight_shape):
            self._convtune_traced.pop(key, None)
            self._convtune_static.pop(key, None)
        self._convtune_update_full_path()
        module = extension.loaded()
        if self._convtune_layer and module is not None and sig.dtype in _LAYER_DTYPES:
            module.layer_forget(self._convtune_layer, *_layer_signature(sig))

    def _convtune_update_full_path(self) -> None:
        """Compiled code takes the layer's op unless a choice is on the Python path, which the op cannot call,
        or waits on a measurement (the full path looks for it): then ``_convtune_traced``, shape by shape. Choices
        made at compiled code's request do not count: switching then would recompile the graph that asked, and
        break it where it was compiled whole (the op runs PyTorch's call for them instead)."""
        asked = self._convtune_from_compiled
        self._convtune_full_path = any(sig not in asked for sig in self._convtune_provisional) or any(
            s.runtime == "python" for sig, s in self._convtune_selections.items() if sig not in asked)

    def _convtune_make_layer(self) -> int:
        """This module's layer for compiled code (``torch.ops.convtune.layer_conv``), made where the extension
        is loaded and the layer does not pad its input first; 0 where none is made."""
        module = extension.loaded()
        # (a string padding is resolved from the weight's kernel: the layer's geometry would not follow a new weight)
        if module is None or self._convtune_pads_first() or isinstance(self.padding, str) \
                or torch.compiler.is_compiling():
            return 0
        nd = self.weight.dim() - 2
        geometry = (list(per_dimension(self.stride, nd)), [lo for lo, _ in explicit_padding(self)],
                    list(per_dimension(self.dilation, nd)), self.groups)
        try:
            layer = module.layer_new(*geometry, list(self._convtune_weight_shape))  # the choices' (see __setstate__)
        except ValueError:  # a geometry no convolution has (stride 0, say): torch's own call says so
            return 0
        self._convtune_layer, self._convtune_geometry = layer, geometry
        _LAYERS[layer] = self
        _FINALIZERS[layer] = weakref.finalize(self, _drop_layer, layer)
        global _TUNER_OF
        if _TUNER_OF is not module:  # once per loaded extension
            module.set_layer_tuner(_tune_layer)
            _TUNER_OF = module
        return layer

    def _convtune_drop_layer(self) -> None:
        """Drop this module's layer (its geometry changed, or its choices were reset): the next choice makes one."""
        layer = self.__dict__.get("_convtune_layer", 0)
        if layer:
            finalizer = _FINALIZERS.pop(layer, None)
            if finalizer is not None:
                finalizer.detach()
            _drop_layer(layer)
        self._convtune_layer = 0

    def _convtune_traced_forward(self, input: torch.Tensor) -> torch.Tensor:
        """The forward as torch.compile traces it. An input of static shape whose choice was made in eager code or
        by optimize (``_convtune_static``: one guarded entry, the only state of convtune's that Dynamo then guards)
        calls PyTorch's convolution where that choice is PyTorch's call or gains less than compiled code pays for
        convtune's op, else ``tuned_conv`` on the chosen executables' handles: a call with fewer arguments than the
        layer op's, and no lookup. Any other input of a layer with a layer of the C++ extension (``_convtune_layer``)
        calls its op, ``torch.ops.convtune.layer_conv``, which looks the input's signature up on every call (one
        met first in compiled code is selected for then, measuring as a first call does) and computes its result's
        shape from symbolic sizes: no shape is baked into the graph, no new shape recompiles it or breaks it.
        Otherwise (no extension loaded, a layer that pads explicitly first, a choice on the Python path or waiting
        on a measurement) one entry of ``_convtune_traced``, found by a string that says what the choice depends
        on (shape, dtype under autocast, device, layout, the gradients needed), which Dynamo guards with one
        lookup (and which specializes the shape); no entry: the full path, which tunes (at a graph break) and
        explains. An unbatched input always takes the full path."""
        cast = _autocast_dtype(input)
        weight = self.weight
        if input.dim() != weight.dim() or (cast is None and weight.dtype != input.dtype):
            return self._convtune_forward(input)  # unbatched (or torch's own error), or mixed dtypes: torch's error
        grad = torch.is_grad_enabled()
        need_dx, need_dw = grad and input.requires_grad, grad and weight.requires_grad
        # An input of static shape whose choice was made in eager code or by optimize: PyTorch's convolution where
        # that choice is PyTorch's call or gains less than compiled code pays to call convtune's op
        # (LayerSelection.compiled_torch), which Inductor calls for less host time (and adds the bias in it); else
        # tuned_conv on the executables' handles, which Inductor calls with three arguments per direction
        # (tuned_run) and no lookup. Read first, so that Dynamo guards one entry of one table for such a layer. An
        # exported program, which another process may load before it made these executables, takes the layer op.
        static = tuple(d for d in input.shape if isinstance(d, int))
        if len(static) == input.dim():
            known = self._convtune_static.get(_traced_key(static, weight.shape, cast or input.dtype, input.device,
                                                          layout_of(input), need_dx, need_dw))
            if known is not None and not (known and _exporting()):
                if not known:
                    return _torch_convolution(self, input)
                return torch.ops.convtune.tuned_conv.default(input, weight, self.bias, *known)
        if self._convtune_layer and not self._convtune_full_path and input.device.type in ("cpu", "cuda"):
            # The layer's op: it looks its input's signature up on every call, and has one met first here
            # selected for, so that neither a new shape nor a symbolic one breaks the graph or recompiles it.
            return torch.ops.convtune.layer_conv.default(input, weight, self.bias, *self._convtune_geometry,
                                                         self._convtune_layer, need_dx, need_dw)
        # int(): each size specialized (Dynamo guards it), so the key is a constant even where shapes are symbolic
        key = _traced_key(tuple(int(d) for d in input.shape), weight.shape, cast or input.dtype, input.device,
                          layout_of(input), need_dx, need_dw)
        entry = self._convtune_traced.get(key)
        if entry is None:
            return self._convtune_forward(input)
        if not entry:
            return _torch_convolution(self, input)
        return torch.ops.convtune.tuned_conv.default(input, weight, self.bias, *entry)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # The hot path, for input shapes met before: either the native op on its executables (the direct
        # call checks everything else the choice depends on: dtype, device, layout, the gradients needed;
        # autocast casts in C++; anything else raises ValueError, which the full path below handles; a
        # tensor subclass goes through torch.ops, whose op lays out an input of other strides itself),
        # or, where PyTorch's own call was chosen, that call after the same checks: in C++ (TorchDirect, whose
        # direct call raises ValueError likewise), or in Python (TorchCall: without the native runtime, for a
        # tensor subclass or mode, an unbatched input or one not dense in its layout).
        if torch.compiler.is_compiling():  # traced: the hot path's dict would only add guards
            return self._convtune_traced_forward(input)
        if isinstance(input, _Proxy):  # torch.fx.symbolic_trace: its graph calls PyTorch's convolution (a function on
            return super().forward(input)  # the layer's parameters; the proxy has no shape to tune for)
        fast = self._convtune_fast
        if fast:
            entry = fast.get(input.shape)
            kind = entry.__class__
            if kind is tuple:
                weight, bias = self.weight, self.bias
                try:
                    if _has_torch_function((input, weight, bias)):  # a subclass or mode: the op as Python calls it
                        return torch.ops.convtune.tuned_conv.default(input, weight, bias, *entry)  # type: ignore[misc]
                    return _tuned_conv(input, weight, bias, *entry)  # type: ignore[misc]
                except ValueError:
                    pass
            elif kind is TorchDirect:
                weight, bias = self.weight, self.bias
                if _has_torch_function((input, weight, bias)):  # a subclass or mode: torch.nn's forward, as it
                    if entry.python.admits(input):  # type: ignore[union-attr]  # sees it, after the Python checks
                        if weight.shape == self._convtune_weight_shape:  # (else the full path tunes again)
                            return super().forward(input)
                else:
                    try:
                        return _torch_conv(input, weight, bias, entry.handle,  # type: ignore[union-attr]
                                           entry.dx_tuned, entry.dw_tuned, entry.no_grad)  # type: ignore[union-attr]
                    except ValueError:
                        pass
            # a tuple or a TorchDirect took a branch above (tested by class, the fastest test, which mypy cannot
            # narrow by; hence the ignores)
            elif entry is not None and entry.admits(input):  # type: ignore[union-attr]
                if self.weight.shape == self._convtune_weight_shape:  # (else the full path tunes again)
                    return super().forward(input)
        return self._convtune_forward(input)

    def _convtune_hot(self, shape: torch.Size, entry: tuple[int, int, int] | TorchDirect | TorchCall,
                      sig: Signature) -> None:
        """Inputs of ``shape`` (of signature ``sig``) take the hot path to ``entry`` from now on (eager code only)."""
        if torch.compiler.is_compiling():
            return
        if sig in self._convtune_provisional:  # waiting for a measurement: the full path looks for it
            return
        if len(self._convtune_fast) >= _HOT_SHAPES:
            self._convtune_fast.clear()
        self._convtune_fast[shape] = entry

    def _convtune_forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            # torch.jit.trace gives sizes as tensors: an input it brings here (one of a shape the layer has no
            # hot path for) is neither tuned nor remembered, and the trace records PyTorch's convolution
            return super().forward(input)
        native = None if torch.compiler.is_compiling() else extension.loaded()  # (traced code: the op decides)
        if native is not None and native.under_transform():
            # torch.func (grad, vmap, ...): its wrapped tensors run PyTorch's convolution, which it knows (the native
            # ops do so themselves; the Python path's autograd Function would fail), and tune nothing
            return super().forward(input)
        nd = len(self.kernel_size)
        batched = input.dim() == nd + 2
        x = input if batched else input.unsqueeze(0)  # unbatched (C, *spatial), as torch allows
        weight, bias = self.weight, self.bias
        cast = _autocast_dtype(x)
        dtype = cast or x.dtype
        if cast is None and weight.dtype != x.dtype:
            return super().forward(input)  # torch raises its own error for mixed dtypes
        sig = Signature(tuple(x.shape), dtype, x.device, layout_of(x))
        grad = torch.is_grad_enabled()
        need_dx, need_dw = grad and x.requires_grad, grad and weight.requires_grad
        if not torch.compiler.is_compiling():
            # (traced code keeps the choice it traced, a provisional one's PyTorch convolution: adopting a landed
            # measurement changes the tables Dynamo guards and the C++ layer's, which traced code cannot call)
            self._convtune_adopt_landed(sig)
        if self._convtune_weight_shape != tuple(weight.shape):
            # a weight of another shape since (a new Parameter, its .data replaced): torch computes with the weight
            # as it is, so the layer is tuned again for the convolution it now is, in eager code. Compiled code calls
            # PyTorch's convolution until then: resetting the tables there would break the guards of the graph
            # being traced (and the layer op, which finds the weight's shape is not its layer's, calls it too).
            if torch.compiler.is_compiling():
                return super().forward(input)
            self._convtune_reset()
        selection = self._convtune_selections.get(sig)
        if selection is None or not selection.covers(need_dx, need_dw):
            if torch.compiler.is_compiling():
                selection = _eager_tuning(type(self))(self, sig, need_dx, need_dw)
            else:
                selection = self._convtune_tune(sig, need_dx, need_dw)
        call = selection.call
        if call is None and selection.native is None:  # torch's path, or torch:native in every direction
            # (traced code keeps no hot path: _convtune_hot; nor does another device type, 'meta', say, which
            # autocast does not know: the full path calls PyTorch there)
            if input.device.type in ("cpu", "cuda") and not torch.compiler.is_compiling():
                self._convtune_hot(input.shape, self._convtune_torch_entry(input, sig, batched, selection), sig)
            return super().forward(input)
        padded = self._convtune_pad(x)
        if selection.native is not None:
            # The op casts under autocast itself, as the hot path relies on (the weight once per autocast
            # region, through autocast's cache), and lays the weight out as the problem needs.
            if padded is x and batched:  # the op on the input as it comes, nothing done to it first
                self._convtune_hot(input.shape, selection.native, sig)
            y = torch.ops.convtune.tuned_conv.default(to_layout(padded, sig.layout), weight, bias, *selection.native)
            return y if batched else y.squeeze(0)
        if cast is not None:
            padded = padded if padded.dtype == cast else padded.to(cast)
            weight = weight.to(cast)
            bias = None if bias is None else bias.to(cast)
        x = to_layout(padded, sig.layout)
        weight = to_layout(weight, sig.layout)
        y = ops.conv_call(x, weight, call)  # type: ignore[arg-type]  # not None: handled above when it is
        if bias is not None:
            if bias.shape != (y.shape[1],) or bias.dtype != y.dtype or bias.device != y.device:
                # the native ops refuse it alike (csrc/executable.h: add_bias); a broadcast would be wrong silently
                raise ValueError(f"convtune: {self._get_name()}({self.extra_repr()}): bias of shape "
                                 f"{list(bias.shape)} and dtype {bias.dtype} on {bias.device} for a result of "
                                 f"{y.shape[1]} channels and dtype {y.dtype} on {y.device}: give a 1-dimensional bias "
                                 f"of {y.shape[1]} elements of the result's dtype and device, as torch's convolution "
                                 f"requires")
            y = y + bias.view(1, -1, *([1] * nd))
        return y if batched else y.squeeze(0)

    def _convtune_torch_entry(self, input: torch.Tensor, sig: Signature, batched: bool,
                              selection: LayerSelection) -> TorchDirect | TorchCall:
        """The hot path's entry for ``input`` (of ``sig``), whose choice (``selection``) is PyTorch's call: its
        signature checked in C++ (``TorchDirect``) where the native runtime is on and a torch:native executable of
        the problem says what the signature is, else in Python (``TorchCall``)."""
        python = TorchCall.of(input, sig, selection)
        # (an input not dense in its layout stays on the Python checks: the C++ check wants the problem's strides;
        # so does a string padding, which the C++ call would take as the numbers resolved from the tuned weight)
        if settings.native and batched and not self._convtune_pads_first() and not isinstance(self.padding, str) \
                and is_in_layout(input, sig.layout):
            try:
                handle = runtime.prepare(ConvProblem.from_key(selection.problem), "torch:native")[0]
            except runtime.REFUSALS:  # no extension, or no problem (a dtype convtune does not tune): ValueError
                pass
            else:
                return TorchDirect(handle, selection.covers(True, False), selection.covers(False, True), python,
                                   selection.no_grad_handle)
        return python

    def _convtune_pads_first(self) -> bool:
        """Whether the layer pads its input explicitly before the convolution (``_convtune_pad``)."""
        return self.padding_mode != "zeros" or (isinstance(self.padding, str) and any(
            lo != hi for lo, hi in explicit_padding(self)))

    def _convtune_pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` padded explicitly where torch would (ConvProblem.from_module describes the same)."""
        if not self._convtune_pads_first():
            return x
        if self.padding_mode != "zeros":
            return F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
        # 'same' with an odd total: the extra row/column goes after, the rest is symmetric.
        return F.pad(x, [v for lo, hi in reversed(explicit_padding(self)) for v in (0, hi - lo)])

    def _convtune_tune(self, sig: Signature, need_dx: bool, need_dw: bool) -> LayerSelection:
        # Under torch.compile this runs eagerly, at a graph break (it measures, reads databases): see
        # _eager_tuning. Never wrapped before: torch.compiler.disable imports Dynamo (a second on a warm start).
        self._convtune_fast.clear()
        directions = directions_needed(need_dx, need_dw)
        tuning = self._convtune_tuning
        selection = select_for_layer(self, sig, tuning, directions, self._convtune_selections.get(sig))
        # Directions answered at once while they are measured in the background (mode 'background'):
        # the layer takes the full path, which selects again once a measurement has finished since.
        since = [tuning.waiting_since(ops.key_for(selection.problem, d)) for d, r in selection.results
                 if r.time_ms is None]
        waiting = [g for g in since if g is not None]
        if waiting:
            self._convtune_provisional[sig] = min(waiting)
        else:
            self._convtune_provisional.pop(sig, None)
        self._convtune_select(sig, selection)
        return selection


_GEOMETRY = frozenset({"stride", "padding", "dilation", "groups", "padding_mode", "kernel_size", "in_channels",
                       "out_channels", "_reversed_padding_repeated_twice"})  # what a choice depends on
_PER_DIMENSION = frozenset({"stride", "padding", "dilation", "kernel_size"})  # tuples of one number a dimension
_GRADIENTS_NEEDED = ((False, False), (True, False), (False, True), (True, True))  # (of the input, of the weight)


_FUNCTIONAL = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}  # by the input's dimensions (batched)
_is_exporting: Callable[[], bool] = getattr(torch.compiler, "is_exporting", lambda: False)  # (torch 2.5 and later)


def _exporting() -> bool:
    """Whether torch.export traces the forward in Python (its default, non-strict), where
    ``torch.compiler.is_exporting()`` reads export's own flag. Where Dynamo traces the forward (torch.compile, or
    ``torch.export.export(..., strict=True)``) this says False: traced by Dynamo, ``is_exporting()`` reads True
    under torch.compile as well in some versions (torch 2.11), which would send every layer to its op."""
    return _is_exporting() and not torch.compiler.is_dynamo_compiling()


def _tuned_weight_shape(module: TunedConv) -> tuple[int, ...]:
    """The weight's shape ``module``'s choices were made for: a choice's that differs from the weight's, if any (the
    weight replaced since: the next eager call tunes again), else the weight's."""
    current = tuple(module.weight.shape)
    for selection in module._convtune_selections.values():
        try:
            shape = ops.problem_of(selection.problem).w_shape
        except ValueError:  # no problem (PyTorch's path for an input convtune does not tune)
            continue
        if shape != current:
            return shape
    return current


def _torch_convolution(module: TunedConv, input: torch.Tensor) -> torch.Tensor:
    """PyTorch's convolution of ``module`` on a batched ``input``, as traced code calls it: the functional form
    where the layer pads with zeros (which reads no more of the module than ``torch.nn``'s forward does, and no
    method of its class, so Dynamo guards nothing of convtune's for it), else the ``torch.nn`` forward."""
    if module.padding_mode == "zeros":
        return _FUNCTIONAL[input.dim()](input, module.weight, module.bias, module.stride, module.padding,
                                        module.dilation, module.groups)
    return super(TunedConv, module).forward(input)


def _traced_key(shape: tuple[int, ...], weight_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                layout: str, need_dx: bool, need_dw: bool) -> str:
    """The key of ``_convtune_traced`` and ``_convtune_static``: a string, which Dynamo guards as one dictionary
    lookup. It names the weight's shape: traced code given a weight of another shape than the choices were made
    for finds no entry (Dynamo recompiles on a new weight shape, its guards holding the parameter's)."""
    return f"{tuple(shape)}|{tuple(weight_shape)}|{dtype}|{device}|{layout}|{int(need_dx)}{int(need_dw)}"


def _traced_keys(sig: Signature, weight_shape: tuple[int, ...]) -> list[tuple[tuple[bool, bool], str]]:
    """((need_dx, need_dw), key) of each combination of gradients an input of ``sig`` may need, with a weight of
    ``weight_shape``."""
    return [(needs, _traced_key(sig.shape, weight_shape, sig.dtype, sig.device, sig.layout, *needs))
            for needs in _GRADIENTS_NEEDED]


_HOT_SHAPES = 16  # input shapes a layer keeps a hot path for (a detection head sees one per level)
_Proxy = torch.fx.Proxy  # (looked up once, for the hot path)


class TorchDirect:
    """The hot path of a layer that calls PyTorch's own convolution, its input's signature checked in C++
    (``_C.torch_conv``, which then calls ``aten::conv2d``, say, as torch.nn's forward does): the handle of a
    torch:native executable of the problem chosen for, whether the input's gradient was chosen for, whether the
    weight's was, and the same checks in Python (``TorchCall``) for a tensor subclass or a mode of
    ``__torch_function__``, which sees torch.nn's forward; and the handle of the forward's executable that a call
    needing no gradient runs instead (``LayerSelection.no_grad``; 0: PyTorch's call)."""

    __slots__ = ("handle", "dx_tuned", "dw_tuned", "python", "no_grad")

    def __init__(self, handle: int, dx_tuned: bool, dw_tuned: bool, python: TorchCall, no_grad: int = 0) -> None:
        self.handle, self.dx_tuned, self.dw_tuned, self.python = handle, dx_tuned, dw_tuned, python
        self.no_grad = no_grad

    def __reduce__(self) -> tuple:  # pickle's protocols 0 and 1 as well (slots have no __dict__)
        return (TorchDirect, (self.handle, self.dx_tuned, self.dw_tuned, self.python, self.no_grad))


class TorchCall:
    """The hot path of a layer that calls PyTorch's own convolution: what an input of the shape it is kept
    for (the hot path's key) must be to take it. A class with slots: its fields read faster than a tuple's."""

    __slots__ = ("strides", "dtype", "autocast", "device_type", "cuda", "covers_dx", "covers_dw")

    def __init__(self, strides: tuple[int, ...], dtype: torch.dtype, autocast: bool, device_type: str, cuda: bool,
                 covers_dx: bool, covers_dw: bool) -> None:
        self.strides = strides  # the same layout (exactly: other strides take the full path, which decides)
        self.dtype = dtype  # the input's, or the autocast dtype
        self.autocast = autocast
        self.device_type = device_type
        self.cuda = cuda  # on a CUDA device (any), else on the CPU
        self.covers_dx = covers_dx  # a gradient of the input was tuned (PyTorch's too), or none is needed
        self.covers_dw = covers_dw

    def __reduce__(self) -> tuple:  # pickle's protocols 0 and 1 as well (slots have no __dict__)
        return (TorchCall, (self.strides, self.dtype, self.autocast, self.device_type, self.cuda, self.covers_dx,
                            self.covers_dw))

    @classmethod
    def of(cls, input: torch.Tensor, sig: Signature, selection: LayerSelection) -> TorchCall:
        device = input.device.type
        return cls(input.stride(), sig.dtype, torch.is_autocast_enabled(device), device, input.is_cuda,
                   selection.covers(True, False), selection.covers(False, True))

    def admits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (of the shape this entry is kept for) takes PyTorch's call with no more checks."""
        if x.stride() != self.strides or not (x.is_cuda if self.cuda else x.is_cpu):
            return False
        if self.autocast:
            if not torch.is_autocast_enabled(self.device_type) or \
                    torch.get_autocast_dtype(self.device_type) is not self.dtype:
                return False
        elif torch.is_autocast_enabled(self.device_type) or x.dtype is not self.dtype:
            return False
        return (self.covers_dx or not x.requires_grad) and (self.covers_dw or not torch.is_grad_enabled())


_LAYERS: weakref.WeakValueDictionary[int, TunedConv] = weakref.WeakValueDictionary()  # layer id -> its module
_FINALIZERS: dict[int, weakref.finalize] = {}  # layer id -> what drops it with its module
_TUNER_OF: Any = None  # the extension module whose layers' tuner is _tune_layer
_LAYER_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what a layer's table keys


def _drop_layer(layer: int) -> None:
    _FINALIZERS.pop(layer, None)
    module = extension.loaded()
    if module is not None:
        module.layer_drop(layer)


def _layer_signature(sig: Signature) -> tuple[list[int], str, str, bool]:
    """``sig`` as a layer's table keys it: shape, dtype name, device, channels_last."""
    return list(sig.shape), str(sig.dtype).removeprefix("torch."), str(sig.device), sig.layout == "channels_last"


def _layer_entry(selection: LayerSelection) -> tuple[list[int], list[bool]]:
    """What a layer's table holds for ``selection``: the handles (0: PyTorch's call, also where the layer is on
    the Python path, which compiled code's op cannot call) and which directions were selected for."""
    if selection.on_torch:
        return [0, 0, 0], [True, True, True]
    tuned = [bool(name) for name in (selection.fwd, selection.bwd_data, selection.bwd_filter)]
    return (list(selection.native) if selection.native is not None else [0, 0, 0]), tuned


_TUNE_FAILED: set[int] = set()  # layers whose tuning from compiled code failed (warned once each)


def _tune_layer(layer: int, x: torch.Tensor, w: torch.Tensor, need_dx: bool,
                need_dw: bool) -> tuple[list[int], list[bool]] | None:
    """The layers' tuner (``set_layer_tuner``): compiled code met a signature the layer's table lacks; select for
    it as the module's first call would, and answer the table's entry. None: not now (a CUDA graph being
    captured, a background measurement pending: the call runs PyTorch's convolution and asks again next time)."""
    module = _LAYERS.get(layer)
    if module is None or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    sig = Signature(tuple(x.shape), x.dtype, x.device, layout_of(x))
    module._convtune_adopt_landed(sig)
    module._convtune_from_compiled.add(sig)
    try:
        selection = module._convtune_tune(sig, need_dx, need_dw)
    except Exception as exc:  # noqa: BLE001  (compiled code must go on: PyTorch's call for this signature)
        if layer not in _TUNE_FAILED:
            _TUNE_FAILED.add(layer)
            warnings.warn(f"convtune: selecting for input {tuple(x.shape)} of a compiled layer failed ({exc}); "
                          f"it runs PyTorch's convolution for that input", RuntimeWarning, stacklevel=2)
        return [0, 0, 0], [True, True, True]
    if sig in module._convtune_provisional:
        return None
    return _layer_entry(selection)


_EAGER_TUNING: dict[type, Any] = {}  # a class's _convtune_tune under torch.compiler.disable, made on first need


def _eager_tuning(cls: type[TunedConv]) -> Any:
    """``cls._convtune_tune`` as a call Dynamo does not trace (it runs eagerly at a graph break).

    Made when a compiled region first meets an input signature not tuned yet, when Dynamo is loaded
    anyway: making it earlier (``optimize``, a layer's construction) would import Dynamo for every user.
    """
    if cls not in _EAGER_TUNING:
        _EAGER_TUNING[cls] = torch.compiler.disable(cls._convtune_tune)
    return _EAGER_TUNING[cls]


def _resolve_tuned_conv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, fwd: int, bwd_data: int,
                        bwd_filter: int) -> torch.Tensor:
    """The hot path's first call: bind ``_tuned_conv`` to the C++ extension's direct call of the op (loaded by
    then: a layer's executables imply it), which skips ``torch.ops``' Python-side argument handling (about
    1 us a call). It consults no ``__torch_function__``: the hot path takes it for plain tensors only. Never
    traced: under torch.compile a layer takes ``_convtune_traced_forward``, which names the op."""
    global _tuned_conv
    module = extension.load()
    _tuned_conv = module.tuned_conv if module is not None else torch.ops.convtune.tuned_conv.default
    return _tuned_conv(x, w, bias, fwd, bwd_data, bwd_filter)


def _resolve_torch_conv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, fwd: int, dx_tuned: bool,
                        dw_tuned: bool, no_grad: int) -> torch.Tensor:
    """The first call of a ``TorchDirect`` hot path: bind ``_torch_conv`` to the C++ extension's ``torch_conv``
    (loaded by then: the entry's executable implies it)."""
    global _torch_conv
    module = extension.load()
    if module is None:  # (not reached: a TorchDirect entry is made with the extension only) the full path decides
        raise ValueError("convtune: the C++ extension is not loaded")
    _torch_conv = module.torch_conv
    return _torch_conv(x, w, bias, fwd, dx_tuned, dw_tuned, no_grad)


# _C.torch_conv(x, w, bias, fwd, dx_tuned, dw_tuned, no_grad): PyTorch's convolution after the signature's checks in
# C++ (or, for a call that needs no gradient, the forward's executable no_grad where it is not 0).
_torch_conv: Callable[..., torch.Tensor] = _resolve_torch_conv
# convtune::tuned_conv(x, w, bias, fwd, bwd_data, bwd_filter): the forward through the layer's executables,
# for tensors without __torch_function__ (nor a mode of it: _has_torch_function).
_tuned_conv: Callable[..., torch.Tensor] = _resolve_tuned_conv
_has_torch_function = torch.overrides.has_torch_function


class Conv1d(TunedConv, torch.nn.Conv1d):
    """``torch.nn.Conv1d`` running convtune's selected algorithms (see the module docstring)."""


class Conv2d(TunedConv, torch.nn.Conv2d):
    """``torch.nn.Conv2d`` running convtune's selected algorithms (see the module docstring)."""


class Conv3d(TunedConv, torch.nn.Conv3d):
    """``torch.nn.Conv3d`` running convtune's selected algorithms (see the module docstring)."""


TUNED: dict[type[torch.nn.Module], type[TunedConv]] = {
    torch.nn.Conv1d: Conv1d, torch.nn.Conv2d: Conv2d, torch.nn.Conv3d: Conv3d}


def convert(module: torch.nn.Module, tuning: Tuning) -> TunedConv:
    """Make ``module`` a convtune module in place, choosing by ``tuning`` (its earlier selections are dropped).

    The object stays the same (its class changes, as ``torch.nn.utils.parametrize`` does), so its
    Parameters, buffers, hooks and every reference to it are kept. ``module`` must be exactly an
    nn.Conv1d/2d/3d (a subclass may compute differently: ``TypeError``) or a convtune module.
    """
    if isinstance(module, TunedConv):
        module._init_convtune(tuning)
        return module
    cls = TUNED.get(type(module))
    if cls is None:
        raise TypeError(f"convert() takes an nn.Conv1d, nn.Conv2d or nn.Conv3d (not a subclass, whose forward may "
                        f"differ), got {type(module).__name__}")
    module.__class__ = cls
    tuned = typing.cast(TunedConv, module)  # the same object, now of class ``cls``
    tuned._init_convtune(tuning)
    return tuned
