"""How close correct algorithms come to what ``find`` refuses: the element bound and the allocation check.

For every registered algorithm that supports each problem of a small set (plain, depthwise,
grouped, 1x1, strided, 5x5) in every direction, dtype and layout on the device: one run checked
against the float64 reference (``verify.errors``), the relative error over the tolerance and the
worst element over the element bound (``settings.element_factor`` x the tolerance; 1.0 is where
``find`` refuses it), and the bytes a further run allocates beyond the algorithm's declared
workspace (``verify.peak_allocated_bytes``) against what ``find`` allows there. On CUDA every cuDNN
plan is one of the algorithms: this is the calibration of both checks on a GPU.

    python bench/verification_margins.py --device cpu
    python bench/verification_margins.py --device cuda --network resnet50 --batch 8 --dtypes float16,bfloat16

writes bench/results/verification_margins_<device>[_<network>_b<batch>].json and .md. With ``--network``, the
problems are a built-in network's, at real sizes: the worst element of far more elements.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from convtune import ConvProblem, zoo  # noqa: E402
from convtune.algorithms.base import allocate_workspace  # noqa: E402
from convtune.algorithms.registry import algorithms  # noqa: E402
from convtune.measure import ALLOCATION_SLACK_BYTES  # noqa: E402
from convtune.ranking import NATIVE  # noqa: E402
from convtune.settings import settings  # noqa: E402
from convtune.units import format_bytes  # noqa: E402
from convtune.verify import errors, peak_allocated_bytes, reference_case, tolerance  # noqa: E402

# (c, k, size, kernel, stride, groups, n): a 3x3, a depthwise 3x3, a 1x1, a grouped strided 5x5, a strided 1x1,
# and a 3x3 with many input channels (the longest sums).
SHAPES = [(16, 32, 12, 3, 1, 1, 2), (32, 32, 9, 3, 1, 32, 2), (64, 64, 8, 1, 1, 1, 4), (24, 48, 11, 5, 2, 2, 2),
          (64, 64, 16, 1, 2, 1, 2), (256, 64, 6, 3, 1, 1, 2)]


def small_problems(device: str, dtypes: list[str]) -> list[ConvProblem]:
    """SHAPES in every direction, dtype and layout (float32 on CUDA with and without TF32: its default is on, and
    there elements err the most)."""
    problems = []
    for dtype, layout, direction in itertools.product(dtypes, ("channels_first", "channels_last"),
                                                      ("fwd", "bwd_data", "bwd_filter")):
        tf32 = (False, True) if dtype == "float32" and device == "cuda" else (False,)
        for (c, k, size, kernel, stride, groups, n), allow_tf32 in itertools.product(SHAPES, tf32):
            problems.append(ConvProblem(direction, n=n, c=c, k=k, input_size=(size, size), kernel_size=kernel,
                                        stride=stride, padding=kernel // 2, groups=groups, dtype=dtype, layout=layout,
                                        device=device, allow_tf32=allow_tf32))
    return problems


def network_problems(network: str, batch: int, device: str, dtypes: list[str]) -> list[ConvProblem]:
    """Every distinct problem of ``network``'s layers at ``batch`` in the three directions (channels_last): real
    sizes, whose outputs are far larger than SHAPES' (the worst of more elements)."""
    problems = []
    for dtype in dtypes:
        layers = zoo.network_layers(network, batch, dtype=dtype, layout="channels_last", device=device)
        problems += [layer.problem.with_direction(d) for layer in layers for d in ("fwd", "bwd_data", "bwd_filter")]
    return list(dict.fromkeys(problems))


def measure(problems: list[ConvProblem], minutes: float | None = None) -> tuple[list[dict], int]:
    """Rows of every algorithm on ``problems``, and how many problems were measured: with ``minutes``, none is
    started after that long."""
    rows = []
    started = time.monotonic()
    measured = 0
    for p in problems:
        if minutes is not None and time.monotonic() - started >= minutes * 60:
            break
        measured += 1
        (a, b), ref = reference_case(p)
        operands = p.min_bytes
        for algo in algorithms(p):
            try:
                if not algo.supports(p):
                    continue
                ws = allocate_workspace(algo.buffer_bytes(p), p.device)
                out = p.empty(p.operand_shapes[2])
                algo.run(p, a, b, workspace=ws, out=out)
                rel, worst = errors(out, ref)
                extra = peak_allocated_bytes(
                    lambda algo=algo, p=p, a=a, b=b, ws=ws, out=out: algo.run(p, a, b, workspace=ws, out=out), p.device)
                declared = algo.workspace_bytes(p)
            except Exception as exc:  # noqa: BLE001  # a plan that does not build here: reported, not measured
                rows.append(dict(problem=p.key, algorithm=algo.name, error=f"{type(exc).__name__}: {exc}"[:200]))
                continue
            tol = tolerance(p, algo.notes(p))
            rows.append(dict(problem=p.key, algorithm=algo.name, rel_over_tolerance=rel / tol,
                             worst_over_tolerance=worst / tol,
                             allocated=extra, declared=declared,
                             allocated_over_allowed=(None if algo.name == NATIVE else
                                                     (extra - declared) / (operands + ALLOCATION_SLACK_BYTES))))
    return rows, measured


def report(payload: dict) -> str:
    # The element bound's figures by the element_factor in force (rows keep the factor-free worst / tolerance)
    rows = [{**r, "worst_over_bound": r["worst_over_tolerance"] / settings.element_factor if settings.element_factor
             else 0.0} for r in payload["rows"] if "error" not in r]
    env = payload["environment"]
    where = (f"the training-step problems of {payload['network']} at batch {payload['batch']}, channels_last"
             if payload.get("network") else "a small set of problems in every direction and layout")
    measured = (f" ({payload['problems_measured']} of {payload['problems']} problems measured in the time given)"
                if payload.get("problems_measured", payload.get("problems")) != payload.get("problems") else "")
    md = [f"# Verification margins\n\n{common.env_line(env)}; {where}{measured}: {len(rows)} runs of "
          f"{len({r['algorithm'] for r in rows})} algorithms ({len(payload['rows']) - len(rows)} plans not built); "
          "1.00 is where `find` refuses a candidate.\n"]
    by_algo: dict[str, list[dict]] = {}
    for r in rows:
        by_algo.setdefault(r["algorithm"].split("_k")[0] if r["algorithm"].startswith("cudnn:") else r["algorithm"],
                           []).append(r)
    table = []
    for name, rs in sorted(by_algo.items(), key=lambda kv: -max(r["worst_over_bound"] for r in kv[1])):
        alloc = [r["allocated_over_allowed"] for r in rs if r["allocated_over_allowed"] is not None]
        table.append([name, len(rs), f"{max(r['rel_over_tolerance'] for r in rs):.3f}",
                      f"{max(r['worst_over_bound'] for r in rs):.3f}", f"{max(alloc):.3f}" if alloc else "-",
                      format_bytes(max(r["allocated"] - r["declared"] for r in rs)) if rs else "-"])
    md.append(common.md_table(["algorithm (cuDNN: by engine)", "runs", "relative error / tolerance (max)",
                               f"worst element / element bound at element_factor {settings.element_factor:g} (max, "
                               "runs over the tolerance too)", "allocated beyond declared / allowed (max)",
                               "allocated beyond declared (max)"], table))
    md.append(f"\n## The element bound by dtype\n\nOf the runs within the norm-wise tolerance (the element bound "
              "judges only those), the worst element error in tolerances (|result_i - ref_i| / (tolerance x (|ref_i| + "
              f"rms(ref)))), against the bound's `element_factor` ({settings.element_factor:g}); a zeroed element "
              "passes only where |ref_i| is under factor x tolerance / (1 - factor x tolerance) of the reference's "
              "RMS.\n")
    by_dtype: dict[str, list[dict]] = {}
    for r in rows:
        if r["rel_over_tolerance"] <= 1:
            by_dtype.setdefault(_dtype_of(r["problem"]), []).append(r)
    dtable = []
    for dtype, rs in sorted(by_dtype.items()):
        worst = max(rs, key=lambda r: r.get("worst_over_tolerance", r["worst_over_bound"] * settings.element_factor))
        w = worst.get("worst_over_tolerance", worst["worst_over_bound"] * settings.element_factor)
        dtable.append([dtype, len(rs), f"{w:.3f}", worst["algorithm"], worst["problem"],
                       f"{settings.element_factor / w:.1f}x" if w > 0 else "-"])
    md.append(common.md_table(["dtype", "runs", "worst element / tolerance (max)", "by", "on",
                               "element_factor / that"], dtable))
    return "\n".join(md)


def _dtype_of(key: str) -> str:
    """'float16', 'float32 tf32', ... from a problem key."""
    fields = key.split("|")
    dtype = next(f for f in fields if f in ("float32", "float16", "bfloat16", "float64"))
    return dtype + (" tf32" if dtype == "float32" and "tf32=1" in fields and "cuda" in fields else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default=None, help="comma-separated (default: float32,float16,bfloat16)")
    parser.add_argument("--network", default=None, help="a built-in network's layers (its training step's problems, "
                                                        "channels_last) instead of the small set")
    parser.add_argument("--batch", type=int, default=8, help="the network's batch (default 8)")
    parser.add_argument("--minutes", type=float, default=None, help="start no problem after this long (the report "
                                                                    "says how many were measured)")
    parser.add_argument("--report", metavar="JSON", default=None, help="write the markdown of a results file again "
                                                                       "(by the element_factor in force), measure "
                                                                       "nothing")
    common.result_arguments(parser, "verification_margins")
    args = parser.parse_args()
    if args.report:
        path = Path(args.report)
        path.with_suffix(".md").write_text(report(json.loads(path.read_text())))
        print(f"wrote {path.with_suffix('.md')}")
        return
    dtypes = args.dtypes.split(",") if args.dtypes else ["float32", "float16", "bfloat16"]
    problems = (network_problems(args.network, args.batch, args.device, dtypes) if args.network else
                small_problems(args.device, dtypes))
    rows, measured = measure(problems, args.minutes)
    payload = {"environment": common.environment(), "device": args.device, "network": args.network,
               "batch": args.batch if args.network else None, "problems": len(problems),
               "problems_measured": measured, "rows": rows}
    md = report(payload)
    name = f"{args.name}_{args.device}" + (f"_{args.network}_b{args.batch}" if args.network else "")
    common.write(name, payload, md, Path(args.out) if args.out else None)
    print(md)


if __name__ == "__main__":
    main()
