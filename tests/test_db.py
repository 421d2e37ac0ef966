"""The tuning database: round trips, policies answered from storage, concurrency, recovery, export/import."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import doctest
import gzip
import json
import logging
import multiprocessing
import os
import pickle
import re
import shutil
import sqlite3
import sys
import threading
from pathlib import Path

import pytest
import torch

import convtune as ct
from convtune import ConvProblem, PerfResult, Policy, Status, TuningDB, db_file, export_lines, hardware, salvage
from convtune import db as db_module
from convtune.settings import settings
from damage import FIND, corruption_suite, problem, stored_file


@pytest.fixture
def db(tmp_path):
    with TuningDB(tmp_path / "tuning.sqlite") as tdb:
        yield tdb


def rows(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT count(*) FROM results").fetchone()[0]


def aside(path: Path, kind: str) -> list[Path]:
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(f"{path.name}.{kind}"))


# -- round trip and policies -------------------------------------------------------------------
def test_store_results_lookup_round_trip(db, tmp_path):
    p = problem()
    db.store(p, FIND)
    assert db.results(p) == FIND
    assert db.lookup(p).algorithm == "cpu:fast"
    assert [db.result(p, r.algorithm) for r in FIND] == FIND  # one row by its algorithm
    assert db.result(p, "cpu:none") is None and db.result(problem(n=2), "cpu:fast") is None
    assert db.results(problem(n=2)) == [] and db.lookup(problem(n=2)) is None
    db.close()
    with TuningDB(tmp_path / "tuning.sqlite") as again:  # another connection reads the same
        assert again.results(p) == FIND
        again.store(p, FIND[1:2])  # a new find replaces the old one, it does not add to it
        assert again.results(p) == FIND[1:2]
    assert db.results(p) == FIND[1:2]  # the closed object reopens


@pytest.mark.parametrize("policy, expected", [
    (Policy(), "cpu:fast"),
    (Policy(workspace_limit="1KiB"), "cpu:mid"),
    (Policy(workspace_limit=0), "cpu:lean"),
    (Policy(deterministic=True), "cpu:mid"),
    (Policy(deterministic=True, allow_tf32=False), "cpu:lean"),
    (Policy(prefer="least_memory"), "cpu:lean"),
    (Policy(max_rel_error=1e-4), "cpu:fast"),
    (Policy(max_rel_error=1e-4, workspace_limit="1KiB"), "cpu:lean"),
    (Policy(tolerance=0.6), "cpu:mid"),  # 1.5 ms ties with 1.0 ms, and the tie goes to less workspace
])
def test_another_policy_is_answered_from_stored_results(db, policy, expected):
    p = problem()
    db.store(p, FIND)
    assert db.lookup(p, policy).algorithm == expected


def test_lookup_never_serves_a_failure(db):
    p = problem()
    db.store(p, [r for r in FIND if not r.ok])
    assert len(db.results(p)) == 2
    assert db.lookup(p) is None


def test_measurements_lists_ok_results_of_this_device(db):
    p1, p2 = problem(1), problem(2, direction="bwd_data")
    db.store(p1, FIND)
    db.store(p2, FIND[:1])
    got = db.measurements("cpu")
    assert [(p, r.algorithm) for p, r in got] == [(p1, "cpu:fast"), (p1, "cpu:lean"), (p1, "cpu:mid"),
                                                  (p2, "cpu:fast")]
    if not torch.cuda.is_available():
        assert db.measurements("cuda") == []


def test_entries_summarise_each_problem(db):
    p = problem()
    db.store(p, FIND)
    db.store(problem(2), FIND[3:])
    entries = {e.problem: e for e in db.entries()}
    assert entries[p.key].num_results == 5
    assert (entries[p.key].best_algorithm, entries[p.key].best_ms) == ("cpu:fast", 1.0)
    assert entries[problem(2).key].best_algorithm is None and entries[problem(2).key].best_ms is None
    assert all(e.usable and e.fingerprint == hardware.fingerprint("cpu") for e in entries.values())
    assert all(e.software == hardware.software_versions() and e.stored_at > 0 for e in entries.values())


def test_store_refuses_what_it_could_not_read_back(db):
    with pytest.raises(TypeError, match="PerfResult"):
        db.store(problem(), [{"algorithm": "x", "status": "ok"}])
    with pytest.raises(ValueError, match="time_ms"):
        db.store(problem(), [PerfResult("x", "ok", time_ms=float("nan"))])
    with pytest.raises(TypeError, match="ConvProblem"):
        db.store("fwd|n1", FIND)
    assert db.entries() == []


def test_clear_removes_every_row(db):
    db.store(problem(1), FIND)
    db.store(problem(2), FIND[:2])
    assert db.clear() == 7
    assert db.entries() == [] and db.lookup(problem(1)) is None


# -- concurrency --------------------------------------------------------------------------------
PROBLEMS_PER_WRITER = 100


def _write_many(tdb: TuningDB, writer: int) -> None:
    for i in range(PROBLEMS_PER_WRITER):
        p = problem(n=1 + writer * 1000 + i)
        tdb.store(p, [PerfResult(f"w{writer}:a", "ok", time_ms=1.0 + i), PerfResult(f"w{writer}:b", "failed")])
        assert tdb.lookup(p).algorithm == f"w{writer}:a"


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method")
def test_processes_writing_at_once_lose_nothing(tmp_path):
    tdb = TuningDB(tmp_path / "tuning.sqlite")
    tdb.store(problem(999_999), FIND)  # the parent's connection is open when it forks: children must not use it
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_many, args=(tdb, w)) for w in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0, 0, 0]
    assert len(tdb.entries()) == 4 * PROBLEMS_PER_WRITER + 1
    assert rows(tdb.path) == 2 * 4 * PROBLEMS_PER_WRITER + len(FIND)
    assert tdb.lookup(problem(1 + 3 * 1000 + 7)).time_ms == 8.0
    tdb.close()


def _create_and_write(path: Path, writer: int) -> None:
    with TuningDB(path) as tdb:
        _write_many(tdb, writer)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method")
def test_processes_racing_to_create_the_file_lose_nothing(tmp_path):
    path = tmp_path / "fresh" / "tuning.sqlite"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_create_and_write, args=(path, w)) for w in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0, 0, 0]
    assert not aside(path, "corrupt") and not aside(path, "schema")  # nobody took a half-created file for a corrupt one
    with TuningDB(path) as tdb:
        assert len(tdb.entries()) == 4 * PROBLEMS_PER_WRITER
        assert rows(path) == 2 * 4 * PROBLEMS_PER_WRITER


def _write_until_killed(path: Path, writer: int, done) -> None:
    with TuningDB(path) as tdb:
        for i in range(10_000):
            tdb.store(problem(n=1 + writer * 100_000 + i), FIND)
            done.put((writer, i))  # after the store returned: committed


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method")
def test_writers_killed_mid_transaction_lose_nothing_they_committed(tmp_path):
    # Rounds of 3 processes storing finds as fast as they can, each SIGKILLed after a random delay (so
    # many die inside a transaction): the file must open cleanly, serve every find a writer finished, and
    # take new ones. Counts for the reliability report: tried / clean / unclean / crashes / lost.
    import random
    import signal
    import time

    path = tmp_path / "tuning.sqlite"
    ctx = multiprocessing.get_context("fork")
    counts = {"tried": 0, "clean": 0, "unclean": 0, "crashes": 0, "lost": 0}
    committed: list[tuple[int, int]] = []
    delays = random.Random(5)
    for round_ in range(4):
        done = ctx.Queue()
        procs = [ctx.Process(target=_write_until_killed, args=(path, 3 * round_ + w, done)) for w in range(3)]
        for proc in procs:
            proc.start()
        time.sleep(0.3)  # the file exists and every writer has begun
        for proc in procs:
            time.sleep(delays.uniform(0.0, 0.05))
            os.kill(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.join(timeout=60)
        while True:  # a writer killed while putting may leave half a message: read up to there
            try:
                committed.append(done.get(timeout=0.5))
            except Exception:  # queue.Empty, or that half message
                break
        counts["tried"] += len(procs)
        try:
            with TuningDB(path) as tdb:
                missing = [(w, i) for w, i in committed if tdb.lookup(problem(n=1 + w * 100_000 + i)) is None]
                tdb.store(problem(99), FIND)
                usable = tdb.lookup(problem(99)).algorithm == "cpu:fast"
        except Exception as exc:  # counted, and the assertion names it
            counts["crashes"] += len(procs)
            raise AssertionError(f"round {round_}: {type(exc).__name__}: {exc}") from exc
        counts["lost"] += len(missing)
        counts["clean" if not missing and usable else "unclean"] += len(procs)
        assert not missing and usable, missing[:5]
    assert all(proc.exitcode == -signal.SIGKILL for proc in procs)  # killed, not finished
    print(f"killed writers: {counts}, {len(committed)} committed finds checked")
    assert counts == {"tried": 12, "clean": 12, "unclean": 0, "crashes": 0, "lost": 0} and len(committed) > 12
    assert not aside(path, "corrupt")


def test_threads_sharing_one_object(db):
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(25):
                db.store(problem(n=1 + t * 100 + i), FIND[:2])
                db.entries()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(db.entries()) == 100


# -- bad files ----------------------------------------------------------------------------------
def _truncated_db(path: Path) -> None:
    with TuningDB(path) as tdb:
        for i in range(200):
            tdb.store(problem(1 + i), [PerfResult("x", "ok", time_ms=1.0, message="m" * 300)])
    size = path.stat().st_size
    assert size > 8 * 4096
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _random_bytes(path: Path) -> None:
    path.write_bytes(torch.randint(0, 256, (20000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
                     .numpy().tobytes())


@pytest.mark.parametrize("content", [b"{\"lr\": 0.1}\n", b"PK\x03\x04model", None,
                                     b"CREATE TABLE results (fingerprint TEXT);\n" * 20],
                         ids=["json", "zip", "random", "sql"])
def test_a_file_the_caller_names_that_is_not_a_database_is_refused_and_left_as_it_is(tmp_path, caplog, content):
    # A path given by mistake (a config, a checkpoint) was moved aside as a damaged database, and a new database took
    # its name: only convtune's own database is moved aside where it is not a SQLite file.
    path = tmp_path / "model.pt"
    if content is None:
        _random_bytes(path)
    else:
        path.write_bytes(content)
    before = path.read_bytes()
    for attempt in (lambda: TuningDB(path), lambda: ct.get(problem(1), db=str(path))):
        with pytest.raises(ValueError, match=r"model\.pt is not a tuning database \(not a SQLite file\), and is left"):
            attempt()
    # optimize, where a database is only a means: the temporary one, with a warning naming the file
    with caplog.at_level(logging.WARNING, logger="convtune.db"):
        ct.optimize(torch.nn.Conv2d(2, 2, 3), torch.randn(1, 2, 6, 6), db=str(path))
    assert any("model.pt is not a tuning database" in r.getMessage() for r in caplog.records)
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_nothing_convtune_writes_replaces_a_tuning_database(tmp_path):
    # An export, a learned model, an HTML report: each refuses a SQLite database, or its companions, as its path.
    from convtune import learned
    from convtune.html_report import write_report

    path = tmp_path / "keep.sqlite"
    with TuningDB(path) as tdb:
        tdb.store(problem(1), [PerfResult("x", "ok", time_ms=1.0)])
    before = path.read_bytes()
    (tmp_path / "keep.sqlite-wal").write_bytes(b"")
    db = TuningDB(path)
    writers = (db.export, learned.writable_model_path,
               lambda target: write_report(ct.plan([problem(1)], "1KiB", db=db), target, "t", db=db))
    (tmp_path / "out.jsonl").symlink_to(tmp_path / "keep.sqlite-wal")  # (a link's name says nothing)
    for target in (path, tmp_path / "keep.sqlite-wal", tmp_path / "out.jsonl"):
        for write in writers:
            with pytest.raises(ValueError, match="is a SQLite database"):
                write(target)
    db.close()
    assert path.read_bytes() == before


@pytest.mark.parametrize("damage", [_random_bytes, _truncated_db], ids=["random_bytes", "truncated"])
def test_corrupt_file_is_moved_aside_and_what_is_intact_salvaged(tmp_path, caplog, damage):
    path = settings.db_path  # convtune's own database (a file the caller names is never moved unless it is SQLite's)
    path.parent.mkdir(parents=True, exist_ok=True)
    damage(path)
    damaged = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="convtune.db_file"):
        tdb = TuningDB(path)
    assert any("moved it to" in r.getMessage() and "unusable" in r.getMessage() for r in caplog.records)
    [moved] = aside(path, "corrupt")
    assert moved.read_bytes() == damaged  # kept for a post-mortem, untouched
    entries = tdb.entries()
    if damage is _random_bytes:
        assert entries == [] and tdb.lookup(problem(1)) is None  # no garbage served
    else:  # whatever still reads is salvaged (a cut through the table's pages can leave nothing), served as stored
        assert len(entries) < 200
        for e in entries:
            served = tdb.lookup(ConvProblem.from_key(e.problem))
            assert (served.algorithm, served.time_ms, served.message) == ("x", 1.0, "m" * 300)
    tdb.store(problem(1), FIND)
    assert tdb.lookup(problem(1)).algorithm == "cpu:fast"
    tdb.close()


def test_a_file_moved_aside_by_another_process_is_followed(tmp_path):
    path = tmp_path / "tuning.sqlite"
    tdb = TuningDB(path)
    tdb.store(problem(1), FIND)
    db_file.move_aside(path, "corrupt", "found corrupt by another process")  # while tdb holds it open
    with TuningDB(path) as other:
        other.store(problem(2), FIND[1:2])
    assert tdb.lookup(problem(1)) is None  # tdb now reads the file at its path, not the one moved aside
    assert tdb.lookup(problem(2)).algorithm == "cpu:lean"
    tdb.close()


class _FailingConnection:
    """What a connection does on a page that went bad after the file was checked."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, *args):
        raise sqlite3.DatabaseError("database disk image is malformed")

    def close(self) -> None:
        self.conn.close()


def test_corruption_found_in_use_replaces_the_file(db, caplog):
    db.store(problem(1), FIND)
    db.lookup(problem(1))
    with open(db.path, "r+b") as f:  # in place: the same file, its pages overwritten
        f.write(b"\xff" * db.path.stat().st_size)
    db._conn = _FailingConnection(db._conn)
    with caplog.at_level(logging.WARNING, logger="convtune.db_file"):
        assert db.lookup(problem(1)) is None  # answered by a fresh file, never from the bad one
    assert any("malformed" in r.getMessage() for r in caplog.records)
    assert aside(db.path, "corrupt")
    db.store(problem(2), FIND)
    assert db.lookup(problem(2)).algorithm == "cpu:fast"


def _other_schema(path: Path, version: int, meta: bool = False) -> bytes:
    """A SQLite file at ``path`` of schema ``version`` (0: another program's database), with a ``meta`` table where
    ``meta`` (every schema of convtune's had both tables); its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as conn:
        if meta:
            conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute("CREATE TABLE results (anything TEXT)")
        conn.execute("INSERT INTO results VALUES ('not ours')")
        conn.execute(f"PRAGMA user_version={version}")
    conn.close()
    return path.read_bytes()


def _newer(path: Path, version: int) -> bytes:
    """A database of convtune's tables at ``path`` that says it is of schema ``version``; its bytes."""
    with TuningDB(path) as tdb:
        tdb.store(problem(), FIND)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(f"PRAGMA user_version={version}")
        conn.execute("PRAGMA journal_mode=DELETE")
    return path.read_bytes()


@pytest.mark.parametrize("version, where", [(db_file.SCHEMA_VERSION + 1, "named"), (db_file.SCHEMA_VERSION + 1, "own"),
                                            (0, "named"), (2, "named")])
def test_a_newer_convtunes_database_and_another_programs_named_one_are_left_as_they_are(tmp_path, version, where):
    # A newer convtune's file was moved aside by any command of an older one (and back again by the newer): each
    # lost the other's measurements from view. Another program's SQLite file given as the path was renamed.
    path = tmp_path / "app.sqlite" if where == "named" else settings.db_path
    before = _other_schema(path, version) if where == "named" else _newer(path, version)
    words = "written by a newer convtune" if where == "own" else "another program's SQLite database"
    with pytest.raises(ValueError, match=words):
        TuningDB(path if where == "named" else None)
    assert path.read_bytes() == before and sorted(path.parent.iterdir()) == [path]


@pytest.mark.parametrize("version", [db_file.SCHEMA_VERSION - 1, 0])
def test_another_schema_is_moved_aside_never_read(tmp_path, caplog, version):
    # (an older convtune's database; another program's where the path is convtune's own)
    path = settings.db_path
    _other_schema(path, version, meta=bool(version))
    with caplog.at_level(logging.WARNING, logger="convtune.db_file"):
        tdb = TuningDB(path)
    assert any(f"schema version {version}" in r.getMessage() for r in caplog.records)
    [moved] = aside(path, f"schema{version}" if version else "foreign")
    with sqlite3.connect(moved) as conn:
        assert conn.execute("SELECT anything FROM results").fetchall() == [("not ours",)]
    conn.close()
    assert tdb.entries() == []
    tdb.store(problem(), FIND)
    assert tdb.lookup(problem()).algorithm == "cpu:fast"
    tdb.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == db_file.SCHEMA_VERSION
        assert conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == str(db_file.SCHEMA_VERSION)
    conn.close()


def _rewrite_row(path: Path, p: ConvProblem, algorithm: str, change) -> None:
    """Replace the text of ``p``'s row by ``algorithm`` with ``change(text)``, its checksum made anew: a row as a
    convtune that wrote it so would have stored it (not a damaged one)."""
    with sqlite3.connect(path) as conn:
        fp, sw, text = conn.execute("SELECT fingerprint, software, result FROM results WHERE problem=? AND "
                                    "algorithm=?", (p.key, algorithm)).fetchone()
        text = change(text)
        conn.execute("UPDATE results SET result=?, checksum=? WHERE problem=? AND algorithm=?",
                     (text, db_file.row_checksum(fp, sw, p.key, algorithm, text), p.key, algorithm))
    conn.close()


def test_a_row_that_no_longer_validates_is_ignored(db, caplog):
    p = problem()
    db.store(p, FIND[:2])
    with sqlite3.connect(db.path) as conn:
        conn.execute("UPDATE results SET result=? WHERE algorithm='cpu:fast'",
                     (json.dumps({**FIND[0].to_dict(), "time_ms": -1.0}),))
    conn.close()
    with caplog.at_level(logging.WARNING, logger="convtune.db"):
        # the rest of that find is not served: the row it lost may be (here: is) the best
        assert db.results(p) == [] and db.lookup(p) is None
    assert [r.getMessage() for r in caplog.records if "damaged row" in r.getMessage()]
    assert "only 1 of the 2 its measurement stored can be read" in caplog.text
    # rows stored before the count was kept are served as they are: what of a find still reads
    _rewrite_row(db.path, p, "cpu:fast", lambda text: json.dumps({**FIND[0].to_dict(), "time_ms": -1.0}))
    _rewrite_row(db.path, p, "cpu:lean", lambda text: json.dumps(FIND[1].to_dict()))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="convtune.db"):
        assert db.results(p) == FIND[1:2]
    assert "no longer validates" in caplog.text


def test_a_find_that_lost_a_row_is_not_served_whether_stored_or_imported(db, tmp_path, caplog):
    p = problem()
    db.store(p, FIND)
    db.export(tmp_path / "all.jsonl")
    for how in ("stored", "imported"):
        if how == "imported":
            db.clear()
            assert db.import_(tmp_path / "all.jsonl") == len(FIND)
        assert db.lookup(p).algorithm == "cpu:fast"
        with sqlite3.connect(db.path) as conn:  # its best row gone (a damaged page, a row deleted by hand)
            conn.execute("DELETE FROM results WHERE algorithm='cpu:fast'")
        conn.close()
        with caplog.at_level(logging.WARNING, logger="convtune.db"):
            assert db.results(p) == [] and db.lookup(p) is None  # never cpu:mid served as the best
        assert f"only {len(FIND) - 1} of the {len(FIND)}" in caplog.text
        [entry] = db.entries()  # listed with the rows that read, and nothing it would serve
        assert entry.num_results == len(FIND) - 1 and entry.best_algorithm is None
    # nor exported: imported, the rest would be taken for a whole find
    assert db.export(tmp_path / "partial.jsonl") == 0
    # an algorithm given twice is one row (the last result), and the find whole: in a store, and in an import of an
    # export file with each line twice (two exports joined)
    db.store(p, [*FIND, dataclasses.replace(FIND[0], time_ms=0.5)])
    assert db.lookup(p).time_ms == 0.5 and len(db.results(p)) == len(FIND)
    assert db.export(tmp_path / "once.jsonl") == len(FIND)
    (tmp_path / "twice.jsonl").write_text((tmp_path / "once.jsonl").read_text() * 2)
    db.clear()
    assert db.import_(tmp_path / "twice.jsonl") == len(FIND)  # (each result once)
    assert db.lookup(p).time_ms == 0.5 and len(db.results(p)) == len(FIND)
    # a count that is no count makes its row one that no longer validates
    db.store(p, FIND[:2])
    _rewrite_row(db.path, p, "cpu:lean", lambda text: json.dumps({**json.loads(text), db_module.ROWS_OF_FIND: 0}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="convtune.db"):
        assert db.results(p) == []
    assert "rows_of_find=0 is not a count of rows" in caplog.text


@pytest.mark.parametrize("column, value", [("result", None), ("problem", "other")])
def test_a_row_changed_on_disk_is_never_served_even_when_it_still_reads_as_valid(db, caplog, column, value):
    # A bit flip that leaves valid JSON (another time) or moves a row to another problem key.
    p, other = problem(), problem(n=2)
    db.store(p, FIND[:2])
    db.store(other, FIND[1:2])
    changed = json.dumps({**FIND[0].to_dict(), "time_ms": 0.001}) if column == "result" else other.key
    with sqlite3.connect(db.path) as conn:
        conn.execute(f"UPDATE results SET {column}=? WHERE algorithm='cpu:fast' AND problem=?", (changed, p.key))
    conn.close()
    with caplog.at_level(logging.WARNING, logger="convtune.db"):
        assert all(r.time_ms != 0.001 for r in db.results(p))
        assert db.result(p, "cpu:fast") is None and db.result(other, "cpu:fast") is None
        assert [r.algorithm for r in db.results(other)] == ["cpu:lean"]
    assert "damaged row" in caplog.text


# -- other machines and software ------------------------------------------------------------------
@pytest.mark.parametrize("what", ["fingerprint", "software_versions"])
def test_rows_of_another_machine_or_software_are_listed_never_used(db, monkeypatch, caplog, what):
    p = problem()
    with monkeypatch.context() as m:
        m.setattr(hardware, what, lambda *args: "cpu|another machine" if what == "fingerprint" else "torch0.1")
        db.store(p, FIND)
        assert db.lookup(p).algorithm == "cpu:fast"  # usable there
    with caplog.at_level(logging.WARNING, logger="convtune.db"):
        assert db.lookup(p) is None and db.results(p) == [] and db.measurements("cpu") == []
        assert db.result(p, "cpu:fast") is None
        assert db.lookup(p, Policy(prefer="least_memory")) is None
    stale = [r for r in caplog.records if "another machine or software" in r.getMessage()]
    assert len(stale) == 1  # warned once, not on every lookup
    [entry] = db.entries()
    assert entry.problem == p.key and not entry.usable and entry.num_results == 5
    db.store(p, FIND[1:2])  # tuning here adds this machine's rows beside the stale ones
    assert db.lookup(p).algorithm == "cpu:lean"
    assert sorted(e.usable for e in db.entries()) == [False, True]


# -- export and import ----------------------------------------------------------------------------
def test_a_results_place_in_its_backends_order_round_trips_through_the_database_and_an_export(db, tmp_path):
    placed = [dataclasses.replace(FIND[0], place=2), *FIND[1:]]
    db.store(problem(1), placed)
    places = {r.algorithm: r.place for r in placed}
    assert {r.algorithm: r.place for r in db.results(problem(1))} == places
    out = tmp_path / "export.jsonl"
    db.export(out)
    assert sum('"place"' in line for line in out.read_text().splitlines()) == 1  # left out where there is none
    with TuningDB(tmp_path / "other.sqlite") as fresh:
        fresh.import_(out)
        assert {r.algorithm: r.place for r in fresh.results(problem(1))} == places


def test_a_file_is_written_whole_or_refused_naming_the_path_given(tmp_path, monkeypatch):
    from convtune.files import write_whole

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=rf"cannot write {re.escape(str(blocker / 'a.txt'))}: .*existing folder"):
        write_whole(blocker / "a.txt", lambda target: target.write_text("y"))
    kept = tmp_path / "kept.txt"
    kept.write_text("mine")
    kept.chmod(0o444)
    with pytest.raises(ValueError, match="read-only"):
        write_whole(kept, lambda target: target.write_text("y"))
    assert kept.read_text() == "mine"

    def fails(target):  # a full disk, a folder without write permission: the error names the path, not the temporary
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match=rf"cannot write {re.escape(str(tmp_path / 'b.txt'))}: No space left"):
        write_whole(tmp_path / "b.txt", fails)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "kept.txt"]  # no temporary file left


def test_export_import_round_trip_keeps_other_machines(db, tmp_path, monkeypatch):
    db.store(problem(1), FIND)
    db.store(problem(2, dtype="bfloat16", layout="NHWC"), FIND[1:3])
    with monkeypatch.context() as m:
        m.setattr(hardware, "fingerprint", lambda device: "cpu|a fleet machine|threads64")
        db.store(problem(3), FIND[:1])
    out = tmp_path / "export.jsonl"
    assert db.export(out) == 8
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert set(lines[0]) == {"schema", "fingerprint", "software", "problem", "stored_at", "result", "checksum"}
    with TuningDB(tmp_path / "other.sqlite") as fresh:
        assert fresh.import_(out) == 8
        assert fresh.entries() == db.entries()  # fingerprints, software and stored_at kept
        assert fresh.results(problem(1)) == FIND
        assert fresh.lookup(problem(2, dtype="bfloat16", layout="NHWC"),
                            Policy(allow_tf32=False)).algorithm == "cpu:lean"
        assert fresh.import_(out) == 8  # idempotent
        assert rows(fresh.path) == 8 and fresh.entries() == db.entries()


def _line(**changes) -> str:
    line = {"schema": db_file.SCHEMA_VERSION, "fingerprint": "cpu|x|threads1", "software": "torch9",
            "problem": problem().key, "stored_at": 1.5e9, "result": FIND[0].to_dict()}
    return json.dumps({**line, **changes})


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not JSON"),
    (_line(result={**FIND[0].to_dict(), "status": "great"}), "status 'great'"),
    (_line(problem="fwd|n1|c4"), "bad problem"),
    (_line(problem=problem().key.replace("n1|", "n0|")), "bad problem"),
    (_line(result={**FIND[0].to_dict(), "time_ms": -2.0}), "time_ms=-2.0"),
    (_line(stored_at=-1), "stored_at"),
    (_line(result={**FIND[0].to_dict(), "status": "ok", "time_ms": float("inf")}), "finite"),
    (_line(result={**FIND[0].to_dict(), "status": "ok", "rel_error": float("inf")}), "finite"),
    (_line(schema=db_file.SCHEMA_VERSION + 1), "schema"),
    (_line(fingerprint="cuda|H200|sm90|cuda12"), "not of a cpu device"),
    (_line(result=base64.b64encode(pickle.dumps(_Evil())).decode()), "JSON object"),
    (_line(result={**FIND[0].to_dict(), "py/reduce": "os.system"}), "unknown PerfResult field"),
    (_line(result={**FIND[0].to_dict(), "place": -1}), "place=-1"),
    (_line(result={**FIND[0].to_dict(), "place": True}), "place=True"),
    (json.dumps({"schema": 1, "result": FIND[0].to_dict()}), "missing"),
    ("[1, 2, 3]", "JSON object"),
    (pickle.dumps(_Evil()), "not UTF-8"),
], ids=["bad_json", "unknown_status", "bad_key", "invalid_problem", "negative_time", "negative_stored_at",
        "ok_with_infinite_time", "ok_with_infinite_error", "other_schema", "device_mismatch", "pickle_in_json",
        "unknown_field", "negative_place", "boolean_place", "missing_fields", "not_object", "raw_pickle"])
def test_malformed_import_is_refused_whole(db, tmp_path, bad, message):
    db.store(problem(5), FIND[:1])
    before = db.entries()
    path = tmp_path / "bad.jsonl"
    bad = bad if isinstance(bad, bytes) else bad.encode()
    path.write_bytes(_line().encode() + b"\n" + bad + b"\n" + _line(problem=problem(2).key).encode() + b"\n")
    with pytest.raises(ValueError, match=message) as info:
        db.import_(path)
    assert f"{path}:2:" in str(info.value) and "nothing was imported" in str(info.value)
    assert db.entries() == before  # not even the valid first line


def test_an_exported_line_changed_into_other_valid_json_is_refused_whole(db, tmp_path):
    # A plain export has no gzip check: a digit of a time changed still parses. Each line's checksum refuses it;
    # the same values spelled otherwise (spacing, key order) are the same line.
    db.store(problem(1), FIND)
    path = tmp_path / "export.jsonl"
    db.export(path)
    lines = path.read_text().splitlines()
    respelled = json.dumps(dict(reversed(list(json.loads(lines[0]).items()))), indent=None, separators=(", ", " : "))
    path.write_text("\n".join([respelled, *lines[1:]]) + "\n")
    with TuningDB(tmp_path / "other.sqlite") as fresh:
        assert fresh.import_(path) == len(FIND)
    changed = json.loads(lines[1])
    changed["result"]["time_ms"] *= 10
    path.write_text("\n".join([lines[0], json.dumps(changed), *lines[2:]]) + "\n")
    before = db.entries()
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}:2: its checksum does not match its content"):
        db.import_(path)
    assert db.entries() == before


@pytest.mark.parametrize("checksum", [None, 0, [], ""], ids=["null", "number", "list", "empty"])
def test_an_export_line_whose_checksum_is_not_its_own_is_refused(db, tmp_path, checksum):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({**json.loads(_line()), "checksum": checksum}) + "\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}:1: its checksum does not match"):
        db.import_(path)


def test_an_export_line_nested_too_deeply_for_its_checksum_is_refused_not_crashed(db, tmp_path):
    # JSON that json.loads reads but json.dumps cannot write again (one level deeper): refused as a bad line
    path = tmp_path / "deep.jsonl"
    limit = sys.getrecursionlimit()
    for depth in range(limit // 2, limit):  # where loads stops and dumps would, the caller's own depth decides
        line = _line(result="@")[:-1] + ', "checksum": "0"}'
        path.write_text(line.replace('"@"', "[" * depth + "]" * depth) + "\n")
        with pytest.raises(ValueError, match=f"{re.escape(str(path))}:1: "):
            db.import_(path)


def test_import_skips_blank_lines(db, tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text("\n" + _line() + "\n\n" + _line(problem=problem(2).key) + "\n")
    assert db.import_(path) == 2
    assert len(db.entries()) == 2 and not any(e.usable for e in db.entries())


def test_a_gzip_export_round_trips_and_a_damaged_or_oversized_one_is_refused_whole(db, tmp_path, monkeypatch):
    db.store(problem(1), FIND)
    plain, packed = tmp_path / "export.jsonl", tmp_path / "export.jsonl.gz"
    assert db.export(plain) == db.export(packed) == len(FIND)
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    first = packed.read_bytes()
    db.export(packed)
    assert packed.read_bytes() == first  # the same results, the same bytes (no timestamp inside)
    renamed = tmp_path / "export.data"  # recognised by its first bytes, not its name
    renamed.write_bytes(first)
    with TuningDB(tmp_path / "other.sqlite") as fresh:
        assert fresh.import_(renamed) == len(FIND) and fresh.results(problem(1)) == FIND
        cut = tmp_path / "cut.jsonl.gz"
        cut.write_bytes(first[: len(first) // 2])
        with pytest.raises(ValueError, match="damaged gzip file.*nothing was imported"):
            fresh.import_(cut)
        monkeypatch.setattr(export_lines, "IMPORT_LIMIT_BYTES", 100)
        with pytest.raises(ValueError, match="over 100 B of results once decompressed.*nothing was imported"):
            fresh.import_(packed)
        with pytest.raises(ValueError, match="over 100 B of results; split"):  # plain files are bounded too
            fresh.import_(plain)
        one_line = tmp_path / "one_line.jsonl"  # even one line longer than the limit is not read whole
        one_line.write_bytes(b"x" * 10_000)
        with pytest.raises(ValueError, match="over 100 B"):
            fresh.import_(one_line)
        assert rows(fresh.path) == len(FIND)
        empty = tmp_path / "empty.jsonl.gz"
        empty.write_bytes(gzip.compress(b""))
        assert fresh.import_(empty) == 0


# -- where the file lives -------------------------------------------------------------------------
def test_default_path_follows_settings_and_environment(tmp_path, monkeypatch):
    with settings.override(cache_dir=str(tmp_path / "a" / "b")):
        with TuningDB() as tdb:
            assert tdb.path == tmp_path / "a" / "b" / "tuning.sqlite"
            tdb.store(problem(), FIND)
        assert (tmp_path / "a" / "b" / "tuning.sqlite").is_file()
    monkeypatch.setenv("CONVTUNE_CACHE_DIR", str(tmp_path / "env"))
    # conftest overrides cache_dir for every test; lift that here so the environment variable counts.
    saved, settings._overrides = settings._overrides, {}
    try:
        with TuningDB() as tdb:
            assert tdb.path == tmp_path / "env" / "tuning.sqlite"
            assert tdb.lookup(problem()) is None  # another file
    finally:
        settings._overrides = saved
    assert (tmp_path / "env" / "tuning.sqlite").is_file()


def test_sqlite_file_is_in_wal_mode(db):
    db.store(problem(), FIND)
    with sqlite3.connect(db.path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_docstring_example_runs():
    failed, attempted = doctest.testmod(db_module, optionflags=doctest.ELLIPSIS)
    assert attempted > 0 and failed == 0


def test_export_lines_of_the_previous_schema_still_import(tmp_path):
    path = tmp_path / "v1.jsonl"
    path.write_text(_line(schema=1) + "\n")
    with TuningDB(tmp_path / "t.sqlite") as db:
        assert db.import_(path) == 1


def test_a_row_that_is_not_utf8_is_ignored_and_its_find_not_served(tmp_path):
    path = tmp_path / "t.sqlite"
    with TuningDB(path) as db:
        db.store(problem(), [PerfResult("fast", "ok", time_ms=1.0), PerfResult("slow", "ok", time_ms=2.0)])
    conn = sqlite3.connect(path)
    conn.execute("UPDATE results SET result = CAST(X'ff7b22616c676f' AS TEXT) WHERE algorithm='fast'")
    conn.commit()
    conn.close()
    with TuningDB(path) as db:
        assert db.lookup(problem()) is None  # the damaged row ignored, with a warning, and so the rest of its find
        assert len(db.entries()) == 1 and db.export(tmp_path / "out.jsonl") == 0  # (nor exported: not whole)


def test_the_rows_of_a_file_that_still_reads_are_salvaged_into_a_fresh_one(tmp_path, caplog):
    damaged, fresh = tmp_path / "damaged.sqlite", tmp_path / "fresh.sqlite"
    with TuningDB(damaged) as tdb:
        for n in (1, 2, 3):
            tdb.store(problem(n), FIND)
    rows = salvage.results(damaged, db_file._intact, timeout_s=1.0)
    assert len(rows) == 3 * len(FIND)
    with caplog.at_level(logging.WARNING, logger="convtune.db_file"):
        db_file._restore(fresh, rows)
    assert "salvaged" in caplog.text
    with TuningDB(fresh) as tdb:
        assert [tdb.lookup(problem(n)).algorithm for n in (1, 2, 3)] == ["cpu:fast"] * 3


def test_salvage_keeps_only_rows_whose_checksum_holds(tmp_path):
    # A damaged page can still parse into rows of zeros or garbage: salvage drops every row its checksum
    # does not bind, so a listing of the salvaged file never shows a key that was not stored.
    path = tmp_path / "damaged.sqlite"
    with TuningDB(path) as tdb:
        tdb.store(problem(1), FIND)
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO results SELECT fingerprint, software, ?, algorithm, device, stored_at, result, checksum "
                 "FROM results LIMIT 1", ("\0" * 40,))
    conn.execute("INSERT INTO results SELECT fingerprint, software, problem, 'cpu:other', device, stored_at, result, "
                 "checksum FROM results LIMIT 1")
    conn.commit()
    conn.close()
    rows = salvage.results(path, db_file._intact, timeout_s=1.0)
    assert len(rows) == len(FIND) and {row[2] for row in rows} == {problem(1).key}


# -- the corruption suite (tests/damage.py) ------------------------------------------------------
def test_a_damaged_file_never_crashes_never_serves_what_was_not_stored_and_stays_usable(tmp_path):
    # Truncations at 24 offsets, 48 random bit flips, 12 flips that change a stored time and still read
    # as valid JSON, and 12 runs of garbage, each over a closed database of 30 finds:
    # opening it, looking every problem up and storing again must raise nothing, and every answer
    # must be what the undamaged file served (or none: a lost row is a new measurement, never a wrong
    # selection: the rest of a find that lost its best row would serve the next best as the best).
    counts, lost, faults = corruption_suite(tmp_path)
    assert not faults, faults[:3]
    assert counts["tried"] == counts["clean"] == 96 and counts["crashes"] == 0
    # Salvage reads every row it can still reach (through the table's indexes, the table scanned and sought
    # past its damage, and every leaf page read straight): no row on a page the damage left as it was is ever
    # lost, a bit flip loses at most the one problem whose row it hit (its row fails its checksum, and the rest
    # of that find is not served), a cut through the file's last pages loses only the problems with rows there
    # (at 23/24 of the file, at most the two or three problems whose rows lay on the last page; where that page
    # falls depends on the rows' length, which names the installed software), the losses fall as the cut moves
    # later, and garbage loses at most the few problems whose rows were on the page it hit.
    assert counts["intact_lost"] == 0 and counts["intact_rows"] > 0
    assert all(n <= 1 for (kind, _), n in lost.items() if kind == "flip")
    cuts = [n for (kind, _), n in lost.items() if kind == "truncate"]
    assert cuts[-1] <= 3 and cuts == sorted(cuts, reverse=True) and cuts[-8] < 30
    assert all(n <= 3 for (kind, at), n in lost.items() if kind == "garbage")


def test_a_read_only_database_serves_what_it_holds_and_warns_once(db, tmp_path, caplog):
    # Every store raised OperationalError, and find warned at each one.
    from convtune import find, get_algorithm

    db.store(problem(), FIND)
    db.export(tmp_path / "all.jsonl")
    db._run(lambda conn: conn.execute("PRAGMA query_only=ON"))  # as a file that may not be written refuses writes
    with caplog.at_level(logging.WARNING):
        db.store(problem(2), FIND)
        db.store(problem(3), FIND)
        results = find(problem(4), db=db, candidates=[get_algorithm("torch:native")])
    assert results[0].ok  # the answer stands
    assert [r.algorithm for r in db.results(problem())] == [r.algorithm for r in FIND]  # served
    assert db.results(problem(2)) == db.results(problem(4)) == []  # used, not remembered
    assert caplog.text.count("is read-only") == 1 and "could not store" not in caplog.text
    for asked in (lambda: db.import_(tmp_path / "all.jsonl"), db.clear):  # what the user asks for by name: an error
        with pytest.raises(ValueError, match="read-only"):
            asked()
    assert len(db.results(problem())) == len(FIND)


def _refuse_journal(monkeypatch):
    """SQLite's answer in a folder it may not write: no journal can be made beside the file (as root, a real
    read-only folder is written all the same)."""
    def check(conn):
        raise sqlite3.OperationalError("attempt to write a readonly database")
    monkeypatch.setattr(db_file, "_check", check)


def test_a_database_in_a_folder_that_may_not_be_written_serves_what_it_holds(tmp_path, monkeypatch, caplog):
    # TuningDB raised "attempt to write a readonly database" there, and optimize fell back to an empty database.
    from convtune import find, get_algorithm

    path = tmp_path / "ro" / "tuning.sqlite"
    with TuningDB(path) as db:
        db.store(problem(), FIND)
    _refuse_journal(monkeypatch)
    with caplog.at_level(logging.WARNING), TuningDB(path) as db:
        assert [r.algorithm for r in db.results(problem())] == [r.algorithm for r in FIND]  # served as it is
        assert find(problem(4), db=db, candidates=[get_algorithm("torch:native")])[0].ok  # used, not remembered
        assert db.results(problem(4)) == []
    assert "may not be written" in caplog.text and caplog.text.count("is read-only") == 1


# Root writes a read-only folder all the same: as root, the check runs in a process without that power.
_UNPRIVILEGED = ([] if not hasattr(os, "geteuid") or os.geteuid() != 0 else
                 ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"] if shutil.which("setpriv")
                 else None)


@pytest.mark.skipif(_UNPRIVILEGED is None, reason="as root, needs setpriv to drop the power to write anywhere")
def test_a_database_in_a_read_only_folder_serves_what_it_holds(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "ro" / "tuning.sqlite"
    with TuningDB(path) as db:
        db.store(problem(), FIND)
    path.chmod(0o444)
    path.parent.chmod(0o555)
    check = (f"import logging, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); logging.basicConfig()\n"
             "from convtune import TuningDB\nfrom damage import FIND, problem\n"
             f"with TuningDB({str(path)!r}) as db:\n"
             "    assert [r.algorithm for r in db.results(problem())] == [r.algorithm for r in FIND]\n"
             "    db.store(problem(2), FIND)\n"
             "    assert db.results(problem(2)) == []\n"
             "print('served')\n")
    try:
        out = subprocess.run([*_UNPRIVILEGED, sys.executable, "-c", check], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, CONVTUNE_CACHE_DIR=str(tmp_path / "cache")))
    finally:
        path.parent.chmod(0o755)
    assert out.returncode == 0 and "served" in out.stdout, out.stderr[-2000:]
    assert "may not be written" in out.stderr and out.stderr.count("is read-only") == 1


def test_an_export_writes_into_a_pipe_or_through_a_link_and_never_replaces_what_is_not_a_regular_file(db, tmp_path):
    # It wrote a temporary file and renamed it over the path: `cache export /dev/null`, run as root,
    # replaced the device with a regular file.
    db.store(problem(), FIND)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    assert db.export(fifo) == len(FIND)
    reader.join(timeout=30)
    assert fifo.is_fifo() and received and received[0].count(b"\n") == len(FIND)
    target = tmp_path / "real.jsonl"
    target.write_text("old")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    db.export(link)
    assert link.is_symlink() and target.read_text().count("\n") == len(FIND)
    with pytest.raises(ValueError, match="is a folder"):
        db.export(tmp_path)
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


# -- another machine's measurements ---------------------------------------------------------------
H200 = "cuda|NVIDIA H200|sm90|driver580|cuda13.0"


def test_another_machines_measurements_are_read_by_its_fingerprint_and_priced_for_its_gpu(db, tmp_path):
    from convtune import costmodel, learned

    gpu_problem = problem(1, device="cuda")
    lines = tmp_path / "h200.jsonl"
    lines.write_text("".join(_line(fingerprint=H200, software="torch2.11", problem=gpu_problem.key,
                                   result=r.to_dict()) + "\n" for r in FIND))
    assert db.import_(lines) == len(FIND)
    if not torch.cuda.is_available():
        assert db.measurements("cuda") == []  # this machine has no such device
    read = db.measurements("cuda", H200)
    assert ({r.algorithm for _, r in read} == {r.algorithm for r in FIND if r.ok}
            and {p for p, _ in read} == {gpu_problem})
    assert db.measurements("cuda", "cuda|another GPU|sm80|driver1|cuda12") == []
    flops, bandwidth = hardware._GPU_PEAKS["H200"][0]["float32"], hardware._GPU_PEAKS["H200"][1]
    floor = 1e3 * max(gpu_problem.flops / flops, gpu_problem.min_bytes / bandwidth)
    with hardware.measured_on(H200):
        assert hardware.roofline_ms(gpu_problem) == pytest.approx(floor)
        priced = learned.samples_from(db, "cuda", H200)
        assert len(priced) == len(read) and all(s.analytic_ms > 0 for s in priced)
        inside = costmodel.analytic_ms("torch:native", gpu_problem)
    assert hardware.assumed_gpu() is None  # restored, and the cached prices with it
    if not torch.cuda.is_available():
        assert costmodel.analytic_ms("torch:native", gpu_problem) != inside  # nominal figures again
        # get's answers and the database's corrections are kept per priced GPU: none leaks in or out
        from convtune import get
        outside = get(gpu_problem, db=db)[0].predicted_ms
        with hardware.measured_on(H200):
            priced = get(gpu_problem, db=db)[0].predicted_ms
        assert get(gpu_problem, db=db)[0].predicted_ms == outside != priced
    # a candidate measured with two versions of the software: its latest result, once
    newer = [PerfResult(r.algorithm, r.status, time_ms=r.time_ms and r.time_ms * 2, workspace_bytes=r.workspace_bytes)
             for r in FIND]
    lines.write_text("".join(_line(fingerprint=H200, software="torch2.12", problem=gpu_problem.key, stored_at=1.6e9,
                                   result=r.to_dict()) + "\n" for r in newer))
    db.import_(lines)
    again = db.measurements("cuda", H200)
    assert sorted((r.algorithm, r.time_ms) for _, r in again) == sorted((r.algorithm, r.time_ms) for r in newer if r.ok)


@pytest.mark.parametrize("fingerprint", ["cpu|AMD EPYC|threads2", "cuda|a GPU of no table|sm70|driver1|cuda11", ""])
def test_pricing_for_a_machine_outside_the_peaks_table_is_refused_with_the_reason(fingerprint):
    with pytest.raises(ValueError, match="peaks table"), hardware.measured_on(fingerprint):
        pass
    assert hardware.assumed_gpu() is None


def test_a_result_measured_under_a_looser_error_bound_is_not_served_without_one(db):
    # find under Policy(max_rel_error=0.1) stores a sloppy candidate as ok, with its error: a policy that sets no
    # bound gets only results within their dtype's default tolerance (float32: 1e-4; with TF32 products, 5e-3).
    from convtune import select

    p = problem(1)
    loose = PerfResult("cpu:loose", Status.OK, time_ms=0.5, workspace_bytes=0, rel_error=1e-2)
    tf32 = PerfResult("cpu:tf32", Status.OK, time_ms=0.7, workspace_bytes=0, uses_tf32=True, rel_error=4e-3)
    db.store(p, [loose, tf32, *FIND])
    assert db.lookup(p).algorithm == "cpu:tf32"  # within TF32's tolerance, and faster than cpu:fast
    assert db.lookup(p, Policy(allow_tf32=False)).algorithm == "cpu:fast"
    assert db.lookup(p, Policy(max_rel_error=0.1)).algorithm == "cpu:loose"  # the policy that allows it
    assert select(p, db=db, mode="db_then_get").algorithm == "cpu:tf32"
    assert "cpu:loose" not in [e.best_algorithm for e in db.entries()]
    bf16 = problem(2, dtype="bfloat16")  # 1e-2 is within bfloat16's tolerance
    db.store(bf16, [loose])
    assert db.lookup(bf16).algorithm == "cpu:loose"


@pytest.mark.parametrize("path", [True, 3, 1.5, b"tuning.sqlite", ["tuning.sqlite"]])
def test_a_path_of_the_wrong_type_is_refused_naming_the_argument(path):
    with pytest.raises(TypeError, match=r"TuningDB\(path=.*must be a str or os.PathLike"):
        TuningDB(path)


def test_an_index_that_lost_its_entries_is_found_and_nothing_is_lost(tmp_path):
    # A flipped bit inside an index's entries (here: one problem's key in every index page that holds it)
    # leaves every page well formed: quick_check passes, and lookups through the index would miss that
    # problem's stored rows. The check on open finds it; the rows are salvaged from the table.
    path = tmp_path / "tuning.sqlite"
    allowed = stored_file(path, 30)
    data = bytearray(path.read_bytes())
    page_size = int.from_bytes(data[16:18], "big")
    key = problem(16).key.encode()
    flipped = 0
    for start in range(page_size, len(data), page_size):
        if data[start] != 0x0A:  # an index's leaf page (SQLite's page type byte)
            continue
        at = data.find(key, start, start + page_size)
        while at >= 0:
            data[at + key.index(b"float32")] ^= 1  # 'f' -> 'g': a key of no stored problem
            flipped += 1
            at = data.find(key, at + 1, start + page_size)
    assert flipped >= 1
    path.write_bytes(bytes(data))
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA quick_check").fetchall() == [("ok",)]  # what a lighter check would miss
    with TuningDB(path) as tdb:
        served = {key: tdb.lookup(ConvProblem.from_key(key)) for key in allowed}
    assert all(r is not None and (r.algorithm, r.time_ms, r.workspace_bytes, r.rel_error) == allowed[key]
               for key, r in served.items())


def test_a_database_whose_folder_was_removed_starts_again_there(tmp_path):
    # The default database is kept open for the process; a user who removes the cache folder meanwhile
    # gets a fresh, empty database at the same path, not an error from every later select or optimize.
    path = tmp_path / "cache" / "tuning.sqlite"
    with TuningDB(path) as db:
        db.store(problem(1), FIND)
        shutil.rmtree(tmp_path / "cache")
        assert db.lookup(problem(1)) is None
        db.store(problem(1), FIND)
        assert db.lookup(problem(1)) is not None and path.exists()


def test_salvage_reads_the_rows_below_a_damaged_header_and_brings_back_nothing_deleted(tmp_path):
    # Garbage over the file's first page (its header and the schema) leaves SQLite nothing to reach the
    # tables through; the rows on the other pages are read straight from them (convtune.sqlite_pages), each
    # checked by its checksum. What was deleted before (a cleared cache) is zeros on disk: never back.
    path = tmp_path / "t.sqlite"
    stored_file(path, 30)
    with TuningDB(path) as tdb:
        assert tdb._run(lambda conn: conn.execute("PRAGMA secure_delete").fetchone()[0]) == 1
        tdb.clear()
        for n in (29, 30):
            tdb.store(problem(n), FIND)
    data = bytearray(path.read_bytes())
    data[:512] = bytes(range(256)) * 2
    path.write_bytes(bytes(data))
    with TuningDB(path) as tdb:
        assert tdb.lookup(problem(29)) is not None and tdb.lookup(problem(30)) is not None
        assert [n for n in range(1, 29) if tdb.lookup(problem(n)) is not None] == []


def test_a_change_of_convtunes_kernels_is_a_change_of_software(tmp_path, monkeypatch):
    # Results and compiled binaries of the kernels before a change are not reused after it.
    (tmp_path / "depthwise.py").write_text("BLOCK = 32\n")
    monkeypatch.setattr(hardware, "KERNELS", tmp_path)
    hardware.kernels_digest.cache_clear()
    try:
        before = hardware.kernels_digest()
        (tmp_path / "depthwise.py").write_text("BLOCK = 64\n")
        hardware.kernels_digest.cache_clear()
        assert hardware.kernels_digest() != before
    finally:
        hardware.kernels_digest.cache_clear()


def test_results_of_another_measurement_method_are_not_reused(tmp_path, monkeypatch):
    # find's way of timing a candidate is part of the software: a result it measured otherwise is another's.
    tdb = TuningDB(tmp_path / "t.sqlite")
    p = ConvProblem("fwd", n=1, c=2, k=2, input_size=(4, 4), kernel_size=1)
    tdb.store(p, [PerfResult("torch:native", Status.OK, 1.0, workspace_bytes=0)])
    assert tdb.lookup(p) is not None
    monkeypatch.setattr(hardware, "MEASUREMENT_METHOD", hardware.MEASUREMENT_METHOD + 1)
    hardware.software_versions.cache_clear()
    try:
        assert tdb.lookup(p) is None
    finally:
        monkeypatch.undo()
        hardware.software_versions.cache_clear()
    assert tdb.lookup(p) is not None


def test_a_path_with_a_tilde_and_a_cache_folder_with_one_are_the_home_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with TuningDB("~/t.sqlite") as db:
        assert db.path == tmp_path / "t.sqlite" and db.path.is_file()
    with settings.override(cache_dir="~/cache"):
        assert settings.db_path == tmp_path / "cache" / "tuning.sqlite"
    assert not (tmp_path / "~").exists()


def test_convtunes_own_database_is_known_however_its_path_is_written(tmp_path, monkeypatch):
    # (db.opened gives TuningDB the resolved path: where the cache folder is given through a link, or relative, the
    # default database is still convtune's own, moved aside and salvaged where it is damaged past its header)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.chdir(tmp_path)
    for cache in (str(tmp_path / "link"), "link"):
        _random_bytes(real / "tuning.sqlite")
        with settings.override(cache_dir=cache), TuningDB((real / "tuning.sqlite").resolve()) as tdb:
            assert tdb.entries() == []
        assert len(aside(real / "tuning.sqlite", "corrupt")) == (1 if cache != "link" else 2)


def test_an_import_of_an_empty_path_is_refused_as_empty(db):
    # (Path('') is the current folder: the import said '. is a folder')
    with pytest.raises(ValueError, match=r"TuningDB.import_\(''\): an empty path"):
        db.import_("")
