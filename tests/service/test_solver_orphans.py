"""A solver process dies with the API process that owns it (coldpool.die_with_owner): an API
process killed with SIGKILL (no cleanup runs) leaves no solve running on past its deadline. Today's
failure was an orphan solving for about 50 s after its owner died, past its 30 s deadline.

Linux only (the checks read /proc): a process is gone when /proc has no entry for it, or only a
zombie waiting for whichever process adopted it to reap it (it holds no CPU or memory then).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from ..inprocess import eoc
from ..service_fixtures import start_service

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 3.0

# An API process in miniature: a pool of one solver, one call sleeping in it, the solver's pid on stdout.
OWNER = """
import sys, threading, time
from sigprop.api.coldpool import SolverPool
pool = SolverPool(1)
threading.Thread(target=pool.call, args=(time.sleep, (120,), 300), daemon=True).start()
while not pool.pids():
    time.sleep(0.01)
time.sleep(0.3)  # the job is sent: the solver sleeps in it
print(pool.pids()[0], flush=True)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids, timeout_s: float = GONE_WITHIN_S) -> float:
    """Seconds until none of ``pids`` is alive; fails after ``timeout_s``."""
    start = time.monotonic()
    while any(alive(p) for p in pids):
        took = time.monotonic() - start
        assert took < timeout_s, f"still alive {took:.1f} s after their owner died: {[p for p in pids if alive(p)]}"
        time.sleep(0.02)
    return time.monotonic() - start


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def test_a_busy_solver_dies_with_its_killed_owner():
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        solver = int(owner.stdout.readline())
        assert alive(solver)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        took = wait_gone([solver])
        print(f"\nbusy solver gone {took * 1000:.0f} ms after its owner's SIGKILL")
    finally:
        try:
            os.killpg(owner.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        owner.wait(10)


def test_killing_a_servers_api_process_ends_its_solve(tmp_path):
    """A real `sigprop serve` in the middle of a cold solve (one that sleeps in its solver process,
    tests/slow_solver.py), its API process killed with SIGKILL: the solver and the forkserver go too."""
    pid_file = tmp_path / "solver.pid"
    svc = start_service(
        tmp_path,
        {
            "SIGPROP_REDIS_URL": None,
            "SIGPROP_DATA_DIR": str(tmp_path / "data"),
            "SIGPROP_TEST_SOLVER_PID_FILE": str(pid_file),
        },
        cli="tests.slow_solver",
    )
    answers = []
    try:
        api = svc.proc.pid  # one worker: the uvicorn process serves itself
        call = threading.Thread(
            target=lambda: answers.append(_post(svc.base_url, eoc(1.75))), name="slow-solve", daemon=True
        )
        call.start()
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline, f"the solve did not start:\n{svc.log()}"
            time.sleep(0.05)
        solver = int(pid_file.read_text())
        forkserver = [p for p in children(api) if solver in children(p)]
        assert alive(solver) and forkserver, (solver, children(api))
        os.kill(api, signal.SIGKILL)
        took = wait_gone([solver, *forkserver])
        print(f"\nsolver and forkserver gone {took * 1000:.0f} ms after the API process's SIGKILL")
        call.join(10)
        assert answers and isinstance(answers[0], httpx.TransportError), answers  # the client saw the server die
    finally:
        svc.stop()


def _post(url: str, body: dict):
    try:
        return httpx.post(f"{url}/v1/solve", json=body, timeout=60)
    except httpx.TransportError as exc:
        return exc
