"""``python -m tests.slow_solver serve ...``: ``sigprop serve`` whose cold solves first sleep
``SLOW_SOLVE_S`` in their solver process, having written the solver's pid to the file named by
``SIGPROP_TEST_SOLVER_PID_FILE``: a solve that is surely in flight when a test kills the server.

The swap is a monkeypatch of the function the API process sends to its solver processes
(``sigprop.api.solutions.solve_prepared``), before the command starts. The solver processes
unpickle it by name from this module: the forkserver has this process's ``sys.path``. No solve is
tried in the API process (``SIGPROP_INLINE_SOLVE_COST=0``), so every one takes that function."""

from __future__ import annotations

import os
import sys
import time

from sigprop import cli
from sigprop.api import coldpool, solutions

SLOW_SOLVE_S = 120.0


def slow_solve_prepared(prep):
    path = os.environ.get("SIGPROP_TEST_SOLVER_PID_FILE")
    if path:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    time.sleep(SLOW_SOLVE_S)
    return coldpool.solve_prepared(prep)


if __name__ == "__main__":
    solutions.solve_prepared = slow_solve_prepared
    os.environ["SIGPROP_INLINE_SOLVE_COST"] = "0"  # every cold solve in a solver process, none inline
    sys.exit(cli.main())
