"""What asking cuDNN's heuristics costs the host, per new problem and mode.

``get`` ranks a problem's cuDNN execution plans in the order cuDNN's heuristics A list them (then FALLBACK's);
on held-out networks heuristics B's first plan is the better pick (``bench/learned_get.py``). Whether ``get``
can afford to ask B depends on what that costs: per problem of the networks named, the host time of building
the problem's cuDNN graph and its list of plans under each set of modes (``ProblemGraph``: validate, build the
operation graph, create the plans; no plan is built), in a fresh graph each time. Before any is timed, one graph
under every mode makes cuDNN's handle and loads what each mode needs; the first timed query of each set is still
reported apart. A problem a set of modes offers nothing for is counted, not timed. Then whether a graph asked for
A's plans gives, asked for FALLBACK's afterwards, the plans of one asked for both (``added_later``: what asking A
alone for ``get`` and adding FALLBACK's for ``find`` needs), and what that second query costs. Needs a GPU and the
cuDNN frontend.

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


def added_later(problems: list, first: tuple[str, ...], later: tuple[str, ...], make_graph, add) -> dict:
    """Whether a graph asked for ``first``'s plans can be asked for ``later``'s afterwards (``get`` could then ask A
    alone and ``find`` add FALLBACK's): per problem, a graph of ``first`` (``make_graph(problem, first)``), then
    ``add(graph, later)``, which asks it again and returns its plans' names; against a graph of both at once. The
    second query's ms (median, worst), and how many problems' names then match that graph's: the same list in the
    same order, or the same set in another order; problems where either graph or the second query failed are
    counted apart."""
    times, same, reordered, failed = [], 0, 0, 0
    for problem in problems:
        try:
            graph, whole = make_graph(problem, first), make_graph(problem, first + later)
            start = time.perf_counter()
            names = add(graph, later)
        except Exception:  # noqa: BLE001 - the frontend raises several types
            failed += 1
            continue
        times.append(1e3 * (time.perf_counter() - start))
        same += names == whole.names
        reordered += names != whole.names and sorted(names) == sorted(whole.names)
    out = dict(problems=len(problems), failed=failed, same=same, same_set_other_order=reordered)
    if times:
        out.update(median_ms=statistics.median(times), max_ms=max(times))
    return out


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
    from convtune.algorithms.cudnn import HEURISTICS

    def add_modes(graph, modes: tuple[str, ...]) -> list[str]:
        g = graph.graph
        g.create_execution_plans([HEURISTICS[m] for m in modes])
        return [g.get_plan_name_at_index(i) for i in range(g.get_execution_plan_count())]

    env = common.environment()

    def cell(r: dict, key: str, form: str = ".2f") -> str:
        return format(r[key], form) if key in r else "-"

    def report(later: dict | None) -> str:
        rows = [[name, r["problems"], r["refused"], cell(r, "first_ms"), cell(r, "median_ms"), cell(r, "p90_ms"),
                 cell(r, "max_ms"), cell(r, "plans_median", "g")] for name, r in results.items()]
        markdown = (f"# What asking cuDNN's heuristics costs the host\n\n{common.env_line(env)}. The layers of "
                    f"{', '.join(args.networks)} (batch {args.batch}, {', '.join(args.dtypes)}, channels_last, every "
                    f"direction; each distinct problem once): per set of heuristics modes, the host time of a new "
                    f"problem's cuDNN graph and its list of plans (`ProblemGraph`; no plan built), ms. "
                    f"`bench/heuristics_cost.py`.\n\n"
                    + common.md_table(["modes", "problems", "no plan offered", "first timed", "median",
                                       "90th percentile", "worst", "plans listed (median)"], rows))
        if later is not None:
            markdown += (f"\n\nA graph asked for A's plans, then for FALLBACK's (`added_later`): of "
                         f"{later['problems']} problems, {later['same']} list then the plans of a graph asked for both "
                         f"at once in the same order, {later['same_set_other_order']} the same plans in another order; "
                         f"{later['failed']} failed; the second query took {cell(later, 'median_ms')} ms (median), "
                         f"{cell(later, 'max_ms')} at worst.\n")
        common.write(args.name, {"environment": env, "networks": args.networks, "batch": args.batch,
                                 "results": results, "added_later": later}, markdown, args.out)
        return markdown

    report(None)  # written before asking a graph twice, which the frontend may not survive
    later = added_later(problems, ("A",), ("FALLBACK",), ProblemGraph, add_modes)
    print("A, then FALLBACK", later, file=sys.stderr, flush=True)
    print(report(later))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
