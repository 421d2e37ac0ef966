"""What a forked child starts with: convtune's locks, made anew.

A child process forked while another thread held a lock (a DataLoader forking its workers while the background
worker reads a database or makes an executable, say) would wait on it for ever: the thread that would release it
does not exist in the child. A module names its locks here once; the child gets new ones.

    >>> import threading
    >>> state = {"_lock": threading.Lock()}
    >>> renew_after_fork(state, _lock=threading.Lock)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def renew_after_fork(namespace: dict[str, Any], **factories: Callable[[], Any]) -> None:
    """In a forked child, ``namespace[name] = factory()`` for each name of ``factories`` (``namespace``: a module's
    ``globals()``, whose code reads the lock by its name on each use)."""

    def renew() -> None:
        for name, factory in factories.items():
            namespace[name] = factory()

    os.register_at_fork(after_in_child=renew)
