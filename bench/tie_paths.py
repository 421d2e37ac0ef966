"""Which path a layer whose pick is PyTorch's own call should take in eager code: measured in one process.

find ranks torch:native first among results within the policy's tolerance of the fastest (a tie), and such a
layer calls PyTorch's convolution through the C++ check of its input (``TorchDirect``). In the host table a
cuDNN executable costs the host 4-8 us less a forward than PyTorch's own call (bench/results/host_probe.md), so
a tie might serve host-bound code better on the executable. This times, in one process and in rotation (A B C D,
then the order turned every round, as bench/ab.py does), four copies of a network (the same weights):

- torch: PyTorch, ``cudnn.benchmark=True``;
- tuned: ``convtune.optimize(training=True)`` on an empty database;
- python_torch: the tuned copy, its layers on PyTorch's call checked in Python (``TorchCall``: nn.Conv2d's forward);
- cudnn_ties: the tuned copy, each direction that chose torch:native on the fastest cuDNN plan measured within
  the policy's tolerance of torch:native's time, where one was (the layer then runs on convtune's op).

Eager inference and training step (forward, loss, backward, SGD), autocast, channels_last. Per workload: each copy's
median over the rounds (ms) and the median of the rounds' ratios torch / copy (above 1: faster than PyTorch).

    python bench/tie_paths.py --models resnet50,mobilenet_v2 --batch 32 --dtype float16
    python bench/tie_paths.py --device cpu --tiny --out /tmp/tie   # the pipeline on a small stand-in network

Results: bench/results/tie_paths.json and .md (or --out, --name).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import convtune  # noqa: E402
import e2e  # noqa: E402
from convtune.pytorch.modules import TorchCall  # noqa: E402
from convtune.pytorch.tuning import LayerSelection  # noqa: E402
from convtune.ranking import NATIVE  # noqa: E402

VARIANTS = ("torch", "tuned", "python_torch", "cudnn_ties")


def tuned_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "_convtune_selections")]


def on_python_checks(model: torch.nn.Module) -> int:
    """Layers whose choice is PyTorch's call take it through the Python checks (``TorchCall``); how many."""
    def entry(self, input, sig, batched, selection):
        return TorchCall.of(input, sig, selection)

    count = 0
    for m in tuned_layers(model):
        m._convtune_torch_entry = types.MethodType(entry, m)
        m._convtune_fast.clear()  # the next call of each shape makes its entry anew
        count += sum(s.runtime == "torch" for s in m._convtune_selections.values())
    return count


def on_cudnn_ties(model: torch.nn.Module, db: convtune.TuningDB, tolerance: float) -> tuple[int, int]:
    """Each direction that chose torch:native takes the fastest cuDNN plan measured within ``tolerance`` of it;
    (layers changed, directions changed)."""
    layers = directions = 0
    for m in tuned_layers(model):
        for sig, selection in list(m._convtune_selections.items()):
            if not selection.problem:
                continue
            base = convtune.ConvProblem.from_key(selection.problem)
            names = {d: getattr(selection, d) for d in ("fwd", "bwd_data", "bwd_filter")}
            results = dict(selection.results)
            changed = 0
            for direction, name in names.items():
                if name != NATIVE:
                    continue
                stored = db.results(base.with_direction(direction))
                native = next((r for r in stored if r.algorithm == NATIVE and r.ok and r.time_ms), None)
                if native is None:
                    continue
                ties = [r for r in stored if r.ok and r.time_ms and r.algorithm.startswith("cudnn:")
                        and r.time_ms <= native.time_ms * (1 + tolerance)]
                if ties:
                    best = min(ties, key=lambda r: r.time_ms)
                    names[direction], results[direction] = best.algorithm, best
                    changed += 1
            if changed:
                new = LayerSelection(selection.problem, **names, results=tuple(results.items()))
                m._convtune_select(sig, new)
                m._convtune_fast.clear()
                layers += 1
                directions += changed
    return layers, directions


def run(model_name: str, batch: int, dtype_name: str, device: str, tiny: bool, steps: int, rounds: int) -> dict:
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    base, size, classes = e2e.build_model(model_name, tiny)
    base = base.to(device).to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
    labels = torch.randint(0, classes, (batch,), device=device)
    tuned = copy.deepcopy(base)
    with tempfile.TemporaryDirectory() as tmp, convtune.TuningDB(str(Path(tmp) / "tie.sqlite")) as db:
        with torch.autocast(device, dtype=dtype):
            t0 = time.perf_counter()
            convtune.optimize(tuned, x, training=True, db=db)
            tune_s = time.perf_counter() - t0
        python_torch, cudnn_ties = copy.deepcopy(tuned), copy.deepcopy(tuned)
        models = dict(torch=base, tuned=tuned, python_torch=python_torch, cudnn_ties=cudnn_ties)
        timer = e2e.Timer(device, steps, 1)
        autocast = lambda: torch.autocast(device, dtype=dtype)  # noqa: E731
        steps_of = {}
        for who, model in models.items():
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
            infer, train_step = e2e.workloads(model, optimizer, x, labels, autocast)
            steps_of[who] = dict(inference=infer, training=train_step)
        changed = {}
        rows = {}
        for workload in ("inference", "training"):
            for model in models.values():
                model.train(workload == "training")
            for who in models:  # first calls: the tuned copies select what the workload needs
                e2e._first_call_s(steps_of[who][workload], timer)
            # the variants, made from what the workload's first calls selected
            changed[f"{workload}: python_torch layers"] = on_python_checks(python_torch)
            changed[f"{workload}: cudnn_ties layers, directions"] = on_cudnn_ties(cudnn_ties, db,
                                                                                 convtune.Policy().tolerance)
            for who in ("python_torch", "cudnn_ties"):
                e2e._first_call_s(steps_of[who][workload], timer)
            times: dict[str, list[float]] = {who: [] for who in models}
            with e2e.FullPathCalls() as full:
                for r in range(rounds):
                    order = list(models) if r % 2 == 0 else list(models)[::-1]
                    order = order[r % len(order):] + order[:r % len(order)]
                    for who in order:
                        times[who].append(timer(steps_of[who][workload])["ms"])
            row = rows[workload] = {"full_path_calls": full.calls}
            for who in models:
                ratios = [t / c for t, c in zip(times["torch"], times[who])]
                interval = common.median_interval(ratios)
                row[who] = dict(ms=statistics.median(times[who]), ratio=statistics.median(ratios),
                                ratio_interval=list(interval) if interval else None, times=times[who])
            print(f"  {model_name} b{batch} {dtype_name} {workload}: " + ", ".join(
                f"{who} {row[who]['ms']:.3f} ms ({row[who]['ratio']:.3f})" for who in models), file=sys.stderr,
                flush=True)
    return dict(rows=rows, tune_s=tune_s, changed=changed, steps=steps, rounds=rounds)


def markdown(env: dict, results: dict) -> str:
    lines = [
        "# Which path a layer whose pick is PyTorch's own call should take, in eager code",
        "",
        f"{common.env_line(env)} Four copies of a network in one process, timed in rotation (`bench/tie_paths.py`, "
        "whose docstring says what each copy runs); ms: each copy's median over the rounds; ratio: the median of the "
        "rounds' PyTorch / copy (above 1: faster than PyTorch), with the interval where that median lies with at "
        "least 95% confidence.",
        "",
    ]
    header = ["model", "batch", "dtype", "workload"] + [f"{v} ms (ratio)" for v in VARIANTS] + ["changed"]
    table = []
    for key, result in results.items():
        model, batch, dtype = key.split(":")
        for workload, row in result["rows"].items():
            cells = []
            for v in VARIANTS:
                iv = row[v]["ratio_interval"]
                cells.append(f"{row[v]['ms']:.3f} ({row[v]['ratio']:.3f}"
                             + (f", {iv[0]:.3f}-{iv[1]:.3f}" if iv else "") + ")")
            changed = "; ".join(f"{k.split(': ', 1)[1]} {v}" for k, v in result["changed"].items()
                                if k.startswith(workload))
            table.append([model, batch, dtype, workload, *cells, changed])
    lines.append(common.md_table(header, table))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=e2e.split, default=["resnet50", "mobilenet_v2"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a small stand-in network (no torchvision needed)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=21)
    common.result_arguments(parser, "tie_paths")
    args = parser.parse_args()
    results = {}
    for model in ["tiny"] if args.tiny else args.models:
        results[f"{model}:b{args.batch}:{args.dtype}"] = run(model, args.batch, args.dtype, args.device, args.tiny,
                                                             args.steps, args.rounds)
    env = common.environment()
    common.write(args.name, dict(environment=env, results=results), markdown(env, results), args.out)
    print(markdown(env, results))


if __name__ == "__main__":
    main()
