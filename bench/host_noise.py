"""How much a host-bound step's time differs between processes, and whether pinning the main thread to one CPU
narrows it.

Where the host sets the pace (a small batch in eager code), two processes of one configuration have measured 1.4-2x
apart in bench/e2e.py (e2e_h100_repeat.md), which no single-process comparison of two configurations survives. Each
process here builds one network, runs PyTorch's eager inference with ``cudnn.benchmark=True`` (autocast,
channels_last) and times it as e2e.py does (``e2e.Timer``); the variants take turns, round by round: 'free' (the
scheduler places the process), and the main thread pinned to one CPU (``os.sched_setaffinity``) before timing, one
variant per CPU named. Each process also records the CPUs its main thread ran on while timed and the load average.

    python bench/host_noise.py --processes 4 --cpus 2,9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import e2e  # noqa: E402


def _cpu_now() -> int:
    """The CPU this thread runs on now (field 39 of /proc/thread-self/stat)."""
    text = Path("/proc/thread-self/stat").read_text()
    return int(text.rsplit(")", 1)[1].split()[36])


def child(args) -> dict:
    """One process: a network's eager inference timed, the main thread pinned to ``args.pin`` if given."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cudnn.benchmark = True
    model, size, _ = e2e.build_model(args.model, args.tiny)
    model = model.to(device).to(memory_format=torch.channels_last).eval()
    x = torch.randn(args.batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
    dtype = getattr(torch, args.dtype)

    def infer():
        with torch.no_grad(), torch.autocast(device, dtype=dtype):
            return model(x)

    timer = e2e.Timer(device, args.steps, args.repeats)
    infer()  # benchmark mode's tuning
    timer.sync()
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    seen: set[int] = set()
    samples = []
    for _ in range(args.rounds):  # several timings, each noting where the thread ran
        samples.append(timer(infer)["ms"])
        seen.add(_cpu_now())
    return dict(ms=statistics.median(samples), samples=samples, cpus=sorted(seen),
                affinity=sorted(os.sched_getaffinity(0)), loadavg=Path("/proc/loadavg").read_text().split()[:3])


def markdown(env: dict, payload: dict) -> str:
    rows = []
    for variant, every in payload["variants"].items():
        runs = [r for r in every if r.get("status") == "ok"]
        ms = [r["ms"] for r in runs]
        if not ms:
            rows.append([variant, "-", "-", "-", "-", "; ".join(r.get("status", "") for r in every)])
            continue
        rows.append([variant, len(ms), f"{statistics.median(ms):.3f}", f"{min(ms):.3f}-{max(ms):.3f}",
                     f"{max(ms) / min(ms):.2f}", ", ".join(f"{r['ms']:.2f} (CPU {'/'.join(map(str, r['cpus']))})"
                                                           for r in runs)])
    cfg = payload["config"]
    return (f"# Between-process spread of a host-bound step\n\n{common.env_line(env)}. "
            f"{'a small network (--tiny)' if cfg.get('tiny') else cfg['model']} b{cfg['batch']} "
            f"{cfg['dtype']} eager inference, autocast, channels_last, `cudnn.benchmark=True`; each process times "
            f"{cfg['rounds']} x e2e.py's timing (median of {cfg['repeats']} timings of {cfg['steps']} steps) and "
            f"gives their median; the variants take turns, round by round. `bench/host_noise.py`.\n\n"
            + common.md_table(["variant", "processes", "median ms", "range ms", "max / min",
                               "each process (the CPUs its main thread ran on)"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--processes", type=int, default=4, help="processes per variant")
    parser.add_argument("--cpus", default="2", help="CPUs to pin to, one variant each, joined by commas ('' : none)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3, help="timings per process")
    parser.add_argument("--tiny", action="store_true", help="a small network (tests on a CPU)")
    parser.add_argument("--pin", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    common.result_arguments(parser, "host_noise")
    args = parser.parse_args()
    if args.child_out:
        Path(args.child_out).write_text(json.dumps(child(args)))
        return
    if args.processes < 1:
        parser.error(f"--processes {args.processes} must be 1 or more")
    try:
        cpus = [int(c) for c in args.cpus.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--cpus {args.cpus!r} must be CPU numbers joined by commas, e.g. 2,9")
    usable = os.sched_getaffinity(0)
    for cpu in cpus:
        if cpu not in usable:
            parser.error(f"--cpus: CPU {cpu} is not one this process may run on ({sorted(usable)})")
    variants = {"free": None} | {f"pinned to CPU {c}": c for c in cpus}
    base = [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch), "--dtype", args.dtype,
            "--steps", str(args.steps), "--repeats", str(args.repeats), "--rounds", str(args.rounds)]
    base += ["--tiny"] if args.tiny else []
    runs: dict[str, list] = {v: [] for v in variants}
    for turn in range(args.processes):
        order = list(variants)[turn % len(variants):] + list(variants)[:turn % len(variants)]
        for variant in order:
            pin = variants[variant]
            run = common.run_child(base + ([] if pin is None else ["--pin", str(pin)]), timeout=600)
            runs[variant].append(run)
            print(f"{variant}: {run.get('ms', run['status'])}", file=sys.stderr, flush=True)
    env = common.environment()
    config = dict(model=args.model, batch=args.batch, dtype=args.dtype, tiny=args.tiny, steps=args.steps,
                  repeats=args.repeats, rounds=args.rounds)
    payload = dict(environment=env, config=config, variants=runs)
    text = markdown(env, payload)
    common.write(args.name, payload, text, args.out)
    print(text)


if __name__ == "__main__":
    main()
