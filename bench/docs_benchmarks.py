"""docs/benchmarks.md and README's "What to expect" table, written from the result files in bench/results/
(never typed by hand).

Headline tables of every benchmark, each figure with the file it comes from and the date, GPU,
versions and revision of the run that measured it. Run it after committing new results:

    python bench/docs_benchmarks.py            # writes docs/benchmarks.md and README's table
    python bench/docs_benchmarks.py --check    # exits 1 when either is out of date
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
README = DOC.parents[1] / "README.md"
README_BEGIN, README_END = "<!-- expect: written by bench/docs_benchmarks.py -->", "<!-- expect end -->"
README_ROWS = (("resnet50", "b32", "ResNet-50, batch 32"), ("resnet50", "b128", "ResNet-50, batch 128"),
               ("mobilenet_v2", "b32", "MobileNetV2, batch 32"), ("mobilenet_v2", "b128", "MobileNetV2, batch 128"))
LINK = "../bench/results/"
STYLES = ("graph", "eager", "compile")


def _load(name: str) -> dict:
    return json.loads((common.RESULTS / name).read_text(encoding="utf-8"))


def _env(env: dict) -> str:
    return common.env_line(env)


def _ratio(torch_row: dict | None, ct_row: dict | None, workload: str) -> str:
    ok = torch_row and ct_row and torch_row.get("status") == ct_row.get("status") == "ok"
    return f"{torch_row[workload]['ms'] / ct_row[workload]['ms']:.2f}" if ok else "-"


def end_to_end() -> str:
    data = _load("e2e.json")
    rows, configs = [], data["configs"]
    groups = sorted({key.rsplit(":", 2)[0] for key in configs})
    for group in groups:
        if not any(f"{group}:{style}:convtune" in configs for style in STYLES):
            continue  # only PyTorch's rows: nothing to compare
        cells = []
        for style in STYLES:
            base, ours = configs.get(f"{group}:{style}:torch_bm1"), configs.get(f"{group}:{style}:convtune")
            revisions = sorted({r.get("revision") or "?" for r in (base, ours) if r})
            cells.append(f"{_ratio(base, ours, 'inference')} / {_ratio(base, ours, 'training')} "
                         f"({', '.join(revisions)})" if base and ours else "-")
        rows.append([group.replace(":", " "), *cells])
    return (f"## Whole networks ([`e2e.md`]({LINK}e2e.md), `bench/e2e.py`)\n\n"
            f"Latest run: {_env(data['environment'])}. Autocast, channels_last; PyTorch with "
            "`cudnn.benchmark=True` in the same style divided by convtune, inference / training step (above 1: "
            "convtune is faster), with the revisions of the two rows; where the host sets the pace (eager and "
            "compiled inference at these sizes) the processes of one configuration have differed by up to 1.7x "
            "([`performance.md`](performance.md)).\n\n"
            + common.md_table(["network", "CUDA graph", "eager", "torch.compile"], rows))


def readme_table() -> str:
    """README's headline table, float16, PyTorch benchmark=True / convtune per style: eager and torch.compile from
    ab.json where it has the configuration (both models in one process, timed in alternation: the median of the
    rounds' ratios), else, like the CUDA-graph column, from e2e.json (each configuration in its own process);
    tuning: the median of convtune's cold-database rows' optimize time / of its warm-database rows' (another
    process) in e2e.json, and PyTorch's first eager inference call plus first training step in benchmark mode."""
    configs, link = _load("e2e.json")["configs"], "bench/results/e2e.md"
    alternated = _load("ab.json")["results"] if (common.RESULTS / "ab.json").exists() else {}
    rows = []
    for network, batch, title in README_ROWS:
        group = f"{network}:{batch}:float16"
        cells = []
        for style in STYLES:
            ab_rows = alternated.get(group, {}).get("rows", {})
            if style != "graph" and all(f"{style}:{w}" in ab_rows for w in ("inference", "training")):
                ratios = " / ".join(f"{ab_rows[f'{style}:{w}']['ratio']:.2f}" for w in ("inference", "training"))
                cells.append(f"[{ratios}](bench/results/ab.md)")
                continue
            base, ours = configs.get(f"{group}:{style}:torch_bm1"), configs.get(f"{group}:{style}:convtune")
            cells.append(f"[{_ratio(base, ours, 'inference')} / {_ratio(base, ours, 'training')}]({link})")
        tuned = [configs.get(f"{group}:{style}:convtune") or {} for style in STYLES]
        cold = [r["tune_s"] for r in tuned if r.get("db") == "cold" and r.get("tune_s") is not None]
        warm = [r["tune_s"] for r in tuned if r.get("db") == "warm" and r.get("tune_s") is not None]
        bench = configs.get(f"{group}:eager:torch_bm1") or {}
        first = (bench.get("inference_first_s") or 0) + (bench.get("training_first_s") or 0)
        tuning = (" / ".join([f"{statistics.median(cold):.1f} s" if cold else "-",
                              f"{statistics.median(warm):.2f} s" if warm else "-"])
                  + (f" ({first:.1f} s)" if bench else ""))
        rows.append([title, *cells, f"[{tuning}]({link})"])
    return common.md_table(["network", "CUDA graph", "eager", "torch.compile",
                            "tuning: empty database / warm (benchmark mode's first calls)"], rows)


def readme() -> str:
    """README.md with its "What to expect" table rewritten between the markers."""
    text = README.read_text(encoding="utf-8")
    head, found, rest = text.partition(README_BEGIN + "\n")
    _, found_end, tail = rest.partition(README_END)
    if not (found and found_end):
        raise SystemExit(f"{README} lacks the markers {README_BEGIN!r} and {README_END!r} around its table")
    return head + README_BEGIN + "\n" + readme_table() + README_END + tail


def host_cost() -> str:
    data = _load("tuning_cost_native.json")
    # "<path>: <what> / nn.Conv2d's" rows: the path and what was timed (forward, forward+backward, ...)
    rows = [[f"{name.split(': ')[0]} ({name.split(': ', 1)[1].split(' / ')[0]})", f"{value:.2f}"]
            for name, value in data["host_us"] if " / " in name and ("executables" in name or "Triton module" in name)]
    return (f"## One layer's host cost ([`tuning_cost_native.md`]({LINK}tuning_cost_native.md), "
            f"`bench/tuning_cost.py`)\n\n{_env(data['environment'])}. A 1x1 8->8 convolution on 4x4 (the Triton "
            f"module's rows: a depthwise 3x3 one of that size), {data['config']['dtype']}, channels_last; module "
            "against `nn.Conv2d` timed in alternation, median of the rounds' ratios; runtime native: the layer's C++ "
            "op, python: the Python path.\n\n"
            + common.md_table(["path", "ratio to nn.Conv2d"], rows))


def warm_start() -> str:
    rows = []
    for path in sorted(common.RESULTS.glob("warm_start*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        a, stages = data["args"], data["stages"]
        warm, torch_row = stages.get("warm", {}), stages.get("torch", {})
        if warm.get("status") != "ok":
            continue
        rows.append([f"{a['network']} b{a['batch']} {a['dtype']}", f"{stages['cold']['optimize_s']:.2f}",
                     f"{warm['optimize_s']:.2f}", f"{warm['first_step_s']:.2f}",
                     f"{torch_row['first_step_s']:.2f}" if torch_row.get("status") == "ok" else "-",
                     f"[{path.stem}.md]({LINK}{path.stem}.md) {_env(data['environment'])}"])
    return ("## Warm start (`bench/warm_start.py`)\n\n`optimize(training=True)` under autocast, channels_last, "
            "seconds: on an empty database, then in a fresh process on the full one; the first training step "
            "after the warm one, and PyTorch's first training step (`cudnn.benchmark=False`) in a fresh process.\n\n"
            + common.md_table(["network", "cold optimize", "warm optimize", "first step after it",
                               "PyTorch's first step", "file"], rows))


def new_shapes() -> str:
    rows = []
    for path in sorted(common.RESULTS.glob("dynamic_shapes*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        a = data["args"]
        for config, r in data["configs"].items():
            if r.get("status") != "ok":
                continue
            s = r["summary"]
            steady = ", ".join(f"{z}: {ms:.2f}" for z, ms in s["steady_ms"].items())
            rows.append([f"{'a small stand-in' if a['tiny'] else a['network']} b{a['batch']} {a['dtype']}", config,
                         f"{s['total_s']:.2f}", f"{s['worst_ratio']:.1f}", s["steps_over_2x"], steady,
                         f"[{path.stem}.md]({LINK}{path.stem}.md) {_env(data['environment'])}"])
    return ("## New input shapes (`bench/dynamic_shapes.py`)\n\nTraining steps over image sizes met in turn, then "
            "cycled; each configuration a fresh process, convtune's on an empty database. Seconds of all steps, the "
            "worst step over its size's steady time, the steps over 2x, and each size's steady ms.\n\n"
            + common.md_table(["network", "configuration", "all steps s", "worst step / steady", "steps over 2x",
                               "steady ms by size", "file"], rows))


def layers() -> str:
    files = sorted(common.RESULTS.glob("layers*.json"), key=lambda p: (p.name != "layers.json", p.name))
    latest = {}
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        for s in data["summaries"]:
            latest[s["config"]] = (path.name, data["environment"], s)
    rows = []
    for config, (name, env, s) in latest.items():
        g, t = s["geomean_vs_exhaustive"], s["summed_ms"]
        md = name.replace(".json", ".md")
        rows.append([config, f"[{md}]({LINK}{md}) {env.get('date')}",
                     *(f"{g[k]:.3f}" for k in ("get_pick_ms", "find_pick_ms", "heurA_ms", "torch_bench1_ms")),
                     f"{t['find_pick_ms']:.3f} / {t['exhaustive_best_ms']:.3f}"])
    return ("## Layers (`bench/layers.py`)\n\nGeometric mean over a network's layers of time / the exhaustive "
            "best cuDNN execution plan (1.000: as fast as trying every plan).\n\n"
            + common.md_table(["config", "file", "get", "find", "cuDNN heuristics A", "torch benchmark=True",
                               "find / exhaustive sum (ms)"], rows))


def budgets() -> str:
    data = _load("plan_budgets.json")
    rows = [[r["budget"], f"{r['shared_ms']:.3f}", f"{r['divided_ms']:.3f}", f"{r['even_cap_ms']:.3f}"]
            for r in data["rows"]]
    return (f"## Workspace budgets ([`plan_budgets.md`]({LINK}plan_budgets.md), `bench/plan_budgets.py`)\n\n"
            f"{_env(data['environment'])}. {data['config']}: summed layer times (ms) of the plan made for each "
            f"budget; without a budget {data['unconstrained_ms']:.3f} ms.\n\n"
            + common.md_table(["budget", "shared plan", "divided plan", "even per-layer cap"], rows))


def learned_get() -> str:
    path = common.RESULTS / "learned_get.json"
    if not path.exists():
        return ""
    data = _load("learned_get.json")
    by_network: dict[str, list[dict]] = {}
    for key, row in data["rows"].items():
        by_network.setdefault(key.split("/", 1)[0], []).append(row)
    rankings = ("learned", "analytic", "torch_bm0", "cudnn_A", "cudnn_B")

    def cell(rows: list[dict], ranking: str) -> str:
        ratios = [r[ranking] for r in rows if r.get(ranking)]
        if not ratios:
            return "-"
        geomean = common.geomean(ratios)
        return f"{geomean:.3f} / {max(ratios):.2f}"

    everything = [r for rows in by_network.values() for r in rows]
    table = [[network, len(rows), *(cell(rows, k) for k in rankings)] for network, rows in sorted(by_network.items())]
    table.append(["all held out", len(everything), *(cell(everything, k) for k in rankings)])
    splits = data.get("random_splits") or [data["random_split"]]
    seeds = range(data.get("seed", 0), data.get("seed", 0) + len(splits))
    return (f"## get's learned cost model ([`learned_get.md`]({LINK}learned_get.md), `bench/learned_get.py`)\n\n"
            f"{'measured on ' + data['measured_on'] + ', judged on ' if data.get('measured_on') else ''}"
            f"{_env(data['environment'])}; {data['samples']} measurements of {data['problems']} problems. Each "
            f"network's layers (every direction) judged by a model built without them: the measured time of "
            f"each ranking's first pick over the best measured, geometric mean / worst (targets: 1.05 / 1.5). "
            f"analytic: the analytic model with cuDNN's order of its plans, as `get` ranks without a learned "
            f"model; torch_bm0: PyTorch's own call without benchmark mode; cudnn_A, cudnn_B: the first plan of "
            f"cuDNN's heuristics A and B (recorded on the GPU that measured, `bench/cudnn_order.py`).\n\n"
            + common.md_table(["held out", "problems", *(f"{k}: geomean / worst" for k in rankings)], table)
            + "\n\nRandom splits of whole problems (a fifth held out), learned against analytic: "
            + "; ".join(f"seed {seed} {split['learned_geomean']:.3f} / {split['learned_worst']:.2f} against "
                        f"{split['analytic_geomean']:.3f} / {split['analytic_worst']:.2f}"
                        for seed, split in zip(seeds, splits)) + ".")


def render() -> str:
    return ("# Benchmarks\n\nWritten by `bench/docs_benchmarks.py` from the result files in `bench/results/`; "
            "what the figures mean and what is still open: [`performance.md`](performance.md).\n\n"
            + "\n\n".join(text for part in (end_to_end, host_cost, warm_start, new_shapes, learned_get, layers, budgets)
                            if (text := part())) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when docs/benchmarks.md or README's table is out of date")
    args = parser.parse_args()
    outputs = {DOC: render(), README: readme()}
    if args.check:
        stale = [path for path, text in outputs.items()
                 if (path.read_text(encoding="utf-8") if path.exists() else "") != text]
        for path in stale:
            print(f"{path} is out of date: run python bench/docs_benchmarks.py", file=sys.stderr)
        sys.exit(1 if stale else 0)
    for path, text in outputs.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
