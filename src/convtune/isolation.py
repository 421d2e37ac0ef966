"""Isolation: a candidate checked and timed in a worker process, so that what it does costs it alone.

A crash (a segmentation fault, ``os._exit``), a hang, ``SystemExit``, or a CUDA error that poisons
the context ends the worker, not the search: the candidate's result says what happened, and the
next isolated candidate gets a fresh worker. The worker is a new interpreter running this module's
``_main`` (never a fork, unsafe in a process that uses CUDA, and never a second run of the user's
script, which a ``multiprocessing`` spawn would import again). It receives this process's import path, every convtune
setting, the CUDA device and PyTorch's numeric switches with each task, computes the same inputs
and float64 reference as the search (the same seed), and measures each candidate exactly as
``find`` does in its own process. One worker serves every isolated candidate of the process, one
at a time (a lock); it keeps a problem's inputs and reference while the candidates are of that
problem and drops them when ``find`` ends; starting it costs an interpreter and ``import torch``
(1-3 s), once, and again after a candidate ends it. It exits when this process does.

Which candidates are isolated (``settings.isolate``, ``CONVTUNE_ISOLATE``):

- ``plugins`` (the default): algorithms defined outside convtune (registered plug-ins and
  candidates passed to ``find``), whose behaviour convtune cannot vouch for; convtune's own
  algorithms and cuDNN's execution plans run in the process, at no extra cost;
- ``all``: every candidate that can be sent to a worker (``bench/sweep.py`` uses it);
- ``off``: none.

A candidate stays in the process when it, or the timer, cannot be sent: a cuDNN execution plan (it holds a
built graph), a class defined in ``__main__`` (a script or a notebook; the worker cannot import it),
a timer that does not pickle. A timer that is sent runs as a copy in the worker.

An isolated candidate must finish its measurement (two checked runs, a third under a policy that asks for
determinism, and the timing) within ``hard_limit_s`` of the worker having its inputs and reference ready: four times the
per-candidate deadline plus ten timing budgets and five seconds (an hour where no deadline is set);
past that its worker is killed and the candidate is a ``timeout``.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import math
import os
import pickle
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

import torch

from . import tf32
from .algorithms.base import Algorithm
from .policy import Policy
from .problem import ConvProblem
from .results import PerfResult, Status
from .settings import settings

log = logging.getLogger(__name__)

START_LIMIT_S = 300.0  # a worker that has not imported convtune, or made its reference, by then is not coming
NO_DEADLINE_LIMIT_S = 3600.0  # where no per-candidate deadline is set
MAX_WAIT_S = 2**31 // 1000 - 1  # poll() takes milliseconds in a C int (24.8 days): a longer wait raises OverflowError


class NotSendable(Exception):
    """The candidate or the timer cannot go to a worker: measure it in the process."""


def sendable(obj: Any) -> bool:
    """Whether ``obj`` (an algorithm, a timer) can go to a worker process: it pickles, and not from ``__main__``."""
    try:
        buffer = io.BytesIO()
        pickle.Pickler(buffer).dump(obj)
    except Exception:  # noqa: BLE001 - anything unpicklable stays in the process
        return False
    return "__main__" not in {getattr(type(obj), "__module__", ""), getattr(obj, "__module__", "")}


def vouched_for(algorithm: Algorithm) -> bool:
    """Whether ``algorithm`` is one of convtune's own (held to its declarations by convtune's tests), not a plug-in."""
    return algorithm.origin.split(".")[0] == "convtune"


def wanted(algorithm: Algorithm, timer: Any = None) -> bool:
    """Whether ``algorithm`` (timed by ``timer``) is measured in a worker under ``settings.isolate``."""
    mode = settings.isolate
    if mode == "off":
        return False
    if mode == "plugins" and vouched_for(algorithm):
        return False
    if not sendable(algorithm) or (timer is not None and not sendable(timer)):
        log.debug("%s (or its timer) cannot be sent to a worker; measured in the process", algorithm.name)
        return False
    return True


def hard_limit_s(deadline_s: float, timer_budget_s: float | None) -> float:
    """Seconds an isolated candidate's measurement may take before its worker is killed (at most ``MAX_WAIT_S``)."""
    if not math.isfinite(deadline_s) or deadline_s <= 0:
        return NO_DEADLINE_LIMIT_S
    # four deadlines: a candidate past the deadline still runs its second checked run (a timeout may answer)
    # (float(): a Policy's deadline may be an int past what a float sum of it holds exactly, never past a float)
    return min(4 * float(deadline_s) + 10 * (timer_budget_s or settings.timing_budget_s) + 5.0, MAX_WAIT_S)


def _state() -> dict[str, Any]:
    """What a worker must share with this process besides the task: import path, settings, device, switches."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {
        "path": list(sys.path),
        # what override() set, and convtune's environment now (the worker inherited it at its start)
        "settings": settings.overrides(),
        "environment": {k: v for k, v in os.environ.items() if k.startswith("CONVTUNE_")},
        "device": torch.cuda.current_device() if cuda else None,
        # (TF32 as it holds now, whichever of PyTorch's interfaces set it: tf32.py)
        "cudnn": (torch.backends.cudnn.enabled, tf32.conv_allowed(), torch.backends.cudnn.benchmark,
                  torch.backends.cudnn.deterministic),
        "matmul_tf32": tf32.matmul_allowed(),
        "deterministic_algorithms": (torch.are_deterministic_algorithms_enabled(),
                                     torch.is_deterministic_algorithms_warn_only_enabled()),
    }


class Worker:
    """A worker interpreter that measures candidates; started on first use, restarted after a candidate
    kills it, ended by ``close`` (or when this process ends: it watches its parent)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._send: Connection | None = None
        self._recv: Connection | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._tasks = itertools.count(1)

    def measure(self, problem: ConvProblem, policy: Policy, timer: Any, seed: int | None, algorithm: Algorithm,
                props: dict, probe_determinism: bool, best_ms: float, timer_budget_s: float | None,
                deadline_s: float) -> PerfResult:
        """The candidate's result as ``find`` would measure it, or a failure or timeout of its own.
        ``NotSendable``: measure it in the process instead."""
        with self._lock:
            try:
                return self._measure(problem, policy, timer, seed, algorithm, props, probe_determinism, best_ms,
                                     timer_budget_s, deadline_s)
            except NotSendable:
                raise  # the worker is fine: the caller measures this one in the process
            except BaseException:
                self.close()  # an interrupt or an error here: the worker's state is unknown, start again
                raise

    def _measure(self, problem, policy, timer, seed, algorithm, props, probe_determinism, best_ms, timer_budget_s,
                 deadline_s) -> PerfResult:
        try:
            self._started()
        except (OSError, RuntimeError, EOFError) as exc:
            self.close()
            raise NotSendable(f"no worker process could start ({type(exc).__name__}: {exc})") from exc
        task_id = next(self._tasks)
        try:
            task = pickle.dumps((problem, policy, timer, seed, algorithm, props, probe_determinism, best_ms,
                                 timer_budget_s))
        except Exception as exc:  # noqa: BLE001 - what cannot be sent is measured in the process
            raise NotSendable(str(exc)) from exc
        # The state (plain values) travels apart: the worker needs its import path to read the task.
        try:
            payload = pickle.dumps(("measure", task_id, _state(), task))
        except Exception as exc:  # noqa: BLE001 - an override that does not pickle: measured in the process
            raise NotSendable(str(exc)) from exc
        limit_s = hard_limit_s(deadline_s, timer_budget_s)
        try:
            self._send_to_live_worker(payload)
            ready = self._reply(task_id, START_LIMIT_S)  # the worker has the inputs and the reference
            if ready is None:
                return self._killed(algorithm, props, f"its worker made no reference within {START_LIMIT_S:.0f} s")
            if ready[0] == "unsendable":  # the worker cannot import what was sent (the parent's script, say)
                raise NotSendable(ready[1])
            if ready[0] == "reference_failed":  # not the candidate's fault: measured in the process, as it can be
                raise NotSendable(f"its worker could not make the float64 reference ({ready[1]})")
            answer = self._reply(task_id, limit_s)
            if answer is None:
                return self._killed(algorithm, props,
                                    f"its measurement did not finish within {limit_s:.0f} s in its worker process, "
                                    f"which was killed (the deadline is Policy.deadline_s, "
                                    f"CONVTUNE_CANDIDATE_DEADLINE_S)")
        except (EOFError, OSError) as exc:
            code = self._exit_code()
            self.close()
            why = f"exit code {code}" if code is not None else f"{type(exc).__name__}: {exc}"
            return PerfResult(algorithm.name, Status.FAILED, **props,
                              message=f"its worker process died measuring it ({why})")
        kind, body = answer
        if kind == "died":  # a BaseException in the candidate, or a CUDA context it poisoned: the worker ended
            self.close()
            return PerfResult(algorithm.name, Status.FAILED, message=body, **props)
        return PerfResult.from_dict(body)

    def release(self) -> None:
        """Let the worker drop its inputs and reference (``find`` is done with the problem)."""
        with self._lock:
            if self._process is not None and self._process.poll() is None and self._pid == os.getpid():
                with contextlib.suppress(OSError, ValueError):
                    self._send_bytes(pickle.dumps(("release", 0, None, None)))

    def _reply(self, task_id: int, limit_s: float) -> tuple[str, Any] | None:
        """The worker's next message about ``task_id`` (older ones, of an interrupted task, are dropped);
        None when none came within ``limit_s``."""
        assert self._recv is not None
        while True:
            if not self._recv.poll(limit_s):
                return None
            reply_id, kind, body = pickle.loads(self._recv.recv_bytes())
            if reply_id == task_id:
                return kind, body

    def _send_to_live_worker(self, payload: bytes) -> None:
        """Send a task; a worker that died while idle (killed, say) is not this task's fault: start another."""
        try:
            self._send_bytes(payload)
        except (OSError, EOFError):
            self.close()
            try:
                self._started()
            except (OSError, RuntimeError, EOFError) as exc:
                self.close()
                raise NotSendable(f"no worker process could start ({type(exc).__name__}: {exc})") from exc
            self._send_bytes(payload)

    def _send_bytes(self, payload: bytes) -> None:
        assert self._send is not None
        self._send.send_bytes(payload)

    def _killed(self, algorithm: Algorithm, props: dict, message: str) -> PerfResult:
        self.close()
        return PerfResult(algorithm.name, Status.TIMEOUT, message=message, **props)

    def _exit_code(self) -> int | None:
        if self._process is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self._process.wait(timeout=5.0)  # the pipe closes as the process ends: its code follows
        return None

    def _started(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        self.close()
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        # The worker imports convtune (and the candidates' modules) from where this process does.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", "import sys; from convtune.isolation import _main; _main(sys.argv[1:])",
                 str(to_child_r), str(to_parent_w), str(os.getpid())],
                pass_fds=(to_child_r, to_parent_w), close_fds=True, stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            os.close(to_child_w)
            os.close(to_parent_r)
            raise
        finally:
            os.close(to_child_r)
            os.close(to_parent_w)
        self._send, self._recv = Connection(to_child_w, readable=False), Connection(to_parent_r, writable=False)
        if not self._recv.poll(START_LIMIT_S):
            raise RuntimeError(f"no answer within {START_LIMIT_S:.0f} s")
        self._recv.recv_bytes()  # "ready"

    def close(self) -> None:
        """End the worker (killed if it does not stop at once)."""
        process, send, recv = self._process, self._send, self._recv
        self._process = self._send = self._recv = None
        if send is not None:
            with contextlib.suppress(OSError, ValueError):
                send.send_bytes(pickle.dumps(("stop", 0, None, None)))
            send.close()
        if recv is not None:
            recv.close()
        if process is not None:
            try:
                process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=5.0)


    def forget_after_fork(self) -> None:
        """In a forked child: the parent's worker, pipes and lock (perhaps held then) are not this process's."""
        self._process = self._send = self._recv = None
        self._lock = threading.Lock()
        self._pid = os.getpid()


_worker = Worker()  # one per process, shared by every find: its start is paid once
os.register_at_fork(after_in_child=_worker.forget_after_fork)


def measure(*args: Any, **kwargs: Any) -> PerfResult:
    """``Worker.measure`` on this process's worker."""
    return _worker.measure(*args, **kwargs)


def release() -> None:
    """``Worker.release`` on this process's worker."""
    _worker.release()


# -- the worker ---------------------------------------------------------------------------------
def _apply(state: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """This worker set as the parent is: import path, environment, device, PyTorch's switches; the settings'
    overrides for the task."""
    sys.path[:] = list(dict.fromkeys([*state["path"], *sys.path]))
    for key in [k for k in os.environ if k.startswith("CONVTUNE_") and k not in state["environment"]]:
        del os.environ[key]
    os.environ.update(state["environment"])
    if state["device"] is not None:
        torch.cuda.set_device(state["device"])
    cudnn = torch.backends.cudnn
    cudnn.enabled, cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic = state["cudnn"]
    torch.backends.cuda.matmul.allow_tf32 = state["matmul_tf32"]
    deterministic, warn_only = state["deterministic_algorithms"]
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    return settings.override(**state["settings"])


def _context_poisoned(problem: ConvProblem) -> bool:
    if problem.device != "cuda":
        return False
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - an illegal address, a device-side assert: every later call fails too
        return True
    return False


def _watch_parent(parent_pid: int) -> None:
    """End this worker when the process that started it is gone (killed, say)."""
    import time

    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(1.0)


def _serve(recv: Connection, send: Connection) -> None:
    """Measure each candidate sent until told to stop. A search (inputs and reference) is kept while the
    candidates sent are of the same problem, policy, timer and seed."""
    from .measure import Search, describe

    def reply(task_id: int, kind: str, body: Any) -> None:
        send.send_bytes(pickle.dumps((task_id, kind, body)))

    send.send_bytes(pickle.dumps("ready"))
    current: tuple[Any, Search] | None = None
    while True:
        try:
            kind, task_id, state, task = pickle.loads(recv.recv_bytes())
        except EOFError:
            return
        if kind == "stop":
            return
        if kind == "release":
            current = None
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            continue
        with _apply(state):
            try:
                problem, policy, timer, seed, algorithm, props, probe, best_ms, timer_budget_s = pickle.loads(task)
            except Exception as exc:  # noqa: BLE001 - a class this worker cannot import: the parent measures it
                reply(task_id, "unsendable", f"{type(exc).__name__}: {exc}")
                continue
            identity = (problem, policy, seed, pickle.dumps(timer))
            if current is None or current[0] != identity:
                current = (identity, Search(problem, policy, timer, seed))
            search = current[1]
            search.best_ms = best_ms
            try:
                search.case(1)
            except Exception as exc:  # noqa: BLE001 - the reference is not the candidate's fault
                current = None
                reply(task_id, "reference_failed", f"{type(exc).__name__}: {exc}")
                continue
            reply(task_id, "ready", None)
            try:
                result = search.measure_here(algorithm, props, probe, timer_budget_s)
            except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt and the like: this worker ends
                reply(task_id, "died", f"it raised {describe(exc)} (its worker process ended)")
                return
            if result.status is not Status.OK and _context_poisoned(problem):
                reply(task_id, "died", f"{result.message}; it left the CUDA context unusable (its worker "
                                       f"process ended)")
                return
        reply(task_id, "result", result.to_dict())


_in_worker = False  # this interpreter is a worker (``_main``)


def in_worker() -> bool:
    """Whether this process is a worker measuring isolated candidates (it serves nothing else)."""
    return _in_worker


def _main(argv: list[str]) -> None:
    global _in_worker
    _in_worker = True
    recv_fd, send_fd, parent_pid = (int(a) for a in argv)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    _serve(Connection(recv_fd, writable=False), Connection(send_fd, readable=False))

