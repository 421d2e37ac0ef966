"""Where a compiled network's step goes, PyTorch against convtune: the GPU kernels of ``--steps`` steps of each
compiled model (torch.profiler, CPU and CUDA activities), per step: how many kernels, their summed time, the
step's wall time, and the kernels one model launches more often than the other.

bench/ab.py measures compiled inference of small batches slower with convtune than with PyTorch while the
convolutions themselves are as fast: this script says whether the difference is on the GPU (extra kernels,
copies Inductor adds around the tuned op, slower convolutions) or on the host.

    python bench/compile_profile.py --models resnet18 --batches 32 --dtypes float16 --workloads inference
    TORCH_LOGS=output_code python bench/compile_profile.py ... 2> code.txt   # Inductor's generated code too
    python bench/compile_profile.py --device cpu --tiny --out /tmp/cp         # checks the pipeline

Results: bench/results/compile_profile.json and .md (or --out, --name).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab  # noqa: E402
import common  # noqa: E402
import e2e  # noqa: E402


def kernels_of(step, steps: int, device: str) -> dict:
    """Per step: kernel (or, on the CPU, operator) counts and time, and the wall time, of ``steps`` calls."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    counts: collections.Counter = collections.Counter()
    times: collections.Counter = collections.Counter()
    host_counts: collections.Counter = collections.Counter()
    host_self: collections.Counter = collections.Counter()
    for e in prof.events():
        on_gpu = e.device_type == torch.autograd.DeviceType.CUDA
        if not on_gpu:
            host_counts[e.name] += 1
            host_self[e.name] += e.self_cpu_time_total
        if (device == "cuda") != on_gpu:
            continue
        if device == "cpu" and e.cpu_parent is not None:  # top-level operators only on the CPU
            continue
        counts[e.name] += 1
        times[e.name] += e.device_time if on_gpu else e.cpu_time
    return dict(wall_ms=wall_ms, kernels=sum(counts.values()) / steps, busy_us=sum(times.values()) / steps,
                by_name={n: dict(count=counts[n] / steps, us=times[n] / steps) for n in counts},
                host_events=sum(host_counts.values()) / steps,
                host_by_name={n: dict(count=host_counts[n] / steps, us=host_self[n] / steps) for n in host_counts})


def run(model_name: str, batch: int, dtype_name: str, workloads: list[str], device: str, tiny: bool,
        steps: int) -> dict:
    dtype = getattr(torch, dtype_name)
    torch_model, ours, x, labels, _ = ab.pair(model_name, batch, dtype, device, tiny)
    out = {}
    for workload in workloads:
        row = {}
        for who, model in (("torch", torch_model), ("convtune", ours)):
            model.train(workload == "training")
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            infer, train_step = e2e.workloads(torch.compile(model), optimizer, x, labels,
                                              lambda: torch.autocast(device, dtype=dtype))
            step = infer if workload == "inference" else train_step
            for _ in range(3):
                step()
            row[who] = kernels_of(step, steps, device)
        out[workload] = row
        t, c = row["torch"], row["convtune"]
        print(f"  {workload}: kernels/step {t['kernels']:.0f} vs {c['kernels']:.0f}, busy {t['busy_us']:.0f} vs "
              f"{c['busy_us']:.0f} us, wall {t['wall_ms']:.3f} vs {c['wall_ms']:.3f} ms", file=sys.stderr, flush=True)
    return out


def differences(row: dict, top: int = 12, key: str = "by_name") -> list[list]:
    """The kernels (or, with key="host_by_name", the host's events and their self time) whose per-step count or
    time differs most between the two models."""
    t, c = row["torch"][key], row["convtune"][key]
    names = set(t) | set(c)
    zero = dict(count=0.0, us=0.0)
    ranked = sorted(names, key=lambda n: -abs(c.get(n, zero)["us"] - t.get(n, zero)["us"]))[:top]
    return [[n[:80], f"{t.get(n, zero)['count']:.0f}", f"{c.get(n, zero)['count']:.0f}",
             f"{t.get(n, zero)['us']:.1f}", f"{c.get(n, zero)['us']:.1f}"] for n in ranked]


def markdown(env: dict, results: dict) -> str:
    parts = ["# Compiled steps, kernel by kernel: PyTorch and convtune\n\n"
             f"{common.env_line(env)}. Autocast, channels_last, `cudnn.benchmark=True`, `torch.compile` (default "
             "mode); per step: kernels launched, their summed GPU time (busy), and the wall time of the profiled "
             "steps (the profiler adds host time to both). `bench/compile_profile.py`."]
    summary = []  # host events: every operator and function the profiler recorded on the host, per step
    for key, res in sorted(results.items()):
        for workload, row in sorted(res.items()):
            t, c = row["torch"], row["convtune"]
            summary.append([*key.split(":"), workload, f"{t['kernels']:.0f}", f"{c['kernels']:.0f}",
                            f"{t['busy_us']:.0f}", f"{c['busy_us']:.0f}", f"{t['wall_ms']:.3f}",
                            f"{c['wall_ms']:.3f}", f"{t['host_events']:.0f}", f"{c['host_events']:.0f}"])
    parts.append(common.md_table(["model", "batch", "dtype", "workload", "kernels torch", "kernels convtune",
                                  "busy us torch", "busy us convtune", "wall ms torch", "wall ms convtune",
                                  "host events torch", "host events convtune"],
                                 summary))
    for key, res in sorted(results.items()):
        for workload, row in sorted(res.items()):
            parts.append(f"## {key} {workload}: the kernels that differ most (per step)\n\n"
                         + common.md_table(["kernel", "count torch", "count convtune", "us torch", "us convtune"],
                                           differences(row)))
            parts.append(f"## {key} {workload}: the host's events that differ most (per step, self time)\n\n"
                         + common.md_table(["event", "count torch", "count convtune", "us torch", "us convtune"],
                                           differences(row, 25, "host_by_name")))
    return "\n\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=e2e.split, default=["resnet18"])
    parser.add_argument("--batches", type=lambda t: [int(b) for b in e2e.split(t)], default=[32])
    parser.add_argument("--dtypes", type=e2e.split, default=["float16"])
    parser.add_argument("--workloads", type=e2e.split, default=["inference", "training"])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a small stand-in network (no torchvision needed)")
    parser.add_argument("--steps", type=int, default=20)
    common.result_arguments(parser, "compile_profile")
    args = parser.parse_args()
    env = common.environment()
    results = {}
    for model in ["tiny"] if args.tiny else args.models:
        for batch in args.batches:
            for dtype in args.dtypes:
                print(f"{model} b{batch} {dtype}", file=sys.stderr, flush=True)
                results[f"{model}:b{batch}:{dtype}"] = run(model, batch, dtype, args.workloads, args.device,
                                                           args.tiny, args.steps)
    common.write(args.name, dict(env=env, results=results), markdown(env, results), args.out)


if __name__ == "__main__":
    main()
