"""Which path a layer whose pick is PyTorch's own call should take in eager code: measured in one process.

find ranks torch:native first among results within the policy's tolerance of the fastest (a tie), and a layer on
it calls PyTorch's convolution through the C++ check of its input (``TorchDirect``). A cuDNN executable costs the
host 4-8 us less a forward than PyTorch's own call (the H200's bench/results/host_probe.md), so ``optimize`` moves
such ties to the executable whose path costs the layer less (``convtune.pytorch.tuning.on_the_cheaper_path``).
This times, in one process and in rotation (the order turned every round, as bench/ab.py does), five copies of a
network (the same weights):

- torch: PyTorch, ``cudnn.benchmark=True``;
- tuned: ``convtune.optimize(training=True)`` on an empty database, as it ships;
- no_grad_off: tuned's copy without the forward's path for calls without gradients
  (``tuning.for_calls_without_gradients``): the move's share, that path's the difference from tuned;
- ties_off: the same choices with that move turned off, and the forward's path for calls without gradients
  (``tuning.for_calls_without_gradients``) too (optimized again on the same database, measuring nothing): ties on
  torch:native, the layers on PyTorch's call through ``TorchDirect`` whatever a call needs;
- cudnn_ties: ties_off's copy with every direction that chose torch:native forced onto the fastest cuDNN plan
  measured within the policy's tolerance of torch:native's time, whatever it costs (the layer then runs on
  convtune's op): the move made everywhere it can be.

Eager inference and training step (forward, loss, backward, SGD), autocast, channels_last. Per workload: each copy's
median over the rounds (ms) and the median of the rounds' ratios torch / copy (above 1: faster than PyTorch); per
copy, how many layer directions run another algorithm than ties_off's.

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
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import convtune  # noqa: E402
import e2e  # noqa: E402
from convtune.pytorch import host_costs, tuning  # noqa: E402
from convtune.pytorch.tuning import LayerSelection, tie_costs  # noqa: E402
from convtune.ranking import NATIVE  # noqa: E402

VARIANTS = ("torch", "tuned", "no_grad_off", "ties_off", "cudnn_ties")


def tuned_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "_convtune_selections")]


def differing(model: torch.nn.Module, other: torch.nn.Module) -> dict[str, int]:
    """Per problem, how many of its layer's directions run another algorithm in ``model`` than in ``other`` (a copy of
    the same network); problems alike left out."""
    out: dict[str, int] = {}
    for mine, theirs in zip(tuned_layers(model), tuned_layers(other)):
        for sig, selection in mine._convtune_selections.items():
            known = theirs._convtune_selections.get(sig)
            count = sum(known is not None and getattr(selection, d) != getattr(known, d)
                        for d in ("fwd", "bwd_data", "bwd_filter"))
            if count:
                out[selection.problem] = out.get(selection.problem, 0) + count
    return out


def on_cudnn_ties(model: torch.nn.Module, db: convtune.TuningDB, tolerance: float) -> None:
    """Each direction that chose torch:native takes the fastest cuDNN plan measured within ``tolerance`` of it."""
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


def run(model_name: str, batch: int, dtype_name: str, device: str, tiny: bool, steps: int, rounds: int,
        host_repeats: int) -> dict:
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    base, size, classes = e2e.build_model(model_name, tiny)
    base = base.to(device).to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
    labels = torch.randint(0, classes, (batch,), device=device)
    tuned, no_grad_off, ties_off = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    with tempfile.TemporaryDirectory() as tmp, convtune.TuningDB(str(Path(tmp) / "tie.sqlite")) as db:
        with torch.autocast(device, dtype=dtype):
            judgements: list[list] = []  # what the rule saw, as it judged each layer (tuning.tie_costs)

            def judged(selection, tuned_as):
                costs = tie_costs(selection, tuned_as)
                if costs is not None:
                    judgements.append([selection.problem, costs.as_chosen_us, costs.moved_us])
                return costs

            t0 = time.perf_counter()
            with mock.patch.object(tuning, "tie_costs", judged):
                convtune.optimize(tuned, x, training=True, db=db)
            tune_s = time.perf_counter() - t0
            unchanged = lambda selection, _: selection  # noqa: E731
            with mock.patch.object(tuning, "for_calls_without_gradients", unchanged):
                convtune.optimize(no_grad_off, x, training=True, db=db)  # the database is warm: nothing measured
                with mock.patch.object(tuning, "on_the_cheaper_path", unchanged):
                    convtune.optimize(ties_off, x, training=True, db=db)
        cudnn_ties = copy.deepcopy(ties_off)
        on_cudnn_ties(cudnn_ties, db, convtune.Policy().tolerance)
        models = dict(torch=base, tuned=tuned, no_grad_off=no_grad_off, ties_off=ties_off, cudnn_ties=cudnn_ties)
        moved = {who: differing(models[who], ties_off) for who in ("tuned", "no_grad_off", "cudnn_ties")}
        changed = {who: sum(m.values()) for who, m in moved.items()}
        rule_costs = host_costs.host_overheads_us(device, db)  # what the rule read (measured once, kept in db)
        # layers whose calls without gradients run another forward
        no_grad = {who: sum(bool(s.no_grad) for m in tuned_layers(models[who]) for s in m._convtune_selections.values())
                   for who in ("tuned", "no_grad_off", "ties_off")}
        on_native = {who: sum(getattr(s, d) == NATIVE for m in tuned_layers(models[who])
                              for s in m._convtune_selections.values() for d in ("fwd", "bwd_data", "bwd_filter"))
                     for who in ("tuned", "no_grad_off", "ties_off", "cudnn_ties")}
        timer = e2e.Timer(device, steps, 1)
        autocast = lambda: torch.autocast(device, dtype=dtype)  # noqa: E731
        steps_of = {}
        for who, model in models.items():
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
            infer, train_step = e2e.workloads(model, optimizer, x, labels, autocast)
            steps_of[who] = dict(inference=infer, training=train_step)
        rows = {}
        for workload in ("inference", "training"):
            for model in models.values():
                model.train(workload == "training")
            for who in models:
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
    # the same measurement made again, as a fresh process would: how far the rule's inputs move on this host
    again = [host_costs.measure_host_overheads(device) for _ in range(host_repeats)]  # (the costs kept stay)
    return dict(rows=rows, tune_s=tune_s, changed=changed, no_grad_paths=no_grad, torch_native_directions=on_native,
                host_costs_again_us=again, steps=steps,
                rounds=rounds, host_costs_us=rule_costs, tie_judgements=judgements,
                moved_problems=sorted(moved["tuned"]))


def markdown(env: dict, results: dict) -> str:
    lines = [
        "# Which path a layer whose pick is PyTorch's own call should take, in eager code",
        "",
        f"{common.env_line(env)} Five copies of a network in one process, timed in rotation (`bench/tie_paths.py`, "
        "whose docstring says what each copy runs: tuned, as `optimize` ships; no_grad_off, without the forward's "
        "path for calls without gradients; ties_off, without that and its ties left on "
        "torch:native; cudnn_ties, every such tie forced onto cuDNN's fastest plan); ms: each copy's median over the "
        "rounds; ratio: the median of the rounds' PyTorch / copy (above 1: faster than PyTorch), with the interval "
        "where that median lies with at least 95% confidence.",
        "",
    ]
    header = (["model", "batch", "dtype", "workload"] + [f"{v} ms (ratio)" for v in VARIANTS]
              + ["layer directions unlike ties_off's"])
    table = []
    for key, result in results.items():
        model, batch, dtype = key.split(":")
        for workload, row in result["rows"].items():
            cells = []
            for v in VARIANTS:
                iv = row[v]["ratio_interval"]
                cells.append(f"{row[v]['ms']:.3f} ({row[v]['ratio']:.3f}"
                             + (f", {iv[0]:.3f}-{iv[1]:.3f}" if iv else "") + ")")
            changed = ", ".join(f"{who} {n}" for who, n in result["changed"].items())
            table.append([model, batch, dtype, workload, *cells, changed])
    lines.append(common.md_table(header, table))
    for key, result in results.items():
        judged = result.get("tie_judgements") or []
        cheaper = [j for j in judged if j[2] < j[1]]
        moved = set(result.get("moved_problems") or [])
        kept = sum(j[0] in moved for j in cheaper)
        costs = ", ".join(f"{kind} {us:.1f}" for kind, us in sorted(result.get("host_costs_us", {}).items()))
        lines += ["", f"{key}: as `optimize` tuned the copy, the rule (`tuning.tie_costs`) judged {len(judged)} layers "
                      f"with a direction on torch:native and found {len(cheaper)} cheaper moved than as chosen on "
                      f"convtune's op (each layer's cost a step as chosen and moved, us, in the JSON), of which {kept} "
                      f"run other choices than ties_off's (the others the host-cost rule, `where_the_host_pays`, "
                      f"then sent to PyTorch's call, cheaper still); on "
                      f"{result.get('no_grad_paths', {}).get('tuned', '-')} layers left on PyTorch's call a call "
                      f"without gradients runs the forward's cheaper path; the host costs it read (us a direction "
                      f"over PyTorch's call): {costs or '-'}."]
        again = result.get("host_costs_again_us") or []
        spread = {kind: [a[kind] for a in again if kind in a] for kind in ("cudnn", "cudnn backward", "native")}
        if any(spread.values()):
            ranges = "; ".join(f"{kind} {min(v):.1f} to {max(v):.1f} (median {statistics.median(v):.1f})"
                               for kind, v in spread.items() if v)
            lines += ["", f"{key}: the host costs measured {len(again)} times again in one process (us): {ranges}."]
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
    parser.add_argument("--host-repeats", type=int, default=5, help="the host costs measured again this many times")
    common.result_arguments(parser, "tie_paths")
    args = parser.parse_args()
    results = {}
    for model in ["tiny"] if args.tiny else args.models:
        results[f"{model}:b{args.batch}:{args.dtype}"] = run(model, args.batch, args.dtype, args.device, args.tiny,
                                                             args.steps, args.rounds, args.host_repeats)
    env = common.environment()
    common.write(args.name, dict(environment=env, results=results), markdown(env, results), args.out)
    print(markdown(env, results))


if __name__ == "__main__":
    main()
