"""The HTML report of a workspace plan: the per-layer table, each layer's Pareto front, the budget curve.

``write_report`` writes one self-contained HTML file (inline CSS, no script, no URL that leaves
its folder) and, beside it, the PNG figures it shows, referred to by relative file name:
``<stem>_layer00.png``, ... (each layer's time/workspace Pareto front) and ``<stem>_budget.png``
(the network's total time as a function of the workspace budget). Move the HTML with its PNGs.
"""

from __future__ import annotations

import datetime
import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from matplotlib.figure import Figure  # Figure + savefig renders with Agg, never touching pyplot's global backend
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

from .files import writable
from .hardware import fingerprint, roofline_ms, software_versions
from .plan import Plan, budget_curve
from .policy import Policy
from .report import format_ms, layer_groups, percent_of_floor, problem_title
from .results import PerfResult
from .units import format_bytes, parse_bytes

_DPI = 110
_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #1d2329;
       margin: 24px auto; max-width: 1320px; padding: 0 16px; }
h1 { font-size: 24px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; }
.meta { color: #59636e; font-size: 12.5px; } .meta code { font-size: 12px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 16px 0; }
.card { border: 1px solid #d1d9e0; border-radius: 6px; padding: 8px 14px; min-width: 150px; }
.card b { display: block; font-size: 18px; } .card span { color: #59636e; font-size: 12px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
.scroll { overflow-x: auto; }
th, td { padding: 4px 8px; border-bottom: 1px solid #e3e8ee; text-align: right; white-space: nowrap; }
td.wrap { white-space: normal; min-width: 180px; } .same { color: #8c959f; }
th { background: #f3f5f7; position: sticky; top: 0; } td.l, th.l { text-align: left; }
td.algo { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px; }
tr.changed td { background: #fff8e6; } tfoot td { font-weight: 600; border-top: 2px solid #8c959f; }
.figs { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 14px; }
figure { margin: 0; border: 1px solid #e3e8ee; border-radius: 6px; padding: 6px; }
figure img { width: 100%; height: auto; } figcaption { font-size: 12px; color: #59636e; }
.wide img { max-width: 820px; width: 100%; }
"""


def write_report(plan: Plan, path: str | Path, title: str, budgets: Sequence[int | str] | None = None, db: Any = None,
                 policy: Policy | None = None, *, names: Sequence[str] | None = None) -> Path:
    """Write the HTML report of ``plan`` to ``path`` and its PNG figures beside it; return the HTML's path.

    budgets: the budgets (bytes or sizes like '1MiB') of the total-time-versus-budget figure (default: every workspace
    on the layers' Pareto fronts, which are the curve's steps in shared mode, plus a log grid in
    divided mode); db, policy: where the layers' measurements are and which of them are usable
    (the ones ``plan`` was given; db None means the default ``TuningDB()``). names: one layer name
    per problem of the plan (default L00, L01, ... by distinct problem). The PNGs are
    ``<stem>_layerNN.png`` and ``<stem>_budget.png``, referenced relatively. Raises ``ValueError``
    when ``names`` does not match the plan's problems or a budget is not a size, ``OSError`` when
    the folder is not writable.

        >>> import tempfile
        >>> from convtune import ConvProblem, PerfResult, plan
        >>> p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(8, 8), kernel_size=3, padding=1)
        >>> class Stored:  # any object with results(problem), like a TuningDB
        ...     def results(self, problem):
        ...         return [PerfResult("a:fast", "ok", time_ms=1.0, workspace_bytes=4096),
        ...                 PerfResult("a:lean", "ok", time_ms=3.0, workspace_bytes=0)]
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     html_path = write_report(plan([p], "1KiB", db=Stored()), Path(folder) / "net.html", "net", db=Stored())
        ...     sorted(f.name for f in html_path.parent.iterdir())
        ['net.html', 'net_budget.png', 'net_layer00.png']
    """
    if db is None:
        from .db import TuningDB

        db = TuningDB()
    writable(path, make_folder=True)  # (a tuning database given by mistake is refused before any work)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = _names(plan, names)
    layers = _layers(names, plan.problems)
    figures = []
    for k, (name, first, runs) in enumerate(layers):
        png = path.with_name(f"{path.stem}_layer{k:02d}.png")
        _pareto_figure(plan, first, runs, name, db, png)
        figures.append((png.name, f"{name}: {problem_title(plan.problems[first])}"))
    curve_png = path.with_name(f"{path.stem}_budget.png")
    if budgets is None:
        budgets = default_budgets(plan)
    budgets = [parse_bytes(b, "write_report(budgets=...)") for b in budgets]
    budgets = sorted(set(budgets) | {plan.workspace_budget or 0})
    _budget_figure(plan, budget_curve(plan.problems, budgets, db, policy, mode=plan.mode), curve_png)
    path.write_text(_html(plan, title, names, figures, curve_png.name), encoding="utf-8")
    return path


def default_budgets(plan: Plan) -> list[int]:
    """Budgets where the total time can change: 0, the fronts' workspaces (their sums' range when divided)."""
    fronts = [plan.pareto(i) for i in range(len(plan.problems))]
    points = {0} | {r.workspace_bytes for front in fronts for r in front}
    top = max(points)
    if plan.mode == "divided":  # steps lie at sums of workspaces: a grid of powers of two covers them
        top = sum(max((r.workspace_bytes for r in f), default=0) for f in fronts)
        points |= {sum(min((r.workspace_bytes for r in f), default=0) for f in fronts), top}
        points |= {2**e for e in range(10, max(top, 1).bit_length() + 1)}
    return sorted(points | {2 * top})  # one more, so the last step shows


def _names(plan: Plan, names: Sequence[str] | None) -> list[str]:
    if names is None:
        index: dict[str, int] = {}
        return [f"L{index.setdefault(p.key, len(index)):02d}" for p in plan.problems]
    if len(names) != len(plan.problems):
        raise ValueError(f"write_report(names=...) has {len(names)} names for {len(plan.problems)} problems; "
                         "give one name per problem of the plan")
    return list(names)


def _layers(names: Sequence[str], problems: Sequence) -> list[tuple[str, int, list[int]]]:
    """(name, first index, every index) of each distinct layer, in order."""
    found: dict[tuple[str, str], tuple[str, int, list[int]]] = {}
    for i, (name, problem) in enumerate(zip(names, problems)):
        found.setdefault((name, problem.key), (name, i, []))[2].append(i)
    return list(found.values())


# -- figures -------------------------------------------------------------------------------------

def _bytes_axis(ax: Any, largest: float) -> None:
    """x as bytes on a symmetric log scale, so 0 (no workspace) shows at the left edge."""
    top_exp = max(12, math.ceil(math.log2(max(largest, 1) * 1.5)))
    step = max(1, math.ceil((top_exp - 10) / 7))
    ticks = [0] + [2**e for e in range(10, top_exp + 1, step)]
    ax.set_xscale("symlog", linthresh=1024, linscale=0.4)
    ax.set_xlim(-300, 2**top_exp)  # room left of 0 for its marker
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(max(int(v), 0))))
    ax.tick_params(axis="x", labelsize=8)


def _time_axis(ax: Any, times: Sequence[float]) -> None:
    if times and max(times) > 10 * min(times) > 0:  # a range this wide reads better in ratios
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("time per run (ms)", fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(True, which="major", alpha=0.3)


def _pareto_figure(plan: Plan, first: int, runs: list[int], name: str, db: Any, png: Path) -> None:
    problem = plan.problems[first]
    measured = [r for r in db.results(problem) if r.ok and r.time_ms is not None]
    front = sorted(plan.pareto(first), key=lambda r: r.workspace_bytes)
    chosen = {plan.choices[i].algorithm: plan.choices[i] for i in runs}
    fastest = plan.unconstrained[first]
    every = measured + front + list(chosen.values()) + [fastest]
    largest = max([r.workspace_bytes for r in every] + [plan.workspace_budget or 0])
    fig = Figure(figsize=(5.2, 3.5), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    _bytes_axis(ax, largest)
    ax.scatter([r.workspace_bytes for r in measured], [r.time_ms for r in measured], s=16, color="#9aa5b1",
               alpha=0.6, label="measured", zorder=2)
    if front:
        xs = [r.workspace_bytes for r in front] + [ax.get_xlim()[1]]
        # Plan fronts, choices and the fastest point hold timed results only.
        ax.plot(xs, [cast(float, r.time_ms) for r in front] + [cast(float, front[-1].time_ms)],
                drawstyle="steps-post", color="#1f5fa8", lw=1.6, label="Pareto front", zorder=3)
        to_axes = ax.transData + ax.transAxes.inverted()
        for r in front:  # a label near the right edge goes to the left of its point, to stay inside
            right = to_axes.transform((r.workspace_bytes, cast(float, r.time_ms)))[0] > 0.75
            ax.annotate(r.algorithm, (r.workspace_bytes, r.time_ms), xytext=(-4 if right else 4, 3),
                        textcoords="offset points", ha="right" if right else "left", fontsize=6.5, color="#1f5fa8")
    if fastest.algorithm not in chosen:
        ax.scatter([fastest.workspace_bytes], [cast(float, fastest.time_ms)], s=70, facecolors="none",
                   edgecolors="#e07b00", lw=1.5, label="fastest, no budget", zorder=4)
    ax.scatter([r.workspace_bytes for r in chosen.values()], [cast(float, r.time_ms) for r in chosen.values()],
               marker="*", s=150, color="#c62828", label="chosen", zorder=5)
    if plan.workspace_budget is not None:
        whose = "" if plan.mode == "shared" else " (all layers)"
        ax.axvline(plan.workspace_budget, color="#c62828", ls="--", lw=1,
                   label=f"budget {format_bytes(plan.workspace_budget)}{whose}")
    _time_axis(ax, [r.time_ms for r in every])
    ax.set_xlabel("workspace", fontsize=9)
    ax.set_title(f"{name}  {problem_title(problem)}", fontsize=8)
    ax.legend(fontsize=7, loc="best", framealpha=0.85)
    fig.savefig(png)


def _budget_figure(plan: Plan, curve: Sequence[tuple[int, float]], png: Path) -> None:
    feasible = [(b, t) for b, t in curve if math.isfinite(t)]
    fig = Figure(figsize=(7.5, 3.8), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    _bytes_axis(ax, max([b for b, _ in curve] + [plan.workspace_budget or 0]))
    smallest = _smallest_feasible(plan)
    if smallest > 0:
        ax.axvspan(ax.get_xlim()[0], smallest, color="#c62828", alpha=0.08, label="infeasible")
    if feasible:
        xs = [b for b, _ in feasible] + [ax.get_xlim()[1]]
        ax.plot(xs, [t for _, t in feasible] + [feasible[-1][1]], drawstyle="steps-post", color="#1f5fa8", lw=1.8,
                marker="o", ms=3, label=f"planned total ({plan.mode})")
    unconstrained_ms = plan.unconstrained_time_ms
    ax.axhline(unconstrained_ms, color="#e07b00", ls=":", lw=1.2, label=f"no budget: {unconstrained_ms:.4g} ms")
    if plan.workspace_budget is not None:
        ax.axvline(plan.workspace_budget, color="#c62828", ls="--", lw=1)
        ax.scatter([plan.workspace_budget], [plan.total_time_ms], marker="*", s=180, color="#c62828", zorder=5,
                   label=f"chosen: {format_bytes(plan.workspace_budget)} -> {plan.total_time_ms:.4g} ms")
    ax.set_xlabel(f"workspace budget ({plan.mode})", fontsize=9)
    ax.set_ylabel("network time (ms)", fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(True, alpha=0.3)
    ax.set_title("total time of the network against the workspace budget", fontsize=10)
    ax.legend(fontsize=8, loc="best", framealpha=0.85)
    fig.savefig(png)


def _smallest_feasible(plan: Plan) -> int:
    least = [min((r.workspace_bytes for r in plan.pareto(i)), default=0) for i in range(len(plan.problems))]
    return (sum(least) if plan.mode == "divided" else max(least, default=0))


# -- HTML ----------------------------------------------------------------------------------------

def _cells(values: Sequence[tuple[str, str]], tag: str = "td") -> str:
    """(text, css class) pairs as escaped cells."""
    return "".join(f'<{tag} class="{cls}">{html.escape(text)}</{tag}>' for text, cls in values)


def _row(name: str, problem, count: int, choice: PerfResult, entry: dict, fastest: PerfResult) -> str:
    changed = choice.algorithm != fastest.algorithm
    cells = [(name, "l"), (problem_title(problem), "l wrap"), (str(count), ""), (choice.algorithm, "l algo"),
             (format_ms(choice.time_ms), ""), (format_bytes(choice.workspace_bytes), ""),
             ("same" if not changed else
              f"{fastest.algorithm} ({format_ms(fastest.time_ms)} ms, {format_bytes(fastest.workspace_bytes)})",
              "l algo" + ("" if changed else " same")),
             (format_ms(entry["time_lost_ms"]), ""), (format_bytes(entry["memory_saved_bytes"]), ""),
             (percent_of_floor(roofline_ms(problem), choice.time_ms), "")]
    return f'<tr class="{"changed" if changed else ""}">{_cells(cells)}</tr>'


def _html(plan: Plan, title: str, names: Sequence[str], figures: Sequence[tuple[str, str]], curve_png: str) -> str:
    entries = plan.report()
    rows = []
    for name, problem, runs in layer_groups(names, plan.problems, plan.choices):
        rows.append(_row(name, problem, len(runs), plan.choices[runs[0]], entries[runs[0]],
                         plan.unconstrained[runs[0]]))
    unconstrained_ms, unconstrained_bytes = plan.unconstrained_time_ms, plan.unconstrained_workspace_bytes
    floor_ms = sum(roofline_ms(p) for p in plan.problems)
    lost_ms = plan.total_time_ms - unconstrained_ms
    footer = _cells([("total", "l"), ("", "l"), (str(len(plan.problems)), ""), ("", "l"),
                     (format_ms(plan.total_time_ms), ""), (format_bytes(plan.workspace_bytes), ""),
                     (f"{format_ms(unconstrained_ms)} ms, {format_bytes(unconstrained_bytes)}", "l"),
                     (format_ms(lost_ms), ""), (format_bytes(unconstrained_bytes - plan.workspace_bytes), ""),
                     (percent_of_floor(floor_ms, plan.total_time_ms), "")])
    header = _cells([(h, "l" if h in ("layer", "problem", "choice", "unconstrained choice") else "") for h in (
        "layer", "problem", "count", "choice", "time ms", "workspace", "unconstrained choice", "time lost ms",
        "memory saved", "% of floor")], tag="th")
    budget = "none" if plan.workspace_budget is None else format_bytes(plan.workspace_budget)
    slower = f"+{100 * lost_ms / unconstrained_ms:.1f}%" if unconstrained_ms else "-"
    cards = [(budget, f"workspace budget ({plan.mode})"),
             (f"{format_ms(plan.total_time_ms)} ms", "planned network time"),
             (format_bytes(plan.workspace_bytes), "planned workspace"),
             (f"{format_ms(unconstrained_ms)} ms", f"no budget (workspace {format_bytes(unconstrained_bytes)})"),
             (slower, "time the budget costs"),
             (format_bytes(unconstrained_bytes - plan.workspace_bytes), "memory the budget saves")]
    device = plan.problems[0].device if plan.problems else "cpu"
    generated = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    e = html.escape
    card_html = "".join(f'<div class="card"><b>{e(v)}</b><span>{e(k)}</span></div>' for v, k in cards)
    figure_html = "".join(f'<figure><img src="{e(png)}" alt="{e(caption)}"><figcaption>{e(caption)}</figcaption>'
                          "</figure>" for png, caption in figures)
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
        f"<style>{_CSS}</style></head><body>", f"<h1>{e(title)}</h1>",
        (f'<div class="meta">generated {e(generated)} &middot; device <code>{e(fingerprint(device))}</code>'
         f" &middot; software <code>{e(software_versions())}</code></div>"),
        f'<div class="cards">{card_html}</div>',
        "<h2>Layers</h2>",
        ('<div class="meta">times are per run; the total weights each layer by its count. Highlighted rows '
         "gave up their fastest algorithm to fit the budget. % of floor: the roofline floor over the time.</div>"),
        (f'<div class="scroll"><table><thead><tr>{header}</tr></thead><tbody>{"".join(rows)}</tbody>'
         f"<tfoot><tr>{footer}</tr></tfoot></table></div>"),
        "<h2>Total time against the budget</h2>",
        f'<figure class="wide"><img src="{e(curve_png)}" alt="network time against the workspace budget"></figure>',
        "<h2>Each layer's time/workspace trade-off</h2>",
        ('<div class="meta">grey: every measured algorithm; blue: the Pareto front (the fastest for each workspace); '
         "red star: the plan's choice; dashed: the budget.</div>"),
        f'<div class="figs">{figure_html}</div>',
        "</body></html>", ""])
