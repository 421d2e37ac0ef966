"""Fit each Triton configuration's measured factor: how its measured times stand to its roofline price.

(The price of its work, without the launches: ``Cost.measured_factor`` scales that part.)

Every family prices all of its configurations alike (its ``cost``: the same products and bytes), so without a fit
``get`` cannot tell a family's tiles apart, and the families' prices were set before they ran on a GPU (the banded
kernels priced 3-4x too cheap, the folded ones 8x too dear). From ``bench/depthwise.py``'s results (every
configuration of every family timed on every layer and direction, checked first, beside cuDNN's fastest plan), per
configuration: the geometric mean over the layers of its measured time over its price without a factor, divided by
its family's anchor (``ANCHORS``):

- the depthwise families: the same mean of the strips' fastest configuration (over the strips' cheapest price) in
  that direction, so that the strips' best keeps its price and ``get``'s balance between convtune's kernels and
  cuDNN's plans stays as it was (it was set on the strips);
- the folded family (first layers; no earlier balance to keep): the same mean of cuDNN's fastest plan on each layer
  over the price every cuDNN plan has there (``cudnn_cost.execution_plan_cost``), so that on these layers a folded
  configuration's price stands to a cuDNN plan's as their measured times stood.

A configuration the results never timed takes the median factor of its family and direction. Written to
``src/convtune/data/triton_prices.json`` (``TritonAlgorithm.measured_factor`` reads it).

Judged before writing: per direction, ``get``'s first pick among convtune's configurations over the fastest of them
measured (geometric mean, worst), without the fit, with it, and with it left one layer out (each layer's pick made
from the factors fitted on the others); for the families anchored on cuDNN, also ``get``'s pick between their best
priced configuration and cuDNN's fastest plan (priced as every plan is) over the faster of the two; and, where
``--check`` names another GPU's results, on those.

    python bench/fit_triton_prices.py --results bench/results/depthwise.json bench/results/first_layers_h100.json \
        --check bench/results/depthwise_h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import convtune as ct  # noqa: E402
from convtune import PerfResult, Policy, Status, costmodel, hardware  # noqa: E402
from convtune.algorithms.cudnn_cost import execution_plan_cost  # noqa: E402
from convtune.algorithms.registry import get_algorithm, registered  # noqa: E402
from convtune.algorithms.triton_family import PRICES_FILE, measured_factor_of  # noqa: E402
from convtune.ranking import best  # noqa: E402

CUDNN = "cudnn"  # an anchor: cuDNN's fastest plan on each layer, priced as every plan is
ANCHORS = {"depthwise": "depthwise_strip", "depthwise_strip": "depthwise_strip", "depthwise_band": "depthwise_strip",
           "depthwise_rows": "depthwise_strip", "folded": CUDNN}  # each fitted family: what its factors are over
FAMILIES = tuple(ANCHORS)


def raw_prices(path: Path) -> tuple[dict, list[dict]]:
    """The results file's environment, and per layer and direction: the problem, per configuration its measured
    ms, the price of its work without a measured factor and of its launches (priced for the file's GPU), and its
    workspace bytes; and cuDNN's fastest plan's ms and the price of a cuDNN plan's work there (None where the row
    has none: its ms, the price of its work, and with its launch)."""
    payload = json.loads(path.read_text())
    env = payload["environment"]
    registered_names = {a.name for a in registered()}
    rows = []
    with hardware.measured_on(f"cuda|{env['gpu']}|fit|fit|fit"):
        for key, row in payload["rows"].items():
            problem = ct.ConvProblem.from_key(key)
            entries = {}
            for name, ms in row.get("ours", {}).items():
                if common.family_of(name) not in FAMILIES or name not in registered_names:  # another's, or retired
                    continue
                algorithm = get_algorithm(name)
                if not algorithm.supports(problem):
                    continue
                workspace = algorithm.workspace_bytes(problem)
                # the work's price alone: the factor scales it, not the launches (a GPU's timer does not see the
                # host's launch latency, which the price adds)
                cost = dataclasses.replace(algorithm.cost(problem, workspace), measured_factor=1.0)
                tf32 = algorithm.notes(problem).tf32
                work = costmodel.roofline_ms(dataclasses.replace(cost, launches=0), problem, tf32)
                entries[name] = (ms, work, costmodel.roofline_ms(cost, problem, tf32) - work, workspace)
            if entries:
                plan = execution_plan_cost(problem)
                cudnn = ((row["cudnn_ms"], costmodel.roofline_ms(dataclasses.replace(plan, launches=0), problem,
                                                                 problem.allow_tf32),
                          costmodel.roofline_ms(plan, problem, problem.allow_tf32)) if row.get("cudnn_ms") else None)
                rows.append(dict(problem=problem, entries=entries, cudnn=cudnn))
    return env, rows


def fit(rows: list[dict]) -> dict[str, float]:
    """Per configuration name, its measured factor (module docstring), from ``rows``: the geometric mean of its
    measured time over its price, over its family's anchor in its direction (``ANCHORS``): the least such mean among
    the strips' configurations (which so keep their prices), or cuDNN's fastest plan's mean over a plan's price on the
    same layers."""
    ratios: dict[str, list[float]] = defaultdict(list)
    over_cudnn: dict[str, list[float]] = defaultdict(list)  # per configuration and layer with cuDNN's plan timed:
    direction: dict[str, str] = {}  # its ratio over the plan's
    for row in rows:
        for name, (ms, work, _, _) in row["entries"].items():
            ratios[name].append(ms / work)
            direction[name] = row["problem"].direction
            if row["cudnn"]:
                over_cudnn[name].append(ms / work / (row["cudnn"][0] / row["cudnn"][1]))
    means = {name: common.geomean(v) for name, v in ratios.items()}
    level: dict[tuple[str, str], float] = {}  # (anchor family, direction) -> its level
    for name, mean in means.items():
        family = common.family_of(name)
        if ANCHORS[family] == family:
            key = (family, direction[name])
            level[key] = min(level.get(key, math.inf), mean)
    factors = {}
    for name, mean in means.items():
        anchor = ANCHORS[common.family_of(name)]
        if anchor == CUDNN:
            if over_cudnn[name]:  # (over the same layers: where cuDNN's plan was timed)
                factors[name] = common.geomean(over_cudnn[name])
        elif (anchor, direction[name]) in level:
            factors[name] = mean / level[anchor, direction[name]]
    return factors


def priced(row: dict, factors: dict[str, float] | None) -> list[PerfResult]:
    """``get``'s guesses for the row's configurations: the price of their work times the factor, and their launches."""
    return [PerfResult(name, Status.OK, workspace_bytes=workspace,
                       time_ms=work * (1.0 if factors is None else measured_factor_of(name, factors)) + launch)
            for name, (_, work, launch, workspace) in row["entries"].items()]


def picks(rows: list[dict], factors: dict[str, float] | None,
          held_out: bool = False) -> dict[str, list[float]]:
    """Per direction, each layer's first pick by get's rule (``ranking.best``: the cheapest price times factor,
    prices within the default tolerance tied and given to the least workspace, then by name) measured time over
    the fastest measured; held_out: each layer's factors fitted without it."""
    out: dict[str, list[float]] = defaultdict(list)
    for i, row in enumerate(rows):
        use = fit(rows[:i] + rows[i + 1:]) if held_out else factors
        pick = best(priced(row, use), Policy())
        measured = {name: ms for name, (ms, _, _, _) in row["entries"].items()}
        out[row["problem"].direction].append(measured[pick.algorithm] / min(measured.values()))
    return out


def against_cudnn(rows: list[dict], factors: dict[str, float] | None,
                  held_out: bool = False) -> dict[str, list[float]]:
    """Per direction, on the layers of families anchored on cuDNN: ``get``'s pick between their cheapest priced
    configuration and cuDNN's fastest plan (priced as every plan is, launch included), its measured time over the
    fastest measured there (cuDNN's plan, or any of the configurations)."""
    out: dict[str, list[float]] = defaultdict(list)
    for i, row in enumerate(rows):
        if not row["cudnn"] or any(ANCHORS[common.family_of(n)] != CUDNN for n in row["entries"]):
            continue
        use = fit(rows[:i] + rows[i + 1:]) if held_out else factors
        ours = best(priced(row, use), Policy())
        plan_ms, _, plan_price = row["cudnn"]
        theirs = PerfResult(CUDNN, Status.OK, time_ms=plan_price)
        pick = best([ours, theirs], Policy())
        measured = {CUDNN: plan_ms, ours.algorithm: row["entries"][ours.algorithm][0]}
        out[row["problem"].direction].append(measured[pick.algorithm] / min(plan_ms, *(
            ms for ms, _, _, _ in row["entries"].values())))
    return out


def summary(per_direction: dict[str, list[float]], directions: list[str]) -> list[str]:
    return [f"{common.geomean(per_direction[d]):.3f} / {max(per_direction[d]):.2f} ({len(per_direction[d])})"
            if per_direction.get(d) else "-" for d in directions]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", nargs="+", default=[str(common.RESULTS / "depthwise.json")],
                        help="bench/depthwise.py's results files (e.g. the depthwise and the first layers' sweeps)")
    parser.add_argument("--check", default=None, help="another GPU's depthwise results to judge the fit on")
    parser.add_argument("--out", default=str(PRICES_FILE), help="where to write the factors")
    args = parser.parse_args(argv)
    envs, rows = [], []
    for path in args.results:
        env, file_rows = raw_prices(Path(path))
        envs.append(f"{Path(path).name}: {env['gpu']}, revision {env['revision']}, {env['date']}")
        rows += file_rows
    if not rows:
        parser.error(f"{', '.join(args.results)}: no timed configuration of {', '.join(FAMILIES)}")
    factors = fit(rows)
    directions = sorted({row["problem"].direction for row in rows})
    table = [["without the fit", *summary(picks(rows, None), directions)],
             ["fitted", *summary(picks(rows, factors), directions)],
             ["fitted, each layer left out", *summary(picks(rows, None, held_out=True), directions)],
             ["against cuDNN's fastest plan, without the fit", *summary(against_cudnn(rows, None), directions)],
             ["against cuDNN's fastest plan, fitted", *summary(against_cudnn(rows, factors), directions)],
             ["against cuDNN's fastest plan, each layer left out",
              *summary(against_cudnn(rows, None, held_out=True), directions)]]
    if args.check:
        _, other = raw_prices(Path(args.check))
        table += [[f"{Path(args.check).name}: without the fit", *summary(picks(other, None), directions)],
                  [f"{Path(args.check).name}: fitted here", *summary(picks(other, factors), directions)]]
    print(common.md_table(["get's first pick / fastest measured: geomean / worst (layers)", *directions], table))
    payload = {"fitted_from": "; ".join(envs), "anchors": ANCHORS, "factors": dict(sorted(factors.items()))}
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {len(factors)} factors to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
