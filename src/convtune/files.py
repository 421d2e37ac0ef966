"""Writing a file whole: a reader never sees half of it, and nothing but a regular file is ever replaced.

``write_whole(path, write)`` calls ``write(target)`` on a temporary file beside ``path`` and renames it
over ``path``. A path that is not a regular file is never renamed over: a device or a pipe
(``/dev/stdout``, a FIFO) is written into directly, a symbolic link's target is what gets replaced
(the link stays), and a folder is refused with ``ValueError``.

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


def writable(path: str | os.PathLike) -> Path:
    """The path ``write_whole`` writes for ``path`` (its real path), checked as it checks before writing:
    ``ValueError`` naming ``path`` where it is a folder, a regular file that nobody may write (chmod a-w: kept
    from being replaced on purpose), or in a folder that is missing or is not one."""
    given, path = path, Path(os.path.realpath(path))  # through symbolic links: a link given stays a link
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:  # a path through a file ('/etc/hostname/x'), one too long
        raise ValueError(f"cannot write {given}: {exc.strerror}; give a path in an existing folder") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError(f"{path} is a folder; give a file's path")
    if mode is not None and stat.S_ISREG(mode) and not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{given} is read-only (nobody may write it); make it writable or give another path")
    if (mode is None or stat.S_ISREG(mode)) and not path.parent.is_dir():
        what = "is not a folder" if path.parent.exists() else "does not exist"
        raise ValueError(f"cannot write {given}: {path.parent} {what}; give a path in an existing folder")
    return path


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
        raise OSError(exc.errno, f"cannot write {given}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path
