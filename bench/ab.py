"""PyTorch against convtune in ONE process, timed in alternation: the host-bound cells of bench/e2e.py without
the process-to-process noise.

bench/e2e.py runs each configuration in its own process, as BENCHMARKING.md asks, and where the host sets the
pace (eager code, compiled inference at small sizes) one configuration has measured up to 1.7x apart in two
processes. Here one process builds the network twice (the same weights), runs ``convtune.optimize`` on one copy
(an empty tuning database) and times the two in rounds, A then B and B then A in turn, each round a timing of
``--steps`` steps between CUDA events; host drift moves both alike. Reported per style and workload: each one's
median over the rounds and the median of the rounds' ratios (PyTorch / convtune; above 1: convtune faster), with
the interval where that median lies with at least 95% confidence (``common.median_interval``; the default 21
rounds give it from the 6th to the 16th ratio, 7 rounds only the whole range).

PyTorch runs with ``cudnn.benchmark=True`` (the flag is per process, so convtune's layers that chose PyTorch's
own call run with it too). Under torch.compile the two compiled models share Dynamo's cache of the network's
forward (one code object): each call's guard check may first try the other model's entry, which fails on its
first differing module type.

    python bench/ab.py --models mobilenet_v2 --batches 128 --dtypes float16 --styles eager,compile
    python bench/ab.py --device cpu --tiny --out /tmp/ab       # a small stand-in network: checks the pipeline

Results: bench/results/ab.json and ab.md (or --out, --name); results of earlier runs in the file are kept
(one row per model, batch, dtype, style, workload). Each row also counts the calls that took a tuned layer's
full path while it was timed (in a steady state there should be none). ``--profile`` adds, per network,
batch and dtype, ``torch.profiler``'s host-side table of ``--steps`` eager training steps of each model
(<name>_profile_<model>_b<batch>_<dtype>.txt): where the host time of a step goes.

With ``--around-tuning`` the PyTorch model's eager inference is also timed alone just before the copy is
optimized and again just after, with what the process holds each time (resident memory, Python's tracked objects,
the CUDA allocator's segments): whether the cold tuning leaves the whole process slower (bench/e2e.py's convtune
process that tuned cold has run 3-6% slower than the one that started warm); with ``--control`` the same timings
have nothing tuned between them, the baseline. Off by default: those timings run PyTorch's model first (its
first calls in the rounds are then no longer its first, and cuDNN's benchmark cache is warm for the tuning).

``--merge FILE...`` folds the results files of other runs (each device call starts from the committed file and returns
its own) into the results file, row by row, the newest measurement of each row winning; an entry whose rows came from
another file takes that file's tune time and runtimes too; nothing is measured.

``--control`` times PyTorch against PyTorch (an A/A test): the second copy is left as it is, not optimized, and
its rows are kept under the model's name with " A/A" added. A control cell's ratio is the method's own bias and
noise in that configuration (which copy runs second in a round, which compiled entry Dynamo tries first): a
convtune cell is judged against it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import convtune  # noqa: E402
import e2e  # noqa: E402

AROUND_TIMINGS = 7  # timings of PyTorch's eager inference before and after the tuning beside it (median)


def profile_tables(models: dict, step_of: dict, steps: int, device: str) -> str:
    """torch.profiler's host-side table (self CPU time) of ``steps`` training steps of each model."""
    from torch.profiler import ProfilerActivity, profile

    parts = []
    for who, model in models.items():
        model.train()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step_of[who]()
            if device == "cuda":
                torch.cuda.synchronize()
        averages = prof.key_averages()
        parts.append(f"## {who}: host-side profile of {steps} eager training steps\n\n"
                     + averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
        # Each tuned executable's run is recorded under its label ('convtune:<problem> by <algorithm>'): which
        # executables cost the host most per call (a plan that launches several kernels, say).
        runs = sorted((e for e in averages if e.key.startswith("convtune:") and not e.key.startswith("convtune::")),
                      key=lambda e: -e.self_cpu_time_total)
        if runs:
            parts.append(f"### {who}: host time of each tuned executable's run, per call\n\n" + common.md_table(
                ["executable", "calls", "self us per call", "total us per call"],
                [[e.key, e.count, f"{e.self_cpu_time_total / e.count:.1f}", f"{e.cpu_time_total / e.count:.1f}"]
                 for e in runs]))
    return "\n\n".join(parts)


def pair(model_name: str, batch: int, dtype: torch.dtype, device: str, tiny: bool, db=None,
         control: bool = False, before_tuning=None) -> tuple:
    """(PyTorch's model, convtune's copy of it, input, labels, seconds ``optimize`` took): the network built once
    (seed 0, channels_last, ``cudnn.benchmark=True``) and copied, the copy optimized for training under autocast
    on ``db`` (default: an empty tuning database, closed on return); with ``control``, the copy as it is (and
    None for the seconds). ``before_tuning(model, x)``, where given, is called with PyTorch's model and the input
    just before the copy is optimized."""
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    torch_model, size, classes = e2e.build_model(model_name, tiny)
    torch_model = torch_model.to(device).to(memory_format=torch.channels_last)
    ours = copy.deepcopy(torch_model)
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
    labels = torch.randint(0, classes, (batch,), device=device)
    if before_tuning is not None:  # in an A/A run too: its after / before is the ratio with nothing tuned between
        before_tuning(torch_model, x)
    if control:  # nothing tuned
        return torch_model, ours, x, labels, None
    with contextlib.ExitStack() as stack:
        if db is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            db = stack.enter_context(convtune.TuningDB(str(Path(tmp) / "ab.sqlite")))
        with torch.autocast(device, dtype=dtype):
            t0 = time.perf_counter()
            convtune.optimize(ours, x, training=True, db=db)
            tune_s = time.perf_counter() - t0
    return torch_model, ours, x, labels, tune_s


def run(model_name: str, batch: int, dtype_name: str, styles: list[str], device: str, tiny: bool, steps: int,
        rounds: int, profile: bool = False, control: bool = False, around_tuning: bool = False) -> dict:
    """{"<style>:<workload>": row} for one network, batch and dtype, both models in this process (and, with
    ``profile``, the host-side profile tables under "profile"; with ``control``, the second model not optimized;
    with ``around_tuning``, PyTorch's eager inference timed just before and after the copy is optimized, under
    "torch_around_tuning": those timings run PyTorch's model first, so its first calls below are no longer its
    first)."""
    dtype = getattr(torch, dtype_name)
    timer = e2e.Timer(device, steps, 1)
    around: dict = {}  # PyTorch's eager inference before and after the tuning beside it (the process's state)

    def inference_ms(model: torch.nn.Module, x: torch.Tensor) -> float:
        model.eval()
        infer = e2e.workloads(model, None, x, None, lambda: torch.autocast(device, dtype=dtype))[0]
        e2e._first_call_s(infer, timer)
        return statistics.median(timer(infer)["ms"] for _ in range(AROUND_TIMINGS))

    def before(model: torch.nn.Module, x: torch.Tensor) -> None:
        around["before_ms"] = inference_ms(model, x)
        around["before"] = e2e.process_state(device)

    torch_model, ours, x, labels, tune_s = pair(model_name, batch, dtype, device, tiny, control=control,
                                                before_tuning=before if around_tuning else None)
    if around:
        around["after_ms"] = inference_ms(torch_model, x)
        around["after"] = e2e.process_state(device)
    rows = {}
    for style in styles:
        steps_of = {}
        for who, model in (("torch", torch_model), ("convtune", ours)):
            runner = torch.compile(model) if style == "compile" else model
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
            infer, train_step = e2e.workloads(runner, optimizer, x, labels, lambda: torch.autocast(device, dtype=dtype))
            steps_of[who] = dict(inference=infer, training=train_step)
        for workload in ("inference", "training"):
            torch_model.train(workload == "training")
            ours.train(workload == "training")
            a, b = steps_of["torch"][workload], steps_of["convtune"][workload]
            first = {who: e2e._first_call_s(steps_of[who][workload], timer) for who in steps_of}
            pairs = []
            with e2e.FullPathCalls() as full:
                for r in range(rounds):
                    order = ((a, b) if r % 2 == 0 else (b, a))
                    times = [timer(step)["ms"] for step in order]
                    pairs.append(times if r % 2 == 0 else times[::-1])
            ratios = [p[0] / p[1] for p in pairs]
            interval = common.median_interval(ratios)
            row = rows[f"{style}:{workload}"] = dict(
                torch_ms=statistics.median(p[0] for p in pairs), convtune_ms=statistics.median(p[1] for p in pairs),
                ratio=statistics.median(ratios), ratio_range=[min(ratios), max(ratios)], ratios=ratios,
                ratio_interval=list(interval) if interval else None,
                first_call_s=first, rounds=rounds, steps=steps,
                # compiled code never calls forward; an untouched copy has no tuned layer
                full_path_calls=full.calls if style == "eager" and not control else None)
            print(f"  {style} {workload}: torch {row['torch_ms']:.3f} ms, convtune {row['convtune_ms']:.3f} ms, "
                  f"ratio {row['ratio']:.3f}", file=sys.stderr, flush=True)
    runtimes: dict[str, int] = {}
    for r in convtune.explain(ours):
        runtimes[r["runtime"]] = runtimes.get(r["runtime"], 0) + 1
    result = dict(rows=rows, tune_s=tune_s, runtimes=runtimes, torch_around_tuning=around or None)
    if profile:
        optimizers = {who: torch.optim.SGD(m.parameters(), lr=1e-3) for who, m in (("torch", torch_model),
                                                                                   ("convtune", ours))}
        models = {"torch": torch_model, "convtune": ours}
        step_of = {who: e2e.workloads(m, optimizers[who], x, labels, lambda: torch.autocast(device, dtype=dtype))[1]
                   for who, m in models.items()}
        result["profile"] = profile_tables(models, step_of, steps, device)
    return result


def markdown(env: dict, results: dict) -> str:
    lines = []
    for key, res in sorted(results.items()):
        for cell, row in sorted(res["rows"].items()):
            lo, hi = row["ratio_range"]
            interval = row.get("ratio_interval")
            lines.append([*key.split(":"), *cell.split(":"), f"{row['torch_ms']:.3f}", f"{row['convtune_ms']:.3f}",
                          f"{row['ratio']:.3f}", f"{lo:.2f}-{hi:.2f}",
                          f"{interval[0]:.3f}-{interval[1]:.3f} ({100 * interval[2]:.1f}%)" if interval else "-",
                          "-" if row.get("full_path_calls") is None else row["full_path_calls"],
                          f"{row.get('date', res.get('date'))} {row.get('revision', res.get('revision'))}"])
    return ("# PyTorch and convtune in one process, timed in alternation\n\n"
            f"{common.env_line(env)}. "
            "Autocast, channels_last, `cudnn.benchmark=True`; per round one timing of each (CUDA events, the "
            "order swapped every round); ms: medians over the rounds; ratio: median of the rounds' PyTorch / "
            "convtune (above 1: convtune faster), and its range; the median's interval: where the median of such "
            "rounds lies with at least 95% confidence (order statistics of the rounds' ratios, its coverage in "
            "brackets; rows measured before it was recorded: -): a cell differs from PyTorch only where this interval "
            "excludes 1.00; a model marked A/A: PyTorch against an untouched copy of itself, the method's own bias "
            "(`--control`). `bench/ab.py`.\n\n"
            + common.md_table(["model", "batch", "dtype", "style", "workload", "PyTorch ms", "convtune ms", "ratio",
                               "range", "median's interval", "full-path calls", "measured"], lines)
            + around_table(results))


def _held(around: dict, what: str, unit: str = "") -> str:
    """'before -> after' of one figure of the process's state around the tuning ('-' where not recorded)."""
    before, after = around["before"], around["after"]
    return f"{before[what]:.0f} -> {after[what]:.0f}{unit}" if what in before and what in after else "-"


def around_table(results: dict) -> str:
    """PyTorch's eager inference just before and just after ``optimize`` tuned the copy beside it on an empty
    database, in the same process, with what the process held each time: whether tuning leaves the process slower
    (one that tuned cold has run its timings slower than one that started warm)."""
    lines = []
    for key, res in sorted(results.items()):
        around = res.get("torch_around_tuning")
        if not around:
            continue
        lines.append([*key.split(":"), f"{around['before_ms']:.3f}", f"{around['after_ms']:.3f}",
                      f"{around['after_ms'] / around['before_ms']:.3f}", _held(around, "rss_mb", " MB"),
                      *(_held(around, what) for what in ("python_objects", "cuda_segments", "cuda_blocks"))])
    if not lines:
        return ""
    return ("\n## PyTorch's eager inference before and after the tuning beside it\n\n"
            f"The PyTorch model's eager inference (ms, median of {AROUND_TIMINGS} timings) just before `optimize` "
            "tuned the copy on an empty database and just after, in the same process, and what the process held "
            "each time (`e2e.process_state`); a model marked A/A had nothing tuned between, the baseline: a ratio "
            "over the baseline's says the tuning left the process slower (`--around-tuning`).\n\n"
            + common.md_table(["model", "batch", "dtype", "before ms", "after ms", "after / before", "resident memory",
                               "Python objects", "CUDA segments", "CUDA blocks"], lines))


def merge(payload: dict, others: list[dict]) -> dict:
    """``payload`` with the rows of ``others`` (results files of other runs) folded in: each row (model, batch, dtype,
    style, workload) from whichever file measured it last (its ``date``; a tie keeps the earlier file's). An entry
    that takes rows from a file takes its other fields (tune time, runtimes) from the file of its newest taken row,
    and the payload's environment is the newest contributing file's."""
    results = payload.setdefault("results", {})
    newest_env = (None, "")
    for other in others:
        took_env = False
        for key, entry in other.get("results", {}).items():
            mine = results.setdefault(key, {**{k: v for k, v in entry.items() if k != "rows"}, "rows": {}})
            taken = {cell: row for cell, row in entry["rows"].items()
                     if cell not in mine["rows"] or row["date"] > mine["rows"][cell]["date"]}
            if not taken:
                continue
            newest_mine = max((row["date"] for row in mine["rows"].values()), default="")
            if max(row["date"] for row in taken.values()) > newest_mine:  # (an older file's entry may lack a field)
                mine.update({"torch_around_tuning": None, **{k: v for k, v in entry.items() if k != "rows"}})
            mine["rows"].update(taken)
            took_env = True
        env = other.get("environment", {})
        if took_env and env.get("date", "") > newest_env[1]:
            newest_env = (env, env.get("date", ""))
    if newest_env[0] is not None and newest_env[1] > payload.get("environment", {}).get("date", ""):
        payload["environment"] = newest_env[0]
    return payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    split = e2e.split
    parser.add_argument("--models", type=split, default=["mobilenet_v2"])
    parser.add_argument("--batches", type=lambda t: [int(b) for b in split(t)], default=[128])
    parser.add_argument("--dtypes", type=split, default=["float16"])
    parser.add_argument("--styles", type=split, default=["eager", "compile"])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a small stand-in network (no torchvision needed)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=21,
                        help="timed rounds per cell (21: the median's 95%% interval runs from the 6th to the 16th)")
    parser.add_argument("--profile", action="store_true", help="also write the host-side profile of eager steps")
    parser.add_argument("--control", action="store_true", help="PyTorch against PyTorch: the method's own bias")
    parser.add_argument("--around-tuning", action="store_true", help="also time PyTorch's eager inference just "
                        "before and just after the copy's cold tuning (with --control: with nothing tuned between)")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="FILE",
                        help="fold these results files of other runs into the results file (newest row wins), "
                             "measuring nothing")
    common.result_arguments(parser, "ab")
    args = parser.parse_args()
    for option, values, allowed in (("--styles", args.styles, ("eager", "compile")), ("--dtypes", args.dtypes,
                                                                                       e2e.DTYPES)):
        if set(values) - set(allowed):
            parser.error(f"{option} {','.join(values)}: each must be one of {','.join(allowed)}")
    out_dir = Path(args.out or common.RESULTS)
    json_path = out_dir / f"{args.name}.json"
    payload = json.loads(json_path.read_text()) if json_path.exists() else {}
    if args.merge:
        payload = merge(payload, [json.loads(path.read_text()) for path in args.merge])
        if "environment" not in payload:
            parser.error(f"--merge: none of {', '.join(map(str, args.merge))} holds a row, and there is no {json_path}")
        common.write(args.name, payload, markdown(payload["environment"], payload["results"]), out_dir)
        print(markdown(payload["environment"], payload["results"]))
        return
    env = common.environment()
    payload = common.extendable(json_path, env, args.name)
    payload["environment"] = env
    results = payload.setdefault("results", {})
    for model in ["tiny"] if args.tiny else args.models:
        for batch in args.batches:
            for dtype in args.dtypes:
                label = f"{model} A/A" if args.control else model
                key = f"{label}:b{batch}:{dtype}"
                print(key, file=sys.stderr, flush=True)
                res = run(model, batch, dtype, args.styles, args.device, args.tiny, args.steps, args.rounds,
                          args.profile, args.control, args.around_tuning)
                if "profile" in res:
                    out_dir.mkdir(parents=True, exist_ok=True)
                    control = "_control" if args.control else ""
                    profile_path = out_dir / f"{args.name}_profile_{model}_b{batch}_{dtype}{control}.txt"
                    profile_path.write_text(f"# {key}: {common.env_line(env)}; layer directions by runtime "
                                            f"{res['runtimes']}\n\n{res.pop('profile')}\n")
                for row in res["rows"].values():  # each row its own stamp: rows kept from earlier runs keep theirs
                    row["date"], row["revision"] = env["date"], env["revision"]
                res["rows"] = {**results.get(key, {}).get("rows", {}), **res["rows"]}
                results[key] = res
                common.write(args.name, payload, markdown(env, results), out_dir)
    print(markdown(env, results))


if __name__ == "__main__":
    main()
