"""Measuring in the background: the 'background' selection mode's worker.

A problem the database does not know is answered at once by PyTorch's own call (or ``get``'s choice where the
policy refuses it: ``select``), and ``measure`` queues it for ``find``; one worker thread measures the queued
problems one at a time, in the order asked, and stores what it measures in the database, and ends once nothing is
queued (the next ``measure`` starts another). It starts a measurement
only once no problem has been queued for ``settings.background_settle_s`` (0.1 s), or once the oldest has waited
``SETTLE_LIMIT`` times that (a model meeting a new shape at every step): a training step that meets a new shape
queues its layers' problems as it runs, and the worker's Python would otherwise compete with the rest of that step
for the interpreter (docs/runtime.md: what it changed). Each finished
measurement (stored, or failed) advances ``generation()``: whoever answered without a measurement compares it
with the one it chose at and, once it has moved, selects again (a tuned layer does so on its next call, from the
database). Before a stored measurement advances it, the worker calls what ``after_measuring`` registered (the
PyTorch integration makes there the executables a layer will switch to, off the training step).
Nothing of the caller's is touched from the worker's thread.

The worker runs its CUDA work on the device current where the problem was queued, on a stream of
its own, timing its candidates as eager loops that wait for that stream only (``benchmark``'s
shared_device: a CUDA graph capture under way would make the caller's ``torch.cuda.synchronize()``
fail). It shares the GPU, the interpreter and PyTorch's process-wide flags with the caller
(docs/runtime.md, "New input shapes"). At exit the queue is dropped and the measurement under way,
if any, is waited for (up to ``EXIT_WAIT_S``); a forked child starts with nothing queued and a new
generation.

    >>> import tempfile, convtune as ct
    >>> p = ct.ConvProblem("fwd", n=1, c=2, k=2, input_size=(5, 5), kernel_size=3)
    >>> db = ct.TuningDB(tempfile.mkdtemp() + "/tuning.sqlite")
    >>> before = generation()
    >>> measure(p, ct.Policy(), db), wait(60)
    (True, True)
    >>> generation() > before, queued(p, ct.Policy(), db), db.lookup(p) is not None
    (True, False, True)
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import tf32
from .policy import Policy
from .problem import ConvProblem
from .settings import settings

if TYPE_CHECKING:
    from .timing import Timing

log = logging.getLogger(__name__)

EXIT_WAIT_S = 60.0  # how long an ending process waits for the measurement under way
SETTLE_LIMIT = 10  # the oldest queued problem waits at most this many settle times, however often others come

_lock = threading.Condition()
# (token, problem, policy, db, device, time.monotonic() when queued), in order
_queue: list[tuple[tuple, ConvProblem, Policy, Any, int, float]] = []
_waiting: set[tuple] = set()  # tokens queued or being measured
_failed: set[tuple] = set()  # tokens whose measurement failed: not asked again in this process
_worker: threading.Thread | None = None
_stopping = False
_generation = 0  # finished measurements (and forks): see generation()
_last_queued = 0.0  # time.monotonic() when a problem was last queued
_after: list[Callable[[ConvProblem, Policy, Any], None]] = []  # after_measuring's callbacks


def after_measuring(callback: Callable[[ConvProblem, Policy, Any], None]) -> None:
    """Have the worker call ``callback(problem, policy, db)`` once it has stored a measurement of ``problem``, on its
    thread (its device current, on its stream), before the measurement counts as finished (``generation``). What it
    raises is logged. Registered once per callback."""
    if callback not in _after:
        _after.append(callback)


def _token(problem: ConvProblem, policy: Policy, db: Any) -> tuple:
    device = torch.cuda.current_device() if problem.device == "cuda" else -1  # the caller's, not the worker's
    return problem.key, policy, str(getattr(db, "path", id(db))), device


def measure(problem: ConvProblem, policy: Policy, db: Any) -> bool:
    """Queue ``problem`` for ``find`` under ``policy``, storing in ``db`` (on the current CUDA device). A
    problem already queued or being measured is not queued twice. Returns False, queuing nothing, for a
    problem whose measurement failed before in this process (``get``'s choice stands) and in a process
    that is ending."""
    global _last_queued
    token = _token(problem, policy, db)
    with _lock:
        if token in _failed or _stopping:
            return False
        if token not in _waiting:
            _waiting.add(token)
            _last_queued = time.monotonic()
            _queue.append((token, problem, policy, db, token[-1], _last_queued))
            _start()
            _lock.notify_all()
    return True


def queued(problem: ConvProblem, policy: Policy, db: Any) -> bool:
    """Whether ``problem`` is queued or being measured (for ``policy`` and ``db``, on the current device)."""
    return _token(problem, policy, db) in _waiting


def generation() -> int:
    """How many measurements have finished in this process (stored or failed), plus one per fork: a choice
    made at an older generation may have a measurement to take now."""
    return _generation


def pending() -> int:
    """How many problems are queued or being measured."""
    with _lock:
        return len(_waiting)


def wait(timeout: float | None = None) -> bool:
    """Wait until nothing is queued or being measured (at most ``timeout`` seconds); whether that happened."""
    with _lock:
        return _lock.wait_for(lambda: not _waiting, timeout)


def _start() -> None:
    """A worker, unless one is at work (under ``_lock``: a worker that finds the queue empty ends, and says so, under
    it too; one that died otherwise is replaced)."""
    global _worker
    if _worker is None or not _worker.is_alive():
        _worker = threading.Thread(target=_work, name="convtune-background", daemon=True)
        _worker.start()


def _settle_s() -> float:
    """``settings.background_settle_s``; 0 where its environment variable does not parse, so that the worker goes
    on (its ``find`` then fails on that setting, naming it, and the choices made at once stay)."""
    try:
        return settings.background_settle_s
    except ValueError as exc:
        log.warning("the background worker starts at once: %s", exc)
        return 0.0


def _work() -> None:
    global _generation, _worker
    streams: dict[int, Any] = {}
    while True:
        with _lock:
            while True:
                if _stopping or not _queue:
                    # Nothing left: the thread ends (``measure`` starts another). A thread that has run PyTorch's
                    # CPU operators keeps their OpenMP threads while it lives, and on a small host the caller's
                    # operators then ran up to twice as slow while it waited (docs/runtime.md).
                    if _worker is threading.current_thread():
                        _worker = None
                    return
                settle_s, now = _settle_s(), time.monotonic()
                quiet = settle_s - (now - _last_queued)  # a problem queued meanwhile moves it on
                overdue = SETTLE_LIMIT * settle_s - (now - _queue[0][-1])  # (problems met at every step)
                if quiet <= 0 or overdue <= 0:
                    break
                _lock.wait(min(quiet, overdue, 1.0))  # (looked at again: a stop, a new problem, a huge setting)
            token, problem, policy, db, device, _ = _queue.pop(0)
        ok = False
        try:
            ok = _find(problem, policy, db, device, streams)
        except BaseException:  # the worker goes on with the next problem whatever this one did (a BaseException
            # too: in this thread it reaches no user, and would leave the problem waiting forever)
            log.exception("measuring %s in the background failed", problem.key)
        with _lock:
            _waiting.discard(token)
            if not ok:
                _failed.add(token)
            _generation += 1
            _lock.notify_all()


def _find(problem: ConvProblem, policy: Policy, db: Any, device: int, streams: dict[int, Any]) -> bool:
    from .find import find  # find imports the algorithms: only when something is measured

    try:
        with tf32.refused_here():
            if device >= 0:
                with torch.cuda.device(device):
                    stream = streams.get(device)
                    if stream is None:
                        stream = streams[device] = torch.cuda.Stream()
                    with torch.cuda.stream(stream):
                        results = find(problem, policy, db, timer=_timer)
            else:
                results = find(problem, policy, db, timer=_timer)
    except Exception as exc:  # the model's choice stands; the user's step goes on
        log.warning("measuring %s in the background failed, so the choice made at once stays: %s", problem.key, exc)
        return False
    if not any(r.ok for r in results):
        log.warning("no candidate for %s passed its measurement in the background; the choice made at once stays",
                    problem.key)
        return False
    for callback in list(_after):
        if _stopping:  # the process is ending: the measurement stands, nothing more is made
            break
        try:
            if device >= 0:
                with torch.cuda.device(device), torch.cuda.stream(streams[device]):
                    callback(problem, policy, db)
            else:
                callback(problem, policy, db)
        except Exception:  # noqa: BLE001 - the measurement stands; what the callback would have made is made later
            log.exception("after measuring %s in the background, %s failed", problem.key,
                          getattr(callback, "__qualname__", callback))
    return True


def _timer(fn: Callable[[], object], **kwargs: Any) -> Timing:
    """The worker's timer: ``benchmark`` on a device it shares with the caller's work."""
    from .timing import benchmark

    return benchmark(fn, shared_device=True, **kwargs)


def stopping() -> bool:
    """Whether the process is ending (the queue dropped): work that is not a measurement should stop."""
    return _stopping


def in_worker() -> bool:
    """Whether this code runs on the worker's thread (it leaves the process's cached CUDA memory alone)."""
    return _worker is not None and threading.current_thread() is _worker


def _stop() -> None:
    """At exit: drop the queue, let the measurement under way finish (a thread still running torch while the
    interpreter shuts down can abort the process), then return."""
    global _stopping
    with _lock:
        _stopping = True
        _waiting.difference_update(token for token, *_ in _queue)
        _queue.clear()
        _lock.notify_all()
    worker = _worker
    if worker is not None and worker.is_alive() and worker is not threading.current_thread():
        worker.join(EXIT_WAIT_S)


def _after_fork() -> None:
    # A forked child (a DataLoader worker, say) has none of the parent's threads: it starts empty.
    global _lock, _worker, _stopping, _generation
    _lock = threading.Condition()
    _queue.clear()
    _waiting.clear()
    _worker, _stopping = None, False
    _generation += 1  # what the parent was measuring is measured again here if still wanted


atexit.register(_stop)
os.register_at_fork(after_in_child=_after_fork)
