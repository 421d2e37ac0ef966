"""The tuning database's file: opening it, checking it, locking it, and recovering it when it is damaged.

``open_checked`` gives a connection to a checked file of this schema in WAL mode (the tables made when the file is
empty). A file that is not a database, fails ``PRAGMA integrity_check`` or has an older schema version is moved aside
(renamed with a suffix, with a warning) under a lock between processes, and a fresh one is started, holding the
results rows of the damaged file that still read (``salvage`` reads them) and still match their checksum
(``row_checksum``). A file in a folder that may not be written is read as it is. ``transaction`` is a write transaction
(``BEGIN IMMEDIATE``); ``identity``, ``file_lock`` and ``move_aside`` let a database in use follow a file that
another process replaced, or replace one found damaged in use. A newer convtune's database (a newer schema version) is
never moved: ``ValueError`` says so, and the file stays for the convtune that wrote it; nor, where the caller named
the path (``mine=False``), another program's SQLite database. What the rows mean, and the API over them, is ``db``'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import salvage, sqlite_pages

log = logging.getLogger(__name__)


# Bump on any change to the tables or to the meaning of a row; older files are moved aside.
SCHEMA_VERSION = 3
BUSY_TIMEOUT_MS = 30_000
_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE results (
    fingerprint TEXT NOT NULL, software TEXT NOT NULL, problem TEXT NOT NULL, algorithm TEXT NOT NULL,
    device TEXT NOT NULL, stored_at REAL NOT NULL, result TEXT NOT NULL, checksum TEXT NOT NULL,
    PRIMARY KEY (fingerprint, software, problem, algorithm)
);
CREATE INDEX results_by_problem ON results (problem);
CREATE TABLE host_costs (
    fingerprint TEXT NOT NULL, software TEXT NOT NULL, device TEXT NOT NULL, stored_at REAL NOT NULL,
    costs TEXT NOT NULL, PRIMARY KEY (fingerprint, software, device)
);
CREATE TABLE executables (
    fingerprint TEXT NOT NULL, software TEXT NOT NULL, problem TEXT NOT NULL, algorithm TEXT NOT NULL,
    stored_at REAL NOT NULL, recipe TEXT NOT NULL, serialized BLOB NOT NULL,
    PRIMARY KEY (fingerprint, software, problem, algorithm)
);
"""
# The results table's row in SQLite's own table of tables (type, name and table name side by side, then its
# definition), as the file keeps it: no text file holds it, damage to the file's header leaves it
_RESULTS_TABLE = b"tableresultsresults"


def may_be_ours(path: str | os.PathLike) -> bool:
    """Whether the regular file at ``path`` may be a tuning database, damaged or not: it starts as a SQLite file does,
    or its first pages still hold the results table's row in SQLite's table of tables (near the end of the first
    page: damage to the header leaves it). Not a file, or an empty one: True (SQLite makes a database there)."""
    if not os.path.isfile(path):
        return True
    with open(path, "rb") as f:
        start = f.read(1 << 16)
    return not start or start.startswith(sqlite_pages.HEADER) or _RESULTS_TABLE in start


def identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``, None where there is none: a database in use compares it with its
    connection's to notice a file another process replaced."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def row_checksum(fingerprint: str, software: str, problem: str, algorithm: str, text: str) -> str:
    """What binds a result row's text to its machine, software, problem and algorithm."""
    digest = hashlib.blake2b(digest_size=12)
    for part in (fingerprint, software, problem, algorithm, text):
        digest.update(part.encode("utf-8", errors="surrogatepass") + b"\0")
    return digest.hexdigest()


def open_checked(path: Path, mine: bool = True) -> sqlite3.Connection:
    """A connection to a checked database at ``path``; a bad file is moved aside and replaced, but not a newer
    convtune's database, nor, unless the path is convtune's own (``mine``), another program's (``ValueError``). In a
    folder that may not be written (SQLite cannot make its journal there), the file is read as it is
    (``_open_as_it_is``)."""
    for _ in range(3):
        conn = _connect(path)
        try:
            fault = _check(conn)
        except sqlite3.OperationalError as exc:
            conn.close()
            if not (read_only(exc) and path.is_file()):
                raise
            return _open_as_it_is(path)
        if fault is None:
            return conn
        conn.close()
        _refuse_to_move(path, fault, mine)
        with file_lock(path):
            # Another process may have replaced the file meanwhile: look again under the lock.
            conn = _connect(path)
            fault = _check(conn)
            conn.close()
            if fault is not None:
                _refuse_to_move(path, fault, mine)
                rows = salvage.results(path, _intact, BUSY_TIMEOUT_MS / 1000) if fault[0] == "corrupt" else []
                move_aside(path, *fault)
                if rows:
                    _restore(path, rows)
    raise RuntimeError(f"could not open a fresh tuning database at {path}; remove the file or set CONVTUNE_CACHE_DIR")


def _refuse_to_move(path: Path, fault: tuple[str, str], mine: bool) -> None:
    """``ValueError`` where the file ``_check`` found ``fault`` in is not to be moved aside: a newer convtune's
    database, or (where the path is not convtune's own) another program's SQLite database."""
    kind, reason = fault
    if kind == "newer":
        raise ValueError(f"the tuning database {path} was written by a newer convtune ({reason}); it is left as it is "
                         f"for that convtune: upgrade this one, or give another path or set CONVTUNE_CACHE_DIR")
    if kind == "foreign" and not mine:
        raise ValueError(f"{path} is another program's SQLite database (it has no tuning tables), and is left as it "
                         f"is; give a tuning database's path, or a new one")


def _open_as_it_is(path: Path) -> sqlite3.Connection:
    """A read-only connection to the database at ``path``, whose folder may not be written: SQLite's
    ``immutable`` mode, which needs no journal beside the file. It serves what the file holds as it was (a
    process allowed to write there may still change it, which this connection need not see). Every store is
    refused as read-only (``TuningDB._write`` warns once).
    A damaged file or another schema raises ValueError: it cannot be moved aside or salvaged there."""
    conn = _connect(Path(f"file:{urllib.parse.quote(str(path.resolve()))}?immutable=1"), uri=True)
    try:
        verdict = [row[0] for row in conn.execute("PRAGMA integrity_check").fetchall()]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        verdict, version = [str(exc)], None
    if verdict != ["ok"] or version != SCHEMA_VERSION:
        conn.close()
        why = ("; ".join(verdict[:3]) if verdict != ["ok"] else
               f"schema version {version}, this convtune uses {SCHEMA_VERSION}")
        raise ValueError(f"the tuning database {path} cannot be used ({why}) and its folder may not be written, so it "
                         f"cannot be replaced; give another path or set CONVTUNE_CACHE_DIR")
    log.warning("the tuning database %s is in a folder that may not be written: it is read as it is, and new "
                "measurements are used but not remembered", path)
    return conn


def _connect(path: Path, uri: bool = False) -> sqlite3.Connection:
    # isolation_level=None: transactions are begun explicitly (BEGIN IMMEDIATE for writes).
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False,
                           uri=uri)
    # A damaged row whose text is not UTF-8 reads as text with the bad bytes replaced: its JSON then
    # fails to decode and that one row is ignored with a warning, instead of every read failing.
    conn.text_factory = lambda raw: raw.decode("utf-8", errors="replace")
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    # What is deleted (a find stored again, a cleared cache) is overwritten with zeros: salvaging a damaged
    # file reads its pages' rows straight (salvage.results), and must not bring deleted rows back.
    conn.execute("PRAGMA secure_delete=ON")
    return conn


def _check(conn: sqlite3.Connection) -> tuple[str, str] | None:
    """None if ``conn`` holds a healthy database of this schema (created if empty), else (kind, reason)."""
    try:
        # integrity_check, not quick_check: only it finds an index that lost or changed a row's entry (a
        # flipped bit), through which lookups would miss stored rows (68 ms against 25 for 38,599 results)
        verdict = [row[0] for row in conn.execute("PRAGMA integrity_check").fetchall()]
        if verdict != ["ok"]:
            return "corrupt", "; ".join(verdict[:3])
        # A file that is not to be moved aside (open_checked's refusals) is told before anything in it changes
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and not (version >= 1 and {"meta", "results"} <= tables):  # (every schema of convtune's has both)
            return "foreign", f"schema version {version} without a tuning database's tables"
        if version > SCHEMA_VERSION:
            return "newer", f"schema version {version}, this convtune uses {SCHEMA_VERSION}"
        _retry_busy(lambda: conn.execute("PRAGMA journal_mode=WAL"))
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a crash may lose the last write, never corrupt
        with transaction(conn):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if version == 0 and not tables:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute("INSERT INTO meta VALUES ('schema', ?), ('created_at', ?)",
                             (str(SCHEMA_VERSION), str(time.time())))
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                return None
            if version != SCHEMA_VERSION or "meta" not in tables:
                return f"schema{version}", f"schema version {version}, this convtune uses {SCHEMA_VERSION}"
            row = conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None or row[0] != str(SCHEMA_VERSION):
                return f"schema{version}", f"meta schema {row and row[0]!r}, this convtune uses {SCHEMA_VERSION}"
    except sqlite3.DatabaseError as exc:
        if not is_corruption(exc):
            raise
        return "corrupt", str(exc)
    return None


def is_corruption(exc: sqlite3.DatabaseError) -> bool:
    """SQLITE_CORRUPT or SQLITE_NOTADB (busy, locked and misuse are not)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (11, 26)
    return type(exc) is sqlite3.DatabaseError


def _retry_busy(fn: Any, budget_s: float = BUSY_TIMEOUT_MS / 1000) -> Any:
    """Changing the journal mode can fail with 'locked' at once, without the busy handler: retry."""
    deadline = time.monotonic() + budget_s
    while True:
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE: take the write lock up front, so concurrent writers wait instead of failing."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        # A corrupt file may refuse even this; the error that matters is the one raised below.
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes, so only one of them replaces a bad file."""
    try:
        import fcntl
    except ImportError:  # Windows: a rename there fails on an open file anyway
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _intact(row: tuple) -> bool:
    """Whether a results row read from a damaged file is what was written: its checksum binds the machine,
    software, problem, algorithm and result (a page of zeros or garbage that still parses fails it); the
    two fields it does not bind must agree with the problem (the device) and be a time (stored_at)."""
    if len(row) != salvage.COLUMNS:
        return False
    fingerprint, software, problem, algorithm, device, stored_at, text, checksum = row
    try:
        bound = checksum == row_checksum(fingerprint, software, problem, algorithm, text)
    except (AttributeError, TypeError):  # a field that is not text
        return False
    sane_time = isinstance(stored_at, (int, float)) and math.isfinite(stored_at) and stored_at > 0
    return bound and sane_time and device in ("cpu", "cuda") and f"|{device}|" in problem


def _restore(path: Path, rows: list[tuple]) -> None:
    """A fresh database at ``path`` holding the salvaged results ``rows`` (each one checked by ``_intact``)."""
    conn = _connect(path)
    try:
        if _check(conn) is None:
            with transaction(conn):
                marks = ", ".join("?" * salvage.COLUMNS)
                conn.executemany(f"INSERT OR IGNORE INTO results VALUES ({marks})", rows)
            log.warning("tuning database %s: %d results rows salvaged from the damaged file", path, len(rows))
    finally:
        conn.close()


def move_aside(path: Path, kind: str, reason: str) -> None:
    """Rename ``path`` (and its -wal/-shm files) to ``<name>.<kind>-<time>-<pid>``, with a warning."""
    stamp = f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    aside = path.with_name(f"{path.name}.{stamp}")
    n = 0
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.{stamp}-{n}")
    log.warning("tuning database %s is unusable (%s); moved it to %s and starting a fresh one", path, reason, aside)
    for suffix in ("", "-wal", "-shm"):
        src = Path(str(path) + suffix)
        if src.exists():
            os.replace(src, Path(str(aside) + suffix))


def read_only(exc: sqlite3.OperationalError) -> bool:
    """Whether SQLite refused a write because the file (or its folder) may not be written."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    return (code is not None and code & 0xFF == sqlite3.SQLITE_READONLY) or "readonly" in str(exc)
