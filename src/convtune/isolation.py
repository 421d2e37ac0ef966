"""Isolation: a candidate checked and timed in a worker process, so that what it does costs it alone.

A crash (a segmentation fault, ``os._exit``), a hang, ``SystemExit``, or a CUDA error that poisons
the context ends the worker, not the search: the candidate's result says what happened, and the
next isolated candidate gets a fresh worker. The worker is a spawned process (never forked: a
fork of a process that uses CUDA is unsafe) that imports convtune, computes the same inputs and
float64 reference as the search (the same seed), and measures each candidate it is sent exactly
as ``find`` does in its own process. One worker serves every isolated candidate of the process
(it keeps a problem's inputs and reference while the candidates are of that problem); starting
it costs an interpreter and ``import torch`` (1-3 s), once, and again after a candidate ends it.

Which candidates are isolated (``settings.isolate``, ``CONVTUNE_ISOLATE``):

- ``plugins`` (the default): algorithms defined outside convtune (registered plug-ins and
  candidates passed to ``find``), whose behaviour convtune cannot vouch for; convtune's own
  algorithms and cuDNN's plans run in the process, at no extra cost;
- ``all``: every candidate that can be sent to a worker (``bench/sweep.py`` uses it); a cuDNN
  plan, which holds a built graph, cannot be, and runs in the process;
- ``off``: none.

An isolated candidate must finish its whole measurement (two checked runs, a determinism probe and
the timing) within ``hard_limit_s``: three times the per-candidate deadline plus ten timing budgets
and five seconds; past that its worker is killed and the candidate is a ``timeout``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import pickle
from multiprocessing.connection import Connection
from typing import Any

from .algorithms.base import Algorithm
from .policy import Policy
from .problem import ConvProblem
from .results import PerfResult, Status
from .settings import settings

log = logging.getLogger(__name__)

START_LIMIT_S = 300.0  # a worker that has not imported convtune by then is not coming


def wanted(algorithm: Algorithm) -> bool:
    """Whether ``algorithm`` is measured in a worker under ``settings.isolate``."""
    mode = settings.isolate
    if mode == "off":
        return False
    if mode == "plugins" and type(algorithm).__module__.split(".")[0] == "convtune":
        return False
    try:
        pickle.dumps(algorithm)
    except Exception as exc:  # noqa: BLE001 - anything unpicklable stays in the process
        log.debug("%s cannot be sent to a worker (%s: %s); measured in the process", algorithm.name,
                  type(exc).__name__, exc)
        return False
    return True


def hard_limit_s(deadline_s: float, timer_budget_s: float | None) -> float:
    """Seconds an isolated candidate's whole measurement may take before its worker is killed."""
    return 3 * deadline_s + 10 * (timer_budget_s or settings.timing_budget_s) + 5.0


class Worker:
    """A spawned process that measures candidates; started on first use, restarted after a candidate
    kills it, ended by ``close`` (or with this process: it is a daemon)."""

    def __init__(self) -> None:
        self._process: Any = None
        self._conn: Connection | None = None

    def measure(self, problem: ConvProblem, policy: Policy, timer: Any, seed: int | None, algorithm: Algorithm,
                props: dict, probe_determinism: bool, best_ms: float, timer_budget_s: float | None,
                deadline_s: float) -> PerfResult:
        """The candidate's result as ``find`` would measure it, or a failure or timeout of its own."""
        try:
            conn = self._started()
        except (OSError, RuntimeError, EOFError) as exc:
            self.close()
            return PerfResult(algorithm.name, Status.FAILED, message=f"its worker process could not start "
                                                                     f"({type(exc).__name__}: {exc})", **props)
        limit_s = hard_limit_s(deadline_s, timer_budget_s)
        task = (problem, policy, timer, seed, settings.overrides(), algorithm, props, probe_determinism, best_ms,
                timer_budget_s)
        try:
            conn.send(task)
            if not conn.poll(None if limit_s == math.inf else limit_s):
                self.close()
                return PerfResult(algorithm.name, Status.TIMEOUT, **props,
                                  message=f"its measurement did not finish within {limit_s:.0f} s in its worker "
                                          f"process, which was killed (the deadline is Policy.deadline_s, "
                                          f"CONVTUNE_CANDIDATE_DEADLINE_S)")
            kind, payload = conn.recv()
        except (EOFError, OSError) as exc:
            code = None
            if self._process is not None:
                self._process.join(timeout=5.0)  # the pipe closes as the process ends: its exit code follows
                code = self._process.exitcode
            self.close()
            why = f"exit code {code}" if code is not None else f"{type(exc).__name__}: {exc}"
            return PerfResult(algorithm.name, Status.FAILED, **props,
                              message=f"its worker process died measuring it ({why})")
        if kind == "died":  # KeyboardInterrupt or the like inside the candidate: the worker ended
            self.close()
            return PerfResult(algorithm.name, Status.FAILED, message=payload, **props)
        return PerfResult.from_dict(payload)

    def _started(self) -> Connection:
        if self._conn is not None and self._process is not None and self._process.is_alive():
            return self._conn
        self.close()
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child,), daemon=True, name="convtune-candidate")
        process.start()
        child.close()
        self._process, self._conn = process, parent
        if not parent.poll(START_LIMIT_S):
            raise RuntimeError(f"no answer within {START_LIMIT_S:.0f} s")
        parent.recv()  # "ready"
        return parent

    def close(self) -> None:
        """End the worker (killed if it does not stop at once)."""
        conn, process = self._conn, self._process
        self._conn = self._process = None
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
            conn.close()
        if process is not None:
            process.join(timeout=1.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)


_worker = Worker()  # one per process, shared by every find: its start is paid once


def measure(*args: Any, **kwargs: Any) -> PerfResult:
    """``Worker.measure`` on this process's worker."""
    return _worker.measure(*args, **kwargs)


def _serve(conn: Connection) -> None:
    """The worker: measure each candidate sent until told to stop (None). A search (its inputs and
    reference) is kept while the candidates sent are of the same problem, policy, timer and seed."""
    from .find import _describe, _Search

    conn.send("ready")
    current: tuple[Any, _Search] | None = None
    while True:
        task = conn.recv()
        if task is None:
            return
        problem, policy, timer, seed, overrides, algorithm, props, probe, best_ms, timer_budget_s = task
        with settings.override(**overrides):
            if current is None or current[0] != (problem, policy, seed, pickle.dumps(timer)):
                current = ((problem, policy, seed, pickle.dumps(timer)), _Search(problem, policy, timer, seed))
            search = current[1]
            search.best_ms = best_ms
            try:
                result = search.measure_here(algorithm, props, probe, timer_budget_s)
            except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt and the like: this worker ends
                conn.send(("died", f"it raised {_describe(exc)} (its worker process ended)"))
                return
        conn.send(("result", result.to_dict()))
