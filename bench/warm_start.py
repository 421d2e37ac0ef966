"""Where a warm ``optimize`` spends its time: a fresh process, a full database.

One process tunes the network on an empty database (``optimize(training=True)`` under autocast,
channels_last, as bench/e2e.py does). Then, each in a fresh process on that database:

- ``warm``: the same ``optimize``, timed (what a user waits for), then its first training step;
- ``profiled``: the same under cProfile: the wall time of each phase (observing the model, the
  database, making the native executables, cuDNN execution plan deserialization) and the costliest functions;
- ``torch``: PyTorch alone (``cudnn.benchmark=False``): its first training step, which loads the same
  libraries and builds cuDNN's execution plans its own way, the cost any process pays before its first step.

    python bench/warm_start.py --network mobilenet_v2 --batch 32

writes bench/results/warm_start_<network>_b<batch>.json and .md (--out, --name); --tiny runs a small stand-in network.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # before torch is imported: a stage's import time counts from here

import argparse  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

STAGES = ("cold", "warm", "profiled", "torch")


def child(stage: str, args: argparse.Namespace, db_path: str) -> dict:
    """One stage, in this (fresh) process."""
    import torch

    import convtune
    from e2e import build_model, logits

    out: dict = {"import_s": time.perf_counter() - _STARTED}
    device, dtype = args.device, getattr(torch, args.dtype)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model, size, classes = build_model(args.network, args.tiny)
    model = model.to(device).to(memory_format=torch.channels_last).train()
    x = torch.randn(args.batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
    labels = torch.randint(0, classes, (args.batch,), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    out["model_s"] = time.perf_counter() - t0

    def step() -> None:
        with torch.autocast(device, dtype=dtype):
            loss = torch.nn.functional.cross_entropy(logits(model(x)), labels)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()

    def first_step() -> None:
        t0 = time.perf_counter()
        step()
        out["first_step_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        step()
        out["second_step_s"] = time.perf_counter() - t0

    if stage == "torch":
        torch.backends.cudnn.benchmark = False
        first_step()
        return out
    profiler = cProfile.Profile() if stage == "profiled" else None
    with convtune.TuningDB(db_path) as db:
        out["db_entries"] = len(db.entries())
        with torch.autocast(device, dtype=dtype):
            t0 = time.perf_counter()
            if profiler:
                profiler.enable()
            convtune.optimize(model, x, training=True, db=db)
            if profiler:
                profiler.disable()
            out["optimize_s"] = time.perf_counter() - t0
    rows = convtune.explain(model)
    out["layers"] = len(rows)
    out["algorithms"] = sorted({r["algorithm"] or "torch (fallback)" for r in rows})
    out["runtimes"] = {k: sum(r["runtime"] == k for r in rows) for k in sorted({r["runtime"] for r in rows})}
    first_step()
    if profiler:
        out["profile"] = summarize(profiler)
    return out


# Phases of a warm optimize: (label, the functions whose cumulative time it is; the first found counts).
PHASES = (
    ("observing the model (its example run)", ("optimize.py:_observe",)),
    ("selecting from the database", ("network.py:select_layers",)),
    ("making each layer's selection (executables)", ("tuning.py:select_for_layer",)),
    ("native executables made", ("runtime.py:",)),
    ("host costs measured (once a machine; kept in the database)", ("host_costs.py:",)),
)


def summarize(profiler: cProfile.Profile, top: int = 25) -> dict:
    """Cumulative and own seconds of the costliest functions, and the phases above."""
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, tottime, cumtime, callers)

    def label(key: tuple) -> str:
        file, _, name = key
        return f"{Path(file).name}:{name}" if file != "~" else name

    rows = [(label(k), v[1], v[2], v[3]) for k, v in stats.items()]
    by_cum = sorted(rows, key=lambda r: -r[3])[:top]
    by_own = sorted(rows, key=lambda r: -r[2])[:top]
    phases = {}
    for name, needles in PHASES:
        for needle in needles:
            hits = [r for r in rows if r[0].startswith(needle)]
            if hits:
                phases[name] = max(h[3] for h in hits)
                break
    return {"cumulative": [list(r) for r in by_cum], "own": [list(r) for r in by_own], "phases": phases}


def run_stage(stage: str, args: argparse.Namespace, db_path: str) -> dict:
    cmd = ([sys.executable, __file__, "--child", stage, "--db", db_path, "--network", args.network,
            "--batch", str(args.batch), "--dtype", args.dtype, "--device", args.device]
           + (["--tiny"] if args.tiny else []))
    return common.run_child(cmd, args.timeout)


def report(payload: dict) -> str:
    env, a = payload["environment"], payload["args"]
    md = [f"# Warm start\n\n{common.env_line(env)}. "
          f"{a['network']} b{a['batch']} {a['dtype']} channels_last, optimize(training=True) under autocast; "
          "each stage a fresh process on the database the cold stage filled.\n"]
    rows = []
    for stage in STAGES:
        r = payload["stages"].get(stage, {})
        if r.get("status") != "ok":
            rows.append([stage, r.get("status", "not run")[:120], "", "", "", ""])
            continue
        runtimes = ", ".join(f"{k} {v}" for k, v in r.get("runtimes", {}).items())
        rows.append([stage, f"{r['import_s']:.2f}", f"{r.get('optimize_s', float('nan')):.2f}",
                     f"{r['first_step_s']:.2f}", f"{r['second_step_s']:.3f}", runtimes])
    md.append(common.md_table(["stage", "import s", "optimize s", "first step s", "second step s",
                               "layer directions by runtime"], rows))
    prof = payload["stages"].get("profiled", {}).get("profile")
    if prof:
        md.append("\n## Phases of the profiled warm optimize (cumulative s; cProfile slows Python)\n")
        md.append(common.md_table(["phase", "s"], [[k, f"{v:.3f}"] for k, v in prof["phases"].items()]))
        md.append("\n## Costliest functions, cumulative\n")
        md.append(common.md_table(["function", "calls", "own s", "cumulative s"],
                                  [[f"`{n}`", c, f"{o:.3f}", f"{t:.3f}"] for n, c, o, t in prof["cumulative"]]))
        md.append("\n## Costliest functions, own time\n")
        md.append(common.md_table(["function", "calls", "own s", "cumulative s"],
                                  [[f"`{n}`", c, f"{o:.3f}", f"{t:.3f}"] for n, c, o, t in prof["own"]]))
    return "\n".join(md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--network", default="mobilenet_v2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small stand-in network (no torchvision needed)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one stage may take")
    parser.add_argument("--db", help="the tuning database (default: a new one in a temporary folder)")
    parser.add_argument("--child", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    common.result_arguments(parser, "warm_start_<network>_b<batch>")
    args = parser.parse_args()
    if args.name == "warm_start_<network>_b<batch>":
        args.name = f"warm_start_{'tiny' if args.tiny else args.network}_b{args.batch}"
    if args.child:
        Path(args.child_out).write_text(json.dumps(child(args.child, args, args.db)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        db_path = args.db or os.path.join(tmp, "tuning.sqlite")
        stages = {}
        for stage in STAGES:
            t0 = time.perf_counter()
            stages[stage] = run_stage(stage, args, db_path)
            print(f"{stage}: {stages[stage].get('status')} in {time.perf_counter() - t0:.1f} s "
                  f"(optimize {stages[stage].get('optimize_s', float('nan')):.2f} s)", file=sys.stderr, flush=True)
    payload = {"environment": common.environment(), "args": vars(args), "stages": stages}
    md = report(payload)
    common.write(args.name, payload, md, Path(args.out) if args.out else None)
    print(md)


if __name__ == "__main__":
    main()
