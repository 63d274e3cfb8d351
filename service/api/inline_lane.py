"""Small cold solves tried in the API process itself, before a solver process is asked.

A cold MLP-100 solve takes 1-4 ms; handing it to a solver process (``coldpool.SolverPool``: the
prepared request pickled through a pipe, a process at nice 15 woken, the answer's JSON back) adds
about half a millisecond when the machine is idle and more under load. ``InlineLane.try_solve``
solves a request whose exact cost (nodes + edges of its built graph) is at most ``max_cost``, and
which is not a sequence graph (token kernels grow with the sequence length, not the graph), in the
calling thread, one at a time per API process, so it adds one CPU-bound thread to the process at
most. It cannot be killed there, so it runs within a cooperative wall-clock budget
(``engine.budget``: the engine stops between evaluations once it is spent): past the budget it
gives up and the caller hands the request to the solver pool as before, with the rest of its
deadline. A solve that ran past the budget closes the lane for ten times the time it spent, so
requests made to exhaust it (an unreachable target, a root scan) cost the API process at most a
tenth of one thread's time, and small solves meanwhile take the solver pool.

A lane that is busy (another solve inline) or closed answers None at once: nothing waits for it.
"""

from __future__ import annotations

import threading
import time

from ..engine.budget import OverBudget, within
from ..engine.sequence.graph import is_sequence_graph
from ..engine.solve import Prepared, solve_canonical
from .observability import INLINE_SOLVES

COOLDOWN_FACTOR = 10.0
_DONE, _OVER, _BUSY = (INLINE_SOLVES.labels(outcome) for outcome in ("done", "over_budget", "busy"))


class InlineLane:
    def __init__(self, max_cost: int, budget_s: float):
        self.max_cost = max_cost
        self.budget_s = budget_s
        self._lock = threading.Lock()
        self.closed_until = 0.0  # time.monotonic() before which the lane takes nothing

    def takes(self, prep: Prepared, cost: int) -> bool:
        """Whether a solve of this size and kind may be tried here at all."""
        return cost <= self.max_cost and prep.request.attention is None and not is_sequence_graph(prep.graph)

    def try_solve(self, prep: Prepared, cost: int) -> str | None:
        """The canonical answer JSON, solved here within the budget; None when the lane does not
        take it, is busy or closed, or the budget ran out (the caller then asks a solver process).
        The engine's own errors (an unreachable target, ...) are raised as from a solver process."""
        if not self.takes(prep, cost) or time.monotonic() < self.closed_until:
            return None
        if not self._lock.acquire(blocking=False):
            _BUSY.inc()
            return None
        start = time.perf_counter()
        try:
            with within(self.budget_s):
                text = solve_canonical(prep).to_json()
        except OverBudget:
            spent = time.perf_counter() - start
            self.closed_until = time.monotonic() + COOLDOWN_FACTOR * spent
            _OVER.inc()
            return None
        finally:
            self._lock.release()
        _DONE.inc()
        return text
