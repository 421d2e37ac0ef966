"""The tuning database: every measured result, keyed by machine, software and problem.

An embedded SQLite file in WAL mode; writes are ``BEGIN IMMEDIATE`` transactions, so several
processes can tune into one file at once and lose nothing. A row is keyed by the device
fingerprint, the software versions and the problem key, and holds one ``PerfResult``: every
result of a find is kept, so a later policy (another workspace limit, determinism) is answered
from the same measurements without running anything. Beside the results it keeps what rebuilds a
chosen native executable in a fresh process without searching again (a cuDNN execution plan's serialized
form: ``store_executable``), so a warm start runs neither cuDNN's heuristics nor its compiler.

    >>> import tempfile, os
    >>> from convtune import ConvProblem, PerfResult, Policy
    >>> p = ConvProblem(direction="fwd", n=1, c=4, k=4, input_size=(8, 8), kernel_size=3)
    >>> with tempfile.TemporaryDirectory() as tmp, TuningDB(os.path.join(tmp, "t.sqlite")) as db:
    ...     db.store(p, [PerfResult("fast", "ok", time_ms=1.0, workspace_bytes=4096),
    ...                  PerfResult("lean", "ok", time_ms=2.0, workspace_bytes=0)])
    ...     db.lookup(p).algorithm, db.lookup(p, Policy(workspace_limit=0)).algorithm
    ('fast', 'lean')

A file that is not a database, fails ``PRAGMA integrity_check`` or has another schema version is
moved aside (renamed with a suffix) with a warning and a fresh one is started (``db_file`` opens,
checks, locks and recovers the file): schemas are bumped, never migrated. Rows of other machines
or software are kept (``entries`` lists them, ``export`` ships them) but never served.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch

from . import db_file, export_lines, forks, hardware
from .errors import check_type
from .files import refuse_database
from .policy import Policy
from .problem import ConvProblem, normalize_device
from .ranking import best
from .results import PerfResult
from .settings import settings

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class Entry:
    """One stored problem of one machine and software, as ``convtune cache ls`` lists it.

    best_algorithm/best_ms: the fastest usable ``ok`` result under the default policy (None if none).
    stored_at: seconds since the epoch of the latest store. usable: measured on this machine and software.
    """

    problem: str
    fingerprint: str
    software: str
    num_results: int
    best_algorithm: str | None
    best_ms: float | None
    stored_at: float
    usable: bool


class TuningDB:
    """Stores and serves the results of ``find``, per machine, software and problem.

    path: the SQLite file; None takes ``settings.db_path`` ($CONVTUNE_CACHE_DIR/tuning.sqlite, else
    the user cache dir). Missing folders are created. Safe across processes (one connection each,
    reopened after a fork) and across threads of one process (one lock).
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"TuningDB(path={path!r}): the path must be a str or os.PathLike (a file's path), "
                            f"not {type(path).__name__}; None takes the default database")
        self.path = Path(path).expanduser() if path is not None else settings.db_path  # ~: the home folder
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot make the folder of the tuning database {self.path} ({exc.strerror or exc}); "
                             f"give a path in a writable folder or set CONVTUNE_CACHE_DIR") from None
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self._forked: list[sqlite3.Connection] = []  # inherited connections: never used, never closed
        self._identity: tuple[int, int] | None = None
        self._warned: set[str] = set()
        # Each row decoded once: a row is immutable (its checksum binds all it says), and a warm start reads
        # a problem's rows more than once (selecting, then judging the host-cost rule).
        self._decoded: dict[tuple[str, ...], tuple[PerfResult, int | None] | None] = {}
        if self.path.exists() and not self.path.is_file():
            hint = f" such as {self.path / 'tuning.sqlite'}" if self.path.is_dir() else ""
            raise ValueError(f"TuningDB path {self.path} is not a regular file; give a file's path{hint}")
        # (only convtune's own file is moved aside: the default path, however it is written)
        self._mine = path is None or _resolved(self.path) == _resolved(settings.db_path)
        if not self._mine and not db_file.may_be_ours(self.path):
            # (a damaged tuning database is moved aside and what is intact salvaged; a file the caller named that
            # neither is a SQLite file nor holds the tables' definitions may be anything of theirs: left as it is)
            raise ValueError(f"TuningDB path {self.path} is not a tuning database (not a SQLite file), and is left "
                             f"as it is; give a database file's path, or a new one")
        try:
            self._run(lambda conn: None)  # open now, so a bad file is reported (and replaced) at construction
        except sqlite3.Error as exc:
            if "locked" in str(exc).lower() or "busy" in str(exc).lower():
                fix = (f"another process held it locked for {db_file.BUSY_TIMEOUT_MS / 1000:g} s; try again once it "
                       f"is done, or give another file's path")
            else:
                fix = "give a writable file's path or set CONVTUNE_CACHE_DIR"
            raise ValueError(f"cannot open the tuning database {self.path} ({exc}); {fix}") from None

    # -- public API ------------------------------------------------------------------------
    def store(self, problem: ConvProblem, results: Iterable[PerfResult]) -> None:
        """Replace this machine's and software's results for ``problem`` with ``results`` (one find's).

        Raises TypeError for a non-ConvProblem or non-PerfResult, ValueError for a result that does not
        validate (e.g. a NaN time), and ValueError when the problem's device is not present here.
        """
        check_type(problem, ConvProblem, "TuningDB.store()'s problem")
        rows = _encoded(list(results))
        here = _here(problem.device)
        if here is None:
            raise ValueError(f"cannot store results of {problem.key}: no {problem.device} device on this machine")
        fp, sw = here
        now = time.time()

        def replace(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM results WHERE fingerprint=? AND software=? AND problem=?", (fp, sw, problem.key))
            conn.executemany(
                "INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(fp, sw, problem.key, name, problem.device, now, text,
                  db_file.row_checksum(fp, sw, problem.key, name, text)) for name, text in rows],
            )

        self._write(replace)

    def results(self, problem: ConvProblem) -> list[PerfResult]:
        """The stored results of ``problem`` measured on this machine and software, in stored order."""
        rows = self._read("SELECT fingerprint, software, algorithm, result, checksum FROM results WHERE problem=? "
                          "ORDER BY rowid", (problem.key,))
        here = _here(problem.device)
        mine = [row for row in rows if tuple(row[:2]) == here]
        if len(mine) < len(rows):
            self._warn_once(f"stale:{problem.key}",
                            "ignoring %d stored result(s) of %s measured on another machine or software "
                            "(see `convtune cache ls`); tune again to refresh them", len(rows) - len(mine), problem.key)
        key = problem.key
        return self._whole(key, [self._decoded_row(text, key, (fp, sw, name, checksum))
                                 for fp, sw, name, text, checksum in mine]) or []

    def result(self, problem: ConvProblem, algorithm: str) -> PerfResult | None:
        """The stored result of ``algorithm`` on ``problem`` measured on this machine and software, or None
        (one row read by its key: what a warm start asks of every layer direction)."""
        here = _here(problem.device)
        if here is None:
            return None
        rows = self._read("SELECT result, checksum FROM results WHERE fingerprint=? AND software=? AND problem=? "
                          "AND algorithm=?", (*here, problem.key, algorithm))
        return self._decode(rows[0][0], problem.key, (*here, algorithm, rows[0][1])) if rows else None

    def lookup(self, problem: ConvProblem, policy: Policy | None = None) -> PerfResult | None:
        """The best stored result of ``problem`` under ``policy`` (default Policy()), or None."""
        return best(self.results(problem), policy or Policy(), problem.dtype)

    def measurements(self, device: str, fingerprint: str | None = None) -> list[tuple[ConvProblem, PerfResult]]:
        """Every ``ok`` result stored for this machine and software on ``device`` ('cpu' or 'cuda'); with
        ``fingerprint``, those of the machine it names instead, with any software (a candidate measured
        with several: its latest result)."""
        device = normalize_device(device)
        if fingerprint is None:
            here = _here(device)
            if here is None:
                return []
            where = "fingerprint=? AND software=? AND device=?"
            params: tuple[str, ...] = (*here, device)
        else:
            where, params = "fingerprint=? AND device=?", (fingerprint, device)
        rows = self._read(f"SELECT problem, algorithm, result, checksum, fingerprint, software FROM results "
                          f"WHERE {where} ORDER BY rowid", params)
        latest: dict[tuple[str, str], tuple[ConvProblem, PerfResult]] = {}  # the last stored wins (rowid order)
        for key, name, text, checksum, fp, software in rows:
            result = self._decode(text, key, (fp, software, name, checksum))
            problem = self._problem(key)
            if result is not None and problem is not None and result.ok:
                latest[key, name] = (problem, result)  # one per candidate: another machine's older software's too
        return list(latest.values())

    def entries(self) -> list[Entry]:
        """One Entry per stored (problem, fingerprint, software), sorted by problem key."""
        entries, here = [], {}
        for (key, fp, sw), rows, results in self._finds("problem, fingerprint, software"):
            problem = self._problem(key)
            first = best(results or [], Policy(), problem.dtype if problem is not None else None)
            device = rows[0][0]
            if device not in here:
                here[device] = _here(device)
            entries.append(Entry(
                problem=key, fingerprint=fp, software=sw, num_results=sum(row is not None for _, _, row in rows),
                best_algorithm=first.algorithm if first else None, best_ms=first.time_ms if first else None,
                stored_at=max(stored_at for _, stored_at, _ in rows), usable=here[device] == (fp, sw),
            ))
        return entries

    def export(self, path: str | os.PathLike) -> int:
        """Write every stored result (all machines; a find that lost rows is left out, ``results``) to ``path`` as
        JSON lines, gzip-compressed where the name
        ends in ``.gz`` (a sweep's dataset: about 17x smaller); returns lines written. ``ValueError`` where ``path``
        is a SQLite file (this database, another one): an export never replaces a database."""
        refuse_database(path)
        lines = []
        for (key, fp, sw), rows, results in self._finds("fingerprint, software, problem"):
            # (a find that lost rows is left out: imported, its rest would be taken for a whole find)
            if results is not None:
                lines += [export_lines.line(db_file.SCHEMA_VERSION, fp, sw, key, stored_at, row[0])
                          for _, stored_at, row in rows if row is not None]
        export_lines.write(path, lines)
        return len(lines)

    def import_(self, path: str | os.PathLike) -> int:
        """Import an ``export`` file; returns the number of results imported (an algorithm's last line for a problem
        on one machine and software: one result).

        Every line is validated first; a malformed one raises ValueError naming the file, the line
        and the fault, and nothing is imported. Rows keep their fingerprint and software, and replace
        what the database had for the same (machine, software, problem): importing twice is idempotent.
        """
        if not os.fspath(path):  # Path('') is the current folder
            raise ValueError("TuningDB.import_(''): an empty path; give a file that export wrote")
        path = Path(path)
        parsed = []
        for number, raw in enumerate(export_lines.read(path), start=1):
            if raw.strip():
                try:
                    parsed.append(export_lines.parse(raw))
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: {exc}; nothing was imported") from None
        # a problem's results on one machine and software: one find's, stored whole (an algorithm's last line wins,
        # as the table's key keeps one row an algorithm)
        groups: dict[tuple[str, str, str], dict[str, tuple[ConvProblem, float, PerfResult]]] = {}
        for fp, sw, p, at, r in parsed:
            group = groups.setdefault((fp, sw, p.key), {})
            group.pop(r.algorithm, None)
            group[r.algorithm] = (p, at, r)
        rows = [(fp, sw, key, name, p.device, at, text, db_file.row_checksum(fp, sw, key, name, text))
                for (fp, sw, key), found in groups.items()
                for texts in (dict(_encoded([r for _, _, r in found.values()])),)
                for name, (p, at, _) in found.items() for text in (texts[name],)]

        def replace(conn: sqlite3.Connection) -> None:
            conn.executemany("DELETE FROM results WHERE fingerprint=? AND software=? AND problem=?", list(groups))
            conn.executemany("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)

        self._write(replace, asked=f"import {path}")
        log.info("imported %d result(s) of %d problem(s) from %s", len(rows), len(groups), path)
        return len(rows)

    def clear(self) -> int:
        """Remove every stored result, executable and host cost (all machines); returns the number of results
        removed."""
        def remove(conn: sqlite3.Connection) -> int:
            conn.execute("DELETE FROM executables")
            conn.execute("DELETE FROM host_costs")
            return conn.execute("DELETE FROM results").rowcount
        return self._write(remove, asked="clear it")

    def store_executable(self, problem: ConvProblem, algorithm: str, recipe: dict[str, Any], serialized: bytes) -> None:
        """Keep what rebuilds the native executable of ``algorithm`` on ``problem`` here without searching:
        its recipe (a JSON-able dict) and serialized form (a cuDNN execution plan's), for this machine and software."""
        here = _here(problem.device)
        if here is None:
            raise ValueError(f"cannot store an executable of {problem.key}: no {problem.device} device on this machine")
        text = json.dumps(recipe)
        # the recipe column holds the recipe's JSON text with a checksum binding it and the serialized form to
        # this machine, software, problem and algorithm: a damaged row is rebuilt, never run
        sealed = json.dumps({"recipe": text, "checksum": _executable_checksum(*here, problem.key, algorithm, text,
                                                                              bytes(serialized))})
        row = (*here, problem.key, algorithm, time.time(), sealed, bytes(serialized))
        self._write(lambda conn: conn.execute("INSERT OR REPLACE INTO executables VALUES (?, ?, ?, ?, ?, ?, ?)", row))

    def store_host_costs(self, device: str, costs: dict[str, float]) -> None:
        """Keep the host microseconds each run path adds on ``device`` here (the host-cost rule's measurement)."""
        here = _here(normalize_device(device))
        if here is None:
            raise ValueError(f"cannot store host costs: no {device} device on this machine")
        row = (*here, normalize_device(device), time.time(), json.dumps(costs, allow_nan=False))
        self._write(lambda conn: conn.execute("INSERT OR REPLACE INTO host_costs VALUES (?, ?, ?, ?, ?)", row))

    def host_costs(self, device: str) -> dict[str, float] | None:
        """The host costs stored for ``device`` on this machine and software, or None."""
        here = _here(normalize_device(device))
        if here is None:
            return None
        rows = self._read("SELECT costs FROM host_costs WHERE fingerprint=? AND software=? AND device=?",
                          (*here, normalize_device(device)))
        try:
            costs = json.loads(rows[0][0]) if rows else None
        except ValueError:
            return None
        if not isinstance(costs, dict):
            return None
        try:
            finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in costs.values())
        except OverflowError:  # an integer too large for a float
            finite = False
        if not finite:
            return None  # measured again (JSON reads NaN and Infinity, which no measurement gives)
        return {str(k): float(v) for k, v in costs.items()}

    def executable(self, problem: ConvProblem, algorithm: str) -> tuple[dict[str, Any], bytes] | None:
        """(recipe, serialized form) stored for ``algorithm`` on ``problem`` on this machine and software, or None."""
        here = _here(problem.device)
        if here is None:
            return None
        rows = self._read("SELECT recipe, serialized FROM executables WHERE fingerprint=? AND software=? AND problem=? "
                          "AND algorithm=?", (*here, problem.key, algorithm))
        if not rows:
            return None
        try:
            serialized = bytes(rows[0][1])  # a damaged row may hold text there: TypeError
            sealed = json.loads(rows[0][0])
            if isinstance(sealed, dict) and "kind" in sealed and "checksum" not in sealed:
                log.info("rebuilding the executable of %s by %s: stored before its rows had checksums", problem.key,
                         algorithm)
                return None
            text = sealed["recipe"]
            if sealed["checksum"] != _executable_checksum(*here, problem.key, algorithm, text, serialized):
                raise ValueError("its checksum does not match (a damaged row)")
            recipe = json.loads(text)
            if not isinstance(recipe, dict):
                raise ValueError("its recipe is not a JSON object")
        except (ValueError, TypeError, KeyError) as exc:
            self._warn_once(f"executable:{problem.key}:{algorithm}", "ignoring a stored executable of %s by %s (%s); "
                            "it is rebuilt", problem.key, algorithm, exc)
            return None
        return recipe, serialized

    def close(self) -> None:
        """Close this process's connection; the object reopens it if used again."""
        if self._pid != os.getpid():
            return  # the parent's connection is not ours to close
        with self._lock:
            if self._conn is not None:
                self._conn.close()
            self._conn = None

    def __enter__(self) -> TuningDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TuningDB({str(self.path)!r})"

    # -- rows --------------------------------------------------------------------------------
    def _finds(self, order: str) -> Iterator[tuple[tuple[str, str, str], list[tuple[str, float, Any]],
                                                    list[PerfResult] | None]]:
        """Every stored find, on every machine and software, in ``order`` (columns of the results table): its
        (problem key, fingerprint, software), its rows in stored order as (device, stored_at, ``_decoded_row``), and
        its results where they are whole (``_whole``; None for a find that lost rows)."""
        rows = self._read("SELECT problem, fingerprint, software, device, stored_at, result, algorithm, checksum "
                          f"FROM results ORDER BY {order}, rowid")
        groups: dict[tuple[str, str, str], list[tuple[str, float, Any]]] = {}
        for key, fp, sw, device, stored_at, text, name, checksum in rows:
            groups.setdefault((key, fp, sw), []).append(
                (device, stored_at, self._decoded_row(text, key, (fp, sw, name, checksum))))
        for (key, fp, sw), found in groups.items():
            yield (key, fp, sw), found, self._whole(key, [row for _, _, row in found])

    def _whole(self, key: str, decoded: list[tuple[PerfResult, int | None] | None]) -> list[PerfResult] | None:
        """The results of one find of ``key`` (its rows ``_decoded_row``), or None (warned once) where fewer can be
        read than it stored: a lost row may be its best, and the rest would pick the next best as if it were. Rows
        stored before the count was kept have none: taken as they are."""
        read = [row for row in decoded if row is not None]
        stored = max((n for _, n in read if n is not None), default=0)
        if len(read) < stored:
            self._warn_once(f"partial:{key}:{len(read)}:{stored}", "ignoring the stored results of %s: only %d of "
                            "the %d its measurement stored can be read (a damaged database); it is measured again "
                            "when next tuned", key, len(read), stored)
            return None
        return [result for result, _ in read]

    def _decode(self, text: str, key: str, row: tuple[str, str, str, str]) -> PerfResult | None:
        """The result a row holds, or None (warned once) when it fails its checksum or no longer validates.

        row: (fingerprint, software, algorithm, checksum) of the row, which the checksum binds together
        with the problem key and the text: a bit flipped anywhere in them is a damaged row, never served.
        """
        decoded = self._decoded_row(text, key, row)
        return None if decoded is None else decoded[0]

    def _decoded_row(self, text: str, key: str, row: tuple[str, str, str, str]) -> tuple[PerfResult, int | None] | None:
        """``_decode``'s result with the number of rows its find stored (None in rows stored before it was kept)."""
        memo = (key, *row, text)
        if memo not in self._decoded:
            if len(self._decoded) >= DECODED_ROWS:  # a long-lived process: start again rather than grow
                self._decoded.clear()
            self._decoded[memo] = self._decode_row(text, key, row)
        return self._decoded[memo]

    def _decode_row(self, text: str, key: str, row: tuple[str, str, str, str]) -> tuple[PerfResult, int | None] | None:
        fp, sw, name, checksum = row
        if checksum != db_file.row_checksum(fp, sw, key, name, text):
            self._warn_once(f"checksum:{key}:{name}:{checksum}", "ignoring a stored result of %s by %s whose "
                            "checksum does not match (a damaged row); tune it again", key, name)
            return None
        try:
            data = json.loads(text)
            stored = data.pop(ROWS_OF_FIND, None) if isinstance(data, dict) else None
            if stored is not None and (isinstance(stored, bool) or not isinstance(stored, int) or stored < 1):
                raise ValueError(f"its {ROWS_OF_FIND}={stored!r} is not a count of rows")
            result = PerfResult.from_dict(data)
            if result.algorithm != name:
                raise ValueError(f"it names {result.algorithm}, its row {name}")
            return result, stored
        except ValueError as exc:  # json.JSONDecodeError is a ValueError too
            self._warn_once(f"row:{key}:{text}", "ignoring a stored result of %s that no longer validates: %s",
                            key, exc)
            return None

    def _problem(self, key: str) -> ConvProblem | None:
        try:
            return ConvProblem.from_key(key)
        except (ValueError, TypeError) as exc:
            self._warn_once(f"key:{key}", "ignoring stored results of a key that no longer validates: %s", exc)
            return None

    def _warn_once(self, token: str, msg: str, *args: Any) -> None:
        if token not in self._warned:
            self._warned.add(token)
            log.warning(msg, *args)

    # -- connection --------------------------------------------------------------------------
    def _run(self, fn: Any) -> Any:
        """``fn(connection)`` under the lock; if the file turns out corrupt under it, again on a fresh file."""
        if self._pid != os.getpid():
            # After a fork the parent's connection (and maybe a held lock) must not be touched.
            if self._conn is not None:
                self._forked.append(self._conn)
            self._conn, self._pid, self._lock = None, os.getpid(), threading.RLock()
        with self._lock:
            try:
                return fn(self._connection())
            except sqlite3.DatabaseError as exc:
                if not db_file.is_corruption(exc):
                    raise
                failed = self._identity
                # fn ran on the connection _connection() set (db_file.open_checked moves a corrupt file aside itself).
                cast(sqlite3.Connection, self._conn).close()
                self._conn = None
                try:
                    with db_file.file_lock(self.path):
                        if db_file.identity(self.path) == failed:  # no other process has replaced it yet
                            db_file.move_aside(self.path, "corrupt", str(exc))
                except OSError as os_exc:  # a folder that may not be written: the file can be neither moved nor fixed
                    raise ValueError(f"the tuning database {self.path} is damaged ({exc}) and its folder may not be "
                                     f"written ({os_exc.strerror or os_exc}); give another path or set "
                                     f"CONVTUNE_CACHE_DIR") from None
            return fn(self._connection())

    def _connection(self) -> sqlite3.Connection:
        """This process's connection to the file now at ``path`` (call under the lock)."""
        if self._conn is not None and db_file.identity(self.path) != self._identity:
            # Another process moved the file aside (or a user removed it): follow the path.
            self._conn.close()
            self._conn = None
        if self._conn is None:
            # The folder too may have gone (a cache folder removed): made again, as at construction (where
            # it cannot be, opening fails as it would have, with SQLite's error).
            with contextlib.suppress(OSError):
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = db_file.open_checked(self.path, mine=self._mine)
            self._identity = db_file.identity(self.path)
        return self._conn

    def _read(self, sql: str, params: tuple = ()) -> list[tuple]:
        return self._run(lambda conn: conn.execute(sql, params).fetchall())

    def _write(self, fn: Any, asked: str = "") -> Any:
        """``fn(connection)`` in one BEGIN IMMEDIATE transaction.

        Where the file is read-only: a write the user ``asked`` for by name (an import, a clear) raises
        ValueError saying so; the stores that tuning makes on its own return None, warned once, not at
        every store. A read-only database still serves what it holds; new measurements are used and
        not remembered.
        """
        def in_transaction(conn: sqlite3.Connection) -> Any:
            with db_file.transaction(conn):
                return fn(conn)
        try:
            return self._run(in_transaction)
        except sqlite3.OperationalError as exc:
            if not db_file.read_only(exc):
                raise
            if asked:
                raise ValueError(f"cannot {asked}: the tuning database {self.path} is read-only ({exc}); make the "
                                 f"file writable or give another path") from None
            self._warn_once("read-only", "the tuning database %s is read-only (%s): it serves what it holds, and "
                            "new measurements are used but not remembered. Make the file writable or give another "
                            "path (TuningDB(path), CONVTUNE_CACHE_DIR)", self.path, exc)
            return None


_OPEN_FAULTS = (OSError, sqlite3.Error, RuntimeError, ValueError)  # what opening a database path can raise
_opened: dict[str, TuningDB] = {}  # every database opened from a path (or the default one), once per file and process
_unopenable: set[str] = set()  # paths that could not be opened where a temporary database served (each warned once)
_fallback: TuningDB | None = None  # the process's temporary database, where a path cannot be opened
_opened_lock = threading.Lock()
forks.renew_after_fork(globals(), _opened_lock=threading.Lock)  # (held while a database is opened)


def opened(path: str | os.PathLike | None = None, *, strict: bool = False) -> TuningDB | None:
    """``TuningDB(path)`` (None: the default path, ``settings.db_path``), opened once per file and process (its
    integrity is checked on open) and shared by whoever asks for that file; a relative path is the file it names
    now (the database keeps it absolute: a later change of the working folder does not move it).

    Where it cannot be opened (a folder, a device, a read-only or missing folder, a lock held too long, a path that
    does not resolve): with ``strict`` the fault is raised (find, select, plan and get given a path: the caller named
    that file, and it is tried again at each call); otherwise (the default database, a path given to optimize or a
    tuned layer) the process's temporary database serves, removed when the process ends, with a warning that names
    the path and the fault, once: for those callers that path is not tried again in this process. Tuning goes on and
    is remembered for the process's lifetime, rather than failing. None only where not even a temporary database can
    be made. The files are opened outside the lock that guards the cache: a slow open holds up no other file's.
    """
    given = settings.db_path if path is None else path
    key = str(given)  # the file's resolved path, once it resolves
    try:
        where = Path(given).expanduser().resolve()  # a symlink loop, a home folder that cannot be found: raise here
        key = str(where)
        with _opened_lock:
            known = _opened.get(key)
            if known is not None:
                return known
            if key in _unopenable and not strict:
                return _temporary()
        db = TuningDB(where)
    except _OPEN_FAULTS as exc:
        if strict:
            raise
        with _opened_lock:
            if key not in _unopenable:
                _unopenable.add(key)
                _warn_unopened(key, exc, "Give a file's path in a writable folder, or set CONVTUNE_CACHE_DIR to one "
                                         "for the default database")
            return _temporary()
    with _opened_lock:  # another thread may have opened the same file meanwhile: the first one opened is everyone's
        kept = _opened.setdefault(key, db)
    if kept is not db:
        db.close()
    return kept


def as_db(db: Any, who: str) -> Any:
    """``db`` as find, select, plan and get take it: a ``TuningDB`` (or an object with its methods), None, or a
    path (``opened(path, strict=True)``: raised where it cannot be opened). ``TypeError`` for anything else, naming
    ``who`` (the function asked)."""
    check_db(db, who)
    return opened(db, strict=True) if isinstance(db, (str, os.PathLike)) else db


def check_db(db: Any, who: str) -> None:
    """``TypeError`` naming ``who`` unless ``db`` is a ``TuningDB`` (or an object with its methods), a path or None."""
    if db is None or isinstance(db, (str, os.PathLike)):
        return
    if not any(callable(getattr(db, m, None)) for m in ("results", "lookup", "measurements")):
        raise TypeError(f"{who}'s db must be a TuningDB, a database file's path or None, got {type(db).__name__}")


def _warn_unopened(where: str, exc: BaseException, fix: str) -> None:
    log.warning("the tuning database at %s cannot be opened (%s: %s); this process remembers its choices in a "
                "temporary database, removed when it ends. %s", where, type(exc).__name__, exc, fix)


def _temporary() -> TuningDB | None:
    """The process's temporary database, made on first need (call under ``_opened_lock``)."""
    global _fallback
    if _fallback is None:
        import atexit
        import shutil
        import tempfile

        try:
            folder = tempfile.mkdtemp(prefix="convtune-db-")
            _fallback = TuningDB(Path(folder) / "tuning.sqlite")
        except _OPEN_FAULTS as exc:
            log.warning("no temporary tuning database either (%s: %s); choices are made but not remembered",
                        type(exc).__name__, exc)
            return None
        creator = os.getpid()

        def remove() -> None:
            if os.getpid() == creator:  # a forked child that exits must not remove its parent's database
                shutil.rmtree(folder, ignore_errors=True)
        atexit.register(remove)
    return _fallback


# In a result row's text beside the result's fields: how many rows the find that stored it stored.
ROWS_OF_FIND = "rows_of_find"
DECODED_ROWS = 100_000  # rows a TuningDB keeps decoded (a few hundred bytes each)


def _executable_checksum(fingerprint: str, software: str, problem: str, algorithm: str, recipe: str,
                         serialized: bytes) -> str:
    """What binds a stored executable's recipe (its JSON text) and serialized form to its machine, software, problem
    and algorithm."""
    return db_file.row_checksum(fingerprint, software, problem, algorithm,
                                recipe + "\0" + hashlib.blake2b(serialized).hexdigest())


def _encoded(results: list[PerfResult]) -> list[tuple[str, str]]:
    """(algorithm, text) of each of one find's ``results``: its result's fields and how many rows the find stores
    (``ROWS_OF_FIND``), so that a set that lost rows in a damaged file is known as such."""
    encoded: dict[str, dict[str, Any]] = {}  # one row an algorithm: the last result given for it, as the table keeps
    for result in results:
        if not isinstance(result, PerfResult):
            raise TypeError(f"TuningDB.store needs PerfResults, got {type(result).__name__}: {result!r}")
        data = result.to_dict()
        PerfResult.from_dict(data)  # refuse now what could not be read back
        encoded.pop(result.algorithm, None)
        encoded[result.algorithm] = data
    return [(name, json.dumps({**data, ROWS_OF_FIND: len(encoded)})) for name, data in encoded.items()]


def _resolved(path: Path) -> Path:
    """``path`` through symbolic links and the home folder, as far as it resolves (``path`` itself where not)."""
    try:
        return path.expanduser().resolve()
    except (OSError, RuntimeError):  # a loop of links, a home folder that cannot be found
        return path


def _here(device: str) -> tuple[str, str] | None:
    """(fingerprint, software) of ``device`` on this machine; None if it has no such device."""
    if device == "cuda" and not torch.cuda.is_available():
        return None
    return hardware.fingerprint(device), hardware.software_versions()
