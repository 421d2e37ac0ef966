"""Rows read straight from the pages of a SQLite file, without its b-trees: what salvaging a damaged tuning
database falls back on where the pages above a table's rows (its root, interior pages) are damaged.

SQLite keeps a table's rows in leaf pages (https://www.sqlite.org/fileformat2.html): a page of type 13 holds
an array of cell pointers, each cell a row's length, its rowid and its record (a header of serial types,
then the values). Every leaf page that is not on the free list is read here, cell by cell, every bound
checked: a damaged page yields nothing or garbage, never an exception. Nothing here knows which table a
row belongs to, nor whether its values are what was written: the caller checks each row (the tuning
database's rows carry a checksum). Rows too long for their page (with overflow pages) are left out.

    >>> import sqlite3, tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.sqlite"
    >>> with sqlite3.connect(path) as conn:
    ...     _ = conn.execute("CREATE TABLE t (a TEXT, b REAL, c INTEGER)")
    ...     _ = conn.execute("INSERT INTO t VALUES ('x', 1.5, 7)")
    >>> [row for row in leaf_rows(path.read_bytes()) if row[0] == "x"]
    [('x', 1.5, 7)]
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

HEADER = b"SQLite format 3\x00"
LEAF_TABLE_PAGE = 13
# Page sizes tried where the file's header is damaged: SQLite's default first.
PAGE_SIZES = (4096, 1024, 2048, 8192, 16384, 32768, 65536, 512)
WAL_MAGIC = (0x377F0682, 0x377F0683)  # the WAL's checksums in little-endian words, or big-endian


def leaf_rows(data: bytes, columns: int | None = None) -> Iterator[tuple]:
    """Every row of every table leaf page of the database image ``data`` (``with_wal``'s, where the file has a
    write-ahead log), as a tuple of its values (None, int, float, str or bytes); with ``columns``, only rows of
    that many values. Where the header is sound: its page size, the pages within the database's size, the free
    list's left out; where it is damaged: each of SQLite's page sizes in turn (so a row may come twice)."""
    sizes: tuple[int, ...] = PAGE_SIZES
    reserved, free, pages = 0, set(), None
    size = page_size(data)
    if size is not None:
        sizes, reserved = (size,), data[20]
        free = _free_pages(data, size, struct.unpack(">I", data[32:36])[0])
        counter, in_header = struct.unpack(">II", data[24:32])
        if in_header and struct.unpack(">I", data[92:96])[0] == counter:  # the header's count of pages is
            pages = in_header  # current: no page past it is in use
    for size in sizes:
        usable = size - reserved
        last = (len(data) + size - 1) // size if pages is None else min(pages, (len(data) + size - 1) // size)
        for number in range(1, last + 1):
            if number not in free:
                yield from page_rows(data, size, usable, number, columns)


def page_size(data: bytes) -> int | None:
    """The page size the header of the database file ``data`` gives; None where the header is damaged."""
    if data[:16] != HEADER or len(data) < 100:
        return None
    size = struct.unpack(">H", data[16:18])[0]
    size = 65536 if size == 1 else size
    return size if size in PAGE_SIZES else None


def with_wal(data: bytes, wal: bytes) -> bytes:
    """The database image that the file ``data`` and its write-ahead log ``wal`` hold together: each page as the
    last committed frame of the log wrote it, and as many pages as the last commit says (frames are taken while
    their salts and cumulative checksums hold, up to the last commit among them; a damaged or absent log leaves
    ``data`` as it is)."""
    if len(wal) < 32:
        return data
    magic, _, size, _, salt1, salt2, c1, c2 = struct.unpack(">8I", wal[:32])
    if magic not in WAL_MAGIC or size not in PAGE_SIZES and size != 1:
        return data
    size = 65536 if size == 1 else size
    order = ">" if magic & 1 else "<"
    s0, s1 = _wal_checksum(wal[:24], order, 0, 0)
    if (s0, s1) != (c1, c2):
        return data
    pages: dict[int, bytes] = {}
    committed: dict[int, bytes] = {}
    count = None
    at = 32
    while at + 24 + size <= len(wal):
        number, commit, f1, f2, c1, c2 = struct.unpack(">6I", wal[at:at + 24])
        page = wal[at + 24:at + 24 + size]
        s0, s1 = _wal_checksum(wal[at:at + 8] + page, order, s0, s1)
        if (f1, f2) != (salt1, salt2) or (s0, s1) != (c1, c2) or number == 0:
            break
        pages[number] = page
        if commit:
            committed.update(pages)
            pages, count = {}, commit
        at += 24 + size
    if count is None:
        return data
    image = bytearray(data[:count * size].ljust(count * size, b"\0"))
    for number, page in committed.items():
        if number <= count:
            image[(number - 1) * size:number * size] = page
    return bytes(image)


def _wal_checksum(buf: bytes, order: str, s0: int, s1: int) -> tuple[int, int]:
    """SQLite's WAL checksum of ``buf`` (a multiple of 8 bytes), going on from (s0, s1)."""
    words = struct.unpack(f"{order}{len(buf) // 4}I", buf)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def _free_pages(data: bytes, size: int, trunk: int) -> set[int]:
    """The pages on the free list, from its first trunk page (as far as the list can be read)."""
    free: set[int] = set()
    seen: set[int] = set()
    while trunk and trunk not in seen:
        seen.add(trunk)
        start = (trunk - 1) * size
        page = data[start:start + size]
        if len(page) < 8:
            break
        following, count = struct.unpack(">II", page[:8])
        free.add(trunk)
        for i in range(min(count, (len(page) - 8) // 4)):
            free.add(struct.unpack(">I", page[8 + 4 * i:12 + 4 * i])[0])
        trunk = following
    return free


def page_rows(data: bytes, size: int, usable: int, number: int, columns: int | None = None) -> Iterator[tuple]:
    """The rows of page ``number`` (pages of ``size`` bytes, ``usable`` of them SQLite's) where it is a table
    leaf page (with ``columns``, only rows of that many values); nothing where it is not or is damaged."""
    start = (number - 1) * size
    page = data[start:start + size]
    head = 100 if number == 1 else 0
    if len(page) < head + 8 or page[head] != LEAF_TABLE_PAGE:
        return
    cells = struct.unpack(">H", page[head + 3:head + 5])[0]
    first = head + 8 + 2 * cells  # cells lie after the pointer array
    local_most = usable - 35  # the largest payload kept whole on its page
    seen: set[int] = set()
    for i in range(cells):
        at = head + 8 + 2 * i
        if at + 2 > len(page):
            return
        offset = struct.unpack(">H", page[at:at + 2])[0]
        if offset < first or offset in seen:
            continue  # a damaged pointer
        seen.add(offset)
        try:
            length, offset = _varint(page, offset)
            _, offset = _varint(page, offset)  # the rowid
        except IndexError:
            continue
        if length > local_most or offset + length > len(page):
            continue  # spills onto overflow pages, or runs past the page: not read
        row = _record(page[offset:offset + length], columns)
        if row is not None:
            yield row


def _varint(buf: bytes, at: int) -> tuple[int, int]:
    """SQLite's variable-length integer at ``at``: (value, the offset after it); IndexError past the end."""
    value = 0
    for i in range(8):
        byte = buf[at + i]
        value = (value << 7) | (byte & 0x7F)
        if byte < 0x80:
            return value, at + i + 1
    return (value << 8) | buf[at + 8], at + 9


def _record(payload: bytes, columns: int | None = None) -> tuple | None:
    """A record's values; None where it does not parse (or has other than ``columns`` values)."""
    try:
        header_size, at = _varint(payload, 0)
        types = []
        while at < header_size:
            serial, at = _varint(payload, at)
            types.append(serial)
            if columns is not None and len(types) > columns:
                return None
    except IndexError:
        return None
    if at != header_size or header_size > len(payload) or columns is not None and len(types) != columns:
        return None
    values: list = []
    body = header_size
    for serial in types:
        width = _width(serial)
        if width is None or body + width > len(payload):
            return None
        raw = payload[body:body + width]
        body += width
        if serial == 0:
            values.append(None)
        elif serial <= 6:
            values.append(int.from_bytes(raw, "big", signed=True))
        elif serial == 7:
            values.append(struct.unpack(">d", raw)[0])
        elif serial in (8, 9):
            values.append(serial - 8)
        elif serial % 2 == 0:
            values.append(bytes(raw))
        else:
            values.append(raw.decode("utf-8", errors="replace"))
    return tuple(values) if body == len(payload) else None


def _width(serial: int) -> int | None:
    """Bytes of a value of serial type ``serial`` in a record's body; None for the reserved types."""
    if serial < 7:
        return (0, 1, 2, 3, 4, 6, 8)[serial]
    if serial == 7:
        return 8
    if serial in (8, 9):
        return 0
    if serial in (10, 11):
        return None
    return (serial - 12) // 2 if serial % 2 == 0 else (serial - 13) // 2
