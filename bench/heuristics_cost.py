"""What asking cuDNN's heuristics costs the host, per new problem and mode.

``get`` ranks a problem's cuDNN execution plans in the order cuDNN's heuristics A list them (then FALLBACK's);
on held-out networks heuristics B's first plan is the better pick (``bench/learned_get.py``). Whether ``get``
can afford to ask B depends on what that costs: per problem of the networks named, the host time of building
the problem's cuDNN graph and its list of plans under each set of modes (``ProblemGraph``: validate, build the
operation graph, create the plans; no plan is built), in a fresh graph each time. Before any is timed, one graph
under every mode makes cuDNN's handle and loads what each mode needs; the first timed query of each set is still
reported apart. A problem a set of modes offers nothing for is counted, not timed. Then whether a graph asked for
A's plans and another asked for FALLBACK's list together (A's, then FALLBACK's not among them) what one asked for
both lists (``separate``: what asking A alone for ``get`` and a second graph of FALLBACK's for ``find`` needs; a graph
asked for FALLBACK's after A's plans raised on all 207 problems of 2026-12-06's run, in git history). Needs a GPU and
the cuDNN frontend.

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

MODES = (("A", "FALLBACK"), ("A",), ("FALLBACK",), ("B",), ("B", "FALLBACK"))  # get's today first


def timed_graphs(problems: list, modes: tuple[str, ...], make_graph) -> dict:
    """Per set of ``modes``, over ``problems`` (three or more): the first graph's ms, the others' median, 90th
    percentile and worst, the median count of plans listed, and how many problems got no plan list
    (``make_graph(problem, modes)`` raised)."""
    times, counts, refused = [], [], 0
    for problem in problems:
        start = time.perf_counter()
        try:
            graph = make_graph(problem, modes)
        except Exception:  # noqa: BLE001 - the frontend raises several types for "no plan offered"
            refused += 1
            continue
        times.append(1e3 * (time.perf_counter() - start))
        counts.append(len(graph.names))
    if len(times) < 3:
        return dict(problems=len(problems), refused=refused)
    rest = times[1:]
    return dict(problems=len(problems), refused=refused, first_ms=times[0], median_ms=statistics.median(rest),
                p90_ms=statistics.quantiles(rest, n=10, method="inclusive")[-1], max_ms=max(rest),
                plans_median=statistics.median(counts))


def separate(problems: list, first: tuple[str, ...], second: tuple[str, ...], make_graph) -> dict:
    """Whether a graph of ``first``'s plans and one of ``second``'s list, together, what a graph of both lists: per
    problem, the names of ``make_graph(problem, first)``, then those of ``make_graph(problem, second)`` not among them,
    against ``make_graph(problem, first + second)``'s: how many problems list the same names in the same order, the
    same set in another order, and (else) how many names each way lacks in all; problems where a graph failed are
    counted apart."""
    same, reordered, failed, only_joined, only_separate = 0, 0, 0, 0, 0
    for problem in problems:
        try:
            names = list(make_graph(problem, first).names)
            names += [n for n in make_graph(problem, second).names if n not in names]
            whole = list(make_graph(problem, first + second).names)
        except Exception:  # noqa: BLE001 - the frontend raises several types
            failed += 1
            continue
        same += names == whole
        reordered += names != whole and sorted(names) == sorted(whole)
        only_joined += len(set(whole) - set(names))
        only_separate += len(set(names) - set(whole))
    return dict(problems=len(problems), failed=failed, same=same, same_set_other_order=reordered,
                names_only_in_the_joined_graph=only_joined, names_only_in_the_separate_graphs=only_separate)


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
        from convtune.algorithms.cudnn import ProblemGraph
    except ImportError as exc:
        parser.error(f"the cuDNN frontend does not load ({exc}): pip install nvidia-cudnn-frontend")
    problems = list(dict.fromkeys(p for _, p in network_problems(args.networks, args.batch, args.dtypes,
                                                                   ["channels_last"], "cuda")))
    if len(problems) < 3:
        parser.error(f"{','.join(args.networks)} has {len(problems)} distinct problems: name networks with 3 or more")
    for mode in {m for modes in MODES for m in modes}:  # cuDNN's handle, and what each mode loads, made untimed
        timed_graphs(problems[:1], (mode,), ProblemGraph)
    results = {}
    for modes in MODES:
        results["+".join(modes)] = timed_graphs(problems, modes, ProblemGraph)
        print("+".join(modes), results["+".join(modes)], file=sys.stderr, flush=True)
    env = common.environment()

    def cell(r: dict, key: str, form: str = ".2f") -> str:
        return format(r[key], form) if key in r else "-"

    def report(apart: dict) -> str:
        rows = [[name, r["problems"], r["refused"], cell(r, "first_ms"), cell(r, "median_ms"), cell(r, "p90_ms"),
                 cell(r, "max_ms"), cell(r, "plans_median", "g")] for name, r in results.items()]
        markdown = (f"# What asking cuDNN's heuristics costs the host\n\n{common.env_line(env)}. The layers of "
                    f"{', '.join(args.networks)} (batch {args.batch}, {', '.join(args.dtypes)}, channels_last, every "
                    f"direction; each distinct problem once): per set of heuristics modes, the host time of a new "
                    f"problem's cuDNN graph and its list of plans (`ProblemGraph`; no plan built), ms. "
                    f"`bench/heuristics_cost.py`.\n\n"
                    + common.md_table(["modes", "problems", "no plan offered", "first timed", "median",
                                       "90th percentile", "worst", "plans listed (median)"], rows))
        markdown += (f"\n\nA graph asked for A's plans and another for FALLBACK's (`separate`; A's names, then "
                     f"FALLBACK's not among them): of {apart['problems']} problems, {apart['same']} list the plans of "
                     f"a graph asked for both in the same order, {apart['same_set_other_order']} the same plans in "
                     f"another order; in all, {apart['names_only_in_the_joined_graph']} names only the joined graph "
                     f"lists and {apart['names_only_in_the_separate_graphs']} only the separate ones; "
                     f"{apart['failed']} problems failed.\n")
        common.write(args.name, {"environment": env, "networks": args.networks, "batch": args.batch,
                                 "results": results, "separate": apart}, markdown, args.out)
        return markdown

    apart = separate(problems, ("A",), ("FALLBACK",), ProblemGraph)
    print("A and FALLBACK apart", apart, file=sys.stderr, flush=True)
    print(report(apart))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
