"""optimize: make a PyTorch model run the algorithms convtune selects, forward and backward.

The model runs once on the example inputs with a hook on every nn.Conv1d/2d/3d, which records the
input each layer sees; every (layer, input) is tuned, and the layers become ``convtune.nn``
modules in place, keeping their Parameters. The example run leaves no trace: buffers (batch-norm
statistics) and the random number generators are restored afterwards.

The example run goes first dry: each conv layer returns zeros of its result's shape, dtype and layout
without computing anything, so none of PyTorch's first-call costs are paid (cuDNN's heuristics, and
its compiling kernels at run time for depthwise layers: seconds on MobileNetV2). Where the database
already answers every (layer, input) that run met, it is all a warm start needs; otherwise (a cold
database, or a model whose code fails on zeros) the model runs again with its real convolutions, and
what that run meets is tuned. A model whose path depends on its activations' values (a branch on
them, a number of detections) may meet other layers or shapes on zeros than on real data: those are
tuned on their first call, as inputs first met later always are.

    >>> import torch, convtune
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1))
    >>> x = torch.randn(1, 3, 8, 8)
    >>> expected = model(x)
    >>> model = convtune.optimize(model, x, mode="get")
    >>> type(model[0]).__module__, torch.allclose(model(x), expected, atol=1e-5)
    ('convtune.pytorch.modules', True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from convtune.algorithms.registry import get_algorithm
from convtune.db import check_db
from convtune.errors import NoAlgorithmError, check_type
from convtune.network import LayerRow, Tuning, plan_layers, planned_rows, select_layers
from convtune.plan import InfeasibleBudgetError
from convtune.policy import Policy
from convtune.problem import empty_in_layout, explicit_padding
from convtune.pytorch.modules import TUNED, TunedConv, _autocast_dtype, convert
from convtune.pytorch.tuning import LayerSelection, Signature, describe, directions_needed, layout_of, select_for_layer
from convtune.results import PerfResult
from convtune.units import parse_bytes

if TYPE_CHECKING:
    from torch.nn.modules.conv import _ConvNd

log = logging.getLogger(__name__)

_CONV_TYPES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _observed_call(module: _ConvNd, x: torch.Tensor, training: bool) -> tuple[Signature, bool, bool]:
    """The signature a call of ``module`` on ``x`` tunes, and whether it needs dx and dw."""
    x = x if x.dim() == len(module.kernel_size) + 2 else x.unsqueeze(0)
    dtype = _autocast_dtype(x) or x.dtype
    grad = training and torch.is_grad_enabled()
    return (Signature(tuple(x.shape), dtype, x.device, layout_of(x)),
            grad and x.requires_grad, grad and module.weight.requires_grad)


def _check_inputs(example_inputs: Any) -> None:
    if not isinstance(example_inputs, (torch.Tensor, dict, tuple, list)):
        raise TypeError(f"example_inputs must be a tensor, a tuple of the model's arguments or a dict of its "
                        f"keyword arguments, got {type(example_inputs).__name__}")


def _call(model: torch.nn.Module, example_inputs: Any) -> None:
    _check_inputs(example_inputs)
    if isinstance(example_inputs, dict):
        model(**example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        model(*example_inputs)
    else:
        model(example_inputs)


@contextlib.contextmanager
def _leave_no_trace(model: torch.nn.Module, example_inputs: Any) -> Iterator[None]:
    """Restore the model's buffers and the random generators after the example run: each buffer the same tensor
    (one the forward assigned anew, a counter's ``self.steps = self.steps + 1``, say, is put back) holding the values
    it held."""
    buffers = [(module, name, b, b.detach().clone()) for module in model.modules()
               for name, b in module.named_buffers(recurse=False)]
    tensors = example_inputs.values() if isinstance(example_inputs, dict) else (
        example_inputs if isinstance(example_inputs, (tuple, list)) else [example_inputs])
    cuda = sorted({t.device.index for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda})
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        with torch.no_grad():
            for module, name, b, saved in buffers:
                if getattr(module, name, None) is not b:
                    setattr(module, name, b)  # (a registered buffer's name: it stays one, persistent or not)
                b.copy_(saved)


def _dry_forward(module: _ConvNd, base: Any, training: bool, input: torch.Tensor) -> torch.Tensor:
    """What a conv layer returns in the dry run: zeros of its output's shape, dtype and layout (PyTorch lays
    a 2-D or 3-D convolution's result out channels_last where the input it convolves or the weight is), requiring grad
    where the real result would. ``base``: the layer's own forward, for a layer convtune cannot describe."""
    batched = input.dim() == len(module.kernel_size) + 2
    x = input if batched else input.unsqueeze(0)
    sig, _, _ = _observed_call(module, x, training)
    if _autocast_dtype(x) is None and x.dtype != module.weight.dtype:
        return base(input)  # mixed dtypes: torch's own error, as the real run (and the tuned layer) raises it
    try:
        problem = describe(module, sig)
    except (TypeError, ValueError):  # stays on torch's path: its result as torch computes it
        return base(input)
    # PyTorch convolves what it padded (padding modes other than zeros): that tensor's layout is the input's.
    padded = x if module.padding_mode == "zeros" else F.pad(
        x, [v for lo, hi in reversed(explicit_padding(module)) for v in (lo, hi)], mode=module.padding_mode)
    channels_last = problem.ndim > 1 and (_strides_like_channels_last(padded) or
                                          _strides_like_channels_last(module.weight))
    y = empty_in_layout(problem.y_shape, "channels_last" if channels_last else "channels_first", sig.dtype,
                        x.device).zero_()
    bias = module.bias is not None and module.bias.requires_grad
    if torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad or bias):
        y = y.requires_grad_().clone()  # not a leaf: an in-place op after the layer (ReLU(inplace=True)) may follow
    return y if batched else y.squeeze(0)


def _strides_like_channels_last(t: torch.Tensor) -> bool:
    """Whether PyTorch takes ``t`` (4-D or 5-D) for channels_last when it lays out a convolution's result: its
    rule on strides (``is_channels_last_strides_2d``/``_3d`` in c10), which, unlike ``layout_of``, counts a
    tensor dense in both orders (one channel, say) as channels_last when its channel stride is the smallest."""
    if t.dim() not in (4, 5):
        return False
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    low = 0
    for d in (1, 3, 2, 0) if t.dim() == 4 else (1, 4, 3, 2, 0):
        if sizes[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return False
        low = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def _observe(model: torch.nn.Module, example_inputs: Any, training: bool,
             tuning: Tuning) -> dict[str, tuple[torch.nn.Module, dict]]:
    """Run the model once; for each conv layer called: (module, {signature: (need_dx, need_dw)}).

    On the meta device first; where the database does not answer everything that run found (or the model
    does not run there), on the model's own device (see the module's docstring)."""
    _check_inputs(example_inputs)
    try:
        seen = _observe_run(model, example_inputs, training, dry=True)
    except Exception as exc:  # noqa: BLE001  # whatever the model's code makes of zeros
        log.debug("optimize: the dry example run failed (%s: %s); running it for real", type(exc).__name__, exc)
    else:
        if _answered(seen, tuning):
            return seen
    return _observe_run(model, example_inputs, training, dry=False)


def _answered(seen: dict[str, tuple[torch.nn.Module, dict]], tuning: Tuning) -> bool:
    """Whether selecting what ``seen`` holds measures nothing: the mode never measures, or the database
    answers every direction of every (layer, input) under the tuning's policy, as ``select`` asks it."""
    if not tuning.measures:
        return True
    if tuning.mode == "find":  # measures every time: nothing is answered
        return False
    for module, calls in seen.values():
        if not _tunable(module):
            continue  # left alone (and its weight not read: a parametrized one computes it, changing its state)
        for sig, (need_dx, need_dw) in calls.items():
            try:
                problem = describe(module, sig)
            except (TypeError, ValueError):
                continue  # stays on torch's path: nothing to select
            if any(tuning.stored(problem.with_direction(d)) is None for d in directions_needed(need_dx, need_dw)):
                return False
    return True


def _observe_run(model: torch.nn.Module, example_inputs: Any, training: bool,
                 dry: bool) -> dict[str, tuple[torch.nn.Module, dict]]:
    """The example run, with the hook recording each conv layer's calls (``dry``: the layers computing
    nothing, ``_dry_forward``)."""
    names: dict[_ConvNd, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, _CONV_TYPES):
            names.setdefault(module, name)  # a shared layer is known by its first name
    seen: dict[str, tuple[torch.nn.Module, dict]] = {}

    def hook(module: _ConvNd, args: tuple, kwargs: dict) -> None:  # registered on the conv layers only
        x = args[0] if args else kwargs.get("input")  # a conv's forward takes its input by position or as input=
        if not isinstance(x, torch.Tensor):
            return
        sig, need_dx, need_dw = _observed_call(module, x, training)
        _, calls = seen.setdefault(names[module], (module, {}))
        dx, dw = calls.get(sig, (False, False))
        calls[sig] = (dx or need_dx, dw or need_dw)

    handles, shadowed = [], []
    try:
        for module in names:
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            forward, changed = module.forward, False
            if isinstance(module, TunedConv):
                # Already converted (optimize called again): observe on torch's path, tune nothing yet.
                base = next(c for c in type(module).__mro__ if c in TUNED)
                forward, changed = functools.partial(base.forward, module), True
            if dry and _tunable(module):
                # (a subclass of a conv module, whose forward may differ, runs its own: it is not tuned)
                forward, changed = functools.partial(_dry_forward, module, forward, training), True
            if changed:
                # An instance attribute that shadows the forward until the run ends, on purpose; one the
                # module had already (a library's wrapper, say) is put back afterwards.
                shadowed.append((module, module.__dict__.get("forward", _NONE)))
                module.forward = forward  # type: ignore[method-assign]
        with _leave_no_trace(model, example_inputs), torch.set_grad_enabled(training):
            _call(model, example_inputs)
    finally:
        for handle in handles:
            handle.remove()
        for module, own in shadowed:
            if own is _NONE:
                del module.forward
            else:
                module.forward = own  # type: ignore[method-assign]
    return seen


_NONE = object()  # a module without a forward of its own (an instance attribute)


def _tunable(module: torch.nn.Module) -> bool:
    """Whether ``optimize`` tunes ``module``: a conv module of torch's own (or one it converted already); a subclass,
    whose forward may differ (a parametrized one, say), is left alone."""
    return isinstance(module, TunedConv) or type(module) in TUNED


def optimize(model: torch.nn.Module, example_inputs: Any, policy: Policy | None = None, training: bool = False,
             mode: str = "hybrid", db: Any = None, workspace_budget: int | str | None = None) -> torch.nn.Module:
    """Tune every convolution of ``model`` for the inputs it sees, and make it run the selections.

    example_inputs: a tensor, a tuple of the model's positional arguments, or a dict of keyword
    arguments; the model runs on them (in its current train/eval mode; buffers and random generators are restored):
    once dry, its conv layers computing nothing, and again with them where the database does not answer what that
    run met (forward hooks fire in each run; docs/runtime.md, "Warm starts"). Each nn.Conv1d/2d/3d that runs is
    tuned for the input it receives
    (its shape, dtype, device and memory layout: a channels_last input makes a channels_last
    problem; under ``torch.autocast`` the autocast dtype, so call ``optimize`` inside the same
    autocast region the model will run under: a signature met first inside a CUDA-graph capture
    or a compiled region is tuned there), the forward direction always, and with ``training=True``
    bwd_filter (if the weight
    requires grad) and bwd_data (if the layer's input requires grad: not for a first layer fed
    plain inputs). policy, mode ('hybrid': the database else find; 'db_then_get': the database
    else the cost model, never measuring; 'find'; 'get') and db (a ``TuningDB``; None: the default
    one where the mode reads one) decide as in ``convtune.select``; they also decide input
    signatures first met later, on their first call. workspace_budget (bytes or a size like
    '64MiB'; None: no budget) bounds the one workspace buffer the layers share: every layer tunes
    with it as its policy's workspace_limit (the smaller of the two), then, where the database
    holds the layers' measurements, ``convtune.plan`` in 'shared' mode makes the choices of
    least total time within it (a layer the plan cannot serve keeps its own choice).

    The layers become ``convtune.nn`` modules in place (the same objects, same Parameters and
    hooks). A layer no algorithm serves under the policy stays on torch's path (logged; see
    ``explain``); subclasses of the conv modules, whose forward may differ, are left alone.
    A rich progress bar shows the tuning unless ``settings.progress`` is off. Returns ``model``.
    Raises ``TypeError`` for a model that is not an nn.Module, ``ValueError`` for an unknown mode.

        >>> import torch, convtune
        >>> net = torch.nn.Conv1d(2, 4, 3)
        >>> net = convtune.optimize(net, torch.randn(1, 2, 16), mode="get")
        >>> [row["direction"] for row in convtune.explain(net)]
        ['fwd']
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"optimize() takes a torch.nn.Module, got {type(model).__name__}")
    check_type(training, bool, "optimize()'s training (True: tune the backward directions too)")
    check_db(db, "optimize()")
    budget = None if workspace_budget is None else parse_bytes(workspace_budget, "optimize(workspace_budget=...)")
    tuning = Tuning(_within(policy, budget), mode, db)  # validates policy and mode before anything runs
    if mode == "background":  # the example's inputs as 'hybrid' (optimize is the tuning step); later shapes
        tuning.mode = "hybrid"  # in the background, from the end of this call
    seen = _observe(model, example_inputs, training, tuning)
    for name, module in model.named_modules():
        if isinstance(module, _CONV_TYPES) and not _tunable(module):
            log.warning("%s is a %s, a subclass of a torch conv module whose forward may differ: left on "
                        "torch's path", name or "the model", type(module).__name__)
    jobs = [(name, module, sig, needs) for name, (module, calls) in seen.items()
            if _tunable(module) for sig, needs in calls.items()]
    if not jobs:
        transposes = (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)
        transposed = [name or "the model" for name, module in model.named_modules() if isinstance(module, transposes)]
        log.warning("optimize: the example inputs ran no convolution that convtune tunes (torch.nn.Conv1d, Conv2d or "
                    "Conv3d, or convtune.nn's)%s; the model is returned as it was",
                    f"; transposed convolutions ({', '.join(map(repr, transposed[:3]))}) are left on torch's path"
                    if transposed else "")
    # A network is tuned one way (convtune.network): every layer's directions selected (a module's
    # backward ones only while its forward is served), each module's selection made of them (checked,
    # judged by the host-cost rule), and under a budget the layers that run convtune's algorithms
    # planned together, their selections made again from the plan's choices.
    layers, owners = [], []  # owners: the job and direction of each layer row
    for index, (name, module, sig, (need_dx, need_dw)) in enumerate(jobs):
        if not isinstance(module, TunedConv) or module._convtune_tuning is not tuning:
            convert(module, tuning)
        try:
            problem = describe(module, sig)
        except (TypeError, ValueError):
            continue  # select_for_layer below puts the layer on torch's path, with the reason
        for direction in directions_needed(need_dx, need_dw):
            layers.append((f"{name or type(module).__name__}", problem.with_direction(direction), 1))
            owners.append((index, direction))
    rows = select_layers(layers, tuning, "convtune: tuning", transient=True, groups=[i for i, _ in owners])
    chosen: dict[int, dict[str, PerfResult | str]] = {}
    for (index, direction), row in zip(owners, rows):
        chosen.setdefault(index, {})[direction] = row.result or row.error
    selections = {index: _select(jobs[index], tuning, chosen.get(index, {})) for index in range(len(jobs))}
    if budget is not None:
        planned = [i for i, (index, _) in enumerate(owners) if not selections[index].on_torch]
        replanned = set()
        for i, row in zip(planned, _within_budget([rows[i] for i in planned], tuning)):
            index, direction = owners[i]
            if row.result is not None and row.result != rows[i].result:
                chosen[index][direction] = row.result
                replanned.add(index)
        for index in replanned:
            selections[index] = _select(jobs[index], tuning, chosen[index])
    for index, (_, module, sig, _) in enumerate(jobs):
        cast(TunedConv, module)._convtune_select(sig, selections[index])  # converted above
    tuning.mode = mode
    return model


def _select(job: tuple, tuning: Tuning, chosen: dict[str, PerfResult | str]) -> LayerSelection:
    name, module, sig, (need_dx, need_dw) = job
    return select_for_layer(module, sig, tuning, directions_needed(need_dx, need_dw), name=name, chosen=chosen)


def _within_budget(rows: list[LayerRow], tuning: Tuning) -> list[LayerRow]:
    """``rows`` (one run each) with the choices of the shared-workspace plan of least total time, where one
    can be made; a layer keeps its own choice where the plan's is not registered here or does not serve it."""
    if tuning.db is None:
        log.info("optimize: no tuning database to plan the workspace budget from; each layer chose within it alone")
        return rows
    try:
        planned = planned_rows(rows, plan_layers(rows, tuning, cast(int, tuning.policy.workspace_limit)))
    except (NoAlgorithmError, InfeasibleBudgetError) as exc:
        log.warning("optimize: no workspace plan (%s); each layer keeps the choice it made within the budget", exc)
        return rows
    kept = []
    for own, new in zip(rows, planned):  # one run each: a row in, a row out
        try:
            serves = new.result is not None and bool(get_algorithm(new.result.algorithm, new.problem).supports(
                new.problem))
        except KeyError:  # stored by a backend not registered here
            serves = False
        kept.append(new if serves else own)
    return kept


def _within(policy: Any, budget: int | None) -> Any:
    """``policy`` with its workspace_limit lowered to ``budget`` (anything not a Policy is left to Tuning to reject)."""
    if budget is None or not (policy is None or isinstance(policy, Policy)):
        return policy
    policy = policy or Policy()
    limit = budget if policy.workspace_limit is None else min(policy.workspace_limit, budget)
    return dataclasses.replace(policy, workspace_limit=limit)
