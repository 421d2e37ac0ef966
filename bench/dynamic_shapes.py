"""New input shapes during training: does a step stall when the model meets an image size it has not seen?

Each configuration runs in its own process: a training step (SGD, autocast, channels_last) on a
network fed a sequence of image sizes. First every size in turn, several steps each (``--repeat``),
so that each size is new once; then the sizes cycled (``--cycles``), which gives each size's steady
step time. Every step is timed on its own (synchronized). The configurations:

- ``torch_bm1``: PyTorch with ``cudnn.benchmark=True``, which measures every new shape on the step that meets it;
- ``torch_bm0``: PyTorch with ``cudnn.benchmark=False``, which measures nothing: what a step that meets a new
  shape costs when nothing is measured (cuDNN's heuristics and plan builds alone), the floor of any cuDNN path;
- ``convtune_background``: ``optimize(training=True, mode="background")`` on the first size (measured
  then, on an empty database); later sizes start on PyTorch's own call while a worker thread
  measures them (``convtune.background``), and the layers switch when the measurements are stored;
- ``convtune_hybrid``: the same in the default mode, which measures a new shape on the step that meets it.

The report gives, per configuration, the worst step over its size's steady time (the target:
no step above 2x for ``convtune_background``), the steps above 2x, and each size's steady time.

    python bench/dynamic_shapes.py --network resnet18 --batch 32

writes bench/results/dynamic_shapes_<network>_b<batch>.json and .md (--out, --name); --tiny runs a
small stand-in network.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CONFIGS = ("torch_bm1", "torch_bm0", "convtune_background", "convtune_hybrid")


def child(config: str, args: argparse.Namespace, db_path: str) -> dict:
    """One configuration, in this (fresh) process: every step's size and seconds."""
    import torch

    import convtune
    from e2e import build_model, logits

    device, dtype = args.device, getattr(torch, args.dtype)
    torch.manual_seed(0)
    model, _, classes = build_model(args.network, args.tiny)
    model = model.to(device).to(memory_format=torch.channels_last).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    sizes = [int(s) for s in args.sizes.split(",")]

    def batch(size: int) -> tuple:
        x = torch.randn(args.batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
        return x, torch.randint(0, classes, (args.batch,), device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def step(size: int) -> float:
        x, labels = batch(size)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=dtype):
            loss = torch.nn.functional.cross_entropy(logits(model(x)), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    out: dict = {}
    t0 = time.perf_counter()
    if config.startswith("torch_"):
        torch.backends.cudnn.benchmark = config == "torch_bm1"
    else:
        mode = config.removeprefix("convtune_")
        with torch.autocast(device, dtype=dtype):
            convtune.optimize(model, batch(sizes[0])[0], training=True, mode=mode, db=db_path)
    out["setup_s"] = time.perf_counter() - t0
    steps = [(size, step(size)) for size in sizes for _ in range(args.repeat)]
    t0 = time.perf_counter()
    convtune.background.wait(args.timeout)  # what is still measured (none for the other configurations)
    out["background_left_s"] = time.perf_counter() - t0
    steps += [(size, step(size)) for _ in range(args.cycles) for size in sizes]
    out["steps"] = steps
    if not config.startswith("torch_"):  # each layer direction's final choice and the path it runs on
        rows = convtune.explain(model)
        out["choices"] = {f"{r['module']} {r['problem']}": r["algorithm"] for r in rows}
        out["runtimes"] = {k: sum(r["runtime"] == k for r in rows) for k in sorted({r["runtime"] for r in rows})}
    return out


def summarize(r: dict, cycles: int, sizes: list[int]) -> dict:
    """Each size's steady time (the median of its cycled steps) and each step over its size's."""
    steps = r["steps"]
    tail = steps[len(steps) - cycles * len(sizes):]
    steady = {size: statistics.median(s for z, s in tail if z == size) for size in sizes}
    ratios = [s / steady[z] for z, s in steps]
    worst = max(range(len(steps)), key=lambda i: ratios[i])
    return {"steady_ms": {str(z): 1e3 * t for z, t in steady.items()}, "worst_ratio": ratios[worst],
            "worst_step": worst, "worst_size": steps[worst][0], "steps_over_2x": sum(q > 2 for q in ratios),
            "total_s": sum(s for _, s in steps)}


def run_config(config: str, args: argparse.Namespace, db_path: str) -> dict:
    cmd = [sys.executable, __file__, "--child", config, "--db", db_path, "--network", args.network,
           "--batch", str(args.batch), "--dtype", args.dtype, "--device", args.device, "--sizes", args.sizes,
           "--repeat", str(args.repeat), "--cycles", str(args.cycles), "--timeout", str(args.timeout)]
    cmd += ["--tiny"] if args.tiny else []
    return common.run_child(cmd, args.timeout)


def report(payload: dict) -> str:
    env, a = payload["environment"], payload["args"]
    sizes = [int(s) for s in a["sizes"].split(",")]
    network = "a small stand-in network" if a["tiny"] else a["network"]
    md = [f"# New input shapes during training\n\n{common.env_line(env)}. "
          f"{network} b{a['batch']} {a['dtype']} channels_last, training steps (SGD) under autocast; sizes "
          f"{a['sizes']} each {a['repeat']} steps in turn, then cycled {a['cycles']} times (steady time: a size's "
          f"median there); each configuration a fresh process, convtune's on an empty database.\n"]
    rows = []
    for config in CONFIGS:
        r = payload["configs"].get(config, {})
        if r.get("status") != "ok":
            rows.append([config, r.get("status", "not run")[:120]] + [""] * (3 + len(sizes)))
            continue
        s = r["summary"]
        worst = f"{s['worst_ratio']:.2f} (step {s['worst_step']}, {s['worst_size']})"
        rows.append([config, f"{r['setup_s']:.2f}", worst, s["steps_over_2x"], f"{s['total_s']:.2f}"]
                    + [f"{s['steady_ms'][str(z)]:.2f}" for z in sizes])
    md.append(common.md_table(["configuration", "setup s", "worst step / steady", "steps over 2x", "all steps s"]
                              + [f"steady ms {z}" for z in sizes], rows))
    tuned = {c: r for c, r in payload["configs"].items() if "choices" in r}
    if tuned:
        md.append("\nThe layer directions' final choices (after every measurement) and the paths they run on; "
                  "choices differing from convtune_hybrid's, whose candidates are timed alone on the device:\n")
        hybrid = tuned.get("convtune_hybrid", {}).get("choices", {})
        md.append(common.md_table(["configuration", "layer directions by runtime", "choices unlike hybrid's"], [
            [c, ", ".join(f"{k} {v}" for k, v in r["runtimes"].items()),
             sum(a != hybrid.get(key, a) for key, a in r["choices"].items())] for c, r in tuned.items()]))
    return "\n".join(md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--network", default="resnet18")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", default=None, help="image sizes, comma-separated (default 224,192,256,160; "
                                                      "--tiny: 32,24,40,16)")
    parser.add_argument("--repeat", type=int, default=5, help="steps per size in the first pass")
    parser.add_argument("--cycles", type=int, default=5, help="cycles over the sizes afterwards")
    parser.add_argument("--tiny", action="store_true", help="a small stand-in network (no torchvision needed)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one configuration may take")
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    common.result_arguments(parser, "dynamic_shapes_<network>_b<batch>")
    args = parser.parse_args()
    args.sizes = args.sizes or ("32,24,40,16" if args.tiny else "224,192,256,160")
    if args.name == "dynamic_shapes_<network>_b<batch>":
        args.name = f"dynamic_shapes_{'tiny' if args.tiny else args.network}_b{args.batch}"
    if args.child:
        Path(args.child_out).write_text(json.dumps(child(args.child, args, args.db)))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    configs = {}
    for config in CONFIGS:
        with tempfile.TemporaryDirectory() as tmp:  # an empty database for each convtune configuration
            t0 = time.perf_counter()
            r = configs[config] = run_config(config, args, os.path.join(tmp, "tuning.sqlite"))
            if r["status"] == "ok":
                r["summary"] = summarize(r, args.cycles, sizes)
            print(f"{config}: {r['status']} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    payload = {"environment": common.environment(), "args": vars(args), "configs": configs}
    md = report(payload)
    common.write(args.name, payload, md, Path(args.out) if args.out else None)
    print(md)


if __name__ == "__main__":
    main()
