"""Depthwise and grouped benchmark: convtune's Triton kernels against every cuDNN execution plan, PyTorch and the
floor.

For each shape and direction, with one timer (convtune.timing.benchmark) for everything and every
result checked against float64 first:
- ours: every configuration of the direction of the depthwise families (triton:depthwise, tap by tap on the
  CUDA cores, triton:depthwise_strip, by strips of a row on the CUDA cores, triton:depthwise_band, on the tensor
  cores, and for the weight gradient triton:depthwise_rows, by input rows on the tensor cores), or for a grouped
  shape of triton:grouped, the fastest reported;
- the best cuDNN execution plan: every plan of heuristics A + FALLBACK, built, checked and timed;
- PyTorch's own call with cudnn.benchmark False and True, each in its own process;
- the floor (hardware.roofline_ms: multiply-adds at the CUDA cores' float32 rate, compulsory bytes).

    python bench/depthwise.py                 # the default sweep (float16, batch 32, the three directions)
    python bench/depthwise.py --sweep full    # the whole grid, resumable with --missing
    python bench/depthwise.py --sweep sample --per-kernel 4 --missing   # 4 shapes of the grid a kernel size, by turns
    python bench/depthwise.py --shape 96:56:7:1 --batch 128 --dtype bfloat16
    python bench/depthwise.py --ours-again    # after a kernel change: cuDNN's and PyTorch's times kept
    python bench/depthwise.py --ours-again --families depthwise_strip   # one family's again, the others' kept
    python bench/depthwise.py --sweep grouped --name grouped   # ResNeXt-50's grouped layers, 8 to 64 channels a group
    python bench/depthwise.py --sweep first --name first_layers --directions fwd,bwd_filter   # 3-channel first layers

A shape is channels:spatial:kernel:stride[:channels a group[:output channels]] (a group: 1, the default, depthwise;
as many as the channels, a dense layer; the output has as many channels as the input unless given). Padding: half
the kernel, none where the kernel is no wider than its stride (a patch embedding). A dense layer of few channels (a
network's first) is timed against triton:folded.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from convtune import hardware  # noqa: E402
from convtune.algorithms.native import native_conv  # noqa: E402
from convtune.algorithms.registry import registered  # noqa: E402
from convtune.algorithms.triton_depthwise import TritonDepthwise  # noqa: E402
from convtune.algorithms.triton_depthwise_band import TritonDepthwiseBand  # noqa: E402
from convtune.algorithms.triton_depthwise_rows import TritonDepthwiseRows  # noqa: E402
from convtune.algorithms.triton_depthwise_strip import TritonDepthwiseStrip  # noqa: E402
from convtune.algorithms.triton_folded import TritonFolded  # noqa: E402
from convtune.algorithms.triton_grouped import TritonGrouped  # noqa: E402
from convtune.problem import DIRECTIONS, ConvProblem  # noqa: E402
from convtune.timing import benchmark  # noqa: E402
from convtune.verify import reference  # noqa: E402
from layers import time_algorithm  # noqa: E402

# channels:spatial:kernel:stride. The four layers furthest from the floor first, then a spread of networks' depthwise
# layers.
DEFAULT_SHAPES = ("96:56:7:1", "384:14:7:1", "672:14:5:1", "1152:7:5:1",
                  "32:112:3:1", "144:56:3:2", "960:7:3:1", "128:56:9:1", "256:28:13:1", "512:14:31:1")
# ResNeXt-50 32x4d's grouped 3x3 layers (4 to 32 channels a group; the strided ones open a stage), then 8, 16, 24
# and 64 channels a group at ResNet's sizes (RegNet-like widths).
# Networks' first layers: ResNet's and GoogLeNet's 7x7 stem, MobileNetV2's and EfficientNet's 3x3 stride 2, VGG's 3x3,
# ConvNeXt's 4x4 patches, a ViT-B/16's 16x16 patch embedding.
FIRST_SHAPES = ("3:224:7:2:3:64", "3:224:3:2:3:32", "3:224:3:1:3:64", "3:224:4:4:3:96", "3:224:16:16:3:768")
GROUPED_SHAPES = ("128:56:3:1:4", "256:56:3:2:8", "256:28:3:1:8", "512:28:3:2:16", "512:14:3:1:16", "1024:14:3:2:32",
                  "1024:7:3:1:32", "128:56:3:1:8", "256:56:3:1:16", "384:28:3:1:24", "512:14:3:1:64")
FULL = dict(channels=(32, 96, 256, 512, 1536), spatial=(7, 14, 28, 56, 112), kernels=(3, 5, 7, 9, 13, 31),
            strides=(1, 2))


def parse_shape(text: str) -> tuple[int, int, int, int, int, int]:
    """(channels, spatial size, kernel, stride, channels a group, output channels) of
    channels:spatial:kernel:stride[:per group[:output channels]]."""
    try:
        values = [int(v) for v in text.split(":")]
    except ValueError:
        values = []
    groups = values[0] // values[4] if len(values) >= 5 and min(values) >= 1 else 1
    if len(values) not in (4, 5, 6) or min(values) < 1 or (len(values) >= 5 and values[0] % values[4]) \
            or (len(values) == 6 and values[5] % groups):
        raise ValueError(f"shape {text!r}: expected channels:spatial:kernel:stride[:channels a group[:output "
                         f"channels]], positive whole numbers, the channels (in and out) a whole number of groups")
    c, hw, r, s, *rest = values
    per_group = rest[0] if rest else 1
    return c, hw, r, s, per_group, rest[1] if len(rest) == 2 else c


def make_problem(shape: str, direction: str, batch: int, dtype: str, layout: str) -> ConvProblem:
    c, hw, r, stride, per_group, k = parse_shape(shape)
    return ConvProblem(direction, n=batch, c=c, k=k, input_size=(hw, hw), kernel_size=r, stride=stride,
                       padding=0 if r <= stride else r // 2, groups=c // per_group, dtype=dtype, layout=layout,
                       device="cuda")


DEPTHWISE_FAMILIES = (TritonDepthwise, TritonDepthwiseBand, TritonDepthwiseStrip, TritonDepthwiseRows)
OUR_FAMILIES = (*DEPTHWISE_FAMILIES, TritonGrouped, TritonFolded)


def ours(algorithm, p: ConvProblem, families: tuple[str, ...] | None = None) -> bool:
    """Whether ``algorithm`` is one of convtune's own kernel families for ``p``'s kind (depthwise, grouped, or dense:
    a first layer's few channels), and one of ``families`` (their names, as ``depthwise_strip``; None: any)."""
    kinds = DEPTHWISE_FAMILIES if p.groups == p.c else (TritonFolded,) if p.groups == 1 else (TritonGrouped,)
    return (isinstance(algorithm, kinds) and (families is None or algorithm.family in families)
            and bool(algorithm.supports(p)))


def full_shapes() -> list[str]:
    return [f"{c}:{hw}:{r}:{s}" for c, hw, r, s in itertools.product(*FULL.values()) if r <= hw]


def sampled_shapes(per_kernel: int, seed: int = 0) -> list[str]:
    """``per_kernel`` shapes of the full grid for each of its kernels, drawn by ``seed``, taken kernel by kernel in
    turns (3, 5, 7, ... then again), so that a run cut short still holds every kernel: the grid's geometric means
    within a session's GPU time."""
    import random

    rng = random.Random(seed)
    drawn = []
    for kernel in FULL["kernels"]:
        pool = [s for s in full_shapes() if parse_shape(s)[2] == kernel]
        drawn.append(rng.sample(pool, min(per_kernel, len(pool))))
    return [shape for turn in itertools.zip_longest(*drawn) for shape in turn if shape]


def measure(p: ConvProblem, row: dict | None = None, families: tuple[str, ...] | None = None) -> dict:
    """The row of ``p``; given an earlier ``row``, only our kernels are measured again (cuDNN's and
    PyTorch's times do not depend on this code), only those of ``families`` if given (the others' times kept; a new
    row has every family's), and the row says at which revision each family was measured (``ours_revisions``)."""
    again = row is not None
    families = families if again else None  # a new row has every family's times (ours: the fastest of them all)
    inputs = p.random_inputs(seed=0)
    ref = reference(p, *inputs)
    row = dict(row or {}, problem=p.key, floor_ms=hardware.roofline_ms(p))
    timed_ours = {a.name: time_algorithm(p, a, inputs, ref) for a in registered() if ours(a, p, families)}
    old, now = row.get("ours") or {}, common.revision()
    earlier = row.get("ours_revisions") or {common.family_of(n): row.get("ours_revision") for n in old}

    def kept(times: dict) -> dict:  # an earlier row's entries of the families not measured now
        return {n: v for n, v in times.items() if families is not None and common.family_of(n) not in families}

    row["ours"] = {**kept(old), **{n: v[0] for n, v in timed_ours.items()}}
    row["ours_failures"] = {**kept(row.get("ours_failures") or {}),
                            **{n: v[2] for n, v in timed_ours.items() if v[2] != "ok"}}
    row["ours_revisions"] = {common.family_of(n): now if n in timed_ours else earlier.get(common.family_of(n))
                             for n in row["ours"]}
    timed = {n: v for n, v in row["ours"].items() if v is not None}
    row["ours_best"] = min(timed, key=timed.get) if timed else None
    row["ours_ms"] = timed.get(row["ours_best"]) if timed else None
    row["ours_revision"] = now if timed_ours else row.get("ours_revision")  # the latest of ours_revisions
    if again:
        return row
    from convtune.algorithms.cudnn import BACKEND

    t0 = time.perf_counter()
    plans = {a.name: time_algorithm(p, a, inputs, ref) for a in BACKEND.algorithms(p)}
    row["cudnn_wall_s"] = time.perf_counter() - t0
    cudnn_timed = {n: v[0] for n, v in plans.items() if v[0] is not None}
    row["cudnn_best"] = min(cudnn_timed, key=cudnn_timed.get) if cudnn_timed else None
    row["cudnn_ms"] = cudnn_timed.get(row["cudnn_best"]) if cudnn_timed else None
    return row


def torch_times(keys: list[str], benchmark_mode: bool) -> list[float]:
    torch.backends.cudnn.benchmark = benchmark_mode
    times = []
    for key in keys:
        p = ConvProblem.from_key(key)
        a, b = p.random_inputs(seed=0)
        def call(p=p, a=a, b=b):
            return native_conv(p, a, b)

        call()
        times.append(benchmark(call, device="cuda").median_ms)
    return times


def torch_in_subprocess(keys: list[str], benchmark_mode: bool) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        keys_path, out_path = Path(tmp) / "keys.json", Path(tmp) / "times.json"
        keys_path.write_text(json.dumps(keys))
        subprocess.run([sys.executable, __file__, "--torch-only", str(keys_path), "--benchmark-mode",
                        str(int(benchmark_mode)), "--torch-out", str(out_path)], check=True)
        return json.loads(out_path.read_text())


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


FAMILIES = ("strip", "band", "rows")  # the depthwise families the table shows apart, beside the best of them all


def family_ms(row: dict, family: str) -> float | None:
    """The fastest triton:depthwise_<family> configuration's time in ``row`` (None: none timed, or an older row)."""
    times = [v for n, v in (row.get("ours") or {}).items() if n.startswith(f"triton:depthwise_{family}_") and v]
    return min(times) if times else None


def markdown(env: dict, rows: dict) -> str:
    def fmt(v, digits=4):
        return "-" if v is None else f"{v:.{digits}f}"

    head = (f"# Depthwise and grouped convolutions: convtune's kernels against cuDNN and PyTorch\n\n"
            f"{common.env_line(env)}; ours: measured at the row's ours_revisions in the JSON (per family). Times in ms "
            f"(convtune.timing.benchmark, every result checked against "
            f"float64 first); a group: channels a group (1: depthwise); ours: the fastest configuration of the "
            f"depthwise families, or of triton:grouped, or (a dense first layer, channels in>out) of triton:folded; "
            f"strip, band, rows: the fastest of triton:depthwise_strip's (by "
            f"strips of a row), of triton:depthwise_band's (the tensor cores) and of triton:depthwise_rows' (the "
            f"weight gradient by input rows; '-' where the row predates the family or the family does not compute "
            f"it); cuDNN: the fastest of every "
            f"plan; floor: multiply-adds at the CUDA cores' float32 rate (depthwise) or the tensor cores' (grouped), "
            f"or compulsory bytes at bandwidth; speed-up: cuDNN's best / ours.\n\n")
    body = []
    groups: dict[tuple, list[float]] = {}
    alone: dict[str, dict[tuple, list[float]]] = {family: {} for family in FAMILIES}
    for r in rows.values():
        p = ConvProblem.from_key(r["problem"])
        speedup = ratio(r.get("cudnn_ms"), r.get("ours_ms"))
        theirs = {family: family_ms(r, family) for family in FAMILIES}
        channels = p.c if p.k == p.c else f"{p.c}>{p.k}"
        body.append([p.direction, p.dtype, p.n, channels, p.c // p.groups, f"{p.input_size[0]}", f"{p.kernel_size[0]}",
                     p.stride[0], fmt(r.get("ours_ms")), *(fmt(theirs[family]) for family in FAMILIES),
                     fmt(r.get("cudnn_ms")), fmt(r.get("torch_bench1_ms")),
                     fmt(r.get("torch_bench0_ms")), fmt(r["floor_ms"]), fmt(speedup, 2),
                     fmt(ratio(r.get("ours_ms"), r["floor_ms"]), 1), r.get("ours_best") or "-"])
        kernel = p.kernel_size[0]
        family = (("≥7" if kernel >= 7 else str(kernel)) if p.groups == p.c else f"first layer, {kernel}x{kernel}"
                  if p.groups == 1 else f"grouped, {p.c // p.groups} a group")
        if speedup:
            groups.setdefault((p.direction, family), []).append(speedup)
            for name, ms in theirs.items():
                if ms:
                    alone[name].setdefault((p.direction, family), []).append(r["cudnn_ms"] / ms)
    table = common.md_table(["direction", "dtype", "batch", "channels", "a group", "size", "kernel", "stride", "ours",
                             *FAMILIES, "cuDNN best", "torch bm1", "torch bm0", "floor", "speed-up", "ours / floor",
                             "our pick"], body)
    def mean(speedups: dict, key: tuple) -> str:
        return f"{common.geomean(speedups[key]):.2f} ({len(speedups[key])})" if key in speedups else "-"

    means = common.md_table(["direction", "kernel", "shapes", "geometric mean speed-up over cuDNN's best",
                             *(f"{family} alone (shapes)" for family in FAMILIES)],
                            [[d, f, len(v), f"{common.geomean(v):.2f}", *(mean(alone[n], (d, f)) for n in FAMILIES)]
                             for (d, f), v in sorted(groups.items())])
    return head + "## Geometric means\n\n" + means + "\n## Every shape\n\n" + table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", choices=("default", "full", "sample", "grouped", "first"), default="default",
                        help="sample: --per-kernel shapes of the full grid for each kernel, drawn by --seed")
    parser.add_argument("--per-kernel", type=int, default=4, help="with --sweep sample: shapes a kernel size")
    parser.add_argument("--seed", type=int, default=0, help="with --sweep sample: which shapes are drawn")
    parser.add_argument("--shape", action="append", default=[],
                        help="channels:spatial:kernel:stride[:channels a group[:output channels]] (repeatable)")
    parser.add_argument("--batch", type=lambda t: [int(v) for v in t.split(",")], default=[32])
    parser.add_argument("--dtype", type=lambda t: t.split(","), default=["float16"])
    parser.add_argument("--layout", default="channels_last")
    parser.add_argument("--directions", type=lambda t: t.split(","), default=list(DIRECTIONS))
    parser.add_argument("--missing", action="store_true", help="only rows the results file lacks (rows measured "
                        "again replace theirs; the others are kept)")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch's own timings")
    parser.add_argument("--ours-again", action="store_true", help="measure only our kernels again in the rows the "
                        "results file has (cuDNN's and PyTorch's times kept)")
    common.result_arguments(parser, "depthwise")
    parser.add_argument("--families", type=lambda t: tuple(t.split(",")), default=None,
                        help="with --ours-again, only these of convtune's families (comma-separated: "
                        + ",".join(f.family for f in OUR_FAMILIES) + "), the others' times kept")
    parser.add_argument("--torch-only")
    parser.add_argument("--benchmark-mode", type=int, default=0)
    parser.add_argument("--torch-out")
    args = parser.parse_args()
    if args.torch_only:
        keys = json.loads(Path(args.torch_only).read_text())
        Path(args.torch_out).write_text(json.dumps(torch_times(keys, bool(args.benchmark_mode))))
        return
    if args.per_kernel < 1:
        parser.error(f"--per-kernel {args.per_kernel}: draw at least 1 shape a kernel size")
    shapes = args.shape or {"full": full_shapes, "grouped": lambda: list(GROUPED_SHAPES),
                            "first": lambda: list(FIRST_SHAPES),
                            "sample": lambda: sampled_shapes(args.per_kernel, args.seed)}.get(
        args.sweep, lambda: list(DEFAULT_SHAPES))()
    unknown = sorted(set(args.families or ()) - {f.family for f in OUR_FAMILIES})
    if args.families and not args.ours_again:
        parser.error("--families needs --ours-again: a row measured anew has every family's times (a row the "
                     "results file lacks is, with --ours-again too)")
    if unknown:
        parser.error(f"--families {','.join(unknown)}: each must be one of "
                     f"{','.join(f.family for f in OUR_FAMILIES)}")
    for shape in shapes:
        try:
            parse_shape(shape)
        except ValueError as exc:
            parser.error(str(exc))
    out_dir = Path(args.out or common.RESULTS)
    json_path = out_dir / f"{args.name}.json"
    env = common.environment()
    payload = common.extendable(json_path, env, args.name)  # rows measured now replace theirs
    payload["environment"] = env
    rows = payload.setdefault("rows", {})
    for shape, batch, dtype, direction in itertools.product(shapes, args.batch, args.dtype, args.directions):
        p = make_problem(shape, direction, batch, dtype, args.layout)
        if p.key in rows and args.missing:
            continue
        rows[p.key] = measure(p, rows.get(p.key) if args.ours_again else None, args.families)
        r = rows[p.key]
        print(f"{p.key}: ours {r['ours_ms']} ({r['ours_best']}) cuDNN {r['cudnn_ms']} floor {r['floor_ms']:.4f}",
              file=sys.stderr, flush=True)
        common.write(args.name, payload, markdown(env, rows), out_dir)  # a cut run keeps what it measured
    if not args.no_torch:
        keys = [k for k, r in rows.items() if "torch_bench1_ms" not in r]
        for mode in (0, 1):
            for key, ms in zip(keys, torch_in_subprocess(keys, bool(mode))):
                rows[key][f"torch_bench{mode}_ms"] = ms
        common.write(args.name, payload, markdown(env, rows), out_dir)
    print(markdown(env, rows))


if __name__ == "__main__":
    main()
