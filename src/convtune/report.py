"""Human-readable tables of tuning results (rich), shared by the CLI and ``summary`` calls."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from .hardware import roofline_ms
from .network import LayerRow
from .problem import ConvProblem
from .results import Choice, PerfResult
from .units import format_bytes, format_ms


def percent_of_floor(floor_ms: float, time_ms: float | None) -> str:
    """The hardware floor's time as a percentage of ``time_ms`` (how near the roofline it runs)."""
    return "-" if not time_ms else f"{100 * floor_ms / time_ms:.1f}%"


def problem_title(problem: ConvProblem) -> str:
    size = "x".join(map(str, problem.input_size))
    kernel = "x".join(map(str, problem.kernel_size))
    stride = "x".join(map(str, problem.stride))
    groups = f" g{problem.groups}" if problem.groups > 1 else ""
    return (f"{problem.direction} n{problem.n} {problem.c}->{problem.k} {size} k{kernel} s{stride}{groups} "
            f"{problem.dtype} {problem.layout} {problem.device}")


def perf_table(problem: ConvProblem, results: Sequence[PerfResult]) -> Table:
    """One row per candidate: status, median time, spread, workspace, % of the roofline floor, error."""
    floor = roofline_ms(problem)
    table = Table(title=f"{problem_title(problem)}  (roofline floor {format_ms(floor)} ms)")
    for column in ("algorithm", "status", "time ms", "spread ms", "workspace", "% of floor", "rel. error", "note"):
        table.add_column(column, justify="right" if column not in ("algorithm", "status", "note") else "left")
    for r in results:
        table.add_row(r.algorithm, r.status.value, format_ms(r.time_ms), format_ms(r.spread_ms),
                      format_bytes(r.workspace_bytes),
                      percent_of_floor(floor, r.time_ms), "-" if r.rel_error is None else f"{r.rel_error:.1e}",
                      r.message[:60])
    return table


def choices_table(problem: ConvProblem, choices: Sequence[Choice]) -> Table:
    floor = roofline_ms(problem)
    table = Table(title=f"{problem_title(problem)}  (predicted; roofline floor {format_ms(floor)} ms)")
    for column in ("rank", "algorithm", "predicted ms", "workspace", "% of floor"):
        table.add_column(column, justify="left" if column == "algorithm" else "right")
    for i, c in enumerate(choices, 1):
        table.add_row(str(i), c.name, format_ms(c.predicted_ms), format_bytes(c.workspace_bytes),
                      percent_of_floor(floor, c.predicted_ms))
    return table


def layer_groups(names: Sequence[str], problems: Sequence[ConvProblem],
                 choices: Sequence[PerfResult]) -> list[tuple[str, ConvProblem, list[int]]]:
    """Indices of the runs of one layer with one choice, in order of first appearance.

    A plan lists a layer that runs 3 times as 3 problems; they share one row per distinct choice
    (a divided budget may give the runs of one layer different algorithms).

        >>> from convtune import ConvProblem, PerfResult
        >>> p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(6, 6), kernel_size=1)
        >>> a, b = PerfResult("x:a", "ok", 1.0), PerfResult("x:b", "ok", 2.0)
        >>> [(name, runs) for name, _, runs in layer_groups(["L0", "L0", "L0"], [p, p, p], [a, b, a])]
        [('L0', [0, 2]), ('L0', [1])]
    """
    groups: dict[tuple[str, str, str], tuple[str, ConvProblem, list[int]]] = {}
    for i, (name, problem, choice) in enumerate(zip(names, problems, choices)):
        groups.setdefault((name, problem.key, choice.algorithm), (name, problem, []))[2].append(i)
    return list(groups.values())


def tune_table(title: str, rows: Sequence[LayerRow], total_workspace_bytes: int | None = None) -> Table:
    """Per-layer choices with a total line (times weighted by how often each layer runs).

    total_workspace_bytes: the footer's workspace (default: the largest of the rows, what layers
    that run one after another and share one buffer need).
    """
    table = Table(title=title, show_footer=True)
    total_ms = sum((r.result.time_ms or 0) * r.count for r in rows if r.result)
    total_floor = sum(r.floor_ms * r.count for r in rows)
    timed = all(r.result and r.result.time_ms is not None for r in rows)
    columns = [("layer", "total"), ("problem", ""), ("count", str(sum(r.count for r in rows))), ("choice", ""),
               ("time ms", format_ms(total_ms) if timed else "-"),
               ("workspace", format_bytes(total_workspace_bytes if total_workspace_bytes is not None else
                                          max((r.result.workspace_bytes for r in rows if r.result), default=0))),
               ("% of floor", percent_of_floor(total_floor, total_ms) if timed else "-")]
    for name, footer in columns:
        table.add_column(name, footer=footer, justify="left" if name in ("layer", "problem", "choice") else "right")
    for r in rows:
        res = r.result
        choice = res.algorithm if res else f"none ({r.error[:40]})"
        table.add_row(r.name, problem_title(r.problem), str(r.count), choice, format_ms(res.time_ms if res else None),
                      format_bytes(res.workspace_bytes) if res else "-",
                      percent_of_floor(r.floor_ms, res.time_ms if res else None))
    return table
