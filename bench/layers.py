"""Layer benchmark: convtune's get and find against cuDNN's heuristics, cuDNN exhaustively, and PyTorch.

For each layer of each configuration (network, batch, dtype, layout, direction), with one timer
(convtune.timing.benchmark: CUDA graph replay between events, L2 flushed) for everything:
- the roofline floor (FLOPs at peak, compulsory bytes at bandwidth);
- get's pick (ranked from the cost model, nothing run) and its measured time;
- find's pick, its time and find's wall time (database empty at the start of the run);
- cuDNN heuristics mode A's and mode B's first plans;
- the exhaustive best: every plan of heuristics A + FALLBACK built, checked and timed, and that wall time;
- PyTorch with cudnn.benchmark False and True, each in its own process (its caches are per process).

    python bench/layers.py --config resnet50:32:float16:NHWC:fwd [--config ...] [--out DIR]
    python bench/layers.py --all
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import convtune as ct  # noqa: E402
from convtune import hardware, zoo  # noqa: E402
from convtune.algorithms.base import allocate_workspace  # noqa: E402
from convtune.algorithms.native import native_conv  # noqa: E402
from convtune.timing import benchmark  # noqa: E402
from convtune.verify import reference, rel_error, tolerance  # noqa: E402

ALL = [  # in order of priority: a run cut short keeps the first ones
    "resnet50:32:float16:NHWC:fwd", "resnet50:32:float32:NCHW:fwd",
    "resnet50:32:float16:NHWC:bwd_data", "resnet50:32:float16:NHWC:bwd_filter",
    "mobilenet_v2:32:float16:NHWC:fwd", "vgg16:32:float16:NHWC:fwd", "resnet50:128:float16:NHWC:fwd",
    "mobilenet_v2:32:float32:NCHW:fwd", "vgg16:32:float32:NCHW:fwd", "resnet50:128:float32:NCHW:fwd",
]


def parse_config(text: str) -> dict:
    network, batch, dtype, layout, direction = text.split(":")
    return dict(network=network, batch=int(batch), dtype=dtype, layout=layout, direction=direction)


def layers_of(cfg: dict) -> list[zoo.Layer]:
    return zoo.network_layers(cfg["network"], cfg["batch"], direction=cfg["direction"], dtype=cfg["dtype"],
                              layout=cfg["layout"], device="cuda")


def checked_call(problem, algo, inputs, ref) -> tuple[Callable[[], object] | None, float | None, str]:
    """(its call as find times it, rel error, status) of one algorithm, after one run on ``inputs`` into a NaN-poisoned
    output compared with ``ref``: no call for a wrong result ('wrong_result') or a failure ('failed: ...')."""
    try:
        ws = allocate_workspace(algo.buffer_bytes(problem), problem.device)
        out = problem.empty(problem.operand_shapes[2]).fill_(float("nan"))
        algo.run(problem, *inputs, workspace=ws, out=out)
        err = rel_error(out, ref)
        if not err <= tolerance(problem, algo.notes(problem)):
            return None, err, "wrong_result"
        return algo.launcher(problem, *inputs, out, ws), err, "ok"
    except Exception as exc:  # noqa: BLE001 - a plan that fails is a row, not the end of the run
        return None, None, f"failed: {type(exc).__name__}: {str(exc)[:120]}"


def time_algorithm(problem, algo, inputs, ref) -> tuple[float | None, float | None, str]:
    """(median ms, rel error, status) of one algorithm with the shared timer; wrong results are not timed."""
    call, err, status = checked_call(problem, algo, inputs, ref)
    if call is None:
        return None, err, status
    try:
        return benchmark(call, device=problem.device).median_ms, err, status
    except Exception as exc:  # noqa: BLE001 - as checked_call
        return None, err, f"failed: {type(exc).__name__}: {str(exc)[:120]}"


def convtune_layers(cfg: dict, db: ct.TuningDB) -> list[dict]:
    from convtune.algorithms.cudnn import BACKEND

    rows = []
    for layer in layers_of(cfg):
        p = layer.problem
        inputs = p.random_inputs(seed=0)
        ref = reference(p, *inputs)
        row = dict(layer=layer.name, problem=p.key, count=layer.count, floor_ms=hardware.roofline_ms(p))
        t0 = time.perf_counter()
        choices = ct.get(p, db=db)
        row["get_first_call_ms"] = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        ct.get(p, db=db)
        row["get_ms"] = 1e3 * (time.perf_counter() - t0)
        row["get_pick"] = choices[0].name if choices else None
        t0 = time.perf_counter()
        results = ct.find(p, db=db)
        row["find_wall_s"] = time.perf_counter() - t0
        row["find_pick"], row["find_pick_ms"] = results[0].algorithm, results[0].time_ms
        row["find_timed"] = sum(r.status.value == "ok" for r in results)
        row["find_statuses"] = {s: sum(r.status.value == s for r in results) for s in {r.status.value for r in results}}
        # each candidate as find left it (in find's answer order), so that a miss of the exhaustive best says why
        row["find_results"] = [[r.algorithm, r.status.value, r.time_ms, r.message[:120]] for r in results]
        # Exhaustive cuDNN: every plan, built, checked and timed with the same timer.
        t0 = time.perf_counter()
        plans = {a.name: a for a in BACKEND.algorithms(p)}
        exhaustive = {name: time_algorithm(p, a, inputs, ref) for name, a in plans.items()}
        row["exhaustive_wall_s"] = time.perf_counter() - t0
        row["cudnn_plans"] = len(plans)
        timed = {n: v[0] for n, v in exhaustive.items() if v[0] is not None}
        best = min(timed, key=timed.get) if timed else None
        row["exhaustive_best"], row["exhaustive_best_ms"] = best, timed.get(best)
        for mode in ("A", "B"):
            name = BACKEND.heuristic_choice(p, mode)
            row[f"heur{mode}"] = name
            row[f"heur{mode}_ms"] = timed.get(name) if name else None
        # get's pick and find's pick timed again by the same method as the plans, to compare like with like.
        for key in ("get_pick", "find_pick"):
            name = row[key]
            if name in timed:
                row[key + "_ms"] = timed[name]
            elif name:
                algo = ct.get_algorithm(name, p)
                row[key + "_ms"] = time_algorithm(p, algo, inputs, ref)[0]
        row["cudnn_failures"] = {n: v[2] for n, v in exhaustive.items() if v[2] != "ok"}
        rows.append(row)
        print(f"{cfg['network']} {layer.name}: floor {row['floor_ms']:.4f} find {row['find_pick']} "
              f"{row['find_pick_ms']} ({row['find_wall_s']:.2f}s) exh {best} {row['exhaustive_best_ms']} "
              f"({row['exhaustive_wall_s']:.2f}s) A {row['heurA_ms']}", file=sys.stderr, flush=True)
    return rows


def torch_layers(cfg: dict, benchmark_mode: bool) -> list[dict]:
    """PyTorch's own path (F.conv / convolution_backward) in this process, benchmark mode as given."""
    torch.backends.cudnn.benchmark = benchmark_mode
    rows = []
    for layer in layers_of(cfg):
        p = layer.problem
        a, b = p.random_inputs(seed=0)
        t0 = time.perf_counter()
        native_conv(p, a, b)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        t = benchmark(lambda p=p, a=a, b=b: native_conv(p, a, b), device="cuda")
        rows.append(dict(layer=layer.name, ms=t.median_ms, first_call_s=first_s))
    return rows


def torch_in_subprocess(cfg_text: str, benchmark_mode: bool) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, __file__, "--torch-only", "--config", cfg_text, "--benchmark-mode", str(int(benchmark_mode)),
           "--torch-out", path]
    subprocess.run(cmd, check=True)
    return json.loads(Path(path).read_text())


def summarize(cfg_text: str, rows: list[dict]) -> dict:
    def ratio(key):
        return common.geomean([r[key] / r["exhaustive_best_ms"] for r in rows
                               if r.get(key) and r.get("exhaustive_best_ms")])

    def total(key):
        return sum((r.get(key) or math.nan) * r["count"] for r in rows)

    return {
        "config": cfg_text, "layers": len(rows),
        "geomean_vs_exhaustive": {k: ratio(k) for k in ("get_pick_ms", "find_pick_ms", "heurA_ms", "heurB_ms",
                                                        "torch_bench0_ms", "torch_bench1_ms")},
        "summed_ms": {k: total(k) for k in ("floor_ms", "get_pick_ms", "find_pick_ms", "heurA_ms", "heurB_ms",
                                            "exhaustive_best_ms", "torch_bench0_ms", "torch_bench1_ms")},
        "tuning_s": {"find": sum(r["find_wall_s"] for r in rows),
                     "exhaustive": sum(r["exhaustive_wall_s"] for r in rows),
                     "torch_benchmark_first_calls": sum(r.get("torch_bench1_first_s", 0) for r in rows)},
        "get_ms_max": max(r["get_ms"] for r in rows),
    }


def markdown(env: dict, summaries: list[dict]) -> str:
    head = (f"# Layer benchmark\n\n{common.env_line(env)}. Times: CUDA-graph replay, L2 flushed, median.\n"
            "Ratios: geometric mean over layers of time / exhaustive cuDNN best (1.00 = the best cuDNN execution "
            "plan). Sums weight each layer by how often the network runs it.\n\n")
    rows = []
    for s in summaries:
        g, t, w = s["geomean_vs_exhaustive"], s["summed_ms"], s["tuning_s"]
        rows.append([s["config"], s["layers"], f"{g['get_pick_ms']:.3f}", f"{g['find_pick_ms']:.3f}",
                     f"{g['heurA_ms']:.3f}", f"{g['heurB_ms']:.3f}", f"{g['torch_bench0_ms']:.3f}",
                     f"{g['torch_bench1_ms']:.3f}", f"{t['find_pick_ms']:.3f}", f"{t['exhaustive_best_ms']:.3f}",
                     f"{t['floor_ms']:.3f}", f"{w['find']:.1f}", f"{w['exhaustive']:.1f}"])
    return head + common.md_table(
        ["config", "layers", "get", "find", "heur A", "heur B", "torch bm=0", "torch bm=1", "find sum ms",
         "exhaustive sum ms", "floor sum ms", "find s", "exhaustive s"], rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("--all", action="store_true")
    common.result_arguments(parser, "layers")
    parser.add_argument("--torch-only", action="store_true")
    parser.add_argument("--benchmark-mode", type=int, default=0)
    parser.add_argument("--torch-out")
    args = parser.parse_args()
    configs = ALL if args.all else args.config
    if args.torch_only:
        rows = torch_layers(parse_config(configs[0]), bool(args.benchmark_mode))
        Path(args.torch_out).write_text(json.dumps(rows))
        return
    env = common.environment()
    payload = {"environment": env, "configs": {}}
    summaries = []
    with tempfile.TemporaryDirectory() as tmp, ct.TuningDB(os.path.join(tmp, "bench.sqlite")) as db:
        for cfg_text in configs:
            cfg = parse_config(cfg_text)
            rows = convtune_layers(cfg, db)
            for mode in (0, 1):
                for row, trow in zip(rows, torch_in_subprocess(cfg_text, bool(mode))):
                    row[f"torch_bench{mode}_ms"] = trow["ms"]
                    row[f"torch_bench{mode}_first_s"] = trow["first_call_s"]
            payload["configs"][cfg_text] = rows
            summaries.append(summarize(cfg_text, rows))
            print(json.dumps(summaries[-1]), file=sys.stderr, flush=True)
            payload["summaries"] = summaries
            common.write(args.name, payload, markdown(env, summaries), args.out)  # after each: a cut run keeps it
    print(markdown(env, summaries))


if __name__ == "__main__":
    main()
