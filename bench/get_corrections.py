"""Does a tuning database of other problems make get's picks better? Judged on networks it never saw.

``get`` prices an unmeasured problem with the analytic model and each candidate's place in its backend's heuristic
order, or, where the database holds measurements, with the learned model of them (``costmodel.Corrections``: the
nearest measured problems, ``learned``). For each built-in network in turn, from a database that a sweep filled
(``bench/sweep.py``), this prices that network's layers' measured candidates with ``Corrections.price``, get's own
formula: without a database, and with every other problem of the database (leave one network out), its results
carrying their places in cuDNN's order as ``find`` now stores them (the sweep's results predate that: the places
come from the recorded order) and, as a database of an earlier version holds them, without; and takes the measured
time of each first pick over the best measured; cuDNN's heuristics A and B beside them (their first plan, where it
was measured).

    convtune cache --db /tmp/sweep.sqlite import bench/data/sweep.jsonl.gz
    python bench/get_corrections.py --db /tmp/sweep.sqlite

The database's rows are priced for the GPU that measured them (``hardware.measured_on``), so this runs on any
machine; cuDNN's order and first choices come from ``bench/data/cudnn_order.json.gz`` (``bench/cudnn_order.py``).
No model is installed; ``price`` would build on one that this machine holds for that GPU (none ships), and the
report says whether one was active. A layer that several networks share is judged once per network.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import convtune as ct  # noqa: E402
from convtune import costmodel, hardware, learned, zoo  # noqa: E402
from learned_get import ORDERS, database_gpu, heuristic_names, recorded_orders, table  # noqa: E402
from sweep import network_problems  # noqa: E402

RANKINGS = ("without", "with_db", "with_db_no_places", "cudnn_A", "cudnn_B")


def first_picks(rows: list[learned.Sample], corrections: costmodel.Corrections, unplaced: costmodel.Corrections,
                heuristics: dict[str, str | None]) -> dict[str, float | None]:
    """Measured time over the best measured of each ranking's first pick (None: its pick was not measured)."""
    best = min(s.measured_ms for s in rows)
    by_name = {s.name: s.measured_ms for s in rows}

    def pick(table: costmodel.Corrections) -> str:
        return min(rows, key=lambda s: table.price(s.name, s.problem, s.analytic_ms, s.order)).name

    chosen = {"without": pick(costmodel.NO_CORRECTIONS), "with_db": pick(corrections),
              "with_db_no_places": pick(unplaced), "cudnn_A": heuristics.get("A"), "cudnn_B": heuristics.get("B")}
    return {r: (by_name[n] / best if n in by_name else None) for r, n in chosen.items()}


SIZES = (1, 3, 10, 30, 100, 150, 200, 300)  # problems in small_databases' databases


def small_databases(pairs: list, by_problem: dict, draws: int = 4, judged: int = 120, seed: int = 0) -> dict:
    """get with a database of a few random problems of the sweep, judged on others drawn at random: per size (``SIZES``)
    and ranking ('without', 'with_db'), the pick-over-best ratios of ``draws`` databases of ``judged`` problems each."""
    rng = random.Random(seed)
    candidates = sorted((p for p, rows in by_problem.items() if len(rows) >= 2), key=lambda p: p.key)
    results: dict = defaultdict(list)
    for p, r in pairs:
        results[p].append((p, r))
    out: dict = {}
    for size in (size for size in SIZES if size < len(candidates)):
        ratios: dict = defaultdict(list)
        for _ in range(draws):
            chosen = rng.sample(candidates, size)
            table = costmodel.Corrections.of([pair for p in chosen for pair in results[p]])
            others = [p for p in candidates if p not in set(chosen)]
            for p in rng.sample(others, min(judged, len(others))):
                picked = first_picks(by_problem[p], table, table, {})
                ratios["without"].append(picked["without"])
                ratios["with_db"].append(picked["with_db"])
        out[(f"{size:>3}",)] = [dict(without=a, with_db=b) for a, b in zip(ratios["without"], ratios["with_db"])]
    return out


def judge(db: ct.TuningDB, fingerprint: str, networks: list[str], batch: int, dtypes: list[str]) -> tuple[dict, dict]:
    recorded = recorded_orders(ORDERS)
    places = {key: learned.positions(entry["plans"]) for key, entry in recorded.items()}
    unplaced = db.measurements("cuda", fingerprint)
    pairs = [(p, dataclasses.replace(r, place=places.get(p.key, {}).get(r.algorithm))) for p, r in unplaced]
    samples = learned.samples_from(db, "cuda", fingerprint, {k: e["plans"] for k, e in recorded.items()})
    by_problem: dict = defaultdict(list)
    for s in samples:
        by_problem[s.problem].append(s)
    members = network_problems(networks, batch, dtypes, ["channels_last"], "cuda", None)
    groups: dict = defaultdict(list)
    for network in networks:
        held = {p for n, p in members if n == network}  # every layer of it out of the database, judged or not
        corrections = costmodel.Corrections.of((p, r) for p, r in pairs if p not in held)
        without_places = costmodel.Corrections.of((p, r) for p, r in unplaced if p not in held)
        for p in sorted((p for p in held if len(by_problem.get(p, ())) >= 2), key=lambda p: p.key):
            ratios = first_picks(by_problem[p], corrections, without_places, heuristic_names(p, recorded))
            groups[(p.direction, p.dtype)].append(dict(network=network, problem=p.key, **ratios))
    return groups, small_databases(pairs, by_problem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", default="bench/data/sweep.sqlite")
    parser.add_argument("--measured-on", default="auto", metavar="FINGERPRINT",
                        help="the database's CUDA fingerprint whose rows are judged ('auto': its only one)")
    parser.add_argument("--networks", default="all", help="built-in networks to hold out in turn, comma-separated")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtypes", default="float16")
    common.result_arguments(parser, "get_corrections")
    args = parser.parse_args(argv)
    with ct.TuningDB(args.db) as db:
        fingerprint = database_gpu(parser, db, args.db, args.measured_on)
        with hardware.measured_on(fingerprint):
            networks = list(zoo.MODELS) if args.networks == "all" else args.networks.split(",")
            groups, small = judge(db, fingerprint, networks, args.batch, args.dtypes.split(","))
            model = "a learned model active" if learned.version("cuda") else "no learned model"
    summary, table_text = table(groups, RANKINGS, ("direction", "dtype"), "judged (per network)")
    small_summary, small_text = table(small, ("without", "with_db"), ("problems in the database",), "judged")
    env = common.environment()
    distinct = {row["problem"] for rows in groups.values() for row in rows}
    text = (f"# get with and without a database of other problems\n\n{common.env_line(env)}; judged on the "
            f"measurements of {fingerprint} (`{args.db}`), the layers of {', '.join(networks)} (batch {args.batch}), "
            f"each network held out of the database in turn ({len(distinct)} distinct layer directions; {model}).\n\n"
            f"Per ranking, the measured time of its first pick over "
            f"the best measured: geometric mean / worst / how often it is the best. without: get's analytic price and "
            f"cuDNN's order, no database; with_db: the learned model of every other problem of the database, each "
            f"result with its place in cuDNN's order; with_db_no_places: the same without the places (a database of an "
            f"earlier version); cudnn_A/B: cuDNN's heuristics' first plan.\n\n" + table_text
            + "\n## A database of a few problems\n\nA database of k problems of the sweep drawn at random (4 draws "
              "each, the places as above), judged on 120 other problems each, every direction and dtype:\n\n"
              + small_text)
    common.write(args.name, {"environment": env, "measured_on": fingerprint, "summary": summary,
                             "small_databases": small_summary,
                             "rows": {"/".join(k): rows for k, rows in groups.items()}}, text, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
