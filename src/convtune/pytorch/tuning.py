"""Tuning one layer: the problems a conv module solves on an input, and the algorithm for each direction.

A ``Tuning`` is how a model's layers choose (policy, ``select`` mode, database); a ``LayerSelection``
is what one layer chose for one input signature (shape, dtype, device, layout): an algorithm name
per direction, or torch's own path with the reason.

    >>> conv = torch.nn.Conv2d(2, 4, 3, padding=1)
    >>> sig = Signature((1, 2, 6, 6), torch.float32, torch.device("cpu"), "channels_first")
    >>> selection = select_for_layer(conv, sig, Tuning(mode="get"), ("fwd",))
    >>> selection.on_torch, selection.fwd != "", selection.bwd_data
    (False, True, '')
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import torch

from convtune import background, extension, ranking
from convtune.algorithms.native import wrong_in_pytorch
from convtune.algorithms.registry import get_algorithm
from convtune.errors import CANDIDATE_FAULTS, NoAlgorithmError
from convtune.network import Tuning
from convtune.policy import Policy
from convtune.problem import DIRECTIONS, ConvProblem, is_in_layout
from convtune.pytorch import host_costs, ops, runtime, workspace
from convtune.ranking import NATIVE
from convtune.results import PerfResult
from convtune.settings import settings

log = logging.getLogger(__name__)
ROUTED_THROUGH_THE_OP = ("torch:native through convtune's op: PyTorch's own call computes this problem wrongly in "
                         "some cases (CPU bfloat16)")


class Signature(NamedTuple):
    """What a layer's choice depends on besides the module: the (batched) input as the convolution sees it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    layout: str


def layout_of(x: torch.Tensor) -> str:
    """'channels_last' for a tensor dense in that order only, else 'channels_first' (what torch assumes)."""
    if is_in_layout(x, "channels_last") and not is_in_layout(x, "channels_first"):
        return "channels_last"
    return "channels_first"


@dataclasses.dataclass(frozen=True)
class LayerSelection:
    """What one layer runs for one input signature.

    problem: the forward problem's key ('' when none could be built, e.g. float64 input).
    fwd, bwd_data, bwd_filter: algorithm names ('' for a direction not tuned: not needed so far).
    results: (direction, PerfResult) of each tuned direction. reason: why torch's path, if it is (or, with
    compiled_torch or compiled_torch_no_grad, why compiled code calls it).
    host_rule: PyTorch's own call was chosen by the host-cost rule (``where_the_host_pays``) over
    the tuned choices, so adding a direction judges them again.
    compiled_torch: in compiled code (an input of static shape) the layer calls PyTorch's convolution, which
    Inductor calls for less host time than convtune's op (``tuned_run``, once per direction): its choices gain
    less GPU time than that (``where_the_host_pays``); eager code runs them.
    no_grad: on a layer that calls PyTorch's convolution (``runtime`` 'torch', torch:native chosen in every
    direction), the forward's algorithm that eager code runs instead for a call that needs no gradient, where its
    path costs the layer less (``for_calls_without_gradients``); '' for none.
    compiled_torch_no_grad: in compiled code a call that needs no gradient (inference) calls PyTorch's
    convolution, where the layer runs its executables otherwise: the forward's own GPU gain is smaller than what
    compiled code pays to call the op for it (a layer tuned for training is judged by the sum over its directions,
    which may gain in the gradients alone).
    """

    problem: str
    fwd: str = ""
    bwd_data: str = ""
    bwd_filter: str = ""
    results: tuple[tuple[str, PerfResult], ...] = ()
    reason: str = ""
    host_rule: bool = False
    compiled_torch: bool = False
    no_grad: str = ""
    compiled_torch_no_grad: bool = False
    call: ops.Call | None = dataclasses.field(init=False, compare=False, repr=False)
    native: tuple[int, int, int] | None = dataclasses.field(init=False, compare=False, repr=False)
    python_reason: str = dataclasses.field(init=False, compare=False, repr=False)  # explain's note on the path
    no_grad_handle: int = dataclasses.field(init=False, compare=False, repr=False)  # no_grad's executable, or 0

    @property
    def on_torch(self) -> bool:
        """The layer runs PyTorch's own convolution for this signature."""
        return not self.fwd

    @property
    def native_only(self) -> bool:
        """Every tuned direction chose torch:native: the module calls torch directly, with no op's host cost
        (except where PyTorch's own call computes the problem wrongly and torch:native does not)."""
        names = [name for name in (self.fwd, self.bwd_data, self.bwd_filter) if name]
        return bool(names) and all(name == NATIVE for name in names) and not wrong_in_pytorch(
            ops.problem_of(self.problem))

    def __post_init__(self) -> None:
        # What the module runs, set once here (the eager forward reads it every call; compiled code reads
        # the module's table made from it, ``TunedConv._convtune_select``): ``native``, the executables'
        # handles (fwd, bwd_data, bwd_filter; 0 for a direction not tuned) when the C++ runtime runs every
        # tuned direction; else ``call``, the Python path, with ``python_reason`` saying why; neither when
        # the layer calls torch.
        native, call, why = None, None, ""
        if not (self.on_torch or self.native_only):
            native, why = _native_handles(self)
            if native is None:
                call = ops.Call(self.problem, self.fwd, self.bwd_data, self.bwd_filter)
            if {self.fwd, self.bwd_data, self.bwd_filter} <= {NATIVE, ""}:  # torch:native, not PyTorch's call
                why = "; ".join(filter(None, (ROUTED_THROUGH_THE_OP, why)))
        no_grad = 0
        if self.no_grad and native is None and call is None:  # (else its forward's executable runs such a call)
            no_grad = ops.native_or_why(ops.problem_of(self.problem), self.no_grad)[0]
        object.__setattr__(self, "native", native)
        object.__setattr__(self, "call", call)
        object.__setattr__(self, "python_reason", why)
        object.__setattr__(self, "no_grad_handle", no_grad)

    def __reduce__(self):
        # Copies and pickles are made anew, so their executables exist in the process that runs them.
        return LayerSelection, (self.problem, self.fwd, self.bwd_data, self.bwd_filter, self.results, self.reason,
                                self.host_rule, self.compiled_torch, self.no_grad, self.compiled_torch_no_grad)

    @property
    def runtime(self) -> str:
        """What runs the layer: 'torch' (PyTorch's own call), 'native' (convtune's C++ ops) or 'python'."""
        return "torch" if self.call is None and self.native is None else ("native" if self.native else "python")

    def covers(self, need_dx: bool, need_dw: bool) -> bool:
        """Whether every direction a call needs has its algorithm (or the call goes to torch anyway)."""
        return self.on_torch or (bool(self.bwd_data or not need_dx) and bool(self.bwd_filter or not need_dw))


LayerPlan = LayerSelection  # the name before; models pickled then still load


def _native_handles(selection: LayerSelection) -> tuple[tuple[int, int, int] | None, str]:
    """The handles of ``selection``'s executables, or (None, why the layer runs on the Python path)."""
    base = ConvProblem.from_key(selection.problem)
    handles = []
    for direction in DIRECTIONS:
        name = getattr(selection, direction)
        handle, why = ops.native_or_why(base.with_direction(direction), name) if name else (0, "")
        if name and not handle:
            log.info("%s runs on the Python path: %s: %s", selection.problem, direction, why)
            return None, f"{direction}: {why}"
        handles.append(handle)
    return (handles[0], handles[1], handles[2]), ""


def _torch_path(problem: str, reason: str, module_name: str) -> LayerSelection:
    log.info("%s stays on torch's path for %s: %s", module_name or "conv", problem, reason)
    return LayerSelection(problem, reason=reason)


def directions_needed(need_dx: bool, need_dw: bool) -> tuple[str, ...]:
    """The directions a layer tunes: the forward, and the gradients a call will need."""
    return ("fwd",) + ("bwd_data",) * need_dx + ("bwd_filter",) * need_dw


def describe(module: torch.nn.Module, signature: Signature) -> ConvProblem:
    """The forward problem ``module`` solves on inputs of ``signature``; ``TypeError`` or ``ValueError`` where
    convtune cannot describe it (float64 input, say: the layer then stays on torch's path)."""
    return ConvProblem.from_module(module, signature.shape, dtype=signature.dtype, layout=signature.layout,
                                   device=signature.device)


def select_for_layer(module: torch.nn.Module, signature: Signature, tuning: Tuning, directions: tuple[str, ...],
               known: LayerSelection | None = None, name: str = "",
               chosen: Mapping[str, PerfResult | str] | None = None) -> LayerSelection:
    """The selection of ``module`` (an nn.Conv1d/2d/3d) for ``signature``, tuning ``directions`` not in ``known``.

    Each direction is chosen by ``tuning.select``, or given in ``chosen`` (a direction's choice, or why
    no algorithm serves it: ``optimize`` selects a network's layers first, ``convtune.network``); on the
    Python path its workspace is reserved now, so running the selection allocates none. A problem
    convtune cannot describe (float64 input, say), a direction no algorithm serves under the policy,
    or a stored choice naming an algorithm that is not registered here leaves the layer on torch's
    path for this signature, with the reason.
    """
    try:
        problem = describe(module, signature)
    except (TypeError, ValueError) as exc:
        described = f"input {tuple(signature.shape)} {signature.dtype} {signature.device}"
        return _torch_path(described, str(exc), name)
    names = {d: getattr(known, d) for d in DIRECTIONS} if known else dict.fromkeys(DIRECTIONS, "")
    results = dict(known.results) if known else {}
    if known is not None and known.host_rule:  # judged again with the new directions
        for direction in results:
            results[direction] = tuning.select(problem.with_direction(direction))
            names[direction] = results[direction].algorithm
    for direction in directions:
        if names[direction]:
            continue
        p = problem.with_direction(direction)
        given = chosen.get(direction) if chosen else None
        if isinstance(given, str):
            return _torch_path(problem.key, f"{direction}: {given}", name)
        try:
            result = given if given is not None else tuning.select(p)
        except NoAlgorithmError as exc:
            return _torch_path(problem.key, f"{direction}: {exc}", name)
        if not ops.native_or_why(p, result.algorithm, tuning.db)[0]:  # a warm start needs no more than that
            try:
                algorithm = get_algorithm(result.algorithm, p)
            except KeyError as exc:
                return _torch_path(problem.key, f"{direction}: the chosen {result.algorithm!r} is not registered "
                                                f"here ({exc}); register its backend or clear the tuning database",
                                   name)
            support = algorithm.supports(p)
            if not support:
                return _torch_path(problem.key, f"{direction}: the chosen {result.algorithm} does not support "
                                                f"the problem ({support.reason})", name)
            try:  # its workspace, reserved below (a cuDNN execution plan is built here)
                algorithm.buffer_bytes(p)
            except CANDIDATE_FAULTS as exc:  # a stored cuDNN execution plan this cuDNN no longer builds, say
                return _torch_path(problem.key, f"{direction}: the chosen {result.algorithm} cannot run here "
                                                f"({type(exc).__name__}: {exc})", name)
        names[direction] = result.algorithm
        results[direction] = result
    ordered = tuple((d, results[d]) for d in DIRECTIONS if d in results)
    selection = LayerSelection(problem.key, **names, results=ordered)
    selection = where_the_host_pays(on_the_cheaper_path(selection, tuning), tuning)
    selection = for_calls_without_gradients(selection, tuning)
    reserve_workspace(selection, signature.device)
    return selection




def on_the_cheaper_path(selection: LayerSelection, tuning: Tuning) -> LayerSelection:
    """``selection``, its directions that chose torch:native each moved to the member of their tie whose path costs
    the layer least, where that lowers the layer's cost: GPU time measured plus the host time its path adds over
    PyTorch's call (``host_costs.extra_host_us``).

    select gives a tie (results within ``policy.tolerance`` of the fastest) to torch:native, which needs no
    workspace of convtune's. On the native runtime a cuDNN execution plan's executable costs the host less a call
    than PyTorch's own convolution (its measured cost is below 0), so host-bound eager code runs faster on it
    (bench/results/tie_paths.md). A layer on PyTorch's call (torch:native in every direction) counts no host time; on
    convtune's op each direction counts its executable's kind, torch:native's ('native') too. Per direction the
    cheapest of torch:native through the op and each member of the tie with an executable; the layer moves where the
    sum is below what it costs as chosen. Only measured results are judged (the database's, under the tuning's
    policy); not a layer on the Python path (its cost is that path's whatever runs it), nor under
    ``prefer='least_memory'``, whose ties go to the least workspace; settings.host_rule=False turns it off with the
    rule it belongs to."""
    if selection.call is not None or not _ties_may_move(tuning):
        return selection
    costs = tie_costs(selection, tuning)
    if costs is None or costs.moved_us >= costs.as_chosen_us:
        return selection
    fwd, bwd_data, bwd_filter = (costs.names[d] for d in DIRECTIONS)
    chosen = LayerSelection(selection.problem, fwd, bwd_data, bwd_filter, results=costs.results)
    if chosen.native is None:  # an executable that would not build here: the Python path costs more than it saves
        return selection
    log.info("%s: the ties select gave torch:native run %s, which costs the layer %.1f us less a step (GPU and host)",
             selection.problem, ", ".join(costs.names[d] for d, r in selection.results if r.algorithm == NATIVE),
             costs.as_chosen_us - costs.moved_us)
    return chosen


def for_calls_without_gradients(selection: LayerSelection, tuning: Tuning) -> LayerSelection:
    """``selection``, given the forward's path that a call needing no gradient takes (``no_grad``) where the layer
    calls PyTorch's convolution for a tuned gradient: the member of the forward's tie whose path costs that call less
    than PyTorch's call does (GPU time measured plus the host time its executable adds, ``host_costs.extra_host_us``).

    A layer tuned for training is judged by the sum over its directions (``on_the_cheaper_path``), so where its
    backward's paths cost more than its forward saves it stays on PyTorch's call, and so did its inference calls; an
    executable of a cuDNN execution plan costs the host less a forward than that call (bench/results/tie_paths.md).
    A layer tuned for its forward alone is judged so already. The same conditions as ``on_the_cheaper_path``."""
    if selection.runtime != "torch" or selection.fwd != NATIVE or len(selection.results) < 2 \
            or not _ties_may_move(tuning):
        return selection
    problem = ConvProblem.from_key(selection.problem)
    native = tuning.db.result(problem, NATIVE)  # measured (select's answer in mode 'get' is a prediction)
    if native is None or not (native.ok and native.time_ms):
        return selection
    member, _ = _cheapest_of_the_tie(problem, _usable(problem, tuning.policy, tuning.db), tuning.policy, tuning.db,
                                     1e3 * native.time_ms)
    if member is None:
        return selection
    chosen = dataclasses.replace(selection, no_grad=member.algorithm)
    if not chosen.no_grad_handle:  # an executable that would not build here
        return selection
    log.info("%s: a call that needs no gradient runs %s, which costs it less than PyTorch's call",
             selection.problem, member.algorithm)
    return chosen


def _ties_may_move(tuning: Tuning) -> bool:
    """Whether a tie given to torch:native may take another path under ``tuning``: the host-cost rule on, the native
    runtime on and loaded, measurements at hand, and a policy whose ties do not go to the least workspace."""
    return (settings.host_rule and settings.native and tuning.db is not None
            and tuning.policy.prefer != "least_memory" and runtime.available())


class TieCosts(NamedTuple):
    """``on_the_cheaper_path``'s figures for one layer: its cost a step as chosen and with its ties moved (GPU time
    measured plus the host time its path adds, us), and the names and results it would run moved."""

    as_chosen_us: float
    moved_us: float
    names: dict[str, str]
    results: tuple[tuple[str, PerfResult], ...]


def tie_costs(selection: LayerSelection, tuning: Tuning) -> TieCosts | None:
    """``on_the_cheaper_path``'s judgement of ``selection`` (on the native runtime, its tuning's database at hand),
    or None where no direction chose torch:native or one of those has no measured time of it."""
    natives = [direction for direction, chosen in selection.results if chosen.algorithm == NATIVE]
    if not natives:
        return None
    base = ConvProblem.from_key(selection.problem)
    on_torch = len(natives) == len(selection.results) and not wrong_in_pytorch(base)
    names = {d: getattr(selection, d) for d in DIRECTIONS}
    results = dict(selection.results)
    as_chosen = moved = 0.0
    for direction in natives:
        problem = base.with_direction(direction)
        native = tuning.db.result(problem, NATIVE)  # measured (select's answer in mode 'get' is a prediction)
        if native is None or not (native.ok and native.time_ms):
            return None
        through_op = 1e3 * native.time_ms + host_costs.extra_host_us(problem, "native", tuning.db)
        as_chosen += through_op if not on_torch else 1e3 * native.time_ms
        cheapest, cost = _cheapest_of_the_tie(problem, _usable(problem, tuning.policy, tuning.db), tuning.policy,
                                              tuning.db, through_op)
        moved += cost  # (the layer runs on the op once any direction moves: torch:native's through it)
        if cheapest is not None:
            names[direction], results[direction] = cheapest.algorithm, cheapest
    return TieCosts(as_chosen, moved, names, tuple((d, results[d]) for d in DIRECTIONS if d in results))


def _usable(problem: ConvProblem, policy: Policy, db: Any) -> list[PerfResult]:
    """``db``'s results of ``problem`` that ``policy`` allows."""
    return [r for r in db.results(problem) if ranking.usable(r, policy, problem.dtype)]


def _cheapest_of_the_tie(problem: ConvProblem, usable: list[PerfResult], policy: Policy, db: Any,
                         bound_us: float) -> tuple[PerfResult | None, float]:
    """(result, its cost a call in us: GPU time measured plus its path's host time) of the member of ``problem``'s tie
    among ``usable`` (its results the policy allows: those within the policy's tolerance of the fastest, other than
    torch:native's) whose native executable costs least, where that is below ``bound_us``; else (None, ``bound_us``).
    A member's kind is read without making it; one without an executable here (the Python path), or a faulty
    plug-in, is no member."""
    cheapest, cost = None, bound_us
    if not usable:
        return cheapest, cost
    limit = min(cast(float, r.time_ms) for r in usable) * (1 + policy.tolerance)
    for result in usable:
        if cast(float, result.time_ms) > limit or result.algorithm == NATIVE:
            continue
        try:
            here = 1e3 * cast(float, result.time_ms) + host_costs.extra_host_us(
                problem, runtime.kind_of(problem, result.algorithm, db), db)
        except CANDIDATE_FAULTS as exc:  # the Python path, no executable here (REFUSALS), or a faulty plug-in
            log.debug("%s: %s is no executable of the tie (%s)", problem.key, result.algorithm, exc)
            continue
        if here < cost:
            cheapest, cost = result, here
    return cheapest, cost


def make_measured_executables(problem: ConvProblem, policy: Policy, db: Any) -> None:
    """What the background worker does once it has stored ``problem``'s measurement (``background.after_measuring``):
    make the executables a layer switching to it may run, so that the layer's next call only takes them (a ResNet-18
    size's switch made about 30 on the training step: 0.12 s, bench/results/dynamic_shapes_resnet18_b32.md): the
    policy's first, and where that is torch:native and ``on_the_cheaper_path`` may move it, the member of its tie
    that the move would take. Nothing where the native runtime is off or not loaded, or the process is ending."""
    if not settings.native or extension.loaded() is None or db is None or background.stopping():
        return
    usable = _usable(problem, policy, db)
    if not usable:
        return
    first = ranking.rank(usable, policy, problem.dtype)[0]
    wanted = [first.algorithm]
    if first.algorithm == NATIVE and settings.host_rule and policy.prefer != "least_memory":
        through_op = 1e3 * cast(float, first.time_ms) + host_costs.extra_host_us(problem, "native", db)
        member, _ = _cheapest_of_the_tie(problem, usable, policy, db, through_op)
        if member is not None:
            wanted.append(member.algorithm)
    for name in wanted:
        if background.stopping():
            return
        try:
            runtime.prepare(problem, name, db)
        except CANDIDATE_FAULTS as exc:  # made (or refused) on the layer's call instead
            log.debug("%s: no executable of %s made in the background (%s)", problem.key, name, exc)


background.after_measuring(make_measured_executables)


def where_the_host_pays(selection: LayerSelection, tuning: Tuning) -> LayerSelection:
    """``selection``, or PyTorch's own call in every direction where that is no slower in eager code.

    The rule: a layer gains, per step, the measured GPU time of torch:native minus that of its choice,
    summed over its tuned directions; it pays, per step, the host time its path adds over PyTorch's
    call (``host_costs.extra_host_us``, measured once per machine and kept in the database: an executable's, or
    the Python path's as a layer pays it, a Triton kernel's apart). Where the gain is smaller than the cost,
    the layer calls PyTorch. Only measured choices are judged (the database holds torch:native's
    time for every tuned direction); settings.host_rule=False turns the rule off.
    """
    if selection.runtime == "torch" or not settings.host_rule or tuning.db is None or not selection.results:
        return selection
    base = ConvProblem.from_key(selection.problem)
    if wrong_in_pytorch(base):  # PyTorch's own call is no option there: torch:native would run through the op too
        return selection
    gain_us = cost_us = 0.0
    forward = (0.0, 0.0)  # the forward's own gain and cost (for a call that needs no gradient)
    natives = {}
    for direction, chosen in selection.results:
        problem = base.with_direction(direction)
        native = tuning.db.result(problem, NATIVE)
        if native is None or not ranking.usable(native, tuning.policy, problem.dtype) or chosen.time_ms is None:
            return selection  # (PyTorch's own call is no option where the policy refuses torch:native)
        natives[direction] = native
        gain_us += 1e3 * (native.time_ms - chosen.time_ms)
        # On the Python path (one of the layer's directions runs a Python algorithm) every direction pays that
        # path's modules and autograd, its Python algorithms their kind's (Triton's launcher); on the native
        # runtime each direction pays its executable's kind.
        if selection.call is None:
            kind = runtime.prepare(problem, chosen.algorithm)[1]
        elif ops.native_handle(problem.key, chosen.algorithm):
            kind = "python"
        else:
            kind = get_algorithm(chosen.algorithm, problem).host_kind
        extra_us = host_costs.extra_host_us(problem, kind, tuning.db)
        cost_us += extra_us
        if direction == "fwd":
            forward = (1e3 * (native.time_ms - chosen.time_ms), extra_us)
    if gain_us >= cost_us:
        return _where_compiled_code_pays(selection, gain_us, cost_us, tuning, forward)
    log.info("%s calls PyTorch: its choices gain %.1f us of GPU time a step, their path costs %.1f us of host time",
             selection.problem, gain_us, cost_us)
    fwd, bwd_data, bwd_filter = (NATIVE if direction in natives else "" for direction in DIRECTIONS)
    return LayerSelection(selection.problem, fwd, bwd_data, bwd_filter, results=tuple(natives.items()), host_rule=True,
                     reason=f"PyTorch's own call: the tuned choices would gain {gain_us:.1f} us of GPU time a step "
                            f"but cost {cost_us:.1f} us more host time "
                            f"({', '.join(r.algorithm for _, r in selection.results)})")


def _where_compiled_code_pays(selection: LayerSelection, gain_us: float, eager_us: float, tuning: Tuning,
                              forward: tuple[float, float]) -> LayerSelection:
    """``selection``, marked ``compiled_torch`` where its GPU gain (``gain_us`` a step) is smaller than what
    compiled code pays for it: the host time its executables add (``eager_us``, as in eager code) and the calls
    of convtune's op rather than of PyTorch's convolution, one per direction tuned (``host_costs.compiled_call_us``:
    a static shape's call, ``tuned_run``); else marked ``compiled_torch_no_grad`` where the layer gains less than
    that in its forward alone (``forward``: the forward's gain and the host time its executable adds in eager
    code, us), which is all that a call needing no gradient runs (a layer tuned for its forward alone is judged
    so too). There an executable that eager code measured cheaper than PyTorch's call is charged nothing, not
    its saving: eager code's PyTorch call goes through the module's Python, which compiled code does not run
    (docs/performance.md: what it changed)."""
    if selection.native is None:  # the Python path: compiled code breaks the graph there whatever it gains
        return selection
    directions = {direction for direction, _ in selection.results}
    call_us = host_costs.compiled_call_us(ConvProblem.from_key(selection.problem).device, tuning.db)
    cost_us = eager_us + len(directions) * call_us
    if gain_us < cost_us:
        return dataclasses.replace(selection, compiled_torch=True, reason=(
            f"under torch.compile PyTorch's own call: the tuned choices gain {gain_us:.1f} us of GPU time a step, "
            f"less than the {cost_us:.1f} us of host time compiled code pays to call convtune's op"))
    forward_gain_us, forward_cost_us = forward[0], max(forward[1], 0.0) + call_us
    if forward_gain_us >= forward_cost_us:
        return selection
    return dataclasses.replace(selection, compiled_torch_no_grad=True, reason=(
        f"under torch.compile a call that needs no gradient calls PyTorch's convolution: the forward's choice gains "
        f"{forward_gain_us:.1f} us of GPU time, less than the {forward_cost_us:.1f} us of host time compiled code "
        f"pays to call convtune's op for it"))


def reserve_workspace(selection: LayerSelection, device: torch.device) -> None:
    """Reserve the Python path's run-time workspace for ``selection``'s Python algorithms (native executables,
    which run the layer's other directions, take theirs from PyTorch's caching allocator on each run, as
    PyTorch's own convolutions do)."""
    if selection.call is None:
        return
    base = ConvProblem.from_key(selection.problem)
    for direction, _ in selection.results:
        problem = base.with_direction(direction)
        name = getattr(selection, direction)
        if not ops.native_handle(problem.key, name):  # an executable takes its own
            workspace.reserve(get_algorithm(name, problem).buffer_bytes(problem), device)

