"""Network workspace budgets: plan time against per-layer caps and against no budget.

For every layer of a network (tuned through one tuning database, so each layer is measured once),
and for each budget B:
- shared plan: layers run one after another and share one buffer of B (= each layer capped at B);
- divided plan: concurrent streams share B in total (an exact knapsack over the Pareto fronts);
- even per-layer cap: each of the L layer runs gets B / L, the naive way to divide B;
- unconstrained: each layer's fastest result.
Times are the sums of the measured times of the chosen results (weighted by how often each layer
runs). The committed configuration:

    python bench/plan_budgets.py --network resnet50 --batch 128 --dtype float16 --layout NHWC --device cuda

writes bench/results/plan_budgets.json and .md (date, device and versions inside).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import convtune as ct  # noqa: E402
from convtune.plan import InfeasibleBudgetError, pareto_front  # noqa: E402
from convtune.units import format_bytes, parse_bytes  # noqa: E402

BUDGETS = ("0", "1MiB", "16MiB", "256MiB", "unlimited")


def total_or_inf(problems, budget, mode, db) -> tuple[float, int | None]:
    try:
        p = ct.plan(problems, budget, mode=mode, db=db)
        return p.total_time_ms, p.workspace_bytes
    except InfeasibleBudgetError:
        return math.inf, None


def even_cap_total(problems, budget, db) -> float:
    """Each of the layer runs gets budget / runs: the fastest result under that cap, summed."""
    if budget is None:
        cap = None
    else:
        cap = budget // len(problems)
    total = 0.0
    for problem in problems:
        front = pareto_front(db.results(problem))
        fitting = [r for r in front if cap is None or r.workspace_bytes <= cap]
        if not fitting:
            return math.inf
        total += min(r.time_ms for r in fitting)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.network_arguments(parser)
    parser.add_argument("--direction", default="fwd")
    parser.add_argument("--layers", type=int, default=None, help="only the first N layers (quick checks)")
    parser.add_argument("--budgets", default=",".join(BUDGETS))
    common.result_arguments(parser, "plan_budgets")
    args = parser.parse_args()
    layers = ct.zoo.network_layers(args.network, args.batch, direction=args.direction, dtype=args.dtype,
                                   layout=args.layout, device=args.device)[: args.layers]
    problems = [layer.problem for layer in layers for _ in range(layer.count)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ct.TuningDB(os.path.join(tmp, "plan.sqlite")) as db:
        for layer in layers:  # every layer measured once, with no workspace limit: the whole front
            ct.find(layer.problem, db=db)
        for text in args.budgets.split(","):
            budget = None if text == "unlimited" else parse_bytes(text, "--budgets")
            shared, shared_ws = total_or_inf(problems, budget, "shared", db)
            divided, divided_ws = total_or_inf(problems, budget, "divided", db)
            rows.append(dict(budget=text, budget_bytes=budget, shared_ms=shared, shared_workspace_bytes=shared_ws,
                             divided_ms=divided, divided_workspace_bytes=divided_ws,
                             even_cap_ms=even_cap_total(problems, budget, db)))
        unconstrained = total_or_inf(problems, None, "shared", db)[0]
    env = common.environment()
    config = f"{args.network} b{args.batch} {args.dtype} {args.layout} {args.direction} on {args.device}"
    payload = dict(environment=env, config=config, layers=len(layers), runs=len(problems),
                   unconstrained_ms=unconstrained, rows=rows)

    def ms(v):
        return "infeasible" if not math.isfinite(v) else f"{v:.3f}"

    table = common.md_table(
        ["budget", "shared plan ms (= per-layer cap B)", "divided plan ms (sum <= B)", "even cap B/L ms",
         "divided workspace", "vs unconstrained (divided)"],
        [[r["budget"], ms(r["shared_ms"]), ms(r["divided_ms"]), ms(r["even_cap_ms"]),
          format_bytes(r["divided_workspace_bytes"]),
          "-" if not math.isfinite(r["divided_ms"]) else f"{r['divided_ms'] / unconstrained:.3f}x"] for r in rows])
    text = (f"# Network workspace budgets\n\n{common.env_line(env)}. {config}: {len(layers)} layers, "
            f"{len(problems)} runs; unconstrained {unconstrained:.3f} ms (sum of measured layer times).\n\n" + table)
    common.write(args.name, payload, text, args.out)
    print(text)


if __name__ == "__main__":
    main()
