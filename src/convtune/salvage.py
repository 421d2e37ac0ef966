"""The results that a damaged tuning database still holds: what ``db_file`` keeps of a file it must move aside.

Two ways into the file, joined. Through SQLite: every rowid that some path still reaches (each index, read as
far as it goes, and the table scanned in rowid order, sought past each damaged page), each row then read on its
own, so a damaged page loses its own rows only. Straight from the file's leaf pages (``sqlite_pages``, its
write-ahead log applied), which finds the rows below a damaged root or interior page too. The caller says which
rows are what was written (``intact``: the tuning database's results rows carry a checksum); nothing here
raises on a damaged file, it keeps what it could read.

A results row is (fingerprint, software, problem, algorithm, device, stored_at, result, checksum): one find of a
problem on one machine and software stores its rows together (the first three columns), one row an algorithm.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from . import sqlite_pages

COLUMNS = 8  # of a results row, as above
ROWS_PER_PAGE = 16  # a result row takes 300-600 bytes: a 4 KiB page holds about 8
MAX_ROWID = 2**63 - 1


def results(path: Path, intact: Callable[[tuple], bool], timeout_s: float) -> list[tuple]:
    """The results rows of the damaged database at ``path`` that can still be read and pass ``intact``. The rows
    SQLite reaches are the table as it stands; a row only the pages show is added where its key (machine,
    software, problem, algorithm) is not there, and never an earlier find's of a problem (a find replaces a
    problem's rows as a whole). In the order they were stored. ``timeout_s``: how long to wait for the file's
    lock."""
    live = _through_sqlite(path, intact, timeout_s)  # kept whole
    try:
        data = path.read_bytes()
        wal = Path(f"{path}-wal")
        if wal.exists():
            data = sqlite_pages.with_wal(data, wal.read_bytes())
    except OSError:
        data = b""
    keys = {row[:4] for row in live}
    earliest: dict[tuple, float] = {}  # (fingerprint, software, problem), what one find stores: its rows' time
    for row in live:
        earliest[row[:3]] = min(earliest.get(row[:3], row[5]), row[5])
    found = [row for row in sqlite_pages.leaf_rows(data, COLUMNS) if intact(row) and row[:4] not in keys]
    latest: dict[tuple, float] = {}
    for row in found:
        latest[row[:3]] = max(latest.get(row[:3], row[5]), row[5])
    extra = {row[:4]: row for row in found
             if row[5] >= earliest.get(row[:3], latest[row[:3]])}  # never an earlier find's row
    return sorted([*live, *extra.values()], key=lambda row: row[5])  # stable: live rows in rowid order


def _through_sqlite(path: Path, intact: Callable[[tuple], bool], timeout_s: float) -> list[tuple]:
    """``results``' rows that SQLite itself still reaches."""
    rows: list[tuple] = []
    try:
        conn = sqlite3.connect(path, timeout=timeout_s)
    except sqlite3.Error:
        return rows
    try:
        # A file cut short: read the pages it still has (SQLite refuses to read a file shorter than its
        # header says unless the schema is writable; salvage only reads).
        conn.execute("PRAGMA writable_schema=ON")
        conn.text_factory = lambda raw: raw.decode("utf-8", errors="replace")
        for rowid in sorted(_rowids(conn, "results")):
            try:
                row = conn.execute("SELECT * FROM results WHERE rowid = ?", (rowid,)).fetchone()
            except sqlite3.Error:
                continue  # on a damaged page
            if row is not None and len(row) == COLUMNS and intact(tuple(row)):
                rows.append(tuple(row))
    except sqlite3.Error:
        pass  # keep what was read
    finally:
        conn.close()
    return rows


def _rowids(conn: sqlite3.Connection, table: str) -> set[int]:
    """The rowids of ``table`` that can still be reached: from each of its indexes (which hold the rowids
    apart from the rows' pages), read as far as it goes, and from the table itself, scanned in rowid
    order and, where the scan meets a damaged page, sought past it."""
    ids: set[int] = set()
    try:
        indexes = [name for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?", (table,))]
    except sqlite3.Error:
        indexes = []
    for index in indexes:
        try:
            for (rowid,) in conn.execute(f'SELECT rowid FROM {table} INDEXED BY "{index}"'):
                ids.add(rowid)
        except sqlite3.Error:
            continue  # this index is damaged from here on: keep what was read
    start: int | None = 1  # the scan reads the rowids from here on (SQLite numbers rows from 1)
    while start is not None:
        begin = following = start  # following: the rowid after the last one read
        try:
            for (rowid,) in conn.execute(f"SELECT rowid FROM {table} WHERE rowid >= ? ORDER BY rowid", (begin,)):
                if rowid < following:  # out of order: a damaged page that still parses
                    raise sqlite3.DatabaseError(f"rowid {rowid} after {following - 1}")
                ids.add(rowid)
                following = rowid + 1
            start = None  # the end of the table
        except sqlite3.Error:
            # The cursor fails stepping past the row it was about to return: read that one alone.
            try:
                one = conn.execute(f"SELECT rowid FROM {table} WHERE rowid >= ? ORDER BY rowid LIMIT 1",
                                   (following,)).fetchone()
            except sqlite3.Error:
                one = None
            if one is not None and one[0] >= following:
                ids.add(one[0])
                following = one[0] + 1
            start = _past_damage(conn, table, max(following, begin + 1))  # always onwards
    return ids


def _past_damage(conn: sqlite3.Connection, table: str, start: int) -> int | None:
    """The first rowid from ``start`` on that a seek reaches, or None when none can be reached. A seek to
    rowid >= m fails while m lies on a damaged page and succeeds past it: found by stepping (the step
    doubles up to a page's worth of rows, so an intact page between two damaged runs is not jumped
    over), then halving the interval between the last failure and the first success."""

    def reaches(m: int) -> tuple[bool, int | None]:
        try:
            found = conn.execute(f"SELECT rowid FROM {table} WHERE rowid >= ? ORDER BY rowid LIMIT 1", (m,)).fetchone()
        except sqlite3.Error:
            return False, None
        if found is not None and found[0] < m:  # a damaged page that still parses
            return False, None
        return True, None if found is None else found[0]

    try:
        end = conn.execute(f"SELECT max(rowid) FROM {table}").fetchone()[0]  # the last page may be intact
    except sqlite3.Error:
        end = None
    step, failed = 1, start - 1  # every seek up to ``failed`` failed (or was not tried: before ``start``)
    while True:
        ok, _ = reaches(failed + step)
        if ok:
            break
        failed += step
        # doubling, but not past a page of small rows where the end of the table is known
        step = min(2 * step, ROWS_PER_PAGE) if end is not None else 2 * step
        if failed + step > (end if end is not None else MAX_ROWID):
            return None
    good = failed + step
    while good - failed > 1:  # the first rowid a seek reaches, between the last failure and the first success
        middle = (failed + good) // 2
        if reaches(middle)[0]:
            good = middle
        else:
            failed = middle
    return reaches(good)[1]
