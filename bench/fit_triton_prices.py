"""Fit each Triton depthwise configuration's measured factor: how its measured times stand to its roofline price.

(The price of its work, without the launches: ``Cost.measured_factor`` scales that part.)

Every family prices all of its configurations alike (its ``cost``: the same products and bytes), so without a fit
``get`` cannot tell a family's tiles apart, and the families' prices were set before they ran on a GPU (the banded
kernels priced 3-4x too cheap). From ``bench/depthwise.py``'s results (every configuration of every family timed on
every layer and direction, checked first), per configuration: the geometric mean over the layers of its measured
time over its price without a factor, divided by the same of the strips' fastest configuration (over the strips'
cheapest price) in that direction, so that the strips' best keeps its price and ``get``'s balance between convtune's
kernels and cuDNN's plans stays as it was. A configuration the results never timed takes the median factor of its
family and direction. Written to ``src/convtune/data/triton_prices.json`` (``TritonAlgorithm.measured_factor``
reads it).

Judged before writing: per direction, ``get``'s first pick among convtune's configurations over the fastest of them
measured (geometric mean, worst), without the fit, with it, and with it left one layer out (each layer's pick made
from the factors fitted on the others); and, where ``--check`` names another GPU's results, on those.

    python bench/fit_triton_prices.py --results bench/results/depthwise.json --check bench/results/depthwise_h100.json
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
from convtune.algorithms.registry import get_algorithm, registered  # noqa: E402
from convtune.algorithms.triton_family import PRICES_FILE, measured_factor_of  # noqa: E402
from convtune.ranking import best  # noqa: E402

FAMILIES = ("depthwise", "depthwise_strip", "depthwise_band", "depthwise_rows")
ANCHOR = "depthwise_strip"


def raw_prices(path: Path) -> tuple[dict, list[dict]]:
    """The results file's environment, and per layer and direction: the problem, and per configuration its measured
    ms, the price of its work without a measured factor and of its launches (priced for the file's GPU), and its
    workspace bytes."""
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
                rows.append(dict(problem=problem, entries=entries))
    return env, rows


def fit(rows: list[dict]) -> dict[str, float]:
    """Per configuration name, its measured factor (module docstring), from ``rows``: the geometric mean of its
    measured time over its price, over that of the strips' configuration with the least such mean in its direction
    (which so keeps its price)."""
    ratios: dict[str, list[float]] = defaultdict(list)
    direction: dict[str, str] = {}
    for row in rows:
        for name, (ms, work, _, _) in row["entries"].items():
            ratios[name].append(ms / work)
            direction[name] = row["problem"].direction
    means = {name: common.geomean(v) for name, v in ratios.items()}
    level: dict[str, float] = {}
    for name, mean in means.items():
        if common.family_of(name) == ANCHOR:
            level[direction[name]] = min(level.get(direction[name], math.inf), mean)
    return {name: mean / level[direction[name]] for name, mean in means.items() if direction[name] in level}


def picks(rows: list[dict], factors: dict[str, float] | None,
          held_out: bool = False) -> dict[str, list[float]]:
    """Per direction, each layer's first pick by get's rule (``ranking.best``: the cheapest price times factor,
    prices within the default tolerance tied and given to the least workspace, then by name) measured time over
    the fastest measured; held_out: each layer's factors fitted without it."""
    out: dict[str, list[float]] = defaultdict(list)
    for i, row in enumerate(rows):
        use = fit(rows[:i] + rows[i + 1:]) if held_out else factors
        guesses = [PerfResult(name, Status.OK, workspace_bytes=workspace,
                              time_ms=work * (1.0 if use is None else measured_factor_of(name, use)) + launch)
                   for name, (_, work, launch, workspace) in row["entries"].items()]
        pick = best(guesses, Policy())
        measured = {name: ms for name, (ms, _, _, _) in row["entries"].items()}
        out[row["problem"].direction].append(measured[pick.algorithm] / min(measured.values()))
    return out


def summary(per_direction: dict[str, list[float]]) -> dict[str, str]:
    return {d: f"{common.geomean(v):.3f} / {max(v):.2f} ({len(v)})" for d, v in sorted(per_direction.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=str(common.RESULTS / "depthwise.json"))
    parser.add_argument("--check", default=None, help="another GPU's depthwise results to judge the fit on")
    parser.add_argument("--out", default=str(PRICES_FILE), help="where to write the factors")
    args = parser.parse_args(argv)
    env, rows = raw_prices(Path(args.results))
    if not rows:
        parser.error(f"{args.results}: no timed configuration of {', '.join(FAMILIES)}")
    factors = fit(rows)
    table = [["without the fit", *summary(picks(rows, None)).values()],
             ["fitted", *summary(picks(rows, factors)).values()],
             ["fitted, each layer left out", *summary(picks(rows, None, held_out=True)).values()]]
    if args.check:
        _, other = raw_prices(Path(args.check))
        table += [[f"{Path(args.check).name}: without the fit", *summary(picks(other, None)).values()],
                  [f"{Path(args.check).name}: fitted here", *summary(picks(other, factors)).values()]]
    directions = sorted({row["problem"].direction for row in rows})
    print(common.md_table(["get's first pick among convtune's configurations / fastest measured: geomean / worst "
                           "(layers)", *directions], table))
    payload = {"fitted_from": f"{Path(args.results).name}: {env['gpu']}, revision {env['revision']}, {env['date']}",
               "anchor": ANCHOR, "factors": dict(sorted(factors.items()))}
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {len(factors)} factors to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
