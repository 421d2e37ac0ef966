"""Judging get's learned cost model on networks it never saw.

From a tuning database that a sweep filled (``bench/sweep.py``: sampled problems, and with
``--networks`` the built-in networks' layers), for each built-in network in turn: a model built from
everything except that network's layers, judged on those layers (leave one network out); then
models built from most problems and judged on the rest (random splits, three seeds). For each held-out problem
with two or more measured candidates: the measured time of the candidate each ranking puts first
over the best measured, for the learned model, the analytic model, PyTorch's own call with
``cudnn.benchmark=False`` (``torch:native`` as find measured it) and, on a GPU, cuDNN's heuristics A
and B (their first plan, where it was measured). Reported per network, direction and dtype: the
geometric mean, the worst case and how often the pick is the best (top-1).

    python bench/learned_get.py --db bench/data/sweep.sqlite --batch 32 --dtypes float16

``--measured-on FINGERPRINT`` judges another machine's measurements (the shipped dataset's, say) on
any machine, the CPU included: its rows, priced for the GPU it names (``hardware.measured_on``);
``--measured-on auto`` takes the database's one CUDA fingerprint. cuDNN's heuristics, their order of the
plans (which ``get`` ranks by and the learned model reads) and their first choices, come from
``--orders`` (``bench/data/cudnn_order.json.gz``, recorded on the GPU that measured by
``bench/cudnn_order.py``; ``live``: asked of this machine's cuDNN, on that GPU only).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import convtune as ct  # noqa: E402
from convtune import hardware, learned, zoo  # noqa: E402
from convtune.costmodel import order_factor  # noqa: E402
from convtune.hardware import fingerprint  # noqa: E402
from convtune.policy import Policy  # noqa: E402
from convtune.settings import settings  # noqa: E402
from sweep import network_problems  # noqa: E402

RANKINGS = ("learned", "analytic", "torch_bm0", "cudnn_A", "cudnn_B")
# Other rules for picking from the learned prices, judged beside its first pick: 'topK' the cheapest of the candidates
# of no ranking backend and cuDNN's first K plans in its order; 'aM' cuDNN's first plan in that order (heuristics
# A) unless the cheapest is priced M% below it; 'bM' the same against heuristics B's first plan.
# 'analytic_b': no learned price, the analytic model's first pick with heuristics B's first plan moved to the head of
# cuDNN's order (what get would rank, were it to ask heuristics B as well).
PRICE_RULES = ("top2", "top3", "a10", "a20", "a30", "b10", "b20")
RULES = (*PRICE_RULES, "analytic_b")
# find's settings simulated: (order, find_patience, find_prune_factor, find_contender_factor); 0: that rule off.
# In the learned order, every patience and prune factor with the contender factor's default, and patience with the
# prune factor's default but no contenders (the rule's share of the picks and of the time); in the analytic order
# (where no learned model answers: nothing is a contender), patience with the prune factor's default
FIND_SETTINGS = tuple(dict.fromkeys((
    *(("learned", patience, prune, settings.find_contender_factor) for prune in (10.0, 100.0, 0.0)
      for patience in (0, 4, 8, 16)),
    *(("learned", patience, settings.find_prune_factor, 0.0) for patience in (4, 8, 16)),
    *(("analytic", patience, settings.find_prune_factor, 0.0) for patience in (4, 8)))))


def picks(order: list[tuple[learned.Sample, float]], heuristics: dict[str, str | None]) -> dict:
    """The measured time over the best of what each ranking puts first (None where it picks nothing measured), from
    one problem's candidates in the learned order (``learned.ranked``)."""
    rows = [s for s, _ in order]
    best = min(s.measured_ms for s in rows)
    by_name = {s.name: s.measured_ms for s in rows}
    chosen = {"learned": order[0][0].name, "analytic": learned.analytic_first(rows).name, "torch_bm0": "torch:native",
              "cudnn_A": heuristics.get("A"), "cudnn_B": heuristics.get("B"),
              "analytic_b": learned.analytic_first(rows, heuristics.get("B")).name}
    chosen.update(rule_picks(order, heuristics.get("B")))
    return {ranking: (by_name[name] / best if name in by_name else None) for ranking, name in chosen.items()}


def rule_picks(order: list[tuple[learned.Sample, float]], first_b: str | None) -> dict[str, str]:
    """What each of ``PRICE_RULES`` picks from one problem's candidates in the learned order, with their prices."""
    price = {s.name: t for s, t in order}
    cheapest, cheapest_ms = order[0][0].name, order[0][1]
    first_a = next((s.name for s, _ in order if s.order == 0), None)
    chosen = {}
    for rule in PRICE_RULES:
        number = int(rule[1:]) if rule[0] in "ab" else int(rule[3:])
        if rule.startswith("top"):
            chosen[rule] = next(s.name for s, _ in order if s.order is None or s.order < number)
            continue
        anchor = first_a if rule[0] == "a" else first_b
        anchor = anchor if anchor in price else cheapest
        chosen[rule] = cheapest if cheapest_ms < (1 - number / 100) * price[anchor] else anchor
    return chosen


ORDERS = Path(__file__).resolve().parent / "data" / "cudnn_order.json.gz"


def recorded_orders(path: Path) -> dict[str, dict]:
    """Problem key: {'plans': cuDNN's plans in its order, 'A'/'B': its heuristics' first plan}
    (bench/cudnn_order.py)."""
    with gzip.open(path, "rt") as f:
        return json.load(f)["problems"]


def heuristic_names(problem: ct.ConvProblem, recorded: dict[str, dict] | None) -> dict[str, str | None]:
    """cuDNN's own first plans under heuristics A and B: as recorded, else asked of this machine's cuDNN (a GPU
    with the cuDNN frontend only)."""
    if recorded is not None:
        entry = recorded.get(problem.key, {})
        return {mode: entry.get(mode) for mode in ("A", "B")}
    if problem.device != "cuda":
        return {}
    try:
        from convtune.algorithms.cudnn import BACKEND
    except ImportError:
        return {}
    return {mode: BACKEND.heuristic_choice(problem, mode) for mode in ("A", "B")}


def judge(samples: list[learned.Sample], held: set, here: str, recorded: dict[str, dict] | None) -> list[dict]:
    """Build the model without the ``held`` problems; one row of ratios per held-out problem."""
    model = learned.train([s for s in samples if s.problem not in held], here)
    by_problem: dict = defaultdict(list)
    for s in samples:
        if s.problem in held:
            by_problem[s.problem].append(s)
    out = []
    for problem, rows in by_problem.items():
        if len(rows) >= 2:
            heuristics, order = heuristic_names(problem, recorded), learned.ranked(model, rows)
            guessed = {s.name for s, _ in order if model.guessed(problem, s.name, s.order)}
            named = [(s.name, s.order) for s, _ in order]
            contenders = {f: model.contenders(problem, named, f) if f else frozenset()
                          for f in {setting[3] for setting in FIND_SETTINGS}}
            out.append(dict(problem=problem.key, direction=problem.direction, dtype=problem.dtype,
                            nearest=model.nearest_distance(problem), **picks(order, heuristics),
                            find=searches(order, guessed, contenders), **prices(order, heuristics.get("B"))))
    return out


DISTANCES = (0.5, 1.0, 2.0, 4.0)  # the bounds of by_distance's groups
NO_ANSWER = f"no answer (fewer than {learned.MIN_MEASURED} of its direction measured)"


def by_distance(groups: dict[tuple, list[dict]]) -> dict[tuple, list[dict]]:
    """The rows of every group, by the distance from their problem to the nearest measured one (``DISTANCES``)."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for rows in groups.values():
        for row in rows:
            if row.get("nearest") is None:
                out[(NO_ANSWER,)].append(row)
                continue
            low = max((d for d in (0.0, *DISTANCES) if row["nearest"] >= d), default=0.0)
            high = next((d for d in DISTANCES if d > low), None)
            out[(f"{low:g} to {high:g}" if high else f"{low:g} and more",)].append(row)
    def lower_bound(key: tuple) -> float:
        return math.inf if key[0] == NO_ANSWER else float(key[0].split()[0])

    return dict(sorted(out.items(), key=lambda item: lower_bound(item[0])))


def family(name: str) -> str:
    """A candidate's family for the price-error table: its backend, and for convtune's Triton kernels the
    kernel ('triton:grouped_bwd_data_p64c32w4' is 'triton:grouped')."""
    backend, _, variant = name.partition(":")
    return f"{backend}:{variant.split('_')[0]}" if backend == "triton" else backend


def prices(order: list[tuple[learned.Sample, float]], first_b: str | None) -> dict:
    """What the learned prices of one problem's candidates (``learned.ranked``) got wrong: 'errors', per family,
    log2(price / measured) of each candidate; 'pick', the learned first pick and the measured best, each with its
    price and measured time, and cuDNN heuristics B's first plan."""
    errors: dict[str, list[float]] = defaultdict(list)
    for sample, price in order:
        errors[family(sample.name)].append(math.log2(price / sample.measured_ms))
    (chosen, chosen_price), best = order[0], min((s for s, _ in order), key=lambda s: s.measured_ms)
    priced = {s.name: price for s, price in order}
    return dict(errors=dict(errors), pick=dict(
        learned=[chosen.name, chosen_price, chosen.measured_ms], best=[best.name, priced[best.name], best.measured_ms],
        cudnn_B=first_b if first_b in priced else None))


def error_table(groups: dict[tuple, list[dict]]) -> tuple[dict, str]:
    """Per direction, dtype and candidate family, over the held-out problems' candidates: how far the learned
    price lies from the measured time (log2(price / measured)): the median (above 0: priced slower than it
    ran), the median of its size, and the share off by more than 2x."""
    summary, lines = {}, []
    for key, rows in sorted(groups.items()):
        merged: dict[str, list[float]] = defaultdict(list)
        for row in rows:
            for name, values in row.get("errors", {}).items():
                merged[name].extend(values)
        for name, values in sorted(merged.items()):
            s = dict(candidates=len(values), median=statistics.median(values),
                     median_size=statistics.median(abs(v) for v in values),
                     over_2x=sum(abs(v) > 1 for v in values) / len(values))
            summary[f"{'/'.join(key)}/{name}"] = s
            lines.append([*key[1:], name, s["candidates"], f"{2 ** s['median']:.2f}x", f"{2 ** s['median_size']:.2f}x",
                          f"{100 * s['over_2x']:.0f}%"])
    header = ["direction", "dtype", "family", "candidates", "price / measured: median", "median factor off",
              "off by over 2x"]
    return summary, common.md_table(header, lines)


def worst_table(groups: dict[tuple, list[dict]], count: int = 12) -> str:
    """The held-out problems where the learned first pick is slowest against the best measured, each problem once
    (the first of the networks that hold it, by that ratio; the others named): what it picked, at what price,
    what was best and at what price, and how heuristics B's first plan did."""
    by_problem: dict[str, list[dict]] = defaultdict(list)
    for rows in groups.values():
        for r in rows:
            if r.get("pick") and r.get("learned"):
                by_problem[r["problem"]].append(r)
    worst = sorted((sorted(rows, key=lambda r: (-r["learned"], r["network"])) for rows in by_problem.values()),
                   key=lambda rows: (-rows[0]["learned"], rows[0]["problem"]))[:count]
    lines = []
    for rows in worst:
        r = rows[0]
        (chosen, chosen_price, chosen_ms), (best, best_price, best_ms) = r["pick"]["learned"], r["pick"]["best"]
        b = f"{r['cudnn_B']:.2f}" if r.get("cudnn_B") else "-"
        lines.append([", ".join(x["network"] for x in rows), r["problem"].split("|cuda")[0], f"{r['learned']:.2f}",
                      chosen, f"{chosen_price:.4f} / {chosen_ms:.4f}", best, f"{best_price:.4f} / {best_ms:.4f}", b])
    header = ["held out", "problem", "learned / best", "learned pick", "its price / measured ms", "best",
              "its price / measured ms", "cudnn_B / best"]
    return common.md_table(header, lines)


def analytic_order(rows: list[learned.Sample]) -> list[tuple[learned.Sample, float]]:
    """One problem's measured candidates in the order ``get`` ranks them without a learned model (the analytic price
    times ``costmodel.order_factor`` of the place, ties by name), each with that price."""
    priced = ((s.analytic_ms * order_factor(s.order), s.name, s) for s in rows)
    return [(s, price) for price, _, s in sorted(priced, key=lambda p: (p[0], p[1]))]


def searches(order: list[tuple[learned.Sample, float]], guessed: set[str],
             contenders: dict[float, frozenset[str]]) -> dict[str, list[float]]:
    """find's search over one problem's measured candidates in the learned order (``learned.ranked``; ``guessed``: the
    candidates priced by a guess, ``learned.LearnedModel.guessed``; ``contenders``: per contender factor, those
    ``learned.LearnedModel.contenders`` names) or the analytic one, per setting simulated (``learned.simulated_find``
    at the default policy's tolerance; key 'order/patience/prune factor/contender factor'): [best
    found / best measured, share of the candidates run, share of their summed measured times (a proxy of find's
    time: a candidate's checks and timings take a multiple of its time)]."""
    rows = [s for s, _ in order]
    best, total_ms = min(s.measured_ms for s in rows), sum(s.measured_ms for s in rows)
    orders = {"learned": order, "analytic": analytic_order(rows)}
    out = {}
    for ranking, patience, prune, factor in FIND_SETTINGS:
        searched = orders[ranking]
        found, run, spent = learned.simulated_find(searched, patience, Policy().tolerance, prune,
                                                   guessed if ranking == "learned" else (), contenders[factor])
        out[f"{ranking}/{patience}/{prune:g}/{factor:g}"] = [found / best, run / len(rows), spent / total_ms]
    return out


def find_table(groups: dict[tuple, list[dict]]) -> tuple[dict, str]:
    """Per direction and dtype, over the held-out problems, each setting's found / best (geometric mean, worst,
    how often above 1.05) and the share of candidates run."""
    summary, lines = {}, []
    for key, rows in sorted(groups.items()):
        for ranking, patience, prune, factor in FIND_SETTINGS:
            setting = f"{ranking}/{patience}/{prune:g}/{factor:g}"
            found = [row["find"][setting] for row in rows if setting in row.get("find", {})]
            if not found:
                continue
            ratios = [f[0] for f in found]
            share, time_share = (sum(f[i] for f in found) / len(found) for i in (1, 2))
            s = dict(learned.summarize(ratios), share_run=share, time_share=time_share,
                     over_5pct=sum(r > 1.05 for r in ratios))
            summary[f"{'/'.join(key)}/{setting}"] = s
            lines.append([*key, ranking, patience or "off", f"{prune:g}" if prune else "off",
                          f"{factor:g}" if factor else "off", len(ratios),
                          f"{s['geomean']:.3f}", f"{s['worst']:.2f}", s["over_5pct"], f"{100 * share:.0f}%",
                          f"{100 * time_share:.0f}%"])
    header = ["held out", "direction", "dtype", "order", "patience", "prune factor", "contender factor", "problems",
              "found / best: geomean",
              "worst", "problems over 1.05", "candidates run", "their time"]
    return summary, common.md_table(header, lines)


def table(groups: dict[tuple, list[dict]], rankings: tuple[str, ...] = RANKINGS,
          key_names: tuple[str, ...] = ("held out", "direction", "dtype"), count: str = "problems") -> tuple[dict, str]:
    """Per group (its key's parts named by ``key_names``), each ranking's pick-over-best summary: a dict keyed by the
    parts joined with '/', and a markdown table of geometric mean / worst / top-1."""
    summary, lines = {}, []
    for key, rows in sorted(groups.items()):
        summary["/".join(key)] = {r: learned.summarize([row[r] for row in rows if row.get(r)]) for r in rankings}
        cells = []
        for ranking in rankings:
            s = summary["/".join(key)][ranking]
            cells.append(f"{s['geomean']:.3f} / {s['worst']:.2f} / {100 * s['top1']:.0f}%" if s else "-")
        lines.append([*key, len(rows), *cells])
    header = [*key_names, count, *(f"{r}: geomean / worst / top-1" for r in rankings)]
    return summary, common.md_table(header, lines)


def database_gpu(parser: argparse.ArgumentParser, db: ct.TuningDB, path: str, measured_on: str | None) -> str | None:
    """--measured-on as given, or for 'auto' the database's one CUDA fingerprint (a parser error otherwise)."""
    if measured_on != "auto":
        return measured_on
    gpus = sorted({e.fingerprint for e in db.entries() if e.fingerprint.startswith("cuda|")})
    if len(gpus) != 1:
        parser.error(f"--measured-on auto: {path} holds {len(gpus)} CUDA fingerprints ({'; '.join(gpus) or 'none'}); "
                     f"name one")
    return gpus[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", default="bench/data/sweep.sqlite")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--networks", default="all")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtypes", default="float16")
    parser.add_argument("--layouts", default="channels_last")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="the first random split's seed")
    parser.add_argument("--splits", type=int, default=3,
                        help="random splits judged, from seeds --seed, --seed + 1, ...")
    parser.add_argument("--orders", default=str(ORDERS) if ORDERS.exists() else "live", metavar="PATH|live",
                        help="cuDNN's plan orders and first choices per problem, as bench/cudnn_order.py recorded "
                             "them (default: bench/data/cudnn_order.json.gz); 'live': this machine's cuDNN")
    parser.add_argument("--measured-on", default=None, metavar="FINGERPRINT",
                        help="judge the measurements of the machine this database fingerprint names ('auto': the "
                             "database's one CUDA fingerprint), priced for its GPU")
    common.result_arguments(parser, "learned_get")
    args = parser.parse_args(argv)
    with ct.TuningDB(args.db) as db:
        measured_on = database_gpu(parser, db, args.db, args.measured_on)
        with contextlib.ExitStack() as stack:
            if measured_on:
                args.device = "cuda"  # the machine's GPU measurements
                try:
                    stack.enter_context(hardware.measured_on(measured_on))
                except ValueError as exc:
                    parser.error(f"--measured-on: {exc}")
            return judge_all(parser, args, db, measured_on)


def judge_all(parser: argparse.ArgumentParser, args: argparse.Namespace, db: ct.TuningDB,
              measured_on: str | None) -> int:
    names = list(zoo.MODELS) if args.networks == "all" else args.networks.split(",")
    recorded = None if args.orders == "live" else recorded_orders(Path(args.orders))
    orders = None if recorded is None else {key: entry["plans"] for key, entry in recorded.items()}
    samples = learned.samples_from(db, args.device, measured_on, orders)
    if not samples:
        parser.error(f"{args.db} holds no measurements of {measured_on or 'this machine'}'s {args.device}: "
                     f"run bench/sweep.py first")
    here = measured_on or fingerprint(args.device)
    members = network_problems(names, args.batch, args.dtypes.split(","), args.layouts.split(","), args.device,
                               args.layers)
    measured = {s.problem for s in samples}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for network in names:
        held = {p for n, p in members if n == network and p in measured}
        if not held:
            print(f"{network}: none of its layers is in {args.db}; run bench/sweep.py --networks {network}",
                  file=sys.stderr)
            continue
        for row in judge(samples, held, here, recorded):
            groups[(network, row["direction"], row["dtype"])].append(dict(row, network=network))
    reports = [learned.holdout_report(samples, here, seed=args.seed + i) for i in range(max(1, args.splits))]
    report = reports[0]
    # the same splits, every ranking judged on the problems whose cuDNN heuristics' first plans are known
    split_groups: dict[tuple, list[dict]] = defaultdict(list)
    split_finds: dict[tuple, list[dict]] = defaultdict(list)  # every split's problems, for find's table
    split_rows = ordered_rows = 0
    last = args.seed + max(1, args.splits) - 1
    seeds = f"seeds {args.seed}-{last}" if last > args.seed else f"seed {args.seed}"
    for i in range(max(1, args.splits)):
        for row in judge(samples, learned.held_out(samples, seed=args.seed + i), here, recorded):
            split_rows += 1
            split_finds[(f"random, {seeds}", row["direction"], "all")].append(row)
            if row.get("cudnn_A") and row.get("cudnn_B"):
                ordered_rows += 1
                split_groups[(f"random, seed {args.seed + i}", row["direction"], "all")].append(row)
    split_summary, splits = table(split_groups)
    split_find_summary, split_find = find_table(split_finds)
    summary, text = table(groups)
    all_groups = {("all", d, t): [r for k, rows in groups.items() if k[1:] == (d, t) for r in rows]
                  for d, t in sorted({k[1:] for k in groups})}
    overall_summary, overall = table(all_groups)
    rules_summary, rules = table(all_groups, ("learned", "cudnn_B", *RULES))
    distance_summary, distances = table(by_distance(groups), ("learned", "analytic", "cudnn_B"),
                                        ("nearest measured problem",))
    find_summary, find_text = find_table(all_groups)
    error_summary, errors = error_table(all_groups)
    worst = worst_table(all_groups)
    for rows in groups.values():  # the per-candidate errors are in the error table; the rows keep the picks
        for row in rows:
            row.pop("errors", None)
    env = common.environment()
    payload = {"environment": env, "measured_on": measured_on, "samples": len(samples), "problems": len(measured),
               "orders": args.orders if recorded is None else str(Path(args.orders).name),
               "seed": args.seed, "random_split": report, "random_splits": reports,
               "random_splits_by_ranking": split_summary, "overall": overall_summary,
               "rules": rules_summary, "by_distance": distance_summary,
               "find": find_summary, "find_random_splits": split_find_summary, "price_errors": error_summary,
               "by_network": summary, "rows": {f"{k[0]}/{r['problem']}": r for k, rows in groups.items() for r in rows}}
    split = "; ".join(f"seed {args.seed + i}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items())
                      for i, r in enumerate(reports))
    where = f"measured on {measured_on}, judged on " if measured_on else ""
    markdown = (f"# get's learned cost model on networks it never saw\n\n{env['date']}, "
                f"{where}{env.get('gpu', env.get('cpu'))}, torch {env['torch']}, revision {env['revision']}, "
                f"seed {args.seed}; "
                f"{len(samples)} measurements of {len(measured)} problems ({args.db}).\n\n"
                f"Each row: a model built without that network's layers, judged on them; per ranking the "
                f"measured time of its first pick over the best measured: geometric mean / worst / how often "
                f"it is the best. torch_bm0: PyTorch's own call (cudnn.benchmark=False); cudnn_A/B: cuDNN's "
                f"heuristics' first plan (cuDNN's order: {payload['orders']}).\n\n{text}\nAll held-out networks "
                f"together:\n\n{overall}\nRandom splits (a fifth of the problems held out whole: the sweep's problems "
                f"of every dtype and layout, most of them far from any network's layers): {split}. The same splits, "
                f"every ranking judged on the {ordered_rows} of their {split_rows} problems whose cuDNN heuristics' "
                f"first plans A and B are both known and measured:\n\n{splits}\n"
                f"## By how far the nearest measured problem lies\n\nThe same held-out problems, by the distance "
                f"from each to the nearest problem of its direction the model was built from (features scaled to "
                f"unit spread, `LearnedModel.nearest_distance`):\n\n{distances}\n"
                f"## Other rules for picking from the learned prices\n\nOn the same held-out problems: topK, the "
                f"cheapest of the candidates of no ranking backend and cuDNN's first K plans in its order; aM, cuDNN's "
                f"first plan in that order (heuristics A) unless the cheapest is priced M% below it; bM, the same "
                f"against heuristics B's first plan; analytic_b, no learned price: the analytic model with heuristics "
                f"B's first plan moved to the head of cuDNN's order (what `get` would rank, were it to ask heuristics "
                f"B as well).\n\n{rules}\n"
                f"## find in the learned order, on the held-out networks\n\nfind's search simulated on each held-out "
                f"problem's measurements (`learned.simulated_find`: each family's first-ranked candidate, then the "
                f"learned order; a candidate predicted over `prune factor` times the best measured is skipped, not a "
                f"family's first try priced by a guess, and a family's prices come down by as much as its first "
                f"timing ran faster than predicted (`search_rules.SearchPrices`); after "
                f"`patience` candidates in a row without a gain beyond the default tolerance "
                f"({Policy().tolerance:g}) the rest are): the best found over the best measured (geometric mean, "
                f"worst, how many problems above 1.05), the share of candidates run and the share of the candidates' "
                f"summed measured times they take (find spends a multiple of a candidate's time on it); with a "
                f"`contender factor`, a candidate that one of the problem's nearest measured problems timed within "
                f"that factor of its best still runs after the patience ran out (`LearnedModel.contenders`). Order "
                f"'analytic': the search in the order `get` ranks without a learned model (the analytic prices), where "
                f"none is a contender: find without an installed model for the device and before its database holds "
                f"{learned.MIN_MEASURED} problems of the direction. find's "
                f"defaults: patience {settings.find_patience}, prune factor {settings.find_prune_factor:g}, contender "
                f"factor {settings.find_contender_factor:g}.\n\n{find_text}\nThe same on the random splits' problems "
                f"(every dtype and layout; {seeds}):\n\n{split_find}\n"
                f"## What the learned prices get wrong\n\nOn the held-out problems, each candidate's learned price "
                f"against its measured time, per family (cuDNN's execution plans, GEMM lowerings, PyTorch's call, "
                f"convtune's Triton kernels by kernel):\n\n{errors}\n"
                f"The held-out problems where the learned first pick is slowest against the best measured (prices "
                f"and times in ms):\n\n{worst}")
    common.write(args.name, payload, markdown, args.out)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
