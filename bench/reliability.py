"""How find treats misbehaving candidates: counts of tried / clean / unclean / crashes.

Each adversarial plug-in is offered to ``find`` beside a correct, slower one, on small CPU problems
of every direction and dtype. It is fast (or claims to be), so a search that does not catch it selects
it. Per adversary and problem:

- clean: find went on, and what it would select is the correct candidate;
- unclean: find selected the adversary, or stored it as ``ok``;
- crash: find raised, or the process running it died;
- untested: find did not run it (none here: every candidate is run, ``find_patience=0`` and
  ``find_prune_factor=0``).

The numerical adversaries (tests/fakes.py: wrong, NaN, unwritten, input-writing, first-call-only,
poison-sniffing, memoising, one wrong element; raising from a run or from its description) run in
this process (``isolate='off'``: they need no worker, and verification alone must catch them), on
problems of every direction and dtype. The process-level ones (tests/adversaries.py: exits,
segfaults, hangs, calls ``sys.exit``, writes its inputs later, hides 64 MiB of workspace) run as
plug-ins under the default isolation, in a worker process, on one problem (float32 forward).

Then the inputs a user may pass (tests/test_fuzz.py's properties, with their hypothesis strategies and
numbers of examples): ConvProblem's and Policy's fields, the command line's arguments, layer files, the
cache command's paths and files, settings from the environment. Per input: clean when it is handled or
refused with a clean error (TypeError or ValueError; exit status 2 and one line for the CLI),
unclean when the check fails (an internal error, a problem that does not round-trip), crash when an
exception escapes.

Then the tuning database damaged (tests/damage.py, as tests/test_db.py runs it): a file of 30 stored
finds truncated at 24 offsets, 48 random bit flips, flips that change a stored time and still read as
valid JSON, 12 runs of garbage. Per damaged copy: clean when opening it, looking every problem up and
storing a new find raised nothing, every answer was what the undamaged file served (or none),
and the new find is served; unclean otherwise; crash when an exception escaped; lost: the lookups that
found nothing (a lost row is measured again, never a wrong selection); and of the rows on pages the damage
left as they were, how many were lost (none should be).

    python bench/reliability.py                    # writes bench/results/reliability.{json,md}
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the adversaries live beside the tests that use them
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent / "tests"), os.environ.get("PYTHONPATH")]))

import adversaries  # noqa: E402
import common  # noqa: E402
import convtune as ct  # noqa: E402
import damage  # noqa: E402
import fakes  # noqa: E402
from convtune.algorithms.base import Algorithm  # noqa: E402
from convtune.ranking import best  # noqa: E402
from convtune.settings import settings  # noqa: E402

KINDS = ("tried", "clean", "unclean", "crash", "untested")
FAST = 1e-3  # ms a numerical adversary claims per run: faster than the correct candidate's 1 ms


class RaisesIn(fakes.Fake):
    """Right when it runs, but one of its description methods raises."""

    def __init__(self, method: str) -> None:
        super().__init__(f"fake:raises_in_{method}", time_ms=FAST)
        self.method = method

    def supports(self, problem):
        if self.method == "supports":
            raise RuntimeError("supports() broke")
        return super().supports(problem)

    def buffers(self, problem):
        if self.method == "buffers":
            raise RuntimeError("buffers() broke")
        return super().buffers(problem)

    def notes(self, problem):
        if self.method == "notes":
            raise RuntimeError("notes() broke")
        return super().notes(problem)


def numerical() -> list[Algorithm]:
    made = [cls(time_ms=FAST) for cls in (fakes.Raising, fakes.OutOfMemory, fakes.NaNResult, fakes.NoWrite,
                                          fakes.InputWriter, fakes.FirstCallOnly, fakes.PoisonSniffer,
                                          fakes.UniformSniffer, fakes.OneWrongElement, fakes.Memoising)]
    # 5% off: wrong in every dtype (1% is within bfloat16's tolerance, 1.6%: a right answer there)
    made.append(fakes.WrongResult(scale=1.05, time_ms=FAST))
    return made + [RaisesIn(method) for method in ("supports", "buffers", "notes")]


def process_level() -> list[tuple[Algorithm, ct.Policy]]:
    quick = ct.Policy(deadline_s=1.0)
    return [(adversaries.Exits(), quick), (adversaries.Segfaults(), quick), (adversaries.Hangs(), quick),
            (adversaries.CallsExit(), quick), (adversaries.WritesItsInputsLater(), quick),
            (adversaries.HiddenAllocation(), ct.Policy(deadline_s=1.0, workspace_limit=0))]


def problems() -> list[ct.ConvProblem]:
    return [ct.ConvProblem(direction, n=4, c=16, k=16, input_size=(16, 16), kernel_size=3, padding=1, dtype=dtype)
            for dtype in ("float32", "float16", "bfloat16") for direction in ("fwd", "bwd_data", "bwd_filter")]


def judge(adversary: Algorithm, problem: ct.ConvProblem, policy: ct.Policy) -> tuple[str, str]:
    """('clean' | 'unclean' | 'crash', what happened)."""
    correct = fakes.Fake("fake:correct", time_ms=1.0)
    try:
        results = ct.find(problem, policy, candidates=[adversary, correct])
    except BaseException as exc:  # noqa: BLE001 - whatever escapes find is a crash, counted
        return "crash", f"find raised {type(exc).__name__}: {exc}"
    mine = next((r for r in results if r.algorithm == adversary.name), None)
    pick = best(results, policy, problem.dtype)
    if mine is None:
        return "untested", "find did not offer it"
    if mine.status == ct.Status.SKIPPED:
        return "untested", f"find did not run it ({mine.message})"
    status = f"{mine.status.value} ({mine.message.split(';')[0][:60]})"
    if (pick is not None and pick.algorithm == adversary.name) or (mine is not None and mine.ok):
        return "unclean", f"{status}; selected {pick.algorithm if pick else None}"
    if pick is None or pick.algorithm != correct.name:
        return "unclean", f"{status}; the correct candidate was not selected ({pick.algorithm if pick else None})"
    return "clean", status


def fuzz() -> dict[str, dict[str, int]]:
    """tried / clean / unclean / crash per input property of tests/test_fuzz.py."""
    from test_fuzz import PROPERTIES

    counts: dict[str, dict[str, int]] = {}
    for name, (strategy, examples, check) in PROPERTIES.items():
        counts[name] = _counted(strategy, examples, check)
        print(f"inputs: {name:32s} {counts[name]}", flush=True)
    return counts


def _counted(strategy, examples: int, check) -> dict[str, int]:
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hsettings

    tally = dict.fromkeys(("tried", "clean", "unclean", "crash"), 0)

    @hsettings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def each(value):
        try:
            verdict = "clean" if check(value) else "unclean"
        except Exception:  # noqa: BLE001  (what the count is for)
            verdict = "crash"
        tally["tried"] += 1
        tally[verdict] += 1

    each()
    return tally


def markdown(payload: dict) -> str:
    rows = [[name, *(payload["by_adversary"][name].get(k, 0) for k in KINDS),
             "; ".join(sorted(set(payload["how"][name])))] for name in payload["by_adversary"]]
    totals = payload["totals"]
    return (f"# Reliability: misbehaving candidates offered to find, and inputs\n\n"
            f"{common.env_line(payload['environment'])}. {payload['elapsed_s']:.0f} s. Each adversary beside a "
            f"correct, slower candidate (`bench/reliability.py`); "
            f"clean: find ran it, went on and selects the correct one; unclean: it selected the adversary or kept "
            f"it as ok; crash: find raised; untested: find did not run it.\n\n"
            f"Totals: {totals['tried']} tried, {totals['clean']} clean, {totals['unclean']} unclean, "
            f"{totals['crash']} crashes, {totals['untested']} untested.\n\n"
            + common.md_table(["adversary", *KINDS, "find's verdict on it"], rows) + _inputs_markdown(payload))


def _inputs_markdown(payload: dict) -> str:
    inputs = payload.get("inputs")
    if not inputs:  # written before the inputs were counted
        return ""
    kinds = ("tried", "clean", "unclean", "crash")
    totals = {k: sum(t[k] for t in inputs.values()) for k in kinds}
    return ("\n\n## Inputs a user may pass\n\nEach property of `tests/test_fuzz.py` on inputs its hypothesis strategy "
            "makes; clean: handled, or refused with a TypeError or ValueError (the CLI: exit status 2, "
            "one line); unclean: its check failed; crash: an exception escaped.\n\n"
            f"Totals: {totals['tried']} tried, {totals['clean']} clean, {totals['unclean']} unclean, "
            f"{totals['crash']} crashes.\n\n"
            + common.md_table(["input", *kinds], [[name, *(t[k] for k in kinds)] for name, t in inputs.items()])
            + _database_markdown(payload))


def database() -> dict:
    """The corruption suite's counts (tests/damage.py), the lookups lost per kind of damage, and its faults."""
    with tempfile.TemporaryDirectory() as tmp:
        counts, lost, faults = damage.corruption_suite(Path(tmp))
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, _), n in lost.items():
        tally = by_kind.setdefault(kind, {"damages": 0, "lost": 0})
        tally["damages"] += 1
        tally["lost"] += n
    return {"counts": counts, "lost_by_kind": by_kind, "faults": [list(f) for f in faults],
            "problems": damage.PROBLEMS}


def _database_markdown(payload: dict) -> str:
    db = payload.get("database")
    if not db:  # written before the database was counted
        return ""
    c = db["counts"]
    rows = [[kind, t["damages"], t["lost"]] for kind, t in db["lost_by_kind"].items()]
    return ("\n\n## The tuning database damaged\n\n`tests/damage.py`'s corruption suite: copies of a file of "
            f"{db['problems']} stored finds, each damaged once, opened, every problem looked up and a new find "
            "stored (clean: nothing raised, nothing served but what the undamaged file served for that problem, the "
            "new find served).\n\n"
            f"Totals: {c['tried']} tried, {c['clean']} clean, {c['unclean']} unclean, {c['crashes']} crashes, "
            f"{c['lost']} of {c['tried'] * db['problems']} lookups lost (measured again, never served wrong)"
            + (f"; of the {c['intact_rows']} rows on pages the damage left as they were (summed over the copies), "
               f"{c['intact_lost']} lost" if "intact_rows" in c else "") + ".\n\n"
            + common.md_table(["damage", "copies", "lookups lost"], rows)
            + ("".join(f"\n- {kind} at {at}: {what}" for kind, at, what in db["faults"]) if db["faults"] else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.result_arguments(parser, "reliability")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    by_adversary: dict[str, dict[str, int]] = {}
    how: dict[str, list[str]] = {}

    def count(adversary: Algorithm, problem: ct.ConvProblem, policy: ct.Policy) -> None:
        verdict, what = judge(adversary, problem, policy)
        tally = by_adversary.setdefault(adversary.name, {})
        for key in ("tried", verdict):
            tally[key] = tally.get(key, 0) + 1
        how.setdefault(adversary.name, []).append(what if verdict == "clean" else f"{verdict}: {what}")
        print(f"{adversary.name:32s} {problem.key[:60]:60s} {verdict}: {what[:80]}", flush=True)

    with settings.override(find_patience=0, find_prune_factor=0):  # every candidate run
        with settings.override(isolate="off"):
            for problem in problems():
                for adversary in numerical():
                    count(adversary, problem, ct.Policy())
        for adversary, policy in process_level():  # plug-ins: in a worker process, as by default
            count(adversary, problems()[0], policy)
    totals = {k: sum(t.get(k, 0) for t in by_adversary.values()) for k in KINDS}
    inputs = fuzz()
    stored = database()
    payload = {"environment": common.environment(), "elapsed_s": time.perf_counter() - start,
               "by_adversary": by_adversary, "how": how, "totals": totals, "inputs": inputs, "database": stored}
    text = markdown(payload)
    common.write(args.name, payload, text, args.out)
    print(text)
    bad_inputs = sum(t["unclean"] + t["crash"] for t in inputs.values())
    bad_files = stored["counts"]["unclean"] + stored["counts"]["crashes"]
    return 0 if totals["unclean"] == totals["crash"] == totals["untested"] == 0 == bad_inputs == bad_files else 1


if __name__ == "__main__":
    raise SystemExit(main())
