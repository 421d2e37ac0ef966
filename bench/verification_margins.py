"""How close correct algorithms come to what ``find`` refuses: the element bound and the allocation check.

For every registered algorithm that supports each problem of a small set (plain, depthwise,
grouped, 1x1, strided, 5x5) in every direction, dtype and layout on the device: one run checked
against the float64 reference (``verify.errors``), the relative error over the tolerance and the
worst element over the element bound (``settings.element_factor`` x the tolerance; 1.0 is where
``find`` refuses it), and the bytes a further run allocates beyond the algorithm's declared
workspace (``verify.peak_allocated_bytes``) against what ``find`` allows there. On CUDA every cuDNN
plan is one of the algorithms: this is the calibration of both checks on a GPU.

    python bench/verification_margins.py --device cpu

writes bench/results/verification_margins_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from convtune import ConvProblem  # noqa: E402
from convtune.algorithms.base import allocate_workspace  # noqa: E402
from convtune.algorithms.registry import algorithms  # noqa: E402
from convtune.find import ALLOCATION_SLACK_BYTES  # noqa: E402
from convtune.ranking import NATIVE  # noqa: E402
from convtune.units import format_bytes  # noqa: E402
from convtune.verify import element_bound, errors, peak_allocated_bytes, reference_case, tolerance  # noqa: E402

# (c, k, size, kernel, stride, groups, n): a 3x3, a depthwise 3x3, a 1x1, a grouped strided 5x5, a strided 1x1,
# and a 3x3 with many input channels (the longest sums).
SHAPES = [(16, 32, 12, 3, 1, 1, 2), (32, 32, 9, 3, 1, 32, 2), (64, 64, 8, 1, 1, 1, 4), (24, 48, 11, 5, 2, 2, 2),
          (64, 64, 16, 1, 2, 1, 2), (256, 64, 6, 3, 1, 1, 2)]


def measure(device: str, dtypes: list[str]) -> list[dict]:
    rows = []
    for dtype, layout, direction in itertools.product(dtypes, ("channels_first", "channels_last"),
                                                      ("fwd", "bwd_data", "bwd_filter")):
        # float32 on CUDA with and without TF32 (its default on, and where elements err the most)
        tf32 = (False, True) if dtype == "float32" and device == "cuda" else (False,)
        for (c, k, size, kernel, stride, groups, n), allow_tf32 in itertools.product(SHAPES, tf32):
            p = ConvProblem(direction, n=n, c=c, k=k, input_size=(size, size), kernel_size=kernel, stride=stride,
                            padding=kernel // 2, groups=groups, dtype=dtype, layout=layout, device=device,
                            allow_tf32=allow_tf32)
            (a, b), ref = reference_case(p)
            operands = p.min_bytes
            for algo in algorithms(p):
                try:
                    if not algo.supports(p):
                        continue
                    ws = allocate_workspace(algo.buffer_bytes(p), device)
                    out = p.empty(p.operand_shapes[2])
                    algo.run(p, a, b, workspace=ws, out=out)
                    rel, worst = errors(out, ref)
                    extra = peak_allocated_bytes(lambda: algo.run(p, a, b, workspace=ws, out=out), device)
                    declared = algo.workspace_bytes(p)
                except Exception as exc:  # noqa: BLE001  # a plan that does not build here: reported, not measured
                    rows.append(dict(problem=p.key, algorithm=algo.name, error=f"{type(exc).__name__}: {exc}"[:200]))
                    continue
                tol = tolerance(p, algo.notes(p))
                rows.append(dict(problem=p.key, algorithm=algo.name, rel_over_tolerance=rel / tol,
                                 worst_over_bound=worst / element_bound(tol),
                                 allocated=extra, declared=declared,
                                 allocated_over_allowed=(None if algo.name == NATIVE else
                                                         (extra - declared) / (operands + ALLOCATION_SLACK_BYTES))))
    return rows


def report(payload: dict) -> str:
    rows = [r for r in payload["rows"] if "error" not in r]
    env = payload["environment"]
    md = [f"# Verification margins\n\n{common.env_line(env)}. {len(rows)} runs of {len({r['algorithm'] for r in rows})} algorithms "
          f"({len(payload['rows']) - len(rows)} plans not built); 1.00 is where `find` refuses a candidate.\n"]
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
                               "worst element / element bound (max)", "allocated beyond declared / allowed (max)",
                               "allocated beyond declared (max)"], table))
    return "\n".join(md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default=None, help="comma-separated (default: float32,float16,bfloat16)")
    common.result_arguments(parser, "verification_margins")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",") if args.dtypes else ["float32", "float16", "bfloat16"]
    payload = {"environment": common.environment(), "device": args.device, "rows": measure(args.device, dtypes)}
    md = report(payload)
    common.write(f"{args.name}_{args.device}", payload, md, Path(args.out) if args.out else None)
    print(md)


if __name__ == "__main__":
    main()
