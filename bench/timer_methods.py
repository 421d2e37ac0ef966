"""What the timer's method costs and whether a cheaper one picks the same: candidates of a network's problems timed
by each method in turn.

A cold ``find`` of ResNet-50 b32's training problems spent 3.9 of its 9.1 s in the timer with 1 ms samples (its first
calls, sizing calls, a CUDA graph captured per candidate, the samples: tuning_cost_resnet50_b32_t8_base.md). Here the
first problems of a network's training step (``--problems``) and each one's first candidates in find's order
(``--candidates``; one that fails to run is left
out) are timed by ``timing.benchmark`` under each method, the methods taking turns in a shuffled order per candidate:

- default: the settings as they are (by default a CUDA graph of the calls of a 0.25 ms sample,
  ``settings.timing_sample_ms``);
- default again: the same, for the noise between two timings of one method;
- the methods named by ``--methods``, settings joined by '/': ``sample=<ms>`` (``timing_sample_ms``),
  ``eager=<ms>`` (``timing_eager_above_ms``: calls that long timed in an eager loop, no graph) and ``graph=<calls>``
  (``timing_graph_calls``: a graph of at most that many calls, replayed as often as a sample needs).

Per method: the timer's wall seconds over all candidates, each candidate's median over the default's (median and
10th-90th percentile), the problems (of two candidates or more) whose fastest candidate differs from the default's,
and what those changed picks cost (the default's time of the method's pick over the default's best; geometric mean
and worst). Needs a GPU.

    python bench/timer_methods.py --network resnet50 --batch 32 --problems 30 --candidates 6 \\
        --methods sample=1,sample=0.1,graph=8,eager=0.1
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from convtune import Policy  # noqa: E402
from convtune.algorithms.registry import algorithms  # noqa: E402
from convtune.get import ranked_predictions  # noqa: E402
from convtune.settings import settings  # noqa: E402
from convtune.timing import benchmark, percentile  # noqa: E402
from convtune.verify import reference  # noqa: E402
from layers import checked_call  # noqa: E402
from tuning_cost import training_problems  # noqa: E402

SETTINGS = {"sample": "timing_sample_ms", "eager": "timing_eager_above_ms", "graph": "timing_graph_calls"}


def parse_method(text: str) -> dict:
    """'eager=0.1/sample=0.25' -> {'timing_eager_above_ms': 0.1, 'timing_sample_ms': 0.25}; 'graph=16' ->
    {'timing_graph_calls': 16}; ValueError naming it."""
    out: dict = {}
    for part in text.split("/"):
        key, _, value = part.partition("=")
        if key not in SETTINGS:
            raise ValueError(f"method {text!r}: {key!r} is not one of {', '.join(SETTINGS)} "
                             f"(e.g. eager=0.1/sample=0.25, graph=16)")
        if key == "graph":
            if not value.isdigit():
                raise ValueError(f"method {text!r}: graph takes a whole number of calls, 0 or more, not {value!r}")
            out[SETTINGS[key]] = int(value)
            continue
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"method {text!r}: {value!r} is not a number of ms") from None
        if not math.isfinite(ms) or ms < 0 or (key == "sample" and ms == 0):
            raise ValueError(f"method {text!r}: {key} must be a finite number of ms above 0 (eager: 0 or more)")
        out[SETTINGS[key]] = ms
    return out


def candidates_of(problem, count: int) -> list:
    """The first ``count`` candidates of ``problem`` in find's order that run and compute it right (checked against
    float64 as ``layers.checked_call`` checks), each with its call (as find times it)."""
    inputs = problem.random_inputs(seed=0)
    ref = reference(problem, *inputs)
    out = []
    for algorithm, _ in ranked_predictions(problem, algorithms(problem), Policy(), keep_filters=False):
        if len(out) == count:
            break
        call, _, _ = checked_call(problem, algorithm, inputs, ref)
        if call is not None:  # one that fails or computes wrong is not timed (find gives it a status)
            out.append((algorithm.name, call))
    return out


def measure(problems: list, count: int, methods: dict[str, dict]) -> dict:
    """{problem key: {candidate: {method: (median ms, timer wall s)}}}, the methods in a shuffled order each time."""
    shuffled = random.Random(0)
    rows: dict = {}
    for problem in problems:
        rows[problem.key] = {}
        for name, call in candidates_of(problem, count):
            order = list(methods)
            shuffled.shuffle(order)  # no method always next to another (the default's two timings included)
            row = {}
            for method in order:
                with settings.override(**methods[method]):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    timing = benchmark(call, device=problem.device)
                    row[method] = (timing.median_ms, time.perf_counter() - start)
            rows[problem.key][name] = row
        print(f"{problem.key}: {len(rows[problem.key])} candidates", file=sys.stderr, flush=True)
    return rows


def summary(rows: dict, methods: list[str]) -> list[list]:
    """Per method: [name, timer wall s, median and 10th-90th percentile of the candidates' ratios to the default,
    the problems (of those with two candidates or more) whose fastest changes, and the changed picks' default time
    over the default's best (geometric mean / worst; '-' where none changed)]."""
    table = []
    for method in methods:
        ratios, wall, choices, losses = [], 0.0, 0, []
        for by_candidate in rows.values():
            for times in by_candidate.values():
                ratios.append(times[method][0] / times["default"][0])
                wall += times[method][1]
            if len(by_candidate) < 2:
                continue
            choices += 1
            default_pick = min(by_candidate, key=lambda c: by_candidate[c]["default"][0])
            pick = min(by_candidate, key=lambda c: by_candidate[c][method][0])
            if pick != default_pick:
                losses.append(by_candidate[pick]["default"][0] / by_candidate[default_pick]["default"][0])
        spread = (f"{percentile(ratios, 0.5):.3f}", f"{percentile(ratios, 0.1):.3f}-{percentile(ratios, 0.9):.3f}") \
            if ratios else ("-", "-")
        cost = f"{math.exp(sum(map(math.log, losses)) / len(losses)):.3f} / {max(losses):.3f}" if losses else "-"
        table.append([method, f"{wall:.2f}", *spread, f"{len(losses)} of {choices}", cost])
    return table


def markdown(env: dict, payload: dict) -> str:
    cfg = payload["config"]
    return (f"# The timer's methods: their cost and their picks\n\n{common.env_line(env)}. {cfg['network']} "
            f"b{cfg['batch']} {cfg['dtype']}, the first {cfg['problems']} training problems, each one's first "
            f"{cfg['candidates']} candidates in find's order; each candidate timed by every method in a shuffled "
            f"order. The default: "
            + (", ".join(f"{name} {value:g}" for name, value in cfg["default"].items()) if "default" in cfg
               else "the settings of its revision")
            + ". `bench/timer_methods.py`."
            "\n\n" + common.md_table(["method", "timer wall s", "median / default's", "10th-90th percentile",
                                        "problems whose fastest changes", "the changed picks' default time / best: "
                                        "geometric mean / worst"], payload["summary"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.network_arguments(parser)
    parser.set_defaults(batch=32)
    parser.add_argument("--problems", type=int, default=30, help="the network's first training problems timed")
    parser.add_argument("--candidates", type=int, default=6, help="candidates per problem, in find's order")
    parser.add_argument("--methods", default="sample=1,sample=0.1,graph=8,eager=0.1",
                        help="methods besides the default, each settings joined by '/', separated by commas")
    common.result_arguments(parser, "timer_methods")
    args = parser.parse_args()
    if args.device != "cuda" or not torch.cuda.is_available():
        parser.error("timer_methods.py compares CUDA timing methods: it needs --device cuda and a GPU")
    try:
        methods = {"default": {}, "default again": {}} | {m: parse_method(m) for m in args.methods.split(",") if m}
    except ValueError as exc:
        parser.error(f"--methods: {exc}")
    problems = training_problems(args.network, args.batch, args.dtype, args.layout, args.device)[:args.problems]
    rows = measure(problems, args.candidates, methods)
    env = common.environment()
    config = dict(network=args.network, batch=args.batch, dtype=args.dtype, problems=len(problems),
                  candidates=args.candidates, methods=methods,
                  default={name: getattr(settings, name) for name in SETTINGS.values()})
    payload = dict(environment=env, config=config, rows=rows, summary=summary(rows, list(methods)))
    text = markdown(env, payload)
    common.write(args.name, payload, text, args.out)
    print(text)


if __name__ == "__main__":
    main()
