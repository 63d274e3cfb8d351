"""Cold solves in worker processes that can be stopped.

A thread cannot be killed: a solve past its timeout used to answer 503 while its thread went on
solving, holding a CPU and a slot of the shared thread pool. ``SolverPool`` keeps up to ``size``
worker processes (started lazily, reused between solves); each solves one request at a time. A
solve that is still running at its deadline gets its process killed (SIGKILL: its CPU is free
at once, whatever the engine was doing) and the caller gets 503 ``solve_timeout``; the next solve
starts a fresh process. A request waiting for a free process counts the wait against the same
deadline, so at most ``size`` solves use CPU at a time, per API process (plus ``small`` solves
of small requests, in a lane of their own). Which waiting solve starts next is ``coldlanes.Lanes``'
business: by lane, by client, then first come, first served.

The processes come from a ``forkserver`` that has imported the engine already, so a replacement
starts in milliseconds rather than importing numpy and the engine again, and no process is forked
from the API's threads.

A solver process dies with the API process that owns it, even one killed with SIGKILL (which runs
no cleanup): the deadline lives in the API process, so an orphan would solve on unbounded. Its
parent is the forkserver, which exits as soon as the API process is gone (its pipe from the API
reaches EOF); the solver asks Linux for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``),
and a watchdog thread, for other systems and for the moment before the ``prctl``, checks every
``WATCHDOG_S`` that its parent and the API process are still there.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any

from ..errors import SigpropError
from .coldlanes import Lanes

log = logging.getLogger("sigprop")
_PRELOAD = ["sigprop.api.solver_preload"]
# CFS weight 36 against the API's 1024: a waking API process (a probe, a hit) preempts the solvers
# at once; solves still get every cycle the API leaves
SOLVER_NICE = 15
WATCHDOG_S = 0.5  # how often a solver process checks that its owner is alive
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def solve_prepared(prep) -> str:
    """The canonical answer JSON of a request prepared already (``sigprop.preparation``), which
    crossed the pipe in its compact pickled form (runs in a worker process)."""
    from ..engine.solve import solve_canonical

    return solve_canonical(prep).to_json()


def solve_request(data: dict | bytes) -> str:
    """The canonical answer JSON of a request body, parsed or not (runs in a worker process;
    tests and tools: the service sends ``solve_prepared`` the request it prepared)."""
    from ..engine.solve import prepare, solve_canonical
    from ..requests import SOLVE_HINT, load_json, parse_solve_request

    if isinstance(data, bytes):
        data = load_json(data, SOLVE_HINT)
    return solve_canonical(prepare(parse_solve_request(data))).to_json()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup to run: the work is the owner's, and it is gone


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (killed, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except OSError:  # gone, or the pid reused by another user's process
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[:1]
    except (OSError, IndexError):  # no /proc: the signal check is all there is
        return True
    return state not in ([b"Z"], [b"X"])


def _release_forkserver() -> None:
    """Close this process's copy of the forkserver's keep-alive pipe. multiprocessing hands it to
    every process the forkserver starts, so the forkserver lives while any of them does; a solver
    starts no process, and without its copy the forkserver ends with the API process (its pipe's
    last writer), which is what fires this process's PR_SET_PDEATHSIG."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _watch(parent: int, owner: int) -> None:
    while True:
        time.sleep(WATCHDOG_S)
        if os.getppid() != parent or not _alive(owner):
            _kill_self()


def die_with_owner(owner: int) -> None:
    """Make this process (a solver) end when its parent or ``owner`` (the API process) ends."""
    _release_forkserver()
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no libc to call: the watchdog alone
            pass
    if os.getppid() != parent or not _alive(owner):  # gone before the prctl took effect
        _kill_self()
    threading.Thread(target=_watch, args=(parent, owner), name="sigprop-solver-watchdog", daemon=True).start()


def one_blas_thread() -> None:
    """BLAS on one thread for the rest of this process (a solver): it shares the cores with the
    other solvers, where BLAS threads mostly wait for each other (``attention_init.one_blas_thread``)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a dependency
        return
    threadpool_limits(limits=1, user_api="blas")


def _serve(conn, owner: int | None = None) -> None:
    """A worker process: answer ``(fn, args)`` jobs until the pipe closes, or until ``owner`` (the
    API process) dies. It runs at a lower CPU priority than the API, so cold solves take the CPU the
    API processes leave, never the reverse, and runs BLAS on one thread."""
    if owner is not None:
        die_with_owner(owner)
    try:
        os.nice(SOLVER_NICE)
    except OSError:
        pass
    one_blas_thread()
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", fn(*args))
        except SigpropError as exc:
            reply = ("sigprop", (exc.code, exc.message, exc.hint, exc.status, exc.headers))
        except Exception as exc:  # noqa: BLE001 - handed back to the API process, which logs and answers 500
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)


class _Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_serve, args=(child, os.getpid()), daemon=True, name="sigprop-solver")
        self.proc.start()
        child.close()

    def kill(self) -> None:
        """SIGKILL and reap: the process's CPU and memory are free when this returns."""
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class SolverPool:
    """Up to ``size`` + ``small`` solver processes; ``call(fn, args, timeout_s)`` runs ``fn(*args)``
    in one of them and kills it when it is still running after ``timeout_s`` (503
    ``solve_timeout``). ``size`` processes take any solve, ``small`` more only solves marked small;
    a client runs at most ``per_client`` solves at once (0: no cap), see ``coldlanes.Lanes``."""

    def __init__(self, size: int, small: int = 0, per_client: int = 0):
        self.size = size + small
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(_PRELOAD)
        self.lanes = Lanes(size, small, per_client)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._lock = threading.Lock()
        self.killed = 0  # solves stopped at their deadline (tests, logs)
        self.last_killed_pid: int | None = None
        self._closed = False

    def warm(self) -> None:
        """Start one process now (the forkserver and its engine import), not at the first cold solve."""
        w = self._take()
        self._give_back(w)

    def call(
        self,
        fn,
        args: tuple,
        wait_s: float,
        timeout_s: float | None = None,
        what: str = "the solve",
        *,
        client: str | None = None,
        small: bool = False,
    ) -> Any:
        """``fn(*args)`` in a solver process, killed when it has not answered ``wait_s`` from now
        (queueing for a free process included); ``timeout_s`` is the timeout the 503 reports.
        ``client`` is who the solve counts against for the per-client cap; ``small``: it may use
        the small lane."""
        timeout_s = wait_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        ticket = self.lanes.acquire(client, small, wait_s)
        if ticket is None:
            raise timeout_error(timeout_s, what)
        try:
            started = time.monotonic()
            w = self._take()
            deadline += time.monotonic() - started  # starting a process is not the solve's time
            try:
                w.conn.send((fn, args))
                ready = w.conn.poll(max(0.0, deadline - time.monotonic()))
                if not ready:
                    self._kill(w)
                    raise timeout_error(timeout_s, what)
                kind, value = w.conn.recv()
            except (EOFError, OSError, BrokenPipeError) as exc:
                self._kill(w)
                raise RuntimeError(f"a solver process died ({type(exc).__name__})") from None
            self._give_back(w)
        finally:
            self.lanes.release(ticket)
        if kind == "ok":
            return value
        if kind == "sigprop":
            code, message, hint, status, headers = value
            raise SigpropError(code, message, hint, status, headers)
        raise RuntimeError(f"the solver process failed: {value}")

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.proc.is_alive():
                    self._busy.add(w)
                    return w
                w.conn.close()
        w = _Worker(self._ctx)
        with self._lock:
            self._busy.add(w)
        return w

    def _give_back(self, w: _Worker) -> None:
        with self._lock:
            self._busy.discard(w)
            if self._closed or len(self._idle) + len(self._busy) >= self.size:
                w.kill()
            else:
                self._idle.append(w)

    def _kill(self, w: _Worker) -> None:
        pid = w.proc.pid
        w.kill()
        with self._lock:
            self._busy.discard(w)
            self.killed += 1
            self.last_killed_pid = pid
        log.warning("solver process stopped", extra={"fields": {"pid": pid, "reason": "deadline"}})
        # a replacement now, in the background, so the next solve does not wait for it
        threading.Thread(target=self._replace, name="sigprop-solver-start", daemon=True).start()

    def _replace(self) -> None:
        with self._lock:
            if self._closed or len(self._idle) + len(self._busy) >= self.size:
                return
        try:
            self._give_back(_Worker(self._ctx))
        except OSError as exc:  # the next solve starts one itself
            log.warning("could not start a solver process: %s", exc)

    def pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in [*self._idle, *self._busy] if w.proc.pid is not None]

    def shutdown(self) -> None:
        """Kill every process (solves still running answer 500 to callers still waiting)."""
        with self._lock:
            self._closed = True
            workers = [*self._idle, *self._busy]
            self._idle.clear()
        for w in workers:
            w.kill()


def timeout_error(timeout_s: float, what: str = "the solve") -> SigpropError:
    return SigpropError(
        "solve_timeout",
        f"{what} took longer than {timeout_s:g} s",
        "the solve was stopped: try a smaller graph, or raise SIGPROP_SOLVE_TIMEOUT_S on your own deployment",
    )
