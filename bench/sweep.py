"""Measurement sweep: every candidate timed on problems sampled from what real networks contain.

The data a learned cost model for ``get`` is built from. Problem i of a sweep is drawn from a
generator seeded with (seed, i): a seed layer (the built-in networks' layer tables and DeepBench),
then random perturbations of it (channels, spatial size, kernel including 1xN and Nx1, stride,
dilation, groups from dense to depthwise, batch; now and then a network's first layer, an image's
1, 3 or 4 channels in), a direction, a dtype (float16, bfloat16, float32 with and without TF32) and
a layout. Each problem is measured by ``find`` with its search rules
off, so every supporting candidate is checked against float64 and timed by the one timer; the
results go to a tuning database, which is what makes a cut run resumable (a problem the database
has is not measured again) and what the dataset is exported from, in the database's export
format (JSON lines keyed by the machine's fingerprint and software).

    python bench/sweep.py --minutes 9 --db bench/data/sweep.sqlite --export bench/data/sweep.jsonl.gz
    python bench/sweep.py --device cpu --tiny --count 4      # a small run, as the tests do
    python bench/sweep.py --networks all --batch 32 --dtypes float16   # the built-in networks' layers too,
                                                     # which bench/learned_get.py holds out one at a time
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import convtune as ct  # noqa: E402
from convtune import zoo  # noqa: E402
from convtune.problem import ConvProblem  # noqa: E402
from convtune.settings import settings  # noqa: E402

DTYPES = (("float16", True), ("bfloat16", True), ("float32", True), ("float32", False))  # (dtype, allow_tf32)
LAYOUTS = ("channels_last", "channels_first")
DIRECTIONS = ("fwd", "bwd_data", "bwd_filter")
BATCHES = (1, 8, 32, 64, 128, 256)
IMAGE_CHANNELS = 4  # grey, RGB, RGBA: the input channels of a network's first layer
# Of the seed layers only a few (7 of 220) are first layers, and find's choice there is its own (cuDNN has
# engines for few input channels only): a share of the problems drawn is made one.
FIRST_LAYERS = 0.05
MAX_ELEMENTS = 2**27  # per operand: keeps one problem's find within seconds and its memory modest


def seeds() -> list[ConvProblem]:
    """Every unique layer of the built-in networks and DeepBench, as forward problems (batch 1)."""
    found: dict[str, ConvProblem] = {}
    for network in zoo.NETWORKS:
        for layer in zoo.network_layers(network, 1):
            p = layer.problem
            found.setdefault(p.replace(n=1).key, p.replace(n=1))
    return list(found.values())


def _round_channels(value: float, rng: random.Random) -> int:
    multiple = rng.choice((1, 8, 8, 16))  # mostly the multiples of 8 networks use, now and then any
    return max(1, int(round(value / multiple)) * multiple or multiple)


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def sample(index: int, seed: int, device: str, tiny: bool, layers: list[ConvProblem],
           depthwise_kernels: tuple[int, ...] = ()) -> ConvProblem:
    """Problem ``index`` of the sweep seeded ``seed``: the same problem for the same arguments, always.
    depthwise_kernels: a depthwise problem's square kernel is drawn from these (large kernels, 9 to 31, where cuDNN's
    plans run far from their analytic price: docs/algorithms.md); none: as for any problem."""
    rng = random.Random(seed * 1_000_003 + index)
    base = rng.choice(layers)
    c, k = base.c, base.k
    if rng.random() < 0.6:
        if c > IMAGE_CHANNELS:  # a first layer's input channels are an image's, not a width to scale
            c = _round_channels(c * rng.choice((0.25, 0.5, 1, 1, 2, 4)), rng)
        k = _round_channels(k * rng.choice((0.25, 0.5, 1, 1, 2, 4)), rng)
    first_layer = rng.random() < FIRST_LAYERS  # a layer made a network's first one (below)
    ndim = base.ndim
    size = tuple(max(1, int(round(s * rng.choice((0.25, 0.5, 1, 1, 2))))) for s in base.input_size)
    kernel = base.kernel_size
    if ndim == 2 and rng.random() < 0.1:  # 1-D, as audio and sequence models have: one long row
        ndim, size, kernel = 1, (size[0] * size[1],), (max(kernel),)
        base = base.replace(input_size=size, kernel_size=kernel, stride=base.stride[0], padding=base.padding[0],
                            dilation=base.dilation[0])
    if rng.random() < 0.4:
        r = rng.choice((1, 3, 3, 5, 7))
        kernel = (r,) * ndim
        if ndim == 2 and rng.random() < 0.25:  # 1xN and Nx1 (Inception, separable stacks)
            kernel = (1, r) if rng.random() < 0.5 else (r, 1)
    stride = base.stride if rng.random() < 0.7 else (rng.choice((1, 2)),) * ndim
    dilation = (1,) * ndim if rng.random() < 0.85 else (rng.choice((2, 3)),) * ndim
    if first_layer:  # an image's channels in and size, a stem's filters out, a 3x3 to 7x7 kernel, mostly stride 2
        c, k = rng.choice((1, 3, 4)), rng.choice((16, 24, 32, 48, 64))
        size = (rng.choice((96, 128, 160, 224, 256, 320)),) * ndim if ndim > 1 else (rng.choice((1024, 4096, 16000)),)
        kernel, dilation = (rng.choice((3, 5, 7)),) * ndim, (1,) * ndim
        stride = (2,) * ndim if rng.random() < 0.7 else (1,) * ndim
    groups = 1
    roll = 1.0 if first_layer else rng.random()  # a first layer is dense
    if roll < 0.15:  # depthwise, with a channel multiplier now and then
        groups, k = c, c * rng.choice((1, 1, 1, 2))
        if depthwise_kernels:
            r, dilation = rng.choice(depthwise_kernels), (1,) * ndim
            kernel = (r,) * ndim
    elif roll < 0.35:  # grouped: 2 to 64 channels per group
        common = [g for g in _divisors(math.gcd(c, k)) if 2 <= c // g <= 64 and g > 1]
        groups = rng.choice(common) if common else 1
    if tiny:  # a small stand-in for the tests: a handful of channels and positions
        c, k = min(c, 8), min(k, 8)
        groups = math.gcd(groups, math.gcd(c, k))
        size = tuple(min(s, 9) for s in size)
        kernel = tuple(min(r, 3) for r in kernel)
    padding = tuple(d * (r - 1) // 2 for r, d in zip(kernel, dilation))
    size = tuple(max(s, d * (r - 1) + 1 - 2 * pad) for s, r, d, pad in zip(size, kernel, dilation, padding))
    dtype, tf32 = rng.choice(DTYPES) if device == "cuda" else rng.choice((("float32", True), ("bfloat16", True)))
    batch = rng.choice(BATCHES[:3] if tiny else BATCHES)
    p = ConvProblem(rng.choice(DIRECTIONS), n=batch, c=c, k=k, input_size=size, kernel_size=kernel, stride=stride,
                    padding=padding, dilation=dilation, groups=groups, dtype=dtype, layout=rng.choice(LAYOUTS),
                    device=device, allow_tf32=tf32)
    while max(math.prod(s) for s in p.operand_shapes) > MAX_ELEMENTS:  # smaller batches, then narrower
        if p.n > 1:
            p = p.replace(n=p.n // 2)
        else:
            g = p.groups
            c, k = max(g, p.c // 2 // g * g), max(g, p.k // 2 // g * g)
            if (c, k) == (p.c, p.k):
                p = p.replace(input_size=tuple(max(1, s // 2) for s in p.input_size))
            else:
                p = p.replace(c=c, k=k)
    return p


def network_problems(networks: list[str], batch: int, dtypes: list[str], layouts: list[str], device: str,
                     layers: int | None = None) -> list[tuple[str, ConvProblem]]:
    """(network, problem) of every layer of ``networks`` in every direction, dtype and layout asked."""
    out = []
    for network in networks:
        for direction in DIRECTIONS:
            for dtype in dtypes:
                for layout in layouts:
                    found = zoo.network_layers(network, batch, direction=direction, dtype=dtype, layout=layout,
                                               device=device)
                    out += [(network, layer.problem) for layer in found[:layers]]
    return out


def measure(p: ConvProblem, db: ct.TuningDB) -> int:
    """Every supporting candidate of ``p`` checked and timed, stored in ``db``; the number timed."""
    # the search's rules off, and every candidate that can be in a worker process: a crash costs it alone
    with settings.override(find_patience=0, find_prune_factor=0, find_max_candidates=0, find_budget_s=0,
                           isolate="all"):
        results = ct.find(p, ct.Policy(allow_tf32=p.allow_tf32), db=db)
    return sum(r.ok for r in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", default="bench/data/sweep.sqlite", help="the tuning database the sweep fills")
    parser.add_argument("--export", default=None, help="write the database's results here (JSON lines) at the end")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="first problem index")
    parser.add_argument("--count", type=int, default=100_000, help="problem indices to go through")
    parser.add_argument("--minutes", type=float, default=0.0, help="stop starting new problems after this (0: none)")
    parser.add_argument("--tiny", action="store_true", help="small problems (tests)")
    parser.add_argument("--networks", default=None, help="measure these built-in networks' layers instead of "
                        "sampled problems (comma-separated, or 'all')")
    parser.add_argument("--batch", type=int, default=32, help="the networks' batch")
    parser.add_argument("--dtypes", default="float16", help="the networks' dtypes (comma-separated)")
    parser.add_argument("--layouts", default="channels_last", help="the networks' layouts (comma-separated)")
    parser.add_argument("--layers", type=int, default=None, help="only the first N layers of each network")
    parser.add_argument("--depthwise-kernels", default="", metavar="R,R,...",
                        help="sampled depthwise problems take a square kernel of these sizes, e.g. 7,9,13,31 (default: "
                             "as every problem, 1 to 7); another set of problems than the default's for one seed")
    args = parser.parse_args(argv)
    try:
        depthwise_kernels = tuple(int(r) for r in args.depthwise_kernels.split(",") if r.strip())
    except ValueError:
        parser.error(f"--depthwise-kernels {args.depthwise_kernels!r}: write sizes like 7,9,13,31")
    if any(r < 1 for r in depthwise_kernels):
        parser.error(f"--depthwise-kernels {args.depthwise_kernels!r}: sizes are 1 or more")
    deadline = time.monotonic() + 60 * args.minutes if args.minutes else math.inf
    if args.networks:
        names = list(zoo.MODELS) if args.networks == "all" else args.networks.split(",")
        listed = network_problems(names, args.batch, args.dtypes.split(","), args.layouts.split(","), args.device,
                                  args.layers)
        problems = iter([(i, p) for i, (_, p) in enumerate(listed)])
    else:
        layers = seeds()
        problems = ((i, sample(i, args.seed, args.device, args.tiny, layers, depthwise_kernels))
                    for i in range(args.start, args.start + args.count))
    Path(args.db).parent.mkdir(parents=True, exist_ok=True)
    measured = kept = failed = 0
    with ct.TuningDB(args.db) as db:
        for index, p in problems:
            if time.monotonic() > deadline:
                break
            if db.results(p):
                kept += 1
                continue
            started = time.monotonic()
            try:
                timed = measure(p, db)
            except Exception as exc:  # noqa: BLE001 - one problem that cannot be measured does not end the sweep
                failed += 1
                print(f"{index} {p.key}: not measured ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
                continue
            measured += 1
            print(f"{index} {p.key}: {timed} timed in {time.monotonic() - started:.1f} s", file=sys.stderr,
                  flush=True)
        if args.export:
            lines = db.export(args.export)
            print(f"exported {lines} results to {args.export}", file=sys.stderr)
    print(f"measured {measured} problems, {kept} already in {args.db}, {failed} could not be measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
