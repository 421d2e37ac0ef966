"""explain: what every convtune layer of a model runs, per input signature and direction.

    >>> import torch, convtune
    >>> net = convtune.optimize(torch.nn.Conv2d(2, 4, 3), torch.randn(1, 2, 8, 8), mode="get")
    >>> row = convtune.explain(net)[0]
    >>> row["module"], row["direction"], row["algorithm"] is not None
    ('', 'fwd', True)
"""

from __future__ import annotations

from typing import Any

import torch
from rich.table import Table

from convtune.problem import ConvProblem
from convtune.pytorch.modules import TunedConv
from convtune.report import problem_title
from convtune.units import format_bytes, format_ms


def explain(model: torch.nn.Module) -> list[dict[str, Any]]:
    """One dict per layer, input signature and tuned direction of ``model``'s convtune modules.

    Keys: module (its path in the model; '' for the model itself), problem (the key of the
    direction's ConvProblem, or a description of an input convtune cannot describe), direction,
    algorithm (None: torch's own path), runtime (what runs the layer: 'native', convtune's C++ ops;
    'torch', PyTorch's own call, where every direction chose torch:native (but for CPU bfloat16, which
    runs it through convtune's op) or none could be tuned;
    'python', convtune's Python path), status (the result's ``Status`` value, 'ok' for a choice measured or
    predicted; 'torch' on a layer that calls PyTorch for every direction, one row holding no result), time_ms (None
    when not measured), workspace_bytes
    note (why torch's or the Python path, on a layer that calls PyTorch the forward's path of a call that needs no
    gradient where it differs (``LayerSelection.no_grad``), or the result's message) and compiled (what torch.compile
    traces for the layer: 'executables', for an input of this static shape the chosen executables by handle
    (``tuned_conv``; a call needing no gradient traces PyTorch's convolution where the forward alone gains less
    than compiled code pays to call convtune's op, ``LayerSelection.compiled_torch_no_grad``, which the note
    says); 'torch', PyTorch's own convolution for an input of this static shape where the layer would
    call PyTorch or its choices gain less than compiled code pays to call convtune's op; 'layer op', its C++ op
    that looks every input shape up (a shape met first in compiled code; any symbolic shape takes it too); or
    'by shape', its choice per specialized shape; docs/runtime.md). Raises ``TypeError`` for a non-Module.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"explain() takes a torch.nn.Module, got {type(model).__name__}")
    rows = []
    for name, module in model.named_modules():
        if not isinstance(module, TunedConv):
            continue
        for sig, selection in module.selections.items():
            compiled = module._convtune_compiled_as(sig)
            if selection.on_torch:
                rows.append(dict(module=name, problem=selection.problem, direction="fwd", algorithm=None,
                                 runtime="torch", status="torch", time_ms=None, workspace_bytes=0,
                                 note=selection.reason, compiled=compiled))
                continue
            for direction, result in selection.results:
                key = ConvProblem.from_key(selection.problem).with_direction(direction).key
                no_grad = (f"a call that needs no gradient runs {selection.no_grad} (eager code's hot path)"
                           if direction == "fwd" and selection.no_grad_handle else "")
                note = "; ".join(n for n in (selection.reason, selection.python_reason, no_grad, result.message) if n)
                rows.append(dict(module=name, problem=key, direction=direction, algorithm=result.algorithm,
                                 runtime=selection.runtime, status=result.status.value, time_ms=result.time_ms,
                                 workspace_bytes=result.workspace_bytes, note=note, compiled=compiled))
    return rows


def explain_table(model: torch.nn.Module) -> Table:
    """``explain(model)`` as a rich Table, for ``rich.print`` or a ``Console``."""
    table = Table(title="convtune layers")
    for column in ("module", "problem", "direction", "algorithm", "runtime", "time ms", "workspace", "note"):
        table.add_column(column, justify="right" if column in ("time ms", "workspace") else "left")
    for row in explain(model):
        try:
            problem = problem_title(ConvProblem.from_key(row["problem"]))
        except ValueError:
            problem = row["problem"]
        table.add_row(row["module"] or "(model)", problem, row["direction"], row["algorithm"] or "torch",
                      row["runtime"], format_ms(row["time_ms"]), format_bytes(row["workspace_bytes"]), row["note"][:80])
    return table
