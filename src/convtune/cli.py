"""The ``convtune`` command: get, find, algorithms, tune, report, cache, settings, native.

Bad arguments give one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import re
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from rich.console import Console
from rich.table import Table

from . import zoo
from .errors import ConvtuneError, NoAlgorithmError
from .files import nearest_existing
from .network import LayerRow, Tuning, check_plannable, plan_layers, planned_rows, run_names, select_layers
from .plan import BUDGET_MODES
from .policy import PREFERENCES, Policy
from .problem import DIRECTIONS, ConvProblem
from .report import choices_table, perf_table, tune_table
from .select import SELECTION_MODES
from .settings import settings
from .units import format_bytes, format_ms, parse_bytes, parse_int

if TYPE_CHECKING:
    from .plan import Plan


class UsageError(Exception):
    """A bad command-line argument: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _dims(text: str, what: str) -> tuple[int, ...]:
    """'56x56' -> (56, 56); '3' -> (3,)."""
    try:
        values = tuple(parse_int(v, what) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--{what} {text!r} is not a size; write it like 56x56, 3x3 or 2") from None
    return values


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _add_problem_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the convolution")
    g.add_argument("--direction", default="fwd", choices=DIRECTIONS)
    g.add_argument("--n", "--batch", dest="n", type=_whole, default=32, help="batch size (default 32)")
    g.add_argument("--c", type=_whole, required=True, help="input channels")
    g.add_argument("--k", type=_whole, required=True, help="output channels (filters)")
    g.add_argument("--size", required=True, help="input spatial size, e.g. 56x56 (1, 2 or 3 dimensions)")
    g.add_argument("--kernel", default="3", help="kernel size, e.g. 3x3 or 3 (default 3)")
    g.add_argument("--stride", default="1")
    g.add_argument("--pad", default="0", help="padding per side (default 0)")
    g.add_argument("--dilation", default="1")
    g.add_argument("--groups", type=_whole, default=1)
    _add_type_args(g)


def _add_type_args(g) -> None:
    g.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16 (default float32)")
    g.add_argument("--layout", default="channels_first", help="NCHW/channels_first or NHWC/channels_last")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")


def _add_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the policy")
    g.add_argument("--workspace-limit", type=_size, default=None,
                   help="most workspace memory per algorithm, e.g. 64MiB")
    g.add_argument("--deterministic", action="store_true", help="only run-to-run deterministic algorithms")
    g.add_argument("--no-tf32", action="store_true", help="forbid TF32 math for float32")
    g.add_argument("--no-reduced-precision", action="store_true", help="forbid half-precision accumulation")
    g.add_argument("--micro-batching", action="store_true",
                   help="with --workspace-limit, also offer sub-batches run one after another (mu-cuDNN)")
    g.add_argument("--prefer", default="fastest", choices=PREFERENCES)
    g.add_argument("--tolerance", type=float, default=0.02, help="times within this fraction tie (default 0.02)")
    g.add_argument("--max-candidates", type=_whole, default=None, help="time at most this many candidates")
    g.add_argument("--budget-s", type=float, default=None, help="seconds one search may spend")


def _add_budget_args(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_argument_group("the network's workspace budget (convtune.plan)")
    g.add_argument("--workspace-budget", type=_size, required=required, default=None,
                   help="workspace memory for the whole network, e.g. 64MiB: one choice per layer so that it fits")
    g.add_argument("--budget-mode", default="shared", choices=BUDGET_MODES,
                   help="shared: layers run one after another and share one buffer, the largest must fit "
                        "(default); divided: layers run concurrently, the sum must fit")


def _add_network_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("network", help=f"one of {', '.join(zoo.NETWORKS)}, or a .json/.csv layer file")
    p.add_argument("--batch", type=_positive, default=None, help="batch size (default 32; DeepBench keeps its own)")
    p.add_argument("--direction", default="fwd", choices=(*DIRECTIONS, "all"))
    _add_type_args(p)


def _add_db_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=None, help="tuning database file (default: $CONVTUNE_CACHE_DIR/tuning.sqlite)")


def _policy(args) -> Policy:
    return Policy(
        workspace_limit=(None if args.workspace_limit is None
                         else parse_bytes(args.workspace_limit, "--workspace-limit")),
        deterministic=args.deterministic, allow_tf32=not args.no_tf32,
        allow_reduced_precision=not args.no_reduced_precision, prefer=args.prefer, tolerance=args.tolerance,
        max_candidates=args.max_candidates, budget_s=args.budget_s, micro_batching=args.micro_batching,
    )


def _problem(args) -> ConvProblem:
    size = _dims(args.size, "size")
    nd = len(size)

    def per_dim(text: str, what: str) -> tuple[int, ...]:
        values = _dims(text, what)
        return values * nd if len(values) == 1 else values

    return ConvProblem(
        direction=args.direction, n=args.n, c=args.c, k=args.k, input_size=size,
        kernel_size=per_dim(args.kernel, "kernel"), stride=per_dim(args.stride, "stride"),
        padding=per_dim(args.pad, "pad"), dilation=per_dim(args.dilation, "dilation"), groups=args.groups,
        dtype=args.dtype, layout=args.layout, device=args.device or default_device(),
        allow_tf32=not getattr(args, "no_tf32", False),
    )


def _check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for, but PyTorch sees no CUDA device here; use --device cpu")


def _db(args, existing: bool = False, means: bool = False):
    """The database of ``--db`` (default: the cache folder's). A command that only reads it or removes from it
    (``existing``) refuses a path where no file is (rather than make one, and its folder); a file that is not a
    tuning database is refused as ``TuningDB`` refuses it (a damaged one is salvaged, as the library does). A
    command for which the default database is only a means (``means``: get, find, tune, report) goes on with a
    temporary one, with the library's warning, where it cannot be opened (a read-only cache folder without one,
    say)."""
    from .db import TuningDB, opened

    if args.db is None and means:
        db = opened()
        if db is None:
            raise UsageError("no tuning database can be opened, not even a temporary one; set CONVTUNE_CACHE_DIR to "
                             "a writable folder")
        return db

    path = None if args.db is None else Path(args.db).expanduser()
    if path is not None and existing and not path.exists():
        default = "" if getattr(args, "action", None) == "clear" else ", or leave --db out for the default one"
        raise UsageError(f"--db {args.db}: no such file, so no tuning database at {path}; give an existing "
                         f"database's path{default}")
    try:
        return TuningDB(path)
    except ValueError as exc:
        raise UsageError(str(exc) if args.db is None else f"--db {args.db}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="convtune", description="Pick, measure and remember the best convolution algorithm.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log tuning (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("get", help="rank algorithms from the cost model, running nothing")
    _add_problem_args(p)
    _add_policy_args(p)
    _add_db_args(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("find", help="run, check and time every candidate")
    _add_problem_args(p)
    _add_policy_args(p)
    _add_db_args(p)
    p.add_argument("--no-store", action="store_true", help="do not store the results in the database")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("algorithms", help="which algorithms support a problem, and why the others do not")
    _add_problem_args(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("tune", help="tune every layer of a built-in network or a layer file")
    _add_network_args(p)
    p.add_argument("--mode", default="hybrid", choices=[m for m in SELECTION_MODES if m != "background"],
                   help="how each layer is chosen (default hybrid; 'background' needs a process that goes on)")
    p.add_argument("--layers", type=_positive, default=None, help="tune only the first N layers")
    _add_budget_args(p, required=False)
    _add_policy_args(p)
    _add_db_args(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("report", help="tune a network, plan it under a workspace budget, write an HTML report")
    _add_network_args(p)
    p.add_argument("--layers", type=_positive, default=None, help="tune only the first N layers")
    _add_budget_args(p, required=True)
    p.add_argument("--out", default="report.html", help="the HTML file; its PNG figures go beside it "
                                                        "(default report.html)")
    p.add_argument("--budgets", default=None, help="budgets of the total-time figure, e.g. 0,1MiB,16MiB,256MiB "
                                                   "(default: where the total time changes)")
    _add_policy_args(p)
    _add_db_args(p)

    p = sub.add_parser("cache", help="the tuning database: ls, export, import, clear")
    p.add_argument("action", choices=("ls", "export", "import", "clear"))
    p.add_argument("path", nargs="?",
                   help="the JSON-lines file for export and import (gzip-compressed where its name ends in .gz)")
    _add_db_args(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("settings", help="every setting, its environment variable and current value")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("train-get", help="build get's learned cost model from this device's measurements")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="whose measurements (default: cuda where there is a GPU, else cpu)")
    p.add_argument("--out", default=None, help="the model file (default: learned_get_<device>.pt in the cache "
                                               "folder, where get looks for it)")
    p.add_argument("--holdout", type=float, default=0.2, help="fraction of the problems held out to judge a "
                                                              "model built from the rest first (0: none)")
    p.add_argument("--epochs", default=None, help=argparse.SUPPRESS)  # of the fitted networks the model once was
    _add_db_args(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("native", help="build (ahead of time) and describe the C++ extension that runs tuned layers")
    p.add_argument("--rebuild", action="store_true", help="build again even if a build of these sources exists")
    p.add_argument("--json", action="store_true")
    return parser


def _size(text: str) -> str:
    """argparse type: a size in bytes or like 64MiB, checked as the arguments are read (kept as written; what
    is used later, after tuning, as --workspace-budget is, must not fail then)."""
    try:
        parse_bytes(text)
    except ValueError as exc:  # parse_bytes' own words, less the name it was given
        raise argparse.ArgumentTypeError(str(exc).partition("=")[2]) from None
    return text


SIZE_OPTIONS = ("--workspace-budget", "--workspace-limit", "--budgets")


def _sizes_joined(argv: list[str]) -> list[str]:
    """``argv`` with a size option's value that starts with '-' and a digit joined to it (``--workspace-limit=-5MiB``;
    the option as written, abbreviated too): argparse would take that value for an option and say only that the size
    is missing; joined, it is read and refused as negative."""
    out: list[str] = []
    for arg in argv:
        sized = out and len(out[-1]) > 4 and any(option.startswith(out[-1]) for option in SIZE_OPTIONS)
        if sized and re.match(r"-\.?\d", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _whole(text: str) -> int:
    """argparse type: a whole number written in digits (``units.parse_int``: '1_0' is no 10)."""
    try:
        return parse_int(text, "")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be 1 or more")
    return value


def _print(console: Console, args, table: Table, payload) -> None:
    if getattr(args, "json", False):
        console.print_json(json.dumps(payload))
    else:
        console.print(table)


def cmd_get(args, out: Console) -> int:
    from .get import get

    problem = _problem(args)
    _check_device(problem.device)
    from .costmodel import basis

    with _db(args, existing=True, means=True) as db:
        choices = get(problem, _policy(args), db=db)
        priced_from = basis(db, problem)
    payload = {"problem": problem.key, "priced_from": priced_from, "choices": [c.__dict__ for c in choices]}
    _print(out, args, choices_table(problem, choices), payload)
    if not args.json:
        out.print(f"priced from {priced_from}")
    return 0


def cmd_find(args, out: Console) -> int:
    from .find import find

    problem = _problem(args)
    _check_device(problem.device)
    with _db(args, means=True) as db:
        results = find(problem, _policy(args), db=None if args.no_store else db)
    payload = {"problem": problem.key, "results": [r.to_dict() for r in results]}
    _print(out, args, perf_table(problem, results), payload)
    return 0


def cmd_algorithms(args, out: Console) -> int:
    from .algorithms.registry import algorithms, unsupported_reasons

    problem = _problem(args)
    offered = algorithms(problem)
    reasons = unsupported_reasons(problem)
    table = Table(title=f"algorithms for {problem.key}")
    for column in ("algorithm", "supports", "workspace", "deterministic", "numerics / reason"):
        table.add_column(column)
    payload = []
    for a in offered:
        ws = a.workspace_bytes(problem)
        table.add_row(a.name, "yes", format_bytes(ws), "yes" if a.is_deterministic(problem) else "no",
                      a.notes(problem).describe())
        payload.append({"algorithm": a.name, "supports": True, "workspace_bytes": ws,
                        "deterministic": a.is_deterministic(problem), "notes": a.notes(problem).describe()})
    for name, reason in reasons.items():
        table.add_row(name, "no", "-", "-", reason)
        payload.append({"algorithm": name, "supports": False, "reason": reason})
    _print(out, args, table, payload)
    return 0


def _tune_layers(args):
    device = args.device or default_device()
    _check_device(device)
    directions = DIRECTIONS if args.direction == "all" else (args.direction,)
    layers = []
    for direction in directions:
        found = zoo.resolve(args.network, args.batch, direction=direction, dtype=args.dtype, layout=args.layout,
                            device=device, allow_tf32=not args.no_tf32)
        found = found[: args.layers] if args.layers else found
        suffix = "" if len(directions) == 1 else f"/{direction}"
        layers += [zoo.Layer(layer.name + suffix, layer.problem, layer.count) for layer in found]
    if args.workspace_budget is not None:  # before any layer is tuned
        check_plannable([layer.count for layer in layers], args.network)
    return layers


def _select_layers(args, layers: list[zoo.Layer], tuning: Tuning, err: Console) -> list[LayerRow]:
    """The network's layers selected by ``tuning``, with a progress bar on ``err`` (none for --json)."""
    return select_layers([(layer.name, layer.problem, layer.count) for layer in layers], tuning,
                         f"tuning {args.network}", err, show_progress=not getattr(args, "json", False))


def _plan_layers(args, rows: list[LayerRow], tuning: Tuning) -> Plan:
    """The plan of the served ``rows`` under ``--workspace-budget``; an infeasible budget is a usage error
    naming the smallest feasible budget."""
    from .plan import InfeasibleBudgetError

    budget = parse_bytes(args.workspace_budget, "--workspace-budget")
    try:
        return plan_layers(rows, tuning, budget, args.budget_mode)
    except NoAlgorithmError as exc:
        if tuning.measures:
            raise
        raise UsageError(f"--workspace-budget plans from measurements, and --mode {args.mode} never measures: "
                         f"{exc}; run once with --mode hybrid") from None
    except InfeasibleBudgetError as exc:
        least = exc.smallest_feasible_bytes
        raise UsageError(f"--workspace-budget {args.workspace_budget} is too small for {args.network} "
                         f"({args.budget_mode} mode): the smallest feasible budget is {format_bytes(least)} "
                         f"({least} bytes); give --workspace-budget {least} or more") from None


def cmd_tune(args, out: Console, err: Console) -> int:
    layers = _tune_layers(args)
    policy = _policy(args)
    payload: dict = {"network": args.network}
    total_workspace, caption = None, None
    with _db(args, means=True) as db:
        tuning = Tuning(policy, args.mode, db)
        rows = _select_layers(args, layers, tuning, err)
        title = (f"convtune tune {args.network}: {len(rows)} layers, {rows[0].problem.dtype if rows else ''} "
                 f"{rows[0].problem.layout if rows else ''} on {rows[0].problem.device if rows else ''}, "
                 f"mode {args.mode}")
        if args.workspace_budget is not None:
            plan = _plan_layers(args, rows, tuning)
            rows = planned_rows(rows, plan)
            total_workspace = plan.workspace_bytes
            caption = (f"planned for a {args.budget_mode} workspace budget of {format_bytes(plan.workspace_budget)}: "
                       f"{format_ms(plan.total_time_ms)} ms, workspace {format_bytes(plan.workspace_bytes)} "
                       f"(no budget: {format_ms(plan.unconstrained_time_ms)} ms, "
                       f"{format_bytes(plan.unconstrained_workspace_bytes)})")
            payload["plan"] = {"mode": plan.mode, "workspace_budget": plan.workspace_budget,
                               "total_time_ms": plan.total_time_ms, "workspace_bytes": plan.workspace_bytes,
                               "unconstrained_time_ms": plan.unconstrained_time_ms,
                               "unconstrained_workspace_bytes": plan.unconstrained_workspace_bytes}
    payload["layers"] = [r.to_dict() for r in rows]
    table = tune_table(title, rows, total_workspace_bytes=total_workspace)
    table.caption = caption
    _print(out, args, table, payload)
    return 0 if all(r.result for r in rows) else 1


def _check_out(args) -> None:
    """Refuse an empty ``--out`` (a variable left unset), which would name the current folder or the default file."""
    if args.out == "":
        raise UsageError("--out '' is an empty path; give a file's path, or leave --out out for the default")


def cmd_report(args, out: Console, err: Console) -> int:
    from .files import writable
    from .html_report import write_report

    _check_out(args)
    writable(args.out, make_folder=True)  # before the network is tuned, not after
    budgets = None
    if args.budgets is not None:
        budgets = [parse_bytes(b, "--budgets") for b in args.budgets.split(",") if b.strip()]
    layers = _tune_layers(args)
    policy = _policy(args)
    with _db(args, means=True) as db:
        tuning = Tuning(policy, "hybrid", db)
        rows = _select_layers(args, layers, tuning, err)
        failed = [r for r in rows if not r.result]
        if failed:
            raise NoAlgorithmError(f"layer {failed[0].name} of {args.network} cannot be served: {failed[0].error}")
        plan, names = _plan_layers(args, rows, tuning), run_names(rows)
        p = layers[0].problem
        direction = "all directions" if args.direction == "all" else p.direction
        title = (f"convtune report: {args.network}, {len(layers)} layers, batch {p.n}, {direction}, "
                 f"{p.dtype} {p.layout} on {p.device}")
        path = write_report(plan, args.out, title, budgets=budgets, db=db, policy=policy, names=names)
    out.print(str(path), highlight=False, soft_wrap=True)
    return 0


def cmd_cache(args, out: Console) -> int:
    if args.action in ("ls", "clear") and args.path:  # it acts on the database: a path here is not the one
        raise UsageError(f"cache {args.action} takes no file: it acts on the tuning database; to name that, "
                         f"convtune cache {args.action} --db {args.path}")
    if args.action in ("export", "import") and not args.path:
        raise UsageError(f"cache {args.action} needs a file path: convtune cache {args.action} FILE.jsonl")
    if args.action == "import":  # before the database is opened: a fresh one is made for an import only
        from .export_lines import check_source

        check_source(Path(args.path))
    elif args.db is None and _never_made(settings.db_path):  # nothing tuned here yet: read it as empty, make none
        return _no_database(args, out, settings.db_path)
    with _db(args, existing=args.action in ("ls", "export", "clear")) as db:  # import may start a database
        if args.action in ("export", "import", "clear"):
            if args.action == "export":
                n = db.export(args.path)
                said = f"exported {n} results to {args.path}"
            elif args.action == "import":
                n = db.import_(args.path)
                said = f"imported {n} results from {args.path} into {db.path}"
            else:
                n = db.clear()
                said = f"removed {n} results from {db.path}"
            if args.json:
                out.print_json(json.dumps({"action": args.action, "results": n, "database": str(db.path),
                                           "file": None if args.path is None else str(args.path)}))
            else:
                out.print(said)
        else:
            entries = db.entries()
            table = Table(title=f"tuning database {db.path}")
            columns = ("problem", "device", "results", "best", "best ms", "usable here", "stored")
            for column in columns:
                table.add_column(column)
            for e in entries:
                table.add_row(e.problem, e.fingerprint, str(e.num_results), e.best_algorithm or "-",
                              format_ms(e.best_ms), "yes" if e.usable else "no",
                              datetime.datetime.fromtimestamp(e.stored_at).strftime("%Y-%m-%d %H:%M"))
            _print(out, args, table, [e.__dict__ for e in entries])
    return 0


def _never_made(path: Path) -> bool:
    """Whether no file is at ``path`` where one could be: its nearest existing folder is a folder (under a file, the
    database cannot be made, which opening it says)."""
    return not path.exists() and nearest_existing(path).is_dir()


def _no_database(args, out: Console, path: Path) -> int:
    """``cache ls``, ``export`` and ``clear`` where the default database was never made: ls lists nothing and clear
    removes nothing (exit 0), export refuses (no file is written), and none makes the database or its folder."""
    if args.action == "export":
        raise UsageError(f"cache export: no tuning database at {path} yet, so nothing to export; tune something first "
                         f"(convtune tune ...), or name another database with --db")
    if args.json:
        payload: Any = [] if args.action == "ls" else {"action": "clear", "results": 0, "database": str(path),
                                                       "file": None}
        out.print_json(json.dumps(payload))
    else:
        out.print(f"no tuning database at {path} yet: nothing has been tuned with it"
                  + ("" if args.action == "ls" else ", so nothing to remove"))
    return 0


def cmd_settings(args, out: Console) -> int:
    rows = settings.describe()
    if args.json:
        out.print_json(json.dumps([{"setting": name, "environment_variable": env, "value": str(value),
                                    "meaning": doc} for name, env, value, doc in rows]))
    else:
        table = Table(title="convtune settings")
        for column in ("setting", "environment variable", "value", "meaning"):
            table.add_column(column)
        for name, env, value, doc in rows:
            table.add_row(name, env, str(value), doc)
        out.print(table)
    settings.check()  # shown first: the table is how one finds the setting the error names
    return 0


def cmd_train_get(args, out: Console) -> int:
    import torch

    from . import learned
    from .hardware import fingerprint

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible to PyTorch here")
    if not 0 <= args.holdout < 1:
        raise UsageError(f"--holdout {args.holdout} must be at least 0 and below 1")
    if args.epochs is not None:
        raise UsageError("--epochs: get's learned model is no longer trained (it is built from the nearest measured "
                         "problems, in about a second); leave the option out")
    _check_out(args)
    out_path = learned.writable_model_path(args.out or learned.default_path(device))  # before the work, not after
    with _db(args, existing=True) as db:
        samples = learned.samples_from(db, device)
    if not samples:
        raise UsageError(f"the database holds no measurements of this machine's {device}: tune first "
                         f"(convtune tune, find)")
    here = fingerprint(device)
    problems = len({s.problem for s in samples})
    summary: dict[str, float | str] = {"device": here, "measurements": len(samples), "problems": problems}
    if args.holdout and problems >= 5:  # too few to hold some out and still learn from the rest
        summary.update(learned.holdout_report(samples, here, fraction=args.holdout))
    model = learned.train(samples, here)
    path = model.save(out_path)
    summary["model"] = str(path)
    counts = {d: model.measured(d) for d in DIRECTIONS}
    summary["answers for"] = ", ".join(d for d, n in counts.items() if n >= learned.MIN_MEASURED) or "no direction yet"
    short = {d: n for d, n in counts.items() if n < learned.MIN_MEASURED}
    if short:
        summary["too few measured"] = (", ".join(f"{d} {n}" for d, n in short.items()) + " (it answers for a "
                                       f"direction from {learned.MIN_MEASURED} problems measured: tune more)")
    table = Table(title="get's learned cost model")
    table.add_column("")
    table.add_column("")
    for key, value in summary.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    _print(out, args, table, summary)
    return 0


def cmd_native(args, out: Console) -> int:
    from . import extension

    if args.rebuild:
        shutil.rmtree(extension.build_dir(), ignore_errors=True)
        extension.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the status below says it
        extension.load()
    status = extension.status()
    table = Table(title="convtune's C++ extension")
    table.add_column("")
    table.add_column("")
    for key, value in status.items():
        table.add_row(key, "-" if value is None else (f"{value:.1f}" if isinstance(value, float) else str(value)))
    _print(out, args, table, status)
    return 0 if status["loaded"] or not status["enabled"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    out = Console(soft_wrap=False, width=200 if not sys.stdout.isatty() else None)
    err = Console(stderr=True)
    args = None
    try:
        args = build_parser().parse_args(_sizes_joined(sys.argv[1:] if argv is None else list(argv)))
        logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                            format="%(levelname)s %(name)s: %(message)s")
        if args.command in ("tune", "report"):
            return (cmd_tune if args.command == "tune" else cmd_report)(args, out, err)
        handler = {"get": cmd_get, "find": cmd_find, "algorithms": cmd_algorithms, "cache": cmd_cache,
                   "settings": cmd_settings, "native": cmd_native, "train-get": cmd_train_get}[args.command]
        return handler(args, out)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as exc:  # bad input: a file, a size, a field
        print(f"convtune: error: {exc}", file=sys.stderr)
        return 2
    except ConvtuneError as exc:
        print(f"convtune: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("convtune: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug of ours: one line, the traceback with -v
        if args is not None and args.verbose:
            raise
        print(f"convtune: internal error: {type(exc).__name__}: {exc} (run with -v for the traceback)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
