"""End-to-end benchmark: whole networks with convtune.optimize against plain PyTorch.

For each network (torchvision ResNet-50, MobileNetV2, ResNeXt-50 32x4d and ConvNeXt-T, weights=None), batch,
autocast dtype (channels_last model and inputs) and execution style (eager; eager captured in a CUDA graph;
torch.compile, default mode), three ways of running the convolutions, EACH IN ITS OWN PROCESS
(PyTorch's cudnn.benchmark cache is per process):
- convtune: ``convtune.optimize(model, x, training=True)`` under autocast, on a tuning database that
  the group's processes (one model, batch and dtype) share: the first convtune process of a group
  finds it empty (its optimize time is the cold tuning time; a second optimize in the same process is
  timed too), the later ones find it full (their optimize time, in a fresh process, is the warm one);
- torch_bm0 / torch_bm1: plain PyTorch with ``torch.backends.cudnn.benchmark`` False / True (the first
  inference call plus the first training step, synchronized, are benchmark mode's tuning time).
Measured in each process: inference latency (eval mode, no_grad) and training-step time (forward,
cross-entropy loss, backward, SGD with momentum; no gradient scaler: timing only). Time: median of
7 timings of 10 steps between CUDA events, after warm-up. The graph style captures the whole step
(PyTorch's "whole network capture", warm-up on a side stream); the compile style reports its
first-call (compile) time; Inductor's on-disk cache is the machine's, shared by the processes of a run, without
AOTAutograd's cache (TORCHINDUCTOR_AUTOGRAD_CACHE=0 unless set: torch 2.11 keys its graphs by whether autocast is on,
not by its dtype, pytorch/pytorch#181564, and served a bfloat16 process the float16 graph, casts and kernels included).
Each timed workload also records what the process held meanwhile (its threads, resident memory, the objects Python's
collector tracks, the CUDA caching allocator's segments and blocks: ``process_state``), in the JSON only.
cProfile of a few inferences (and in the eager style of a few training steps) gives the host's time per step and the
functions that take it, and profiled training steps and inferences (torch.profiler,
eager and compile styles) give each conv layer's forward and backward kernel time, the time of
everything else, the host's time per op and where the device sat idle in a training step (``gpu_idle``: the host
late with the next launch, and after which op); convtune's runs are found by
the profiler ranges its ops open ('convtune:<problem key> by <algorithm>'). With --processes N each
configuration runs in N processes, the modes of a group taking turns, and its row gives the median of
the processes' medians and their range (where the host sets the pace, two processes of one
configuration have differed by 1.7x). Each configuration's result is written as soon as it ends, and
results of earlier runs in the same file are kept (one configuration: one row), so a run cut short,
or several 10-minute runs of parts, add up. With --gpus N, N workers take the groups' (network, batch, dtype)
families in turn, each running a family's styles one after another in processes that see one GPU of their own
(CUDA_VISIBLE_DEVICES), so a family's first convtune process still finds its database empty; the workers' processes
share the host's CPUs, so where the host sets the pace every row reads the load of the others beside it (rows record
the GPU and how many workers there were; a run's last groups may run with fewer beside them):

    python bench/e2e.py                                     # everything (hours: run it in parts)
    python bench/e2e.py --models resnet50 --batches 128 --dtypes float16 --styles eager,graph
    python bench/e2e.py --models mobilenet_v2 --batches 128 --styles eager --processes 3
    python bench/e2e.py --missing                           # what the results file lacks for the current src/
    python bench/e2e.py --missing --gpus 8                  # 8 groups at once, each on a GPU of its own
    python bench/e2e.py --merge /tmp/out/e2e.json           # groups another run's copy holds, newest whole
    python bench/e2e.py --device cpu --tiny --out /tmp/e2e  # a small stand-in network: checks the pipeline

Results: bench/results/e2e.json and e2e.md (or --out, --name).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import convtune  # noqa: E402
from convtune.problem import ConvProblem  # noqa: E402
from convtune.pytorch import ops  # noqa: E402
from convtune.pytorch.modules import TunedConv  # noqa: E402

# ConvNeXt-T: a 7x7 depthwise convolution in every block, the layers where cuDNN's execution plans are farthest from the
# floor and convtune's own depthwise kernels are meant to pay (MobileNetV2's are 3x3).
MODELS = ("resnet50", "mobilenet_v2", "resnext50_32x4d", "convnext_tiny")
BATCHES, DTYPES = (32, 128), ("float16", "bfloat16")
STYLES, MODES = ("eager", "graph", "compile"), ("convtune", "torch_bm0", "torch_bm1")
ANCHORS = """Anchors (BENCHMARKING.md, "Measured anchors, whole networks": H200, autocast float16, channels_last,
2026-11-29, plain PyTorch 2.11, each configuration in its own process, median of 7 timings of 10 steps):

| network, batch | eager benchmark=False | eager benchmark=True | CUDA graph (benchmark=True) | torch.compile | torch.compile max-autotune |
|---|---|---|---|---|---|
| ResNet-50 b128 inference | 9.21 ms | 9.18 ms | 8.91 ms | 5.27 ms (20 s to compile) | 5.29 ms (296 s to compile) |
| ResNet-50 b128 training step (SGD) | 23.3 ms | 27.6 ms (noisy, 24.3-29.5) | 22.8 ms | | |
| ResNet-50 b32 inference | 4.09 ms | 4.40 ms | 2.75 ms | | |
| ResNet-50 b32 training step | 26.4 ms (host-bound) | 24.8 ms (host-bound) | 7.99 ms | | |
| MobileNetV2 b128 inference | 6.15 ms | 4.79 ms | 4.49 ms | | |
| MobileNetV2 b128 training step | 23.6 ms | 26.4 ms | 14.5 ms | | |

benchmark=True's first step: ResNet-50 b128 training 13.1 s, MobileNetV2 b128 training 18.8 s.
bfloat16 ResNet-50 b128 training step, benchmark=True: 30.5 ms.
"""  # noqa: E501


class TinyNet(torch.nn.Module):
    """Stand-in for the torchvision models (--tiny): strided, depthwise, 1x1 convs, batch norm, a classifier."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()

        def block(c_in, c_out, **kw):
            return [torch.nn.Conv2d(c_in, c_out, bias=False, **kw), torch.nn.BatchNorm2d(c_out), torch.nn.ReLU()]

        self.features = torch.nn.Sequential(
            *block(3, 16, kernel_size=3, stride=2, padding=1), *block(16, 16, kernel_size=3, padding=1, groups=16),
            *block(16, 32, kernel_size=1), *block(32, 32, kernel_size=3, stride=2, padding=1))
        self.classifier = torch.nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


def build_model(name: str, tiny: bool) -> tuple[torch.nn.Module, int, int]:
    """(model, input height/width, classes)."""
    if tiny:
        return TinyNet(), 32, 10
    import torchvision  # on the GPU machine; not needed for --tiny

    return getattr(torchvision.models, name)(weights=None), 224, 1000


def logits(output):
    """A classifier's main output: GoogLeNet in training mode returns its auxiliary heads' logits too."""
    return output[0] if isinstance(output, tuple) else output


class Timer:
    """Median over ``repeats`` of the time of ``steps`` calls, per call, in ms (CUDA events, or the host clock)."""

    def __init__(self, device: str, steps: int, repeats: int, warmup: int = 3) -> None:
        self.device, self.steps, self.repeats, self.warmup = device, steps, repeats, warmup

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def __call__(self, step) -> dict:
        for _ in range(self.warmup):
            step()
        self.sync()
        samples = []
        for _ in range(self.repeats):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.steps):
                    step()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / self.steps)
            else:
                t0 = time.perf_counter()
                for _ in range(self.steps):
                    step()
                samples.append(1e3 * (time.perf_counter() - t0) / self.steps)
        return dict(ms=statistics.median(samples), min_ms=min(samples), max_ms=max(samples))


def host_probe_us(rounds: int = 5) -> float:
    """How fast this process's host runs a fixed workload (µs, the median of ``rounds``): Python's own work and
    PyTorch's dispatcher, no GPU. Where the host sets a step's pace, two processes of one configuration have differed
    by up to 1.7x, every op slower alike in one of them; a probe taken in each process just before it is timed tells
    a slower host (both probe and steps slower) from a slower layer path (the probes alike)."""
    def once() -> float:
        t0 = time.perf_counter()
        values: list[int] = []
        for i in range(20_000):
            values.append(i * 3 % 7)
        for _ in range(2_000):
            torch.empty(0)
        return 1e6 * (time.perf_counter() - t0)

    return statistics.median(once() for _ in range(rounds))


def _first_call_s(fn, timer: Timer) -> float:
    timer.sync()
    t0 = time.perf_counter()
    fn()
    timer.sync()
    return time.perf_counter() - t0


def _graphed(step, device: str):
    """``step`` captured in a CUDA graph (warm-up on a side stream first); returns (replay, capture seconds)."""
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    return graph.replay, time.perf_counter() - t0


def run_config(cfg: dict) -> dict:
    """One configuration, in this process: tuning times, then inference and training-step times."""
    device, dtype = cfg["device"], getattr(torch, cfg["dtype"])
    if cfg["style"] == "graph" and device != "cuda":
        return dict(status="skipped: CUDA graphs need a CUDA device")
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = cfg["mode"] == "torch_bm1"
    model, size, classes = build_model(cfg["model"], cfg["tiny"])
    model = model.to(device).to(memory_format=torch.channels_last)
    x = torch.randn(cfg["batch"], 3, size, size, device=device).to(memory_format=torch.channels_last)
    labels = torch.randint(0, classes, (cfg["batch"],), device=device)
    # Graph capture needs autocast's cast cache off (its cached casts would be made during the capture).
    autocast = lambda: torch.autocast(device, dtype=dtype, cache_enabled=cfg["style"] != "graph")  # noqa: E731
    timer = Timer(device, cfg["steps"], cfg["repeats"])
    out: dict = dict(status="ok", visible_gpus=os.environ.get("CUDA_VISIBLE_DEVICES"),
                     host_probe_start_us=host_probe_us())  # (before convtune tunes; ``host_probe_us``)
    if cfg["mode"] == "convtune":
        with convtune.TuningDB(cfg["db"]) as db:
            out["db"] = "warm" if db.entries() else "cold"
            model.train()
            with autocast():
                t0 = time.perf_counter()
                convtune.optimize(model, x, training=True, db=db)
                out["tune_s"] = time.perf_counter() - t0
                if out["db"] == "cold":  # and again in this process: every answer is in the database now
                    t0 = time.perf_counter()
                    convtune.optimize(model, x, training=True, db=db)
                    out["tune_again_s"] = time.perf_counter() - t0
            out["algorithms"] = sorted({r["algorithm"] or "torch (fallback)" for r in convtune.explain(model)})
    runner = torch.compile(model) if cfg["style"] == "compile" else model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    infer, train_step = workloads(runner, optimizer, x, labels, autocast)

    for workload, step, train in (("inference", infer, False), ("training", train_step, True)):
        model.train(train)
        out[f"{workload}_first_s"] = _first_call_s(step, timer)  # benchmark mode's tuning, or the compile time
        if cfg["style"] == "graph":
            step, out[f"{workload}_capture_s"] = _graphed(step, device)
        probe_us = host_probe_us()  # this process's host speed just before the steps are timed
        # The process's CPU time over the wall time while timed (all its threads; the main thread counts as busy
        # while it waits on the GPU, torch.cuda.synchronize spinning: only a value clearly above 1 says that
        # another thread works beside the steps, and a Python one takes turns with them on the GIL), and its
        # threads: Python's by name, and every thread of the process as the OS names it.
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if cfg["mode"] == "convtune" and cfg["style"] == "eager":  # (compiled code and graphs call no forward)
            with FullPathCalls() as full:  # a tuned layer's calls off its hot path while timed (steady: none)
                out[workload] = timer(step)
            out[workload]["full_path_calls"] = full.calls
            out[workload]["python_path_calls"] = full.python_calls
        else:
            out[workload] = timer(step)
        out[workload]["cpu_per_wall"] = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        out[workload]["host_probe_us"] = probe_us
        out[workload]["threads"] = sorted(t.name for t in threading.enumerate())
        out[workload]["os_threads"] = _os_threads()
        out[workload]["process"] = process_state(device)
        calls = out[workload].get("full_path_calls")
        print(f"  {workload}: {out[workload]['ms']:.3f} ms (first call {out[f'{workload}_first_s']:.2f} s; "
              f"CPU / wall {out[workload]['cpu_per_wall']:.2f}, {len(out[workload]['threads'])} threads)"
              + (f", {calls} full-path calls" if calls else ""), file=sys.stderr, flush=True)
    if cfg["style"] != "graph" and cfg.get("profile", True):
        steps = cfg.get("profile_steps", 3)
        model.train()
        if cfg["style"] == "eager":
            out["host_profile"] = host_profile(train_step, timer, steps)
        if device == "cuda":
            out["profile"] = profile_step(train_step, steps)
        model.eval()
        # (under compile the Python that runs is Dynamo's guard check and Inductor's wrapper code)
        out["inference_host_profile"] = host_profile(infer, timer, steps)
        if device == "cuda":
            out["inference_profile"] = profile_step(infer, steps)
    return out


def process_state(device: str) -> dict:
    """What this process holds while it is timed, to tell processes of one configuration apart (one that tuned on
    an empty database has run slower than one that started warm): its resident memory (MB; Linux only), the objects
    Python's collector tracks, and on CUDA the caching allocator's segments and live blocks."""
    import gc

    state: dict = dict(python_objects=len(gc.get_objects()))
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                state["rss_mb"] = int(line.split()[1]) / 1024
    if device == "cuda":
        stats = torch.cuda.memory_stats()
        state["cuda_segments"] = stats.get("segment.all.current", 0)
        state["cuda_blocks"] = stats.get("active.all.current", 0)
        state["cuda_reserved_mb"] = stats.get("reserved_bytes.all.current", 0) / 2**20
    return state


def _os_threads() -> list[str] | None:
    """Every thread of this process by the name the OS gives it (native ones too; Linux only, else None)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(names)


class FullPathCalls:
    """Counts the calls that take a tuned layer's full path (selection, checks) instead of its hot path. A layer
    that has no hot path for its input after the call (one of its directions runs a Python algorithm: explain's
    runtime 'python') takes its full path by design: its calls are counted apart (``python_calls``)."""

    def __init__(self) -> None:
        self.calls = self.python_calls = 0
        self._original = TunedConv._convtune_forward

    def __enter__(self) -> FullPathCalls:
        original = self._original

        def counted(module, input):
            out = original(module, input)
            if module._convtune_fast.get(input.shape) is None:
                self.python_calls += 1
            else:
                self.calls += 1
            return out

        TunedConv._convtune_forward = counted
        return self

    def __exit__(self, *exc) -> None:
        TunedConv._convtune_forward = self._original


def workloads(runner, optimizer, x: torch.Tensor, labels: torch.Tensor, autocast) -> tuple:
    """(inference, training step) of ``runner`` on ``x``: inference without gradients, and a step of
    forward, cross-entropy loss, backward and ``optimizer``; each inside ``autocast()``. The caller sets
    the model's train/eval mode."""

    def infer():
        with torch.no_grad(), autocast():
            return runner(x)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = torch.nn.functional.cross_entropy(logits(runner(x)), labels)
        loss.backward()
        optimizer.step()

    return infer, train_step


def split(text: str) -> list[str]:
    """argparse type: a comma-separated list."""
    return [s for s in text.split(",") if s]


def host_profile(step, timer: Timer, steps: int, top: int = 15) -> dict:
    """Host time per training step (ms): the step's wall time, and the functions that take most of it (cProfile)."""
    import cProfile
    import pstats

    timer.sync()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    wall_ms = 1e3 * (time.perf_counter() - t0) / steps  # before the sync: the host's own time
    timer.sync()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return dict(wall_ms=wall_ms, functions=[
        dict(function=_function_name(where), calls=int(calls / steps), self_ms=1e3 * tottime / steps,
             cumulative_ms=1e3 * cumtime / steps) for where, (_, calls, tottime, cumtime, _) in rows])


def _function_name(where: tuple) -> str:
    """'file.py:line(name)' of a cProfile entry, the path cut to its last two parts ('{built-in ...}' as it is)."""
    path, line, name = where
    if path == "~":
        return name
    return f"{'/'.join(Path(path).parts[-2:])}:{line}({name})"


def _layer_of(x_shape, w_shape) -> str:
    """A conv layer as the profile names it: its input (N, C, *spatial) and weight (K, C/g, *kernel) shapes."""
    return f"x{'x'.join(map(str, x_shape))} w{'x'.join(map(str, w_shape))}"


def _torch_conv(event) -> str | None:
    """'fwd' / 'bwd' for PyTorch's own convolution ops not run inside a convtune algorithm, else None."""
    direction = {"aten::convolution": "fwd", "aten::convolution_backward": "bwd"}.get(event.name)
    parent = event.cpu_parent
    while direction and parent is not None:
        if parent.name.startswith(ops.LABEL_PREFIX) or parent.name in ("aten::convolution",
                                                                       "aten::convolution_backward"):
            return None
        parent = parent.cpu_parent
    return direction


def profile_step(step, steps: int) -> dict:
    """GPU kernel time per step: per conv layer (forward, backward) and in all, from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.events()
    layers: dict = defaultdict(lambda: dict(fwd_ms=0.0, bwd_ms=0.0, algorithms=set()))
    for e in events:
        if e.name.startswith(ops.LABEL_PREFIX) and not e.name.startswith("convtune::"):
            key, algorithm = e.name.removeprefix(ops.LABEL_PREFIX).split(ops.LABEL_SEP, 1)
            p = ConvProblem.from_key(key)
            row = layers[_layer_of(p.x_shape, p.w_shape)]
            row["fwd_ms" if p.direction == "fwd" else "bwd_ms"] += e.device_time_total / 1e3 / steps
            row["algorithms"].add(f"{p.direction}={algorithm}")
        elif direction := _torch_conv(e):
            shapes = e.input_shapes
            x_shape, w_shape = (shapes[0], shapes[1]) if direction == "fwd" else (shapes[1], shapes[2])
            row = layers[_layer_of(x_shape, w_shape)]
            row[f"{direction}_ms"] += e.device_time_total / 1e3 / steps
            row["algorithms"].add(f"{direction}=torch")
    # Every kernel the step ran. attributed_gpu_ms, a check: the self device time of all events, which
    # counts each kernel twice (as its own event and under its CPU op), so about twice total_gpu_ms.
    # A kernel is a device event that is not a range a user (Inductor's "## Call CompiledFxGraph ##", the
    # optimizer's step) marked on the device.
    kernel_events = [e for e in events
                     if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
    total_ms = sum(e.time_range.elapsed_us() for e in kernel_events) / 1e3 / steps
    attributed_ms = sum(e.self_device_time_total for e in events) / 1e3 / steps
    conv_ms = sum(r["fwd_ms"] + r["bwd_ms"] for r in layers.values())
    kernels: dict = defaultdict(lambda: [0.0, 0])  # every kernel by name: ms and launches per step
    for e in kernel_events:
        kernels[e.name][0] += e.time_range.elapsed_us() / 1e3 / steps
        kernels[e.name][1] += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:40]
    launches = {e.id: (e.time_range.start, _launching_op(e)) for e in events
                if e.device_type == DeviceType.CPU and e.name in LAUNCH_CALLS}
    idle = gpu_idle([(e.time_range.start, e.time_range.end, e.id) for e in kernel_events], launches, steps)
    return dict(total_gpu_ms=total_ms, attributed_gpu_ms=attributed_ms, conv_ms=conv_ms, other_ms=total_ms - conv_ms,
                layers={k: dict(v, algorithms=sorted(v["algorithms"])) for k, v in sorted(layers.items())},
                idle=idle, cpu_ops=_cpu_ops(prof, steps),
                kernels=[dict(kernel=name[:160], ms=ms, launches=n // steps) for name, (ms, n) in top])


# The CUDA runtime and driver calls that launch work on the device (their correlation id is the kernel's).
LAUNCH_CALLS = frozenset({name + suffix for suffix in ("", "_ptsz") for name in (
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel",
    "cudaMemsetAsync", "cudaMemcpyAsync", "cudaMemset", "cudaMemcpy", "cudaGraphLaunch")})


# Profiler ranges around many ops (a compiled graph's call, its autograd node, the optimizer's step): not what launched.
RANGES = ("## ", "ProfilerStep", "Torch-Compiled Region", "Optimizer.", "CompiledFunction",
          "autograd::engine::evaluate_function")


def _launching_op(launch) -> str:
    """The innermost op above a launch call that is not a range around many ops (``RANGES``): what the host was
    running when it launched (in compiled code every launch is under the graph's call; the launch call's own name
    where nothing is above it)."""
    parent = launch.cpu_parent
    while parent is not None and parent.name.startswith(RANGES):
        parent = parent.cpu_parent
    return launch.name if parent is None else parent.name


def gpu_idle(kernels: list[tuple[float, float, int]], launches: dict[int, tuple[float, str]], steps: int,
             min_gap_us: float = 10.0, top: int = 8) -> dict:
    """Where the device sat idle between the first kernel and the last (us timestamps): ``kernels`` as (start, end,
    correlation id), ``launches`` the host's launch call of each id as (start, the op that made it). A gap the next
    kernel's launch began inside (or after) was the host's: it launched late; one whose launch came before the gap
    was the device's own (a wait on an event, another stream); one whose launch is not among ``launches``, unmatched.
    Per step: idle ms in all, the host's share, the unmatched share, and the host's gaps of at least ``min_gap_us``
    summed by the op that launched the kernel after them, largest first.

        >>> idle = gpu_idle([(0, 10, 1), (30, 40, 2), (45, 50, 3), (50, 60, 4)], {2: (20, "aten::mm"), 3: (1, "")}, 1)
        >>> idle["idle_ms"], idle["host_late_ms"], idle["unmatched_ms"], idle["after"]
        (0.025, 0.02, 0.0, [{'op': 'aten::mm', 'ms': 0.02, 'gaps': 1.0}])
    """
    idle_us = late_us = unmatched_us = 0.0
    after: dict = defaultdict(lambda: [0.0, 0])
    busy_until = None
    for start, end, corr in sorted(kernels):
        if busy_until is not None and start > busy_until:
            gap = start - busy_until
            idle_us += gap
            launch = launches.get(corr)
            if launch is None:  # (no launch call of that correlation id among the host's events)
                unmatched_us += gap
            elif launch[0] > busy_until:  # launched while the device was already idle
                late_us += gap
                if gap >= min_gap_us:
                    after[launch[1]][0] += gap
                    after[launch[1]][1] += 1
        busy_until = end if busy_until is None else max(busy_until, end)
    ranked = sorted(after.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(idle_ms=idle_us / 1e3 / steps, host_late_ms=late_us / 1e3 / steps,
                unmatched_ms=unmatched_us / 1e3 / steps,
                after=[dict(op=op, ms=us / 1e3 / steps, gaps=n / steps) for op, (us, n) in ranked])


def _cpu_ops(prof, steps: int, top: int = 25) -> list[dict]:
    """The host's self time per op (torch.profiler, C++ level: what cProfile sees as one call), per step; the
    ranges convtune's runs open are summed per direction and algorithm kind."""
    totals: dict = defaultdict(lambda: [0.0, 0])
    for a in prof.key_averages():
        name = a.key
        if name.startswith(ops.LABEL_PREFIX) and not name.startswith("convtune::"):  # a run, not the op
            key, algorithm = name.removeprefix(ops.LABEL_PREFIX).split(ops.LABEL_SEP, 1)
            name = f"{ops.LABEL_PREFIX}{key.split('|', 1)[0]} by {algorithm.split(':', 1)[0]}:*"
        totals[name][0] += a.self_cpu_time_total / 1e3 / steps
        totals[name][1] += a.count // steps
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [dict(op=name, self_ms=ms, calls=calls) for name, (ms, calls) in rows]


def combine(runs: list[dict]) -> dict:
    """One configuration's row from its processes: the first process's row (its tuning time is the cold
    one, its profiles the ones kept), each workload's time the median of the processes' medians, with
    the processes' medians and the whole range; later processes' tuning times (a warm database)."""
    row = dict(runs[0])
    ok = [r for r in runs if r.get("status") == "ok"]
    if len(runs) == 1 or not ok:
        return row
    if row.get("status") != "ok":
        row = dict(ok[0])
    for workload in ("inference", "training"):
        measured = [r[workload] for r in ok if workload in r]
        if measured:
            row[workload] = dict(ms=statistics.median(m["ms"] for m in measured),
                                 min_ms=min(m["min_ms"] for m in measured), max_ms=max(m["max_ms"] for m in measured),
                                 process_ms=[m["ms"] for m in measured])
            # each process's count of calls off the hot path, CPU over wall time and threads (a row of one process
            # keeps them under their own names)
            for key in ("full_path_calls", "python_path_calls", "cpu_per_wall", "host_probe_us", "threads",
                        "os_threads", "process"):
                if any(key in m for m in measured):
                    row[workload][key] = [m.get(key) for m in measured]
    if any("db" in r for r in ok):  # each process's database (the row's own "db" is the first's: cold)
        row["process_db"] = [r.get("db") for r in ok]
    later = [r["tune_s"] for r in ok[1:] if "tune_s" in r]
    if later:
        row["later_tune_s"] = later
    row["processes"] = len(runs)
    if len(ok) < len(runs):
        row["failed_processes"] = [r.get("status") for r in runs if r.get("status") != "ok"]
    return row


def config_id(cfg: dict) -> str:
    return f"{cfg['model']}:b{cfg['batch']}:{cfg['dtype']}:{cfg['style']}:{cfg['mode']}"


# What a child prints at exit that is not its error (the cuDNN frontend's bindings list "leaked" objects).
_EXIT_NOISE = re.compile(r"nanobind: |\s+- (leaked|\.\.\. skipped)|See https://nanobind")
_ERROR_LINE = re.compile(r"\w+(\.\w+)*(Error|Exception|Interrupt)\b")


def in_subprocess(cfg: dict, timeout_s: float, gpu: str | None = None) -> dict:
    """``run_config(cfg)`` in a fresh Python process (seeing only GPU ``gpu`` where given); a crash or a timeout is a
    row with its status."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        env = dict(os.environ, CONVTUNE_PROGRESS="0", CONVTUNE_CACHE_DIR=tmp)  # never the user's database
        env.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")  # the docstring says why
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        cmd = [sys.executable, __file__, "--child", json.dumps(cfg), "--child-out", str(path)]
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout_s, stderr=subprocess.PIPE, text=True)
        except subprocess.TimeoutExpired:
            return dict(status=f"timeout after {timeout_s:.0f} s")
        lines = [line for line in proc.stderr.splitlines() if not _EXIT_NOISE.match(line)]
        sys.stderr.write("\n".join(lines)[-4000:] + "\n")
        if proc.returncode != 0 or not path.exists():
            errors = [line for line in lines if _ERROR_LINE.match(line)] or lines[-1:] or ["no output"]
            return dict(status=f"failed (exit {proc.returncode}): {errors[-1][:300]}", stderr="\n".join(lines)[-3000:])
        return json.loads(path.read_text())


def visible_gpus(parser: argparse.ArgumentParser, count: int, device: str) -> list[str | None]:
    """The GPUs the workers of ``--gpus count`` pin their processes to: [None] for one (the processes see what this
    one sees), else the first ``count`` of CUDA_VISIBLE_DEVICES's list (or 0 to count - 1); on CUDA no more than there
    are."""
    if count < 1:
        parser.error(f"--gpus {count} must be 1 or more")
    if count == 1:
        return [None]
    shown = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    shown = shown or [str(i) for i in range(count)]
    there = torch.cuda.device_count() if device == "cuda" else count
    if count > min(len(shown), there):
        parser.error(f"--gpus {count}: this machine shows {min(len(shown), there)} GPU(s)")
    return list(shown[:count])


def _ms(row: dict | None, workload: str) -> str:
    if not (row and workload in row):
        return "-"
    spread = row[workload].get("process_ms", [])
    return f"{row[workload]['ms']:.3f}" + (f" ({min(spread):.3f}-{max(spread):.3f}, {len(spread)} processes)"
                                           if len(spread) > 1 else "")


def _probe_ratio(base: dict | None, ct_row: dict, workload: str) -> str:
    """The host probes (``host_probe_us``) of PyTorch's process over convtune's, taken as each was timed (the median
    of a row's processes): below 1, convtune's process ran the same host work slower."""
    def probe(row: dict | None) -> float | None:
        value = (row or {}).get(workload, {}).get("host_probe_us")
        return statistics.median(value) if isinstance(value, list) else value

    torch_us, ct_us = probe(base), probe(ct_row)
    return f"{torch_us / ct_us:.2f}" if torch_us and ct_us else "-"


def markdown(env: dict, rows: dict) -> str:
    head = (f"# End-to-end benchmark\n\n{common.env_line(env)}, the last run's. Autocast, channels_last; "
            "median of 7 timings of 10 steps (ms per step); each row its own process (or, where a range follows, "
            "the median of several processes' medians and their range); rows keep the date and revision of the "
            "run that measured them.\n\n" + ANCHORS + "\n")
    table = []
    for cid, row in rows.items():
        source = f" (src {row['source']})" if cid.endswith(":convtune") and row.get("source") else ""
        beside = f", on GPU {row['gpu']}, one of {row['workers']} workers" if row.get("workers") else ""
        measured = f"{row.get('date', '-')} {row.get('revision') or 'revision not recorded'}{source}{beside}"
        table.append([*cid.split(":"), _ms(row, "inference"), _ms(row, "training"), tuning_cell(row), row["status"],
                      measured.strip()])
    out = head + "## Every configuration\n\nTuning (s): convtune's `optimize` on a cold database (then again in " \
        "the same process) or, in a fresh process, on the warm one; torch: its first inference call plus its " \
        "first training step (benchmark mode tunes there; under compile they include compiling).\n\n"
    out += common.md_table(["model", "batch", "dtype", "style", "mode", "inference ms", "training ms", "tuning s",
                            "status", "measured"], table)
    groups = sorted({cid.rsplit(":", 1)[0] for cid in rows})
    ratios = []
    for g in groups:
        ct_row, bm0, bm1 = (rows.get(f"{g}:{m}") for m in MODES)
        if ct_row is None:
            continue
        cells = []
        for workload in ("inference", "training"):
            for base in (bm0, bm1):
                ok = ct_row and base and workload in ct_row and workload in base
                cells.append(f"{base[workload]['ms'] / ct_row[workload]['ms']:.2f}x" if ok else "-")
        cold, warm = group_tuning(rows, g, ct_row.get("source"))
        first = tuning_cell(bm1) if bm1 else "-"
        probes = " / ".join(_probe_ratio(bm1, ct_row, workload) for workload in ("inference", "training"))
        ratios.append([*g.split(":"), *cells, cold, warm, first, probes, ct_row.get("source", "not recorded")])
    sources = sorted({r[-1] for r in ratios})
    out += "\n## convtune's speed-up (torch time / convtune time; above 1: convtune faster)\n\n"
    out += (f"convtune's rows ran the library's src/ tree {sources[0]} (`git rev-parse --short <commit>:src`: every "
            "commit that leaves src/ as it is runs the same library).\n\n" if len(sources) == 1 else
            f"convtune's rows ran {len(sources)} versions of the library's src/ tree (last column: "
            "`git rev-parse --short <commit>:src`); `--missing` measures again the groups of those not of the current "
            "one, PyTorch's rows with them.\n\n")
    out += ("Tuning (s): convtune's `optimize(training=True)` on an empty database (cold: the first process of the "
            "network, batch and dtype, whichever its style) and, in a fresh process, on the database it filled "
            "(warm: the median of those processes); bm1 first: benchmark mode's first inference call plus its "
            "first training step in that style (under compile, compiling included). Host probe: a fixed host "
            "workload (Python and PyTorch's dispatcher, no GPU) timed in each process just before its inference and "
            "its training steps, PyTorch's over convtune's (`host_probe_us`): where it is well below 1, convtune's "
            "process ran everything slower, not only its layers; '-' for rows measured before the probe.\n\n")
    out += common.md_table(["model", "batch", "dtype", "style", "inference vs bm0", "inference vs bm1",
                            "training vs bm0", "training vs bm1", "cold tuning s", "warm tuning s", "bm1 first s",
                            "host probe, torch / convtune", "convtune's src/"], ratios)
    for g in groups:
        ct_row, bm1 = rows.get(f"{g}:convtune"), rows.get(f"{g}:torch_bm1")
        if not (ct_row and bm1):
            continue
        for key, what in (("profile", "per training step"), ("inference_profile", "per inference")):
            if key in ct_row and key in bm1:
                out += f"\n## Where the GPU time goes {what}: {g}\n\n" + profile_table(
                    bm1[key], ct_row[key]).replace("per training step", what)
        if "idle" in ct_row.get("profile", {}) and "idle" in bm1.get("profile", {}):
            out += f"\n## Where the GPU waited in the training step: {g}\n\n" + idle_table(bm1["profile"],
                                                                                         ct_row["profile"])
        if "cpu_ops" in ct_row.get("profile", {}) and "profile" in bm1:
            out += f"\n## Host time per op of the training step: {g}\n\n" + cpu_ops_table(bm1["profile"],
                                                                                        ct_row["profile"])
        for key, what in (("host_profile", "the training step's"), ("inference_host_profile", "inference's")):
            if key in ct_row and key in bm1:
                out += f"\n## Where {what} host time goes: {g}\n\n" + host_table(bm1[key], ct_row[key])
    return out


def merged(configs: list[dict]) -> dict:
    """The rows of several results files' ``configs``, each group (network, batch, dtype, style) whole from the one
    whose rows of it were measured last (the latest date among them; the first file's on a tie), so that each
    ratio still compares rows of one run.

        >>> a = {"m:b32:float16:eager:convtune": {"date": "2026-12-06 04:30 UTC"},
        ...      "m:b32:float16:eager:torch_bm1": {"date": "2026-12-06 04:30 UTC"}}
        >>> b = {"m:b32:float16:eager:convtune": {"date": "2026-12-06 05:00 UTC"},
        ...      "m:b32:float16:graph:convtune": {"date": "2026-12-06 04:00 UTC"}}
        >>> sorted((k, v["date"][11:16]) for k, v in merged([a, b]).items())
        [('m:b32:float16:eager:convtune', '05:00'), ('m:b32:float16:graph:convtune', '04:00')]
    """
    latest: dict[str, tuple[str, dict]] = {}
    for rows in configs:
        groups: dict[str, dict] = {}
        for cid, row in rows.items():
            groups.setdefault(cid.rsplit(":", 1)[0], {})[cid] = row
        for group, group_rows in groups.items():
            date = max(str(row.get("date", "")) for row in group_rows.values())
            if group not in latest or date > latest[group][0]:
                latest[group] = (date, group_rows)
    return {cid: row for _, group_rows in latest.values() for cid, row in group_rows.items()}


def current(row: dict, mode: str, env: dict) -> bool:
    """Whether ``row`` stands for this run: measured (status ok) and, for convtune's rows, with this src/ tree
    (PyTorch's rows do not run the library's code). A tree with uncommitted changes ('+') or none known is never
    the same as another run's."""
    source = env["source"]
    same = row.get("source") == source and source != "unknown" and not source.endswith("+")
    return row.get("status") == "ok" and (mode != "convtune" or same)


def group_tuning(rows: dict, group: str, source: str | None) -> tuple[str, str]:
    """(cold, warm) tuning seconds of ``group``'s network, batch and dtype: the cold optimize of its first
    process and the median warm one of the others, among the convtune rows of ``source`` (any source where
    none is of it)."""
    network = group.rsplit(":", 1)[0]
    mine = [r for cid, r in rows.items() if cid.startswith(network + ":") and cid.endswith(":convtune")
            and r.get("status") == "ok" and "tune_s" in r]
    same = [r for r in mine if r.get("source") == source] or mine
    cold = [r["tune_s"] for r in same if r.get("db") == "cold"]
    warm = [r["tune_s"] for r in same if r.get("db") == "warm"] + [t for r in same for t in r.get("later_tune_s", [])]
    return (f"{statistics.median(cold):.2f}" if cold else "-", f"{statistics.median(warm):.2f}" if warm else "-")


def tuning_cell(row: dict) -> str:
    if "tune_s" in row:
        again = f" (again {row['tune_again_s']:.2f})" if "tune_again_s" in row else ""
        later = f"; warm {', '.join(f'{t:.2f}' for t in row['later_tune_s'])}" if row.get("later_tune_s") else ""
        return f"{row['db']} {row['tune_s']:.2f}{again}{later}"
    firsts = [row.get(f"{w}_first_s") for w in ("inference", "training")]
    return f"{sum(firsts):.2f}" if None not in firsts else "-"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def profile_table(torch_profile: dict, ct_profile: dict) -> str:
    """Per conv layer (summed over the layers of one shape) and in all: PyTorch benchmark=True against convtune."""
    lines = []
    for layer in sorted(set(torch_profile["layers"]) | set(ct_profile["layers"])):
        t, c = torch_profile["layers"].get(layer), ct_profile["layers"].get(layer)
        cells = [f"{r[k]:.3f}" if r else "-" for k in ("fwd_ms", "bwd_ms") for r in (t, c)]
        ratio = _ratio(c["fwd_ms"] + c["bwd_ms"], t["fwd_ms"] + t["bwd_ms"]) if t and c else "-"
        lines.append([layer, *cells, ratio, "; ".join(c["algorithms"]) if c else "-"])
    for what in ("conv_ms", "other_ms", "total_gpu_ms"):
        t, c = torch_profile[what], ct_profile[what]
        lines.append([f"**{what.removesuffix('_ms')}**", "", "", "", "", f"{_ratio(c, t)} ({t:.3f} -> {c:.3f} ms)", ""])
    return ("GPU kernel time per training step (ms), torch.profiler; a layer row sums the layers of that input and "
            "weight shape; ratio = convtune / torch.\n\n" + common.md_table(
                ["layer", "fwd torch bm1", "fwd convtune", "bwd torch bm1", "bwd convtune", "ratio",
                 "convtune's algorithms"], lines))


def idle_table(torch_profile: dict, ct_profile: dict) -> str:
    """The device's idle time per training step, and the ops whose launches came after the host-made gaps."""
    t, c = torch_profile["idle"], ct_profile["idle"]
    lines = [["**idle in all**", f"{t['idle_ms']:.3f}", f"{c['idle_ms']:.3f}"],
             ["**of which the host launched late**", f"{t['host_late_ms']:.3f}", f"{c['host_late_ms']:.3f}"],
             ["**of which no launch was found**", f"{t['unmatched_ms']:.3f}", f"{c['unmatched_ms']:.3f}"]]
    torch_after = {r["op"]: r for r in t["after"]}
    ct_after = {r["op"]: r for r in c["after"]}
    for op in dict.fromkeys([*ct_after, *torch_after]):
        lines.append([f"after `{op}`", *(f"{r['ms']:.3f} ({r['gaps']:g})" if r else "-"
                                          for r in (torch_after.get(op), ct_after.get(op)))])
    return ("The device idle between kernels per training step (ms, torch.profiler): in all, where the next kernel's "
            "launch began only once the device had run out of work (the host was late), where the profile holds no "
            "launch of the next kernel (unmatched), and the host's gaps of 10 us "
            "or more by the op that launched the kernel after them (ms, gaps per step).\n\n"
            + common.md_table(["", "torch bm1", "convtune"], lines))


def cpu_ops_table(torch_profile: dict, ct_profile: dict) -> str:
    """Host self time per op per training step (torch.profiler), convtune's costliest beside torch's."""
    torch_ops = {r["op"]: r for r in torch_profile.get("cpu_ops", [])}
    lines = []
    for r in ct_profile.get("cpu_ops", []):
        t = torch_ops.get(r["op"])
        lines.append([f"`{r['op']}`", f"{t['self_ms']:.2f} ({t['calls']})" if t else "-",
                      f"{r['self_ms']:.2f} ({r['calls']})"])
    return ("Host self time per op per training step (ms, calls), torch.profiler (C++ level); rows: convtune's "
            "costliest ops.\n\n" + common.md_table(["op", "torch bm1", "convtune"], lines))


def host_table(torch_profile: dict, ct_profile: dict) -> str:
    """The host's wall time per training step, and convtune's costliest functions (self time) beside torch's."""
    lines = [["**wall time per step**", f"{torch_profile['wall_ms']:.2f}", f"{ct_profile['wall_ms']:.2f}", ""]]
    torch_self = {f["function"]: f for f in torch_profile["functions"]}
    for f in ct_profile["functions"]:
        t = torch_self.get(f["function"])
        lines.append([f"`{f['function']}`", f"{t['self_ms']:.2f}" if t else "-", f"{f['self_ms']:.2f}",
                      str(f["calls"])])
    return ("Host (CPU) time per training step (ms), cProfile of a few steps (its own overhead included, so "
            "compare the columns, not the absolute figures); rows: convtune's costliest functions by self time, "
            "with torch benchmark=True's time in the same function where it is among its own costliest.\n\n"
            + common.md_table(["function", "torch bm1 self ms", "convtune self ms", "convtune calls per step"], lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=split, default=list(MODELS))
    parser.add_argument("--batches", type=lambda t: [int(b) for b in split(t)], default=list(BATCHES))
    parser.add_argument("--dtypes", type=split, default=list(DTYPES))
    parser.add_argument("--styles", type=split, default=list(STYLES))
    parser.add_argument("--modes", type=split, default=list(MODES))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a small stand-in network (no torchvision needed)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--config-timeout", type=float, default=540.0, help="seconds one configuration may take")
    parser.add_argument("--gpus", type=int, default=1, help="groups run at once, each family (network, batch, dtype) "
                        "on a GPU of its own (the first N that CUDA_VISIBLE_DEVICES shows, or 0 to N-1)")
    parser.add_argument("--processes", type=int, default=1, help="processes per configuration, the modes of a "
                        "group taking turns (a row's time is the median of its processes' medians, with their range: "
                        "where the host sets the pace, processes of one configuration differ by far more than "
                        "the timings inside one)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled steps (eager and compile styles)")
    parser.add_argument("--missing", action="store_true", help="only the groups (network, batch, dtype, style) the "
                        "results file lacks an ok row of, convtune's counting only where it ran the current src/ tree, "
                        "each measured again whole, PyTorch's rows too (a run in parts goes on where the last one "
                        "stopped, over several runs while src/ stays as it is)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no group (network, batch, dtype, "
                        "style) once this many seconds are spent or the longest group so far would not end within "
                        "them (a run on a machine lent for a limited time ends between groups, which --missing "
                        "then goes on from)")
    parser.add_argument("--report", action="store_true", help="write the markdown again from the results file "
                        "(runs nothing)")
    parser.add_argument("--merge", nargs="+", metavar="FILE", help="add to the results file the groups (network, "
                        "batch, dtype, style) of these results files of the same machine, each group whole, from the "
                        "file that measured it last (runs nothing): runs in parts on machines that kept their own "
                        "copies")
    parser.add_argument("--db-dir", default=None, help="where the groups' tuning databases live (default: a "
                        "temporary folder, so each run tunes cold first)")
    common.result_arguments(parser, "e2e")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.child_out).write_text(json.dumps(run_config(json.loads(args.child))))
        return
    for option, values, allowed in (("--styles", args.styles, STYLES), ("--modes", args.modes, MODES),
                                    ("--dtypes", args.dtypes, DTYPES)):
        if set(values) - set(allowed):
            parser.error(f"{option} {','.join(values)}: each must be one of {','.join(allowed)}")
    models = ["tiny"] if args.tiny else args.models
    out_dir = Path(args.out or common.RESULTS)
    json_path = out_dir / f"{args.name}.json"
    if args.report:
        payload = json.loads(json_path.read_text())
        common.write(args.name, payload, markdown(payload["environment"], payload["configs"]), out_dir)
        return
    if args.merge:
        payload = json.loads(json_path.read_text())
        others = [(Path(p), json.loads(Path(p).read_text())) for p in args.merge]
        for path, other in others:
            if common.where(other.get("environment", {})) != common.where(payload["environment"]):
                parser.error(f"--merge {path}: measured on {common.where(other.get('environment', {}))}, the results "
                             f"file {json_path} on {common.where(payload['environment'])}")
        payload["configs"] = merged([payload["configs"], *(other["configs"] for _, other in others)])
        payload["environment"] = max([payload["environment"], *(o["environment"] for _, o in others)],
                                     key=lambda env: env.get("date", ""))
        common.write(args.name, payload, markdown(payload["environment"], payload["configs"]), out_dir)
        return
    env = common.environment()
    payload = common.extendable(json_path, env, args.name)
    payload["environment"] = env
    rows = payload.setdefault("configs", {})
    if args.processes < 1:
        parser.error(f"--processes {args.processes} must be 1 or more")
    gpus = visible_gpus(parser, args.gpus, args.device)
    state = dict(started=time.monotonic(), longest=0.0, stop=False)
    lock = threading.Lock()  # the rows, the results file, the budget's figures
    with tempfile.TemporaryDirectory() as tmp:
        db_dir = Path(args.db_dir or tmp)
        db_dir.mkdir(parents=True, exist_ok=True)
        families = list(itertools.product(models, args.batches, args.dtypes))

        def group(model: str, batch: int, dtype: str, style: str, gpu: str | None) -> None:
            cfgs = [dict(model=model, batch=batch, dtype=dtype, style=style, mode=mode, device=args.device,
                         tiny=args.tiny, steps=args.steps, repeats=args.repeats, profile=not args.no_profile,
                         db=str(db_dir / f"{model}_b{batch}_{dtype}.sqlite")) for mode in args.modes]
            # --missing: a group (network, batch, dtype, style) any of whose rows is missing or stale is measured
            # again whole, its modes taking turns, so that each of its ratios compares rows of one run.
            with lock:
                if not cfgs or args.missing and all(current(rows.get(config_id(c), {}), c["mode"], env) for c in cfgs):
                    return
                spent = time.monotonic() - state["started"]
                if state["stop"] or args.budget_s is not None and spent + state["longest"] > args.budget_s:
                    if not state["stop"]:
                        print(f"{model}:b{batch}:{dtype}:{style} and the groups after it not started: {spent:.0f} s "
                              f"spent, the longest group took {state['longest']:.0f} s, --budget-s {args.budget_s:g}",
                              file=sys.stderr)
                    state["stop"] = True
                    return
            group_start = time.monotonic()
            runs: dict[str, list[dict]] = {config_id(c): [] for c in cfgs}
            for turn in range(args.processes):  # the modes take turns, in a rotated order
                for cfg in cfgs[turn % len(cfgs):] + cfgs[:turn % len(cfgs)]:
                    where = "" if gpu is None else f" on GPU {gpu}"
                    print(f"{config_id(cfg)} (process {turn + 1} of {args.processes}){where}", file=sys.stderr,
                          flush=True)
                    result = in_subprocess(dict(cfg, profile=cfg["profile"] and turn == 0), args.config_timeout, gpu)
                    with lock:
                        runs[config_id(cfg)].append(result)
                        row = combine(runs[config_id(cfg)])
                        row["date"], row["revision"], row["source"] = env["date"], env["revision"], env["source"]
                        if gpu is not None:
                            row["gpu"], row["workers"] = gpu, len(gpus)
                        rows[config_id(cfg)] = row
                        common.write(args.name, payload, markdown(env, rows), out_dir)  # a cut run keeps what it did
            with lock:
                state["longest"] = max(state["longest"], time.monotonic() - group_start)

        def worker(gpu: str | None) -> None:  # takes the next family until none is left
            while True:
                with lock:
                    if not families or state["stop"]:
                        return
                    family = families.pop(0)
                for style in args.styles:
                    group(*family, style, gpu)

        if len(gpus) == 1:
            worker(gpus[0])  # in this thread, as a run of one GPU always was
        else:
            failures: list[BaseException] = []

            def guarded(gpu: str | None) -> None:  # a worker's error ends the run (the others start no new group)
                try:
                    worker(gpu)
                except BaseException as exc:  # noqa: BLE001 - raised again below, in the main thread
                    with lock:
                        failures.append(exc)
                        state["stop"] = True

            threads = [threading.Thread(target=guarded, args=(gpu,), name=f"e2e-gpu{gpu}") for gpu in gpus]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if failures:
                raise failures[0]
    print(markdown(env, rows))


if __name__ == "__main__":
    main()
