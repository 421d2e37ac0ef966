"""Rows read straight from a SQLite file's pages (convtune.sqlite_pages), its write-ahead log applied."""

import sqlite3

import pytest

from convtune import sqlite_pages


def _rows(data: bytes, columns: int = 3) -> set[tuple]:
    return set(sqlite_pages.leaf_rows(data, columns))


def test_every_row_of_every_leaf_page_and_nothing_deleted(tmp_path):
    path = tmp_path / "t.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (a TEXT, b REAL, c BLOB)")
    conn.executemany("INSERT INTO t VALUES (?, ?, ?)",
                     [(f"row {i}" * 20, i / 3, bytes([i % 256]) * 50) for i in range(300)])
    conn.execute("PRAGMA secure_delete=ON")
    conn.execute("DELETE FROM t WHERE b > 50")
    conn.commit()
    conn.close()
    rows = _rows(path.read_bytes())
    assert rows == {(f"row {i}" * 20, i / 3, bytes([i % 256]) * 50) for i in range(300) if i / 3 <= 50}
    assert _rows(path.read_bytes(), columns=2) == set()  # rows of another width are left out


def test_the_write_ahead_log_is_applied_up_to_its_last_commit(tmp_path):
    path = tmp_path / "t.sqlite"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("PRAGMA wal_autocheckpoint=0")  # the log keeps what follows, as while another process has it open
    writer.execute("CREATE TABLE t (a TEXT, b INTEGER, c TEXT)")
    writer.executemany("INSERT INTO t VALUES (?, ?, ?)", [(f"old {i}", i, "x" * 100) for i in range(100)])
    writer.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the old rows in the file itself
    writer.execute("DELETE FROM t WHERE b < 50")
    writer.execute("INSERT INTO t VALUES ('new', 1000, 'y')")
    main, wal = path.read_bytes(), (tmp_path / "t.sqlite-wal").read_bytes()
    assert ("old 1", 1, "x" * 100) in _rows(main)  # the file alone still shows the deleted rows
    now = _rows(sqlite_pages.with_wal(main, wal))
    assert ("new", 1000, "y") in now and not any(r[1] < 50 for r in now) and len(now) == 51
    # A log cut inside its last frame (the insert's commit): the delete before it applied, not the insert
    cut = _rows(sqlite_pages.with_wal(main, wal[:len(wal) - 100]))
    assert ("new", 1000, "y") not in cut and not any(r[1] < 50 for r in cut) and len(cut) == 50
    # A damaged log header: the file as it is
    assert sqlite_pages.with_wal(main, b"\0" * 32 + wal[32:]) == main
    writer.close()


@pytest.mark.parametrize("seed", range(5))
def test_garbage_yields_nothing_and_never_raises(seed):
    import random

    data = random.Random(seed).randbytes(1 << 18)
    assert list(sqlite_pages.leaf_rows(data, 8)) == []
    assert sqlite_pages.with_wal(data, random.Random(seed + 1).randbytes(1 << 14)) == data
