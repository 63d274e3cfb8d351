"""How ``sigprop serve`` knows when to say it is listening: once every API process answers.

An API process accepts connections only after its lifespan has run (the engine's import and
warm-up, the solver processes' forkserver: seconds), and with ``--workers`` N each process starts on
its own. A line printed before then sent the user's first request to a refused connection. So the
CLI hands every process a folder (``READY_DIR_ENV``, inherited through the environment as uvicorn's
workers inherit the settings), each process's lifespan leaves a file there per stage of its start
(``<pid>.solvers`` as its solver processes start, ``<pid>.ready`` when its start-up is done), and a
thread of the CLI (the uvicorn supervisor with N workers, the one worker itself with one) watches
the folder, says when the solver processes start and how many workers are ready, and prints the
ready line once N live processes are ready *and* a ``GET /healthz`` on the address answers 200.

Why both: the marker alone comes a few statements before uvicorn starts accepting (the lifespan
ends first), and a probe alone reaches one process of N. A process that has marked itself ready
has nothing left to do but hand the listening socket to its event loop (no I/O, well under a
millisecond, against the probe's round trip); and the processes share that one socket, so a
connection is taken by whichever of them is free.
"""

from __future__ import annotations

import http.client
import os
import shutil
import threading
from collections.abc import Callable

READY_DIR_ENV = "SIGPROP_SERVE_READY_DIR"  # not a setting: only `sigprop serve` sets it, for its own workers
SOLVERS = "solvers"
READY = "ready"
POLL_S = 0.02  # a listing of a folder of a few empty files: far cheaper than the 20 ms it adds at most


def report(stage: str) -> None:
    """Tell the ``sigprop serve`` that started this process that it reached ``stage`` (nothing
    when the process was started otherwise: tests, ``uvicorn --factory``)."""
    folder = os.environ.get(READY_DIR_ENV)
    if not folder:
        return
    try:
        os.close(os.open(os.path.join(folder, f"{os.getpid()}.{stage}"), os.O_CREAT | os.O_WRONLY, 0o600))
    except OSError:  # the folder was removed: the CLI has said it is ready, or is gone
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def processes_at(folder: str) -> dict[str, int]:
    """How many live processes have reached each stage. A worker that died after its marker (and
    that uvicorn replaces) is not counted: its replacement has to mark itself."""
    counts: dict[str, int] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return counts
    for name in names:
        pid, _, stage = name.partition(".")
        if pid.isdigit() and _alive(int(pid)):
            counts[stage] = counts.get(stage, 0) + 1
    return counts


def probe_host(host: str) -> str:
    """The address a client on this machine reaches a server bound to ``host`` at."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def healthz_ok(host: str, port: int, timeout_s: float = 2.0) -> bool:
    # http.client, not urllib: urllib would send a loopback probe to a proxy named in http_proxy
    conn = http.client.HTTPConnection(probe_host(host), port, timeout=timeout_s)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def announce_when_ready(
    folder: str,
    workers: int,
    host: str,
    port: int,
    ready_line: str,
    stop: threading.Event,
    say: Callable[[str], None],
) -> None:
    """Say ``ready_line`` once ``workers`` processes are ready and /healthz answers, with a progress
    line when the solver processes start and, with several workers, as each one is ready."""
    said_solvers = False
    said_ready = 0
    while not stop.is_set():
        counts = processes_at(folder)
        ready = counts.get(READY, 0)
        if not said_solvers and counts.get(SOLVERS, 0):
            said_solvers = True
            say("sigprop serve: starting the solver processes (they import the engine and warm it up) ...")
        if ready >= workers and healthz_ok(host, port):
            say(ready_line)
            # now, not when the server stops: uvicorn ends a process stopped by a signal by raising
            # the signal again once it has shut down, and no cleanup of the CLI's runs after that
            shutil.rmtree(folder, ignore_errors=True)
            return
        if said_ready < ready < workers:
            said_ready = ready
            say(f"sigprop serve: {ready} of {workers} workers ready ...")
        stop.wait(POLL_S)
