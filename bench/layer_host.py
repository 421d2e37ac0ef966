"""Each tuned layer of a network against PyTorch's own, one layer at a time: host and GPU microseconds per call.

Where a whole network runs slower in eager code than PyTorch's ``cudnn.benchmark=True`` although its CUDA
graph (the GPU's work alone) is as fast, the host pays for it. The host-cost rule measures each kind of
executable once, on a probe layer; this script measures every layer of a real network in its own shape.

One process builds the network twice (the same weights), optimizes one copy for training under autocast
on an empty database, and records each convolution's input in one pass (eval mode, gradients on). Then,
per layer, in rounds that alternate PyTorch's module and the tuned one (the order swapped every round):
``--calls`` calls of the module's forward under autocast (no gradients, as inference runs, or with ``--grad`` a
forward and backward, each input asking for its gradient where the network's training pass does), timed
on the host from the first call to the last one's return, and on the GPU by CUDA events. On CUDA the GPU
is first given a queue of matrix products longer than the calls take the host, and the start event waits
behind it: the calls then queue up, so the host's time is its own (never a wait on the GPU) and the GPU runs
them back to back (its time is its own, never a wait on the host). Medians over the rounds. Rows name what
each tuned layer runs (``convtune.explain``, after the timings: a signature first met while timed is in it).

    python bench/layer_host.py --network resnet50 --batch 32 --dtype float16
    python bench/layer_host.py --device cpu --tiny --calls 5 --rounds 3     # a check of the script
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab  # noqa: E402
import common  # noqa: E402
import convtune  # noqa: E402

CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _inputs(model: torch.nn.Module, x: torch.Tensor, autocast) -> dict[str, tuple[torch.Tensor, bool]]:
    """Each convolution module's input in one pass with gradients on (by the module's name), and whether it
    asks for its gradient there (the network's first layer's input does not)."""
    seen: dict[str, tuple[torch.Tensor, bool]] = {}

    def keep(name: str, args: tuple) -> None:  # a pre-hook returning something would replace the inputs
        seen.setdefault(name, (args[0].detach().clone(), args[0].requires_grad))

    hooks = [m.register_forward_pre_hook(lambda _, args, name=name: keep(name, args))
             for name, m in model.named_modules() if isinstance(m, CONVOLUTIONS)]
    try:
        with torch.enable_grad(), autocast():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


class Busy:
    """A queue of GPU work longer than ``host_us`` of host time: the CUDA events that follow it start when the
    calls after them are already queued."""

    def __init__(self, device: str) -> None:
        self.device = device
        if device == "cuda":
            self.a = torch.randn(4096, 4096, device=device, dtype=torch.float16)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a @ self.a
            start.record()
            for _ in range(10):
                self.a @ self.a
            end.record()
            torch.cuda.synchronize()
            self.product_us = start.elapsed_time(end) * 100  # ms for 10 -> us for one

    def queue(self, host_us: float) -> None:
        if self.device == "cuda":
            for _ in range(1 + int(2 * host_us / self.product_us)):
                self.a @ self.a


def _timed(call, calls: int, device: str, busy: Busy, host_us: float) -> tuple[float, float | None]:
    """(host us per call, GPU us per call or None off CUDA) of ``calls`` calls of ``call``; ``host_us``: about
    how long the calls take the host (the GPU is kept busy at least twice that long before them)."""
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        busy.queue(host_us)
        start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - t0) / calls * 1e6
    if device == "cuda":
        end.record()
        torch.cuda.synchronize()
        return host, start.elapsed_time(end) * 1e3 / calls
    return host, None


def measure_layer(ours: torch.nn.Module, theirs: torch.nn.Module, x: torch.Tensor, wants_grad: bool, autocast,
                  grad: bool, calls: int, rounds: int, device: str, busy: Busy) -> dict:
    """Host and GPU microseconds per call of both modules on ``x``, in alternating rounds (with ``grad``, a
    forward and backward, ``x`` asking for its gradient where ``wants_grad``)."""
    xg = x.detach().clone().requires_grad_(grad and wants_grad)

    def caller(module):
        if grad:
            def call():
                with autocast():
                    y = module(xg)
                y.backward(torch.ones_like(y))
        else:
            def call():
                with torch.no_grad(), autocast():
                    module(xg)
        return call

    calls_of = {"torch": caller(theirs), "convtune": caller(ours)}
    first = {}
    for who, call in calls_of.items():  # first calls: selection for a new signature, lazy builds
        call()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        first[who] = (time.perf_counter() - t0) * 1e6  # about one call's host time, for the GPU's queue
    times: dict[str, list[tuple[float, float | None]]] = {who: [] for who in calls_of}
    for r in range(rounds):
        for who in (("torch", "convtune") if r % 2 == 0 else ("convtune", "torch")):
            times[who].append(_timed(calls_of[who], calls, device, busy, calls * first[who]))
    row = {}
    for who, samples in times.items():
        row[f"{who}_host_us"] = statistics.median(h for h, _ in samples)
        gpu = [g for _, g in samples if g is not None]
        row[f"{who}_gpu_us"] = statistics.median(gpu) if gpu else None
    return row


def run(args) -> dict:
    dtype = getattr(torch, args.dtype)

    def autocast():
        return torch.autocast(args.device, dtype=dtype)

    rows = []
    # Measured with the tuning database open: a signature first met while timed is selected for on it.
    with tempfile.TemporaryDirectory() as tmp, convtune.TuningDB(str(Path(tmp) / "layers.sqlite")) as db:
        model, ours, x, _, tune_s = ab.pair(args.network, args.batch, dtype, args.device, args.tiny, db=db)
        model.eval()
        ours.eval()
        inputs = _inputs(model, x, autocast)
        theirs, mine = dict(model.named_modules()), dict(ours.named_modules())
        busy = Busy(args.device)
        for name, (xin, wants_grad) in inputs.items():
            row = dict(layer=name, input=list(xin.shape), dtype=str(xin.dtype).replace("torch.", ""))
            row.update(measure_layer(mine[name], theirs[name], xin, wants_grad, autocast, args.grad, args.calls,
                                     args.rounds, args.device, busy))
            rows.append(row)
            print(f"{name}: host {row['torch_host_us']:.1f} / {row['convtune_host_us']:.1f} us", file=sys.stderr)
        chosen: dict[str, dict] = {}
        for r in convtune.explain(ours):  # after the timings: what each layer ran in them
            entry = chosen.setdefault(r["module"], {"runtime": r["runtime"]})
            entry[r["direction"]] = r["algorithm"] or "torch"
        for row in rows:
            row.update(chosen.get(row["layer"], {"runtime": "not tuned"}))
    env = common.environment()
    return dict(environment=env, network="tiny" if args.tiny else args.network, batch=args.batch, dtype=args.dtype,
                grad=args.grad, calls=args.calls, rounds=args.rounds, tune_s=tune_s, rows=rows)


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(payload: dict) -> str:
    env, rows = payload["environment"], payload["rows"]
    what = "forward and backward" if payload["grad"] else "inference (no gradients)"
    against = "PyTorch with `cudnn.benchmark=True`; " if env.get("gpu") else ""
    gpu = ("; GPU: CUDA events, the calls queued behind a longer queue of other work" if env.get("gpu")
           else "")
    directions = ("fwd", "bwd_data", "bwd_filter") if payload["grad"] else ("fwd",)
    out = (f"# Each tuned layer's host and GPU time against PyTorch's\n\n{common.env_line(env)}. "
           f"{payload['network']} b{payload['batch']} {payload['dtype']} autocast, channels_last, {what}; "
           f"{against}per layer the median of {payload['rounds']} alternating rounds "
           f"of {payload['calls']} calls; host: from the first call to the last one's return{gpu}. "
           f"`bench/layer_host.py`; tuning took {payload['tune_s']:.1f} s.\n\n")
    total = {k: sum(r[k] for r in rows if r[k] is not None) for k in
             ("torch_host_us", "convtune_host_us", "torch_gpu_us", "convtune_gpu_us")
             if any(r[k] is not None for r in rows)}
    out += "Summed over the network's convolution modules (each once): " + ", ".join(
        f"{k.replace('_us', '').replace('_', ' ')} {v:.0f} us" for k, v in total.items()) + ".\n\n"
    out += "Worst first (convtune's host time over PyTorch's).\n\n"
    ordered = sorted(rows, key=lambda r: r["convtune_host_us"] - r["torch_host_us"], reverse=True)
    out += common.md_table(
        ["layer", "input", *directions, "runtime", "host us: torch", "convtune", "GPU us: torch", "convtune"],
        [[r["layer"], "x".join(map(str, r["input"])), *(r.get(d, "-") for d in directions), r["runtime"],
          _us(r["torch_host_us"]), _us(r["convtune_host_us"]), _us(r["torch_gpu_us"]), _us(r["convtune_gpu_us"])]
         for r in ordered])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--network", default="resnet50")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a small stand-in network (no torchvision needed)")
    parser.add_argument("--grad", action="store_true", help="time forward and backward instead of inference")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    common.result_arguments(parser, "layer_host_<network>_b<batch>")
    args = parser.parse_args()
    if args.calls < 1 or args.rounds < 1:
        parser.error(f"--calls {args.calls} and --rounds {args.rounds} must be 1 or more")
    if args.name == "layer_host_<network>_b<batch>":
        args.name = f"layer_host_{'tiny' if args.tiny else args.network}_b{args.batch}{'_grad' if args.grad else ''}"
    payload = run(args)
    text = markdown(payload)
    common.write(args.name, payload, text, Path(args.out) if args.out else None)
    print(text)


if __name__ == "__main__":
    main()
