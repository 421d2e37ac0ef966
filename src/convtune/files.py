"""Writing a file whole: a reader never sees half of it, and nothing but a regular file is ever replaced.

``write_whole(path, write)`` calls ``write(target)`` on a temporary file beside ``path`` and renames it
over ``path``. A path that is not a regular file is never renamed over: a device or a pipe
(``/dev/stdout``, a FIFO) is written into directly, a symbolic link's target is what gets replaced
(the link stays), and a folder, a file that nobody may write (kept from being replaced on purpose), or a SQLite
database (a tuning database: its write-ahead log, shared memory and journal too) is refused with ``ValueError``.

    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> write_whole(folder / "a.txt", lambda target: target.write_text("hello")).read_text()
    'hello'
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from .sqlite_pages import HEADER as SQLITE_HEADER  # the first 16 bytes of every SQLite database file

SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")  # the files SQLite keeps beside a database, by their name's ending


def header(path: str | os.PathLike) -> bytes | None:
    """The first 16 bytes of the regular file at ``path`` (a SQLite file's are ``SQLITE_HEADER``); None where there
    is no regular file (a pipe is not opened: that would wait for a writer). ``OSError`` (naming the path) where
    there is one that cannot be read."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read(16)


def is_database(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file that starts as a SQLite database does (``header``)."""
    return header(path) == SQLITE_HEADER


def refuse_database(path: str | os.PathLike) -> None:
    """``ValueError`` where ``path`` is a SQLite database or one's write-ahead log, shared memory or journal, which
    writing another kind of file there would destroy (a tuning database's measurements)."""
    for name in dict.fromkeys((str(path), os.path.realpath(path))):  # (a link's name, and the file it leads to)
        base = next((name[:-len(end)] for end in SQLITE_COMPANIONS if name.endswith(end)), None)
        if is_database(name) or (base and is_database(base)):
            raise ValueError(f"{path} is a SQLite database (a tuning database?){' or beside one' if base else ''}; "
                             f"writing this file there would replace it: give another path")


def writable(path: str | os.PathLike, make_folder: bool = False) -> Path:
    """The path ``write_whole`` writes for ``path``, checked as it checks before writing: ``ValueError`` where it
    is empty, and naming ``path`` where it is a folder, a regular file that nobody may write (chmod a-w: kept from
    being replaced on purpose), a SQLite database (``refuse_database``), or in a folder that is missing (with
    ``make_folder``: whose nearest existing folder up the path is not one) or is not one. A device or a pipe
    (``/dev/stdout``, a FIFO) is its path as given; a regular file, its real path (through symbolic links: a link
    given stays a link, its target is replaced)."""
    given = path
    if not os.fspath(given):  # Path('') is the current folder
        raise ValueError("an empty path was given to write; give a file's path")
    try:
        mode = os.stat(given).st_mode  # through links: /dev/stdout may be a pipe
    except FileNotFoundError:
        mode = None
    except OSError as exc:  # a path through a file ('/etc/hostname/x'), one too long
        raise ValueError(f"cannot write {given}: {exc.strerror}; give a path in an existing folder") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError(f"{given} is a folder; give a file's path")
    if mode is not None and not stat.S_ISREG(mode):
        return Path(given)
    if mode is not None and not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{given} is read-only (nobody may write it); make it writable or give another path")
    refuse_database(given)
    path = Path(os.path.realpath(given))
    folder = nearest_existing(path) if make_folder else path.parent  # (the missing ones up the path are made)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ValueError(f"cannot write {given}: {folder} {what}; give a path in an existing folder")
    return path


def nearest_existing(path: Path) -> Path:
    """The nearest path up ``path`` that exists, or the root: the folder the missing ones would be made in (a file,
    where the path runs through one)."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def write_whole(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Have ``write`` fill ``path`` (see the module docstring); returns the path written. ``ValueError`` where
    ``path`` cannot be written (``writable``); ``OSError`` naming ``path`` where writing it fails (a folder
    without write permission, a full disk)."""
    given, path = path, writable(path)
    if path.exists() and not path.is_file():  # a device, a pipe, a socket: written into, never replaced
        write(path)
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:  # named by the path given, not by the temporary file beside it
        message = f"cannot write {given}: {exc.strerror or exc}"
        raise (OSError(exc.errno, message) if exc.errno else OSError(message)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path
