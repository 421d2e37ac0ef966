"""How long ``get`` takes to answer: a problem never seen in the process, and the same problem again.

Per distinct problem of the networks named (every layer, every direction; batch, dtypes and channels_last as given),
in one process: the wall time of the first ``convtune.get(problem)`` (cold: every candidate listed and priced, on
CUDA cuDNN's graph and list of plans made), then of a second one (warm: the answer remembered). Before any is timed,
one ``get`` of a problem of none of the networks makes what a process makes once (cuDNN's handle, the registry, the
learned model's file read). The cold calls' time is split by phase (``PHASES``: listing the candidates, cuDNN's
graph, pricing, cuDNN plan builds), timed by wrapping those functions while they run. Then, untimed, the same
networks' problems at batch + 1 (each new to the process) are asked cold under cProfile: the functions their time
went to, by cumulative ms per problem (``--no-profile`` skips it). Targets (the learned-GET
issue): at most 5 ms cold and 1 ms warm. On a CPU the problems
are the CPU's (no cuDNN): a check of the script, not of the targets.

    python bench/get_latency.py --networks resnet50,mobilenet_v2,resnext50_32x4d --batch 32

Results: bench/results/get_latency.json and .md (or --out, --name).
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

TARGETS_MS = {"cold": 5.0, "warm": 1.0}


def summary(times_ms: list[float]) -> dict:
    """Median, 90th percentile and worst of ``times_ms``, and how many."""
    p90 = statistics.quantiles(times_ms, n=10, method="inclusive")[-1] if len(times_ms) > 1 else times_ms[0]
    return dict(problems=len(times_ms), median_ms=statistics.median(times_ms), p90_ms=p90, max_ms=max(times_ms))


# Where a cold get's time goes (common.phase_clock): (phase, module, attribute) of the callables timed while it runs;
# phases nest (pricing and ranking hold the plan builds they ask for, listing the candidates holds cuDNN's graph).
# cuDNN's only where it is loaded.
PHASES = (("candidates listed", "convtune.get", "algorithms"),
          ("cuDNN graph (heuristics query)", "convtune.algorithms.cudnn", "ProblemGraph.__init__"),
          ("priced and ranked", "convtune.get", "ranked_predictions"),
          ("cuDNN plan builds", "convtune.algorithms.cudnn", "ProblemGraph.build"))


def timed(problems: list) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per problem, the ms of its first ``get`` (cold) and of its second (warm); and the ms of all the cold ones
    spent in each phase (``PHASES``)."""
    import convtune as ct

    out: dict[str, list[float]] = {"cold": [], "warm": []}
    with common.phase_clock(PHASES) as spent:
        for problem in problems:
            start = time.perf_counter()
            ct.get(problem)
            out["cold"].append(1e3 * (time.perf_counter() - start))
    for problem in problems:
        start = time.perf_counter()
        ct.get(problem)
        out["warm"].append(1e3 * (time.perf_counter() - start))
    return out, dict(spent)


def profiled(problems: list, top: int = 20) -> list[tuple[float, str]]:
    """The ``top`` costliest functions of cold ``get``s of ``problems`` under cProfile, by cumulative ms per
    problem."""
    import cProfile
    import pstats

    import convtune as ct

    profiler = cProfile.Profile()
    profiler.enable()
    for problem in problems:
        ct.get(problem)
    profiler.disable()
    return [(1e3 * s / len(problems), name)
            for s, name in common.costliest(pstats.Stats(profiler).stats, top, where=None)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--networks", type=e2e.split, default=["resnet50", "mobilenet_v2", "resnext50_32x4d"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtypes", type=e2e.split, default=["float16"])
    parser.add_argument("--device", default=None, help="cuda where there is a GPU, else cpu")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled cold gets at batch + 1")
    common.result_arguments(parser, "get_latency")
    args = parser.parse_args(argv)
    import torch

    import convtune as ct

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    per_network = {network: list(dict.fromkeys(p for _, p in network_problems([network], args.batch, args.dtypes,
                                                                              ["channels_last"], device)))
                   for network in args.networks}
    seen: set = set()
    for network, problems in per_network.items():  # each problem timed once, with the first network that has it
        per_network[network] = [p for p in problems if p not in seen]
        seen.update(problems)
    if not seen:
        parser.error(f"{','.join(args.networks)}: no problems")
    ct.get(ct.ConvProblem("fwd", n=3, c=5, k=7, input_size=(11, 13), kernel_size=3, dtype=args.dtypes[0],
                          layout="channels_last", device=device))  # what a process makes once, untimed
    results, phases = {}, {}
    for network, problems in per_network.items():
        if problems:
            times, spent = timed(problems)
            results[network] = {kind: summary(t) for kind, t in times.items()}
            phases[network] = {"cold gets, in all": sum(times["cold"]), **spent}
    profiles = {}
    if not args.no_profile:  # afterwards, on problems new to the process: the timings above are cProfile's-free
        for network in args.networks:
            fresh = [p for p in dict.fromkeys(p for _, p in network_problems([network], args.batch + 1, args.dtypes,
                                                                             ["channels_last"], device))
                     if p not in seen]
            seen.update(fresh)
            if fresh:
                profiles[network] = profiled(fresh)
    env = common.environment()
    columns = ("cold gets, in all", *(p for p, _, _ in PHASES))
    rows = [[network, kind, r[kind]["problems"], f"{r[kind]['median_ms']:.3f}", f"{r[kind]['p90_ms']:.3f}",
             f"{r[kind]['max_ms']:.3f}", f"{TARGETS_MS[kind]:g}"] for network, r in results.items() for kind in r]
    markdown = (f"# How long get takes to answer\n\n{common.env_line(env)}. The layers of {', '.join(args.networks)} "
                f"(batch {args.batch}, {', '.join(args.dtypes)}, channels_last, every direction, on {device}; each "
                f"distinct problem once, with the first network that has it): the wall time of a problem's first "
                f"`get` in the process (cold) and of its second (warm), ms. `bench/get_latency.py`.\n\n"
                + common.md_table(["network", "get", "problems", "median", "90th percentile", "worst", "target"],
                                  rows)
                + "\n\nWhere the cold calls' time went, ms over all of a network's (phases nest: pricing and ranking "
                  "hold the plan builds they ask for, listing the candidates holds cuDNN's graph; '-': not here, "
                  "cuDNN not loaded):\n\n"
                + common.md_table(["network", *columns], [[network, *(f"{spent[p]:.1f}" if p in spent else "-"
                                                                    for p in columns)]
                                                          for network, spent in phases.items()]))
    for network, top in profiles.items():
        markdown += (f"\n\n{network}'s problems at batch {args.batch + 1}, each asked cold under cProfile (its "
                     f"overhead included): the costliest functions, cumulative ms per problem (they nest).\n\n"
                     + common.md_table(["function", "ms"], [[f"`{name}`", f"{ms:.3f}"] for ms, name in top]))
    common.write(args.name, {"environment": env, "device": device, "networks": args.networks, "batch": args.batch,
                             "results": results, "cold_phases_ms": phases, "cold_profile_ms": profiles},
                 markdown + "\n", args.out)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
