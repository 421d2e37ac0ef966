"""What asking cuDNN's heuristics costs the host, per new problem and mode.

``get`` ranks a problem's cuDNN execution plans in the order cuDNN's heuristics A list them (then FALLBACK's);
on held-out networks heuristics B's first plan is the better pick (``bench/learned_get.py``). Whether ``get``
can afford to ask B depends on what that costs: per problem of the networks named, the host time of building
the problem's cuDNN graph and its list of plans under each set of modes (``ProblemGraph``: validate, build the
operation graph, create the plans; no plan is built), in a fresh graph each time. The first query of each mode
in the process is reported apart (it loads what the mode needs). Needs a GPU and the cuDNN frontend.

    python bench/heuristics_cost.py --networks resnet50,mobilenet_v2,resnext50_32x4d --batch 32

Results: bench/results/heuristics_cost.json and .md (or --out, --name).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import e2e  # noqa: E402
from sweep import network_problems  # noqa: E402

MODES = (("A", "FALLBACK"), ("A",), ("B",), ("B", "FALLBACK"))  # get's today first


def timed_graphs(problems: list, modes: tuple[str, ...]) -> tuple[float, list[float], list[int]]:
    """(ms of the first graph, ms of each other one, how many plans each lists) for ``problems`` under ``modes``."""
    from convtune.algorithms.cudnn import ProblemGraph

    times, counts = [], []
    for problem in problems:
        start = time.perf_counter()
        graph = ProblemGraph(problem, modes=modes)
        times.append(1e3 * (time.perf_counter() - start))
        counts.append(len(graph.names))
    return times[0], times[1:], counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--networks", type=e2e.split, default=["resnet50", "mobilenet_v2", "resnext50_32x4d"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtypes", type=e2e.split, default=["float16"])
    common.result_arguments(parser, "heuristics_cost")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        parser.error("cuDNN's heuristics need a GPU: run this on one (bench/gpu_checks.sh heuristics)")
    try:
        import convtune.algorithms.cudnn  # noqa: F401
    except ImportError as exc:
        parser.error(f"the cuDNN frontend does not load ({exc}): pip install nvidia-cudnn-frontend")
    problems = list(dict.fromkeys(p for _, p in network_problems(args.networks, args.batch, args.dtypes,
                                                                   ["channels_last"], "cuda")))
    results = {}
    for modes in MODES:
        first, rest, counts = timed_graphs(problems, modes)
        results["+".join(modes)] = dict(first_ms=first, median_ms=statistics.median(rest),
                                        p90_ms=statistics.quantiles(rest, n=10)[-1], max_ms=max(rest),
                                        plans_median=statistics.median(counts), problems=len(problems))
        print("+".join(modes), {k: round(v, 3) for k, v in results["+".join(modes)].items()}, file=sys.stderr,
              flush=True)
    env = common.environment()
    rows = [[name, r["problems"], f"{r['first_ms']:.2f}", f"{r['median_ms']:.2f}", f"{r['p90_ms']:.2f}",
             f"{r['max_ms']:.2f}", f"{r['plans_median']:g}"] for name, r in results.items()]
    markdown = (f"# What asking cuDNN's heuristics costs the host\n\n{common.env_line(env)}. The layers of "
                f"{', '.join(args.networks)} (batch {args.batch}, {', '.join(args.dtypes)}, channels_last, every "
                f"direction; each distinct problem once): per set of heuristics modes, the host time of a new "
                f"problem's cuDNN graph and its list of plans (`ProblemGraph`; no plan built), ms. "
                f"`bench/heuristics_cost.py`.\n\n"
                + common.md_table(["modes", "problems", "first in the process", "median", "90th percentile", "worst",
                                   "plans listed (median)"], rows))
    common.write(args.name, {"environment": env, "networks": args.networks, "batch": args.batch,
                             "results": results}, markdown, args.out)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
