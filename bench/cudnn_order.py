"""cuDNN's own order of its plans, for every CUDA problem of a tuning database.

``get`` ranks the plans of a problem in the order cuDNN's heuristics list them (each later one a
little higher, ``costmodel.order_factor``), and so must anything that judges ``get`` away from the GPU
(``bench/learned_get.py`` on the shipped dataset). Per problem: the names of the cuDNN backend's plans
in the backend's order (heuristics A, then FALLBACK), and cuDNN's first plan under heuristics A and B.
Needs the GPU the database measured (its heuristics are this cuDNN's on this GPU).

    python bench/cudnn_order.py --db /tmp/sweep.sqlite --out bench/data   # writes cudnn_order.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import convtune as ct  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--out", type=Path, default=Path("bench/data"))
    args = parser.parse_args(argv)
    from convtune.algorithms.cudnn import BACKEND  # needs the cuDNN frontend and a GPU

    with ct.TuningDB(args.db) as db:
        keys = sorted({e.problem for e in db.entries() if e.fingerprint.startswith("cuda|")})
    problems = [ct.ConvProblem.from_key(k) for k in keys]
    start = time.perf_counter()
    orders = {}
    for problem in problems:
        orders[problem.key] = {"plans": [a.name for a in BACKEND.algorithms(problem)],
                               "A": BACKEND.heuristic_choice(problem, "A"),
                               "B": BACKEND.heuristic_choice(problem, "B")}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cudnn_order.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"environment": common.environment(), "problems": orders}, f, sort_keys=True)
    print(f"{len(orders)} problems' cuDNN plan orders in {time.perf_counter() - start:.0f} s: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
