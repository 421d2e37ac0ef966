"""The tuning database's corruption suite, shared by tests/test_db.py and bench/reliability.py: a database of
stored finds, damaged many ways (truncations, bit flips, flips that leave valid JSON with another time, runs
of garbage), each copy opened, every problem looked up and a new find stored."""

from __future__ import annotations

import contextlib
import re
import sqlite3
from pathlib import Path
from typing import cast

import torch

from convtune import ConvProblem, PerfResult, Status, TuningDB, sqlite_pages

PROBLEMS = 30  # finds in the file the suite damages


def problem(n: int = 1, **changes) -> ConvProblem:
    fields = dict(direction="fwd", n=n, c=4, k=8, input_size=(8, 8), kernel_size=3, padding=1)
    return ConvProblem(**{**fields, **changes})


# One find's worth: a fast algorithm that needs workspace and is not deterministic, a slower lean
# deterministic one, a TF32 one, and failures that must never be served.
FIND = [
    PerfResult("cpu:fast", Status.OK, time_ms=1.0, spread_ms=0.01, workspace_bytes=1 << 20, deterministic=False,
               rel_error=1e-6),
    PerfResult("cpu:lean", Status.OK, time_ms=3.0, spread_ms=0.02, workspace_bytes=0, rel_error=2e-6),
    PerfResult("cpu:mid", Status.OK, time_ms=1.5, workspace_bytes=1 << 10, uses_tf32=True, rel_error=1e-3),
    PerfResult("cpu:wrong", Status.WRONG_RESULT, time_ms=0.1, rel_error=1.0, message="max error 1.0"),
    PerfResult("cpu:oom", Status.OUT_OF_MEMORY, message="needs 1 TiB"),
]


def stored_file(path: Path, problems: int) -> dict[str, tuple]:
    """A closed database of ``problems`` finds, each told apart by its times; what each problem may serve: its
    selection from the whole find (a row lost may be the one it selects: the rest would serve the next best as if it
    were the best)."""
    allowed: dict[str, tuple] = {}
    with TuningDB(path) as tdb:
        for n in range(1, problems + 1):
            find = [PerfResult(r.algorithm, r.status, time_ms=None if r.time_ms is None else r.time_ms * n,
                               workspace_bytes=r.workspace_bytes, deterministic=r.deterministic,
                               uses_tf32=r.uses_tf32, rel_error=r.rel_error, message=r.message) for r in FIND]
            tdb.store(problem(n), find)
            best = cast(PerfResult, tdb.lookup(problem(n)))
            allowed[problem(n).key] = (best.algorithm, best.time_ms, best.workspace_bytes, best.rel_error)
    return allowed


def damages(data: bytes) -> list[tuple[str, int]]:
    """Truncations at 24 offsets, 48 random bit flips, flips that change a stored time and still read as valid
    JSON, and 12 runs of garbage."""
    size = len(data)
    generator = torch.Generator().manual_seed(7)
    flips = torch.randint(0, size * 8, (48,), generator=generator).tolist()
    # and flips that leave a row valid JSON with another time (a digit's low bit): only checksums catch them
    times = [m.end() - 1 for m in re.finditer(rb'"time_ms": [0-9]', data)][::10]
    return ([("truncate", size * i // 24) for i in range(24)] + [("flip", bit) for bit in flips]
            + [("flip", 8 * at) for at in times] + [("garbage", size * i // 12) for i in range(12)])


def damage(path: Path, kind: str, at: int) -> None:
    data = bytearray(path.read_bytes())
    if kind == "truncate":
        data = data[:at]
    elif kind == "flip":
        data[at // 8] ^= 1 << (at % 8)
    else:
        data[at:at + 512] = torch.randint(0, 256, (len(data[at:at + 512]),), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(at)).numpy().tobytes()
    path.write_bytes(bytes(data))


def rows_by_page(data: bytes) -> dict[int, set[str]]:
    """The checksums of the results rows on each table leaf page of the database file ``data``."""
    size = cast(int, sqlite_pages.page_size(data))  # (an undamaged file)
    pages = {}
    for number in range(1, len(data) // size + 1):
        checksums = {row[7] for row in sqlite_pages.page_rows(data, size, size - data[20], number) if len(row) == 8}
        if checksums:
            pages[number] = checksums
    return pages


def unchanged_rows(pristine: bytes, damaged: bytes, by_page: dict[int, set[str]]) -> set[str]:
    """The rows (checksums) of ``by_page`` whose page ``damaged`` holds unchanged and whole."""
    size = cast(int, sqlite_pages.page_size(pristine))
    return {checksum for number, checksums in by_page.items()
            for start in ((number - 1) * size,) if damaged[start:start + size] == pristine[start:start + size]
            for checksum in checksums}


def corruption_suite(folder: Path,
                     problems: int = PROBLEMS) -> tuple[dict[str, int], dict[tuple[str, int], int], list]:
    """Every damage of ``damages`` to a copy of a database of ``problems`` finds: (counts, lost lookups per
    damage, faults). counts: tried; clean (opening, looking every problem up and storing again raised nothing,
    every answer was the one the undamaged file served or none, and the new find is served); unclean
    (something else was served, or the new find was not); crashes (an exception escaped); lost (lookups that
    found nothing: a lost row is a new measurement, never a wrong selection); intact_rows (rows on pages the
    damage left as they were, summed over the copies) and intact_lost (those not in the database afterwards).
    faults: (kind, at, what)."""
    pristine = folder / "pristine.sqlite"
    allowed = stored_file(pristine, problems)
    counts = {"tried": 0, "clean": 0, "unclean": 0, "crashes": 0, "lost": 0, "intact_rows": 0, "intact_lost": 0}
    by_page = rows_by_page(pristine.read_bytes())
    lost: dict[tuple[str, int], int] = {}
    faults = []
    for i, (kind, at) in enumerate(damages(pristine.read_bytes())):
        path = folder / f"damaged{i}" / "tuning.sqlite"
        path.parent.mkdir()
        path.write_bytes(pristine.read_bytes())
        damage(path, kind, at)
        damaged = path.read_bytes()
        counts["tried"] += 1
        try:
            with TuningDB(path) as tdb:
                served = {key: tdb.lookup(ConvProblem.from_key(key)) for key in allowed}
                wrong = [key for key, r in served.items() if r is not None
                         and (r.algorithm, r.time_ms, r.workspace_bytes, r.rel_error) != allowed[key]]
                lost[kind, at] = sum(r is None for r in served.values())
                counts["lost"] += lost[kind, at]
                tdb.store(problem(99), FIND)
                usable = tdb.lookup(problem(99)).algorithm == "cpu:fast"
        except Exception as exc:  # noqa: BLE001  (counted: whatever escapes is a crash)
            counts["crashes"] += 1
            faults.append((kind, at, f"{type(exc).__name__}: {exc}"))
            continue
        # Every row on a page the damage left as it was must still be there.
        intact = unchanged_rows(pristine.read_bytes(), damaged, by_page)
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.text_factory = lambda raw: raw.decode("utf-8", errors="replace")  # a flip that passed the checks
            present = {checksum for (checksum,) in conn.execute("SELECT checksum FROM results")}
        counts["intact_rows"] += len(intact)
        counts["intact_lost"] += len(intact - present)
        if intact - present:
            faults.append((kind, at, f"{len(intact - present)} rows on undamaged pages lost"))
        counts["clean" if not wrong and usable else "unclean"] += 1
        if wrong or not usable:
            faults.append((kind, at, f"served {wrong}" if wrong else "the new find was not served"))
    return counts, lost, faults
