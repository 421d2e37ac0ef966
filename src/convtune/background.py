"""Measuring in the background: the 'background' selection mode's worker.

A problem the database does not know is answered at once by ``get``'s choice, and ``measure``
queues it for ``find``; one worker thread measures the queued problems one at a time, in the order
asked, and stores what it measures in the database. Whoever answered from the cost model asks
to hear when the measurement is stored (``measure(..., then=...)``): a tuned layer then forgets
its provisional choice, and its next call selects again, from the database.

The worker runs its CUDA work on a stream of its own, so it never waits on the training step's
stream nor makes it wait; it does share the GPU and the interpreter with the step, which makes
its timings noisier than a quiet ``find`` (see docs/runtime.md, "New input shapes").

    >>> import tempfile, convtune as ct
    >>> p = ct.ConvProblem("fwd", n=1, c=2, k=2, input_size=(5, 5), kernel_size=3)
    >>> db = ct.TuningDB(tempfile.mkdtemp() + "/tuning.sqlite")
    >>> done = []
    >>> measure(p, ct.Policy(), db, then=lambda: done.append(p.key))
    True
    >>> wait(60)
    True
    >>> done == [p.key], db.lookup(p) is not None
    (True, True)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from .policy import Policy
from .problem import ConvProblem

log = logging.getLogger(__name__)

_lock = threading.Condition()
_queue: list[tuple[str, ConvProblem, Policy, Any]] = []  # (token, problem, policy, db), in the order asked
_waiting: dict[str, list[Callable[[], None]]] = {}  # token -> what to call once it is stored
_failed: set[str] = set()  # tokens whose measurement failed: not asked again in this process
_worker: threading.Thread | None = None


def _token(problem: ConvProblem, policy: Policy, db: Any) -> str:
    return f"{problem.key}|{policy}|{id(db)}"


def measure(problem: ConvProblem, policy: Policy, db: Any, then: Callable[[], None] | None = None) -> bool:
    """Queue ``problem`` for ``find`` under ``policy``, storing in ``db``; ``then()`` is called (on the
    worker's thread) once its results are stored. A problem already queued or being measured is not
    queued twice (``then`` joins it). Returns False, queuing nothing, for a problem whose measurement
    failed before in this process (``get``'s choice stands)."""
    token = _token(problem, policy, db)
    with _lock:
        if token in _failed:
            return False
        if token not in _waiting:
            _waiting[token] = []
            _queue.append((token, problem, policy, db))
        if then is not None:
            _waiting[token].append(then)
        _start()
        _lock.notify_all()
    return True


def pending() -> int:
    """How many problems are queued or being measured."""
    with _lock:
        return len(_waiting)


def wait(timeout: float | None = None) -> bool:
    """Wait until nothing is queued or being measured (at most ``timeout`` seconds); whether that happened."""
    with _lock:
        return _lock.wait_for(lambda: not _waiting, timeout)


def _start() -> None:
    global _worker
    if _worker is None or not _worker.is_alive():
        # A daemon: a process that ends drops what is still queued (the database is written whole or not at all).
        _worker = threading.Thread(target=_work, name="convtune-background", daemon=True)
        _worker.start()


def _work() -> None:
    stream = None
    while True:
        with _lock:
            _lock.wait_for(lambda: bool(_queue))
            token, problem, policy, db = _queue.pop(0)
        ok = False
        try:
            if problem.device == "cuda" and stream is None:
                stream = torch.cuda.Stream()
            ok = _find(problem, policy, db, stream)
        except Exception:  # the worker goes on with the next problem whatever this one did
            log.exception("measuring %s in the background failed", problem.key)
        finally:
            with _lock:
                calls = _waiting.pop(token, [])
                if not ok:
                    _failed.add(token)
                _lock.notify_all()
        for call in calls if ok else ():
            try:
                call()
            except Exception:  # a listener's fault is its own: the worker goes on
                log.exception("a listener of the background measurement of %s failed", problem.key)


def _find(problem: ConvProblem, policy: Policy, db: Any, stream: Any) -> bool:
    from .find import find  # find imports the algorithms: only when something is measured

    try:
        if stream is not None:
            with torch.cuda.stream(stream):
                results = find(problem, policy, db)
        else:
            results = find(problem, policy, db)
    except Exception as exc:  # the model's choice stands; the user's step goes on
        log.warning("measuring %s in the background failed, so the cost model's choice stays: %s", problem.key, exc)
        return False
    if not any(r.ok for r in results):
        log.warning("no candidate for %s passed its measurement in the background; the cost model's choice stays",
                    problem.key)
        return False
    return True
